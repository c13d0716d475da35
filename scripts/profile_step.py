"""Where a training step's device time goes: every op of the step timed alone with CUDA events.

Usage: python scripts/profile_step.py [--preset base|small] [--batch-size B] [--seq-len T] [--precision fp32|tf32|bf16]
[--rows N]
[--n-attn-layer M]
Prints the time per op family (kernel name, or GEMM shape class) and the total, next to the step
time of the plan run as a whole. Needs a GPU.
"""
import argparse
from collections import defaultdict

import numpy as np

from rwkvx import Config, init_params
from rwkvx.model import Model
from rwkvx.precision import DEFAULT_PRECISION, PRECISION_NAMES
from rwkvx.presets import get_preset
from rwkvx._core import Plan
from rwkvx.runtime import EventTimer
from rwkvx.runtime.ops import Gemm, Launch, flatten_ops
from rwkvx.workloads import mfu


def op_family(op) -> str:
    if isinstance(op, Launch):
        return f"{op.module}.{op.name}"
    if isinstance(op, Gemm):
        return f"gemm m={op.m} n={op.n} k={op.k} {'T' if op.transa else 'N'}{'T' if op.transb else 'N'}"
    return type(op).__name__


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--n-attn-layer", type=int, help="override the preset's attention blocks (0: pure RWKV-7)")
    ap.add_argument("--precision", default=DEFAULT_PRECISION, choices=PRECISION_NAMES)
    ap.add_argument("--rows", type=int, default=40, help="op families listed (the costliest first)")
    args = ap.parse_args()
    preset = get_preset(args.preset, "gpu")
    overrides = {} if args.n_attn_layer is None else {"n_attn_layer": args.n_attn_layer}
    cfg = Config(**{**preset["model"], **overrides})
    B = args.batch_size or preset["train"].batch_size
    T = args.seq_len or preset["train"].seq_len
    model = Model(cfg, init_params(cfg, 0, device="gpu"), B, T, precision=args.precision)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    model.stage_batch(tokens, np.roll(tokens, -1, axis=1))
    timer = EventTimer(model.dev)
    model.run_step()
    total = timer.time_ms(model.run_step, 2)
    step_ops = flatten_ops(model.ops.step)
    per_family: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for op in step_ops:     # in order, so every op sees the buffers its predecessors wrote
        plan = Plan(model.dev, [op])
        ms = timer.time_ms(plan.run, 1)
        fam = per_family[op_family(op)]
        fam[0] += ms
        fam[1] += 1
    summed = sum(v[0] for v in per_family.values())
    utilisation = mfu(cfg, B, T, total, args.precision)
    print(f"config {args.preset} B={B} T={T} {args.precision} recompute={model.recompute}: step {total:.2f} ms, "
          f"MFU {100 * utilisation:.1f}% of the H200's peak "
          f"(ops timed one by one: {summed:.2f} ms, {len(step_ops)} ops)")
    print(f"{'op family':<58}{'count':>6}{'ms':>10}{'%':>7}")
    for name, (ms, n) in sorted(per_family.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        print(f"{name:<58}{n:>6}{ms:>10.2f}{100 * ms / summed:>7.1f}")


if __name__ == "__main__":
    main()
