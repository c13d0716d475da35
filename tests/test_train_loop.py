"""The training loop over steps that do not wait (rwkvx.training.loop.train_loop with a stub trainer),
and Trainer.submit on the CPU backend: each step's loss is read after the next step is submitted, in
order; evaluation, checkpoints, the end of the run and a stop see every submitted step read; no step is
lost or added."""
import csv
import types

import numpy as np
import pytest

from lazy_device import install, mean_target
from rwkvx import Config, init_params
from rwkvx.data import BatchSampler
from rwkvx.training.config import TrainConfig
from rwkvx.training.loop import train_loop
from rwkvx.training.rundir import fmt
from rwkvx.training.setup import Run
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches, seeded_rng

B, T = 2, 8
CFG = Config(vocab_size=64, n_embd=32, n_rwkv_layer=1, n_attn_layer=1, head_size=16,
             moba_chunk_size=8, moba_top_k=2)


class StubStep:
    """A submitted step of :class:`StubTrainer`: its loss is 10 + its step number."""

    def __init__(self, trainer, step):
        self.trainer, self.step = trainer, step

    def done(self):
        return self.step in self.trainer.read

    def loss(self):
        if self.step not in self.trainer.read:
            self.trainer.read.add(self.step)
            self.trainer.events.append(("read", self.step))
        if self.step == self.trainer.nan_at:
            raise FloatingPointError(f"loss is nan at step {self.step}")
        return 10.0 + self.step

    def stats(self):
        return {"lr": 1e-3 * self.step, "grad_norm": 0.5 * self.step, "clip": 1.0}


class StubTrainer:
    """Stands in for a Trainer (which needs a model): records submits, reads, evaluations and saves,
    and, at each evaluation and save, which submitted steps were still unread."""

    device, world = "stub", None

    def __init__(self, config, stop_after=None, nan_at=None):
        self.config, self.stop_after, self.nan_at = config, stop_after, nan_at
        self.step_count, self.meta, self.events, self.read = 0, {}, [], set()

    def unread(self):
        return sorted(set(range(1, self.step_count + 1)) - self.read)

    def submit(self, tokens, targets):
        self.step_count += 1
        self.events.append(("submit", self.step_count))
        return StubStep(self, self.step_count)

    def evaluate(self, tokens, targets):
        self.events.append(("evaluate", self.step_count, self.unread()))
        return 2.0

    def save(self, path, meta=None):
        self.events.append(("save", self.step_count, self.unread()))

    def request_stop(self):
        pass

    @property
    def stop_agreed(self):
        return self.stop_after is not None and self.step_count >= self.stop_after


class StubSampler:
    def next(self):
        return np.zeros((B, T), np.int64), np.zeros((B, T), np.int64)

    def state(self):
        return {}


def make_run(trainer, sampler, val_batches, out):
    prep = types.SimpleNamespace(world_size=1, resume=None, val_batches=val_batches, cfg=CFG, preset="test")
    return Run(prep=prep, trainer=trainer, sampler=sampler, start=0, out=out, entropy=None, info={},
               progress=False)


def run_stub(tmp_path, steps, eval_every=0, ckpt_every=0, **stub):
    config = TrainConfig(batch_size=B, seq_len=T, steps=steps, eval_every=eval_every, ckpt_every=ckpt_every)
    trainer = StubTrainer(config, **stub)
    return trainer, make_run(trainer, StubSampler(), [StubSampler().next()], tmp_path)


def log_rows(run):
    with open(run.log_path, newline="") as f:
        return list(csv.DictReader(f))


def test_each_loss_is_read_after_the_next_step_is_submitted(tmp_path):
    trainer, run = run_stub(tmp_path, steps=4)
    outcome = train_loop(run)
    assert trainer.events == [("submit", 1), ("submit", 2), ("read", 1), ("submit", 3), ("read", 2),
                              ("submit", 4), ("read", 3), ("read", 4), ("evaluate", 4, []), ("save", 4, [])]
    rows = log_rows(run)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert [float(r["train_loss"]) for r in rows] == [11.0, 12.0, 13.0, 14.0]
    assert [float(r["lr"]) for r in rows] == [1e-3, 2e-3, 3e-3, 4e-3]         # each step's own stats
    assert [int(r["tokens"]) for r in rows] == [B * T * s for s in (1, 2, 3, 4)]
    assert [r["val_loss"] for r in rows] == ["", "", "", "2"]
    assert (outcome.step, outcome.interrupted, outcome.final_train, outcome.final_val) == (4, False, 14.0, 2.0)


