"""Training the released RWKV-7 sizes on one GPU, per fine-tuning mode: step time, tokens/s and device
memory (report, don't assert). bf16, recompute (the least memory), T = 4096 at B = 1 and at the largest B
that fits, rwkv7-1.5b, -2.9b and -7.2b, and state tuning and LoRA also at T = 1024 beside RWKV-PEFT's
published peak memory for that setting (RTX 4090, bf16, ctx 1024, batch 1: state tuning 1.5B 5.3 GB,
2.9B 8.2 GB; LoRA 5.6 / 8.8 GB;
``extra_info["rwkv_peft_GB"]``):

* ``full``: every parameter trains, AdamW moments in float32 (18 bytes a parameter);
* ``full-lean``: the same with the lean moments (bf16, stochastically rounded: 14 bytes a parameter);
* ``state``: state tuning, only the initial WKV states train (the frozen GEMM weights kept only as their
  bf16 copy, no moments, no weight gradients);
* ``lora``: LoRA with the default rank, alpha and targets (:mod:`rwkvx.lora`), only the factors train
  (the frozen parameters likewise).

The parameters are drawn on the device (``init_params(..., device="gpu")``: seconds at 7.2B), once per
size for all its rows. Each row
builds the model (its peak is the arena plus cuBLASLt's workspace), runs one step (graph capture,
GEMM algorithms), then times ``ROUNDS`` steps (``MAX_B_ROUNDS`` at the largest batch) by wall clock, each
waiting for its loss.
``extra_info``: ms per step, tokens/s, the arena and the device's peak allocation and use, GiB.
Rows ``-Bmax`` take the largest batch (up to ``MAX_B``) whose arena leaves ``HEADROOM`` of the free memory.
Skipped without a GPU; rows whose arena does not fit the free memory are skipped with the sizes.

Run: ``python -m pytest benchmarks/bench_finetune.py -k 7.2b --benchmark-columns=mean``
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.arena import Layout
from rwkvx.lora import DEFAULT_ALPHA, DEFAULT_RANK, DEFAULT_TARGETS, LoraSettings, init_factors
from rwkvx.optim import Schedule
from rwkvx.presets import get_preset
from rwkvx.runtime import Device
from rwkvx.state_tuning import zero_states

from _common import free_memory, skip_unless_fits

SIZES = ("rwkv7-1.5b", "rwkv7-2.9b", "rwkv7-7.2b")
LORA = LoraSettings(DEFAULT_RANK, DEFAULT_ALPHA, DEFAULT_TARGETS)
MODES = {"full": dict(moments="f32"), "full-lean": dict(moments="bf16"), "state": dict(moments="f32", states=True),
         "lora": dict(moments="f32", lora=True)}
# RWKV-PEFT's published peaks (RTX 4090, bf16, ctx 1024, batch 1), GB
RWKV_PEFT_GB = {("rwkv7-1.5b", "state"): 5.3, ("rwkv7-1.5b", "lora"): 5.6,
                ("rwkv7-2.9b", "state"): 8.2, ("rwkv7-2.9b", "lora"): 8.8}
RUNS = [(preset, mode, T, batch) for preset in SIZES
        for mode, T, batch in ([(mode, 4096, 1) for mode in MODES] + [(mode, 1024, 1) for mode in ("state", "lora")]
                               + [(mode, 4096, "max") for mode in MODES])]
ROUNDS = 3                      # timed steps a row (each waits for its loss)
MAX_B_ROUNDS = 2                # at the largest batch a step takes seconds
MAX_B = 256                     # the largest batch a "max" row tries
HEADROOM = 2 << 30              # device memory left beside the arena (cuBLASLt workspace, modules, context)


@functools.lru_cache(maxsize=1)
def fresh_params(preset: str) -> dict[str, np.ndarray]:
    """One size's parameters, kept for its next rows (the rows run size by size; read only)."""
    params = init_params(Config(**get_preset(preset)["model"]), 0, device="gpu")
    for array in params.values():
        array.flags.writeable = False
    return params


def arena_bytes(cfg: Config, B: int, T: int, dev: Device, mode: str) -> int:
    """The arena of one fine-tuning mode at batch B, by layout (nothing allocated)."""
    opts = MODES[mode]
    return Layout(cfg, B, T, dev.info, "bf16", True, tune_states=bool(opts.get("states")),
                  moments=opts["moments"], lora=LORA if opts.get("lora") else None).total


def largest_batch(cfg: Config, T: int, dev: Device, mode: str, free: int) -> int:
    """The largest B <= MAX_B whose arena leaves HEADROOM of ``free``; 0 when not even B = 1 does."""
    lo, hi = 0, MAX_B
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if arena_bytes(cfg, mid, T, dev, mode) + HEADROOM <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


@pytest.mark.parametrize("preset, mode, T, batch", RUNS, ids=[f"{p}-{m}-T{t}-B{b}" for p, m, t, b in RUNS])
def test_finetune_step(benchmark, dev, preset, mode, T, batch):
    from rwkvx.model import Model
    cfg = Config(**get_preset(preset)["model"])
    opts = MODES[mode]
    lora = LORA if opts.get("lora") else None
    free = free_memory(dev)
    B = largest_batch(cfg, T, dev, mode, free) if batch == "max" else batch
    # B = 0: not even B = 1 leaves the largest batch's headroom
    skip_unless_fits(f"{preset} {mode} at B = 1", arena_bytes(cfg, max(B, 1), T, dev, mode), free,
                     HEADROOM if B == 0 else 0)
    if batch == "max" and B == 1:
        pytest.skip(f"{preset} {mode}: B = 1 is the largest batch that fits (its B1 row)")
    params = fresh_params(preset)
    dev.reset_peak()
    model = Model(cfg, params, B, T, precision="bf16", recompute=True, moments=opts["moments"],
                  states=zero_states(cfg) if opts.get("states") else None,
                  lora=init_factors(cfg, lora) if lora else None, lora_scale=LORA.scale)
    model.configure_optimizer(Schedule(lr_max=1e-5, lr_min=1e-6, total_steps=100), 0.0, 1.0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1))
    inputs = (tokens[:, :-1], tokens[:, 1:])
    model.train_step(*inputs)                         # graph capture, GEMM algorithms, modules
    losses = []
    benchmark.pedantic(lambda: losses.append(model.train_step(*inputs)),
                       rounds=ROUNDS if batch == 1 else MAX_B_ROUNDS, iterations=1)
    step_ms = benchmark.stats.stats.mean * 1e3
    mem = dev.memory_info()
    benchmark.extra_info.update({
        "B": B,
        "ms_per_step": round(step_ms, 1),
        "tokens_per_s": round(B * T / (step_ms / 1e3)),
        "arena_GiB": round(model.memory_bytes() / 2**30, 2),
        "peak_alloc_GiB": round(mem["peak_allocated"] / 2**30, 2),
        "device_used_GiB": round((mem["total"] - mem["free"]) / 2**30, 2),
        "loss": round(float(losses[-1]), 4),
    })
    if T == 1024 and (preset, mode) in RWKV_PEFT_GB:
        benchmark.extra_info["rwkv_peft_GB"] = RWKV_PEFT_GB[preset, mode]
