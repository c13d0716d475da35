"""A training run from its first step to its last: progress bar, periodic evaluation and checkpoints,
the loss log and plot, and Ctrl-C (stop after the current step, checkpointed and resumable).

The host never waits for a step before the next one is submitted (:meth:`Trainer.submit`): the loop
draws batch i+1 and submits step i+1 while step i runs, then reads step i's loss, writes its log row
and moves the progress bar. A step whose end something needs — evaluation and checkpoints (the
parameters after it), the last step, a stop — is read before that happens, so no step is lost and none
is added. Gradient clipping and the learning-rate schedule run inside the step and need no loss on the
host; a non-finite loss raises FloatingPointError when it is read (on the GPU, with the next step
already launched), and the run ends without writing a checkpoint.

Data parallel: every rank trains and evaluates its shard; only rank 0 shows progress and writes.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from .rundir import LOG_NAME, RUN_NAME, fmt, read_log, write_json, write_log, write_plot
from .setup import Run
from .trainer import Trainer, TrainStep

EMA = 0.9                  # smoothing of the training loss shown and summarised
PROGRESS_INTERVAL_S = 0.5  # the progress bar redraws at most this often


@dataclass
class Outcome:
    """How a training run ended."""

    step: int                       # the trainer's step count at the end
    interrupted: bool               # stopped by Ctrl-C before the last step
    ema: float | None               # smoothed training loss (None: no step ran)
    final_train: float | None       # the log's last training loss
    final_val: float | None         # the log's last validation loss
    train_time: float               # seconds in the trainer's steps (submitting, waiting for losses), this run
    wall_time: float                # seconds of the whole loop and the final writes, this run


@contextlib.contextmanager
def ctrl_c_stops(announce: Callable[[str], None]) -> Iterator[types.SimpleNamespace]:
    """Within the block the first Ctrl-C only sets ``flag.requested`` (and ``announce``s it): the
    loop reads the flag between steps, so a run never stops inside an update and is checkpointed as
    usual. A second Ctrl-C raises KeyboardInterrupt at once: the run aborts and the last periodic
    checkpoint stays (every file is written atomically). Only the main thread can set signal
    handlers; elsewhere Ctrl-C keeps its default behaviour."""
    flag = types.SimpleNamespace(requested=False)

    def on_sigint(signum: int, frame: Any) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True
        announce("stopping after this step (Ctrl-C again to abort without saving)...")

    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def mean_val_loss(trainer: Trainer, batches: list[tuple[np.ndarray, np.ndarray]]) -> float | None:
    """The mean loss over the validation batches; None without validation data."""
    if not batches:
        return None
    return float(np.mean([trainer.evaluate(x, y) for x, y in batches]))


def start_run(run: Run) -> None:
    """Create the run directory and write ``run.json`` (the model, the TrainConfig and the run
    options); rank 0 only."""
    if run.main:
        run.out.mkdir(parents=True, exist_ok=True)
        write_json(run.out / RUN_NAME, {"config": run.prep.cfg.to_dict(), "train": run.train.to_dict(),
                                        "run": run.info})


def train_loop(run: Run) -> Outcome:
    """Train ``run`` to its last step with a progress bar (on stderr, when ``run.progress``),
    validation every ``eval_every`` steps and at the end, and a checkpoint every ``ckpt_every`` steps;
    then write the final checkpoint, the log and the plot. Ctrl-C: see :func:`ctrl_c_stops`."""
    from tqdm import tqdm

    prep, trainer, sampler, tr = run.prep, run.trainer, run.sampler, run.train
    steps, start = tr.steps, run.start
    step_tokens = prep.world_size * tr.batch_size * tr.seq_len
    resumed = prep.resume is not None
    rows = read_log(prep.resume.parent / LOG_NAME, start) if resumed and run.main else []
    tokens_seen = int(trainer.meta.get("tokens_seen", start * step_tokens)) if resumed else 0
    elapsed0 = float(trainer.meta.get("elapsed_s", 0.0)) if resumed else 0.0

    def save(elapsed: float) -> None:
        if not run.main:
            return
        trainer.save(run.ckpt_path, meta={"run": run.info, "sampler": sampler.state(),
                                      "tokens_seen": tokens_seen, "elapsed_s": elapsed})
        write_log(run.log_path, rows)

    train_time, ema, last_val = 0.0, None, None
    tokens0, interrupted = tokens_seen, False
    with tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, mininterval=PROGRESS_INTERVAL_S,
              disable=not (run.progress and run.main), file=sys.stderr) as bar, \
            ctrl_c_stops(bar.write if run.main else lambda _: None) as stop:
        t0 = time.perf_counter()

        def report(done: TrainStep, evaluate: bool) -> None:
            """Read ``done``'s loss (waiting for that step alone), evaluate after it when asked, log it
            and show it."""
            nonlocal train_time, ema, last_val
            ts = time.perf_counter()
            loss, stats = done.loss(), done.stats()
            train_time += time.perf_counter() - ts
            step = done.step
            ema = loss if ema is None else EMA * ema + (1 - EMA) * loss
            tps = (step - start) * step_tokens / max(train_time, 1e-9)
            row = {"step": step, "tokens": tokens0 + (step - start) * step_tokens, "lr": fmt(stats["lr"]),
                   "train_loss": fmt(loss), "grad_norm": fmt(stats["grad_norm"]), "tokens_per_s": fmt(tps, 5)}
            if evaluate:
                last_val = mean_val_loss(trainer, prep.val_batches)
                row["val_loss"] = fmt(last_val)
            row["elapsed_s"] = fmt(elapsed0 + time.perf_counter() - t0, 5)
            rows.append(row)
            postfix = {"loss": f"{ema:.3f}", "tok/s": f"{tps:,.0f}"}
            if last_val is not None:
                postfix["val"] = f"{last_val:.3f}"
            bar.set_postfix(postfix, refresh=False)
            if step < steps:
                bar.update(1)
            else:    # closing the bar draws the last line: update() would draw it a second time
                bar.n = step

        pending: TrainStep | None = None     # the step submitted last, its loss not read yet
        for step in range(start + 1, steps + 1):
            if stop.requested:
                trainer.request_stop()
            if trainer.stop_agreed:    # data parallel: every rank stops after the same step
                interrupted = True
                break
            x, y = sampler.next()      # drawn while the previous step runs
            ts = time.perf_counter()
            try:
                submitted = trainer.submit(x, y)
            except FloatingPointError:     # the CPU backend checks its loss in submit: log the step before
                if pending is not None:
                    report(pending, evaluate=False)
                raise
            train_time += time.perf_counter() - ts
            tokens_seen += step_tokens
            if pending is not None:
                report(pending, evaluate=False)
            pending = submitted
            evaluate = bool(tr.eval_every and step % tr.eval_every == 0) or step == steps
            checkpoint = bool(tr.ckpt_every and step % tr.ckpt_every == 0) and step != steps
            if evaluate or checkpoint:     # both need this step's end: read it now
                report(pending, evaluate)
                pending = None
            if checkpoint:
                save(elapsed0 + time.perf_counter() - t0)
        if pending is not None:            # stopped: the last step submitted is read, not lost
            report(pending, evaluate=False)
    save(elapsed0 + time.perf_counter() - t0)
    cfg = prep.cfg
    ranks = "" if prep.world_size == 1 else f"{prep.world_size} x "
    title = (f"rwkvx {prep.preset}: V={cfg.vocab_size} C={cfg.n_embd} L={cfg.n_rwkv_layer} "
             f"M={cfg.n_attn_layer}, B={ranks}{tr.batch_size} T={tr.seq_len}, {trainer.device}")
    if run.main:
        write_plot(run.plot_path, rows, title, run.entropy)
    return Outcome(
        step=trainer.step_count, interrupted=interrupted, ema=ema,
        final_train=next((float(r["train_loss"]) for r in reversed(rows) if r.get("train_loss")), None),
        final_val=next((float(r["val_loss"]) for r in reversed(rows) if r.get("val_loss")), None),
        train_time=train_time, wall_time=time.perf_counter() - t0)
