"""GPU step timings (report, don't assert): eager plan vs CUDA-graph replay, and peak device memory, for
every configuration of rwkvx.workloads.STEP_WORKLOADS in every precision, with and without recompute
(the released 1.5B and 2.9B shapes in bf16 only).

Each benchmark times with CUDA events on the model's stream (pytest-benchmark's own wall-clock rounds
are one synchronised call each); ``extra_info`` carries the event-timed per-step milliseconds, the
device memory and the model FLOP utilisation (``mfu``: rwkvx.workloads.mfu, the model FLOPs over the
event time as a share of the H200's dense peak for the precision's arithmetic). The parameters are
drawn on the device (``init_params(..., device="gpu")``: seconds at 2.9B). ``test_trainer_step_overlap``
times the whole training step through the Trainer (AdamW included, batches drawn by a BatchSampler):
wall ms per step waiting for each loss (``Trainer.step``) and reading it after the next step is
submitted (``Trainer.submit``), beside the step graph's own device ms. Skipped without a GPU.
"""
import numpy as np
import pytest

from rwkvx import init_params
from rwkvx.arena import Layout
from rwkvx.precision import PRECISION_NAMES
from rwkvx.workloads import STEP_WORKLOADS, mfu

from _common import free_memory, skip_unless_fits

LONG = ("base_B1_T131072",)       # bf16 with recompute only (the other modes need more memory)
BIG = ("pure1.5b_B4_T4096", "pure2.9b_B4_T4096")      # bf16 only, as these sizes train
EAGER = ("small_B8_T512", "base_B8_T4096")

RUNS = ([(name, "eager", "fp32", True) for name in EAGER]
        + [(name, "graph", precision, recompute) for recompute in (True, False)
           for name in STEP_WORKLOADS if name not in LONG + BIG for precision in PRECISION_NAMES]
        + [(name, "graph", "bf16", True) for name in LONG]
        + [(name, "graph", "bf16", recompute) for name in BIG for recompute in (True, False)])


@pytest.mark.parametrize("name, mode, precision, recompute", RUNS,
                         ids=[f"{n}-{m}-{p}-{'recompute' if r else 'keep'}" for n, m, p, r in RUNS])
def test_step(benchmark, dev, name, mode, precision, recompute):
    from rwkvx.model import Model
    from rwkvx.runtime import Graph, warm_time_ms
    cfg, B, T = STEP_WORKLOADS[name]
    skip_unless_fits(name, Layout(cfg, B, T, dev.info, precision, recompute).total, free_memory(dev))
    rng = np.random.default_rng(0)
    dev.reset_peak()
    model = Model(cfg, init_params(cfg, 0, device="gpu"), B, T, precision=precision, recompute=recompute)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    model.stage_batch(tokens, np.roll(tokens, -1, axis=1))
    model.run_step()              # warm-up: modules loaded, cuBLAS heuristics chosen
    dev.synchronize()
    if mode == "graph":
        graph = Graph.capture(dev, model.run_step)
        enqueue = graph.launch
    else:
        enqueue = model.run_step
    repeats = 20 if name.startswith("small") else 1 if name in LONG else 3
    step_ms = warm_time_ms(dev, enqueue, repeats)

    def one_step():
        enqueue()
        dev.synchronize()

    benchmark.pedantic(one_step, rounds=1 if name in LONG else 3, iterations=1)
    mem = dev.memory_info()
    benchmark.extra_info.update({
        "event_ms_per_step": round(step_ms, 3),
        "tokens_per_s": round(B * T / (step_ms / 1e3)),
        "mfu": round(mfu(cfg, B, T, step_ms, precision), 3),
        "arena_GiB": round(model.memory_bytes() / 2**30, 2),
        "arena_KiB_per_token": round(model.layout.bytes_per_token() / 1024, 1),
        "peak_alloc_GiB": round(mem["peak_allocated"] / 2**30, 2),
        "device_used_GiB": round((mem["total"] - mem["free"]) / 2**30, 2),
        "loss": round(model.mean_loss(), 4),
    })
    if mode == "graph":
        graph.close()


# The whole training step through the Trainer (AdamW included, batches drawn by a BatchSampler), waiting
# for each loss (Trainer.step) against reading it after the next step is submitted (Trainer.submit).
OVERLAP_STEPS = {"small_B8_T512": 300, "base_B8_T4096": 12}


def waiting_steps(trainer, sampler, n: int) -> None:
    """``n`` steps, each loss read before the next batch is drawn (Trainer.step)."""
    for _ in range(n):
        trainer.step(*sampler.next())


def submitted_steps(trainer, sampler, n: int) -> None:
    """``n`` steps, each loss read once the next step is submitted (the training loop's order)."""
    pending = None
    for _ in range(n):
        submitted = trainer.submit(*sampler.next())
        if pending is not None:
            pending.loss()
        pending = submitted
    pending.loss()


@pytest.mark.parametrize("name", list(OVERLAP_STEPS))
def test_trainer_step_overlap(benchmark, dev, name):
    """Wall ms per training step (bf16, recompute) waiting for each loss and not waiting, beside
    ``graph_ms_per_step``: CUDA events around back-to-back ``launch_step`` calls on one batch (each
    stages the batch into the next slot and replays the graph; on a launch-bound model the host's
    staging can show in it)."""
    import time

    from rwkvx.data import BatchSampler
    from rwkvx.runtime import EventTimer
    from rwkvx.training.trainer import Trainer
    cfg, B, T = STEP_WORKLOADS[name]
    n = OVERLAP_STEPS[name]
    trainer = Trainer(cfg, init_params(cfg, 0), backend="gpu", batch_size=B, seq_len=T, steps=10 * n,
                      precision="bf16")
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 8 * B * T)
    sampler = BatchSampler(tokens, B, T, seed=0)
    trainer.step(*sampler.next())            # warm-up: the graphs captured
    wall_ms = {}
    for mode, run in (("wait", waiting_steps), ("submit", submitted_steps)):
        t0 = time.perf_counter()
        run(trainer, sampler, n)
        dev.synchronize()
        wall_ms[mode] = (time.perf_counter() - t0) * 1e3 / n
    model, batch = trainer.backend.model, sampler.next()
    timer = EventTimer(dev)
    try:
        graph_ms = timer.time_ms(lambda: model.launch_step(*batch), n)
    finally:
        timer.close()
    benchmark.pedantic(waiting_steps, args=(trainer, sampler, 1), rounds=3, iterations=1)
    benchmark.extra_info.update({
        "wait_ms_per_step": round(wall_ms["wait"], 3),
        "submit_ms_per_step": round(wall_ms["submit"], 3),
        "graph_ms_per_step": round(graph_ms, 3),
        "wait_over_graph_%": round(100 * (wall_ms["wait"] / graph_ms - 1), 1),
        "submit_over_graph_%": round(100 * (wall_ms["submit"] / graph_ms - 1), 1),
    })