def test_evaluation_and_checkpoints_see_their_step_read(tmp_path):
    trainer, run = run_stub(tmp_path, steps=7, eval_every=2, ckpt_every=3)
    train_loop(run)
    assert [e[0] for e in trainer.events].count("submit") == 7                 # no step added
    evaluations = [e[1:] for e in trainer.events if e[0] == "evaluate"]
    saves = [e[1:] for e in trainer.events if e[0] == "save"]
    assert evaluations == [(2, []), (4, []), (6, []), (7, [])]
    assert saves == [(3, []), (6, []), (7, [])]
    reads = [e[1] for e in trainer.events if e[0] == "read"]
    assert reads == list(range(1, 8))                                           # in order, each once
    rows = log_rows(run)
    assert [int(r["step"]) for r in rows] == list(range(1, 8))
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [2, 4, 6, 7]


def test_a_stop_reads_the_last_submitted_step(tmp_path):
    trainer, run = run_stub(tmp_path, steps=10, stop_after=3)
    outcome = train_loop(run)
    assert trainer.events[-4:] == [("submit", 3), ("read", 2), ("read", 3), ("save", 3, [])]
    assert outcome.interrupted and outcome.step == 3 and outcome.final_train == 13.0
    assert [int(r["step"]) for r in log_rows(run)] == [1, 2, 3]


def test_a_non_finite_loss_stops_the_run_without_a_checkpoint(tmp_path):
    trainer, run = run_stub(tmp_path, steps=5, ckpt_every=4, nan_at=2)
    with pytest.raises(FloatingPointError, match="at step 2"):
        train_loop(run)
    assert trainer.events[-2:] == [("submit", 3), ("read", 2)]      # found one step late
    assert not any(e[0] == "save" for e in trainer.events)


def _cpu_trainer():
    return Trainer(CFG, init_params(CFG, 0), backend="cpu", batch_size=B, seq_len=T, lr=1e-3, lr_min=1e-4,
                   warmup=1, steps=4, grad_clip=1.0)


def test_submit_gives_the_losses_of_step():
    data = seeded_batches(4, CFG.vocab_size, B, T, seed=0)
    waiting, submitting = _cpu_trainer(), _cpu_trainer()
    losses = [waiting.step(*d) for d in data]
    handles = [submitting.submit(*d) for d in data]
    assert [h.step for h in handles] == [1, 2, 3, 4] and submitting.step_count == 4
    assert all(h.done() for h in handles)                       # the CPU backend finishes inside submit
    assert np.isnan(submitting.last_stats["lr"])                # no step's results read yet
    stats = handles[1].stats()
    assert set(stats) == {"lr", "grad_norm", "clip"} and stats["lr"] == submitting.lr_at(2)
    assert submitting.last_stats["lr"] == submitting.lr_at(2)
    assert [h.loss() for h in handles] == losses
    assert submitting.last_stats == waiting.last_stats          # the latest step read: the last
    handles[0].loss()
    assert submitting.last_stats == waiting.last_stats          # an older step read later changes nothing
    a, b = waiting.params, submitting.params
    assert all(np.array_equal(a[n], b[n]) for n in a)


def test_the_loop_on_the_gpu_backend_logs_every_step_and_checkpoints_it(tmp_path, monkeypatch):
    """The real Trainer and Model over a stand-in device whose steps run only when the host waits
    (tests/lazy_device.py; a step's loss is the mean of its targets): the log holds each step's own
    loss, the evaluations and checkpoints come after their step."""
    install(monkeypatch)
    config = TrainConfig(batch_size=B, seq_len=T, steps=5, eval_every=2, ckpt_every=3, warmup=1)
    trainer = Trainer(CFG, init_params(CFG, 0), config, backend="gpu")
    tokens = seeded_rng(6).integers(0, CFG.vocab_size, 10_000)
    val = seeded_batches(1, CFG.vocab_size, B, T, seed=7)
    run = make_run(trainer, BatchSampler(tokens, B, T, seed=0), val, tmp_path)
    outcome = train_loop(run)
    replay = BatchSampler(tokens, B, T, seed=0)
    want = [mean_target(replay.next()[1]) for _ in range(5)]
    rows = log_rows(run)
    assert [r["train_loss"] for r in rows] == [fmt(w) for w in want]
    assert [int(r["step"]) for r in rows if r["val_loss"]] == [2, 4, 5]
    assert outcome.step == 5 and Trainer.load(run.ckpt_path, backend="cpu").step_count == 5
