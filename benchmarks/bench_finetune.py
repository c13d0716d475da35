"""Training the released RWKV-7 sizes on one GPU, per fine-tuning mode: step time, tokens/s and device
memory (report, don't assert). bf16, B = 1, T = 4096, recompute (the least memory), rwkv7-1.5b, -2.9b
and -7.2b, and state tuning and LoRA also at T = 1024 beside RWKV-PEFT's published peak memory for that
setting (RTX 4090, bf16, ctx 1024, batch 1: state tuning 1.5B 5.3 GB, 2.9B 8.2 GB; LoRA 5.6 / 8.8 GB;
``extra_info["rwkv_peft_GB"]``):

* ``full``: every parameter trains, AdamW moments in float32 (18 bytes a parameter);
* ``full-lean``: the same with the lean moments (bf16, stochastically rounded: 14 bytes a parameter);
* ``state``: state tuning, only the initial WKV states train (the frozen GEMM weights kept only as their
  bf16 copy, no moments, no weight gradients);
* ``lora``: LoRA with the default rank, alpha and targets (:mod:`rwkvx.lora`), only the factors train
  (the frozen parameters likewise).

The parameters are random, not ``init_params``'s:
its orthogonal matrices take hours at 7.2B on a small host and neither time nor memory depends on the
values, so each orthogonal matrix is a seeded block of Gaussian values of its scale, tiled. Each row
builds the model (its peak is the arena plus cuBLASLt's workspace), runs one step (graph capture,
GEMM algorithms), then times ``ROUNDS`` steps by wall clock, each waiting for its loss.
``extra_info``: ms per step, tokens/s, the arena and the device's peak allocation and use, GiB.
Skipped without a GPU; rows whose arena does not fit the free memory are skipped with the sizes.

Run: ``python -m pytest benchmarks/bench_finetune.py -k 7.2b --benchmark-columns=mean``
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import rwkvx.params
from rwkvx import Config, init_params
from rwkvx.arena import Layout
from rwkvx.lora import DEFAULT_ALPHA, DEFAULT_RANK, DEFAULT_TARGETS, LoraSettings, init_factors
from rwkvx.optim import Schedule
from rwkvx.presets import get_preset
from rwkvx.state_tuning import zero_states

SIZES = ("rwkv7-1.5b", "rwkv7-2.9b", "rwkv7-7.2b")
LORA = LoraSettings(DEFAULT_RANK, DEFAULT_ALPHA, DEFAULT_TARGETS)
MODES = {"full": dict(moments="f32"), "full-lean": dict(moments="bf16"), "state": dict(moments="f32", states=True),
         "lora": dict(moments="f32", lora=True)}
# RWKV-PEFT's published peaks (RTX 4090, bf16, ctx 1024, batch 1), GB
RWKV_PEFT_GB = {("rwkv7-1.5b", "state"): 5.3, ("rwkv7-1.5b", "lora"): 5.6,
                ("rwkv7-2.9b", "state"): 8.2, ("rwkv7-2.9b", "lora"): 8.8}
RUNS = ([(preset, mode, 4096) for preset in SIZES for mode in MODES]
        + [(preset, mode, 1024) for preset in SIZES for mode in ("state", "lora")])
B, ROUNDS = 1, 3
TILE = 1 << 20                  # random values per orthogonal matrix, tiled over it


def tiled_orthogonal(rng: np.random.Generator, shape: tuple[int, int], gain: float) -> np.ndarray:
    """A stand-in for rwkvx.params.orthogonal with its scale (gain / sqrt(columns) per entry), fast."""
    block = rng.standard_normal(min(TILE, shape[0] * shape[1]), dtype=np.float32) * np.float32(gain / np.sqrt(shape[1]))
    return np.resize(block, shape)


@pytest.mark.parametrize("preset, mode, T", RUNS, ids=[f"{p}-{m}-T{t}" for p, m, t in RUNS])
def test_finetune_step(benchmark, dev, monkeypatch, preset, mode, T):
    from rwkvx.model import Model
    cfg = Config(**get_preset(preset)["model"])
    opts = MODES[mode]
    lora = LORA if opts.get("lora") else None
    need = Layout(cfg, B, T, dev.info, "bf16", True, tune_states=bool(opts.get("states")),
                  moments=opts["moments"], lora=lora).total
    free = dev.memory_info()["free"]
    if need > free:
        pytest.skip(f"{preset} {mode}: the arena takes {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
    monkeypatch.setattr(rwkvx.params, "orthogonal", tiled_orthogonal)
    params = init_params(cfg, 0)
    dev.reset_peak()
    model = Model(cfg, params, B, T, precision="bf16", recompute=True, moments=opts["moments"],
                  states=zero_states(cfg) if opts.get("states") else None,
                  lora=init_factors(cfg, lora) if lora else None, lora_scale=LORA.scale)
    del params
    model.configure_optimizer(Schedule(lr_max=1e-5, lr_min=1e-6, total_steps=100), 0.0, 1.0)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T + 1))
    batch = (tokens[:, :-1], tokens[:, 1:])
    model.train_step(*batch)                         # graph capture, GEMM algorithms, modules
    start = time.perf_counter()
    for _ in range(ROUNDS):
        loss = model.train_step(*batch)
    step_ms = (time.perf_counter() - start) / ROUNDS * 1e3
    benchmark.pedantic(lambda: model.train_step(*batch), rounds=1, iterations=1)
    mem = dev.memory_info()
    benchmark.extra_info.update({
        "ms_per_step": round(step_ms, 1),
        "tokens_per_s": round(B * T / (step_ms / 1e3)),
        "arena_GiB": round(model.memory_bytes() / 2**30, 2),
        "peak_alloc_GiB": round(mem["peak_allocated"] / 2**30, 2),
        "device_used_GiB": round((mem["total"] - mem["free"]) / 2**30, 2),
        "loss": round(float(loss), 4),
    })
    if T == 1024 and (preset, mode) in RWKV_PEFT_GB:
        benchmark.extra_info["rwkv_peft_GB"] = RWKV_PEFT_GB[preset, mode]
