"""One rank of a data-parallel GPU job (or a single GPU), for the multi-GPU tests and the benchmark.

    python scripts/dist_run.py OUT [--preset small] [--batch-size B] [--steps K] [--warmup W]

Started alone it trains on one GPU; started by ``rwkvx.dist.launch.spawn`` (or torchrun) each process
is one rank: it joins the job, uses its GPU and steps on its shard of every global batch (random tokens
from a fixed seed: the same global batches for any number of ranks). ``--warmup`` steps are run first
(the first captures the graph), then ``--steps`` timed steps. Every rank writes ``OUT/rank<r>.npz``: its
final parameters (``p.<name>``), the losses and the wall-clock seconds of each timed step.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from rwkvx import Config, init_params
from rwkvx.data import BatchSampler
from rwkvx.dist import init_world, launch_info
from rwkvx.dist.env import device_ordinal
from rwkvx.dist.launch import visible_gpus
from rwkvx.presets import get_preset
from rwkvx.runtime.device import Device
from rwkvx.training.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank (default: the preset's)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--precision", default="fp32")
    args = ap.parse_args()

    info = launch_info(os.environ)
    world = init_world(info) if info is not None else None
    if world is not None:
        Device.select(device_ordinal(world.local_rank, visible_gpus()))
    rank, ranks = (0, 1) if world is None else (world.rank, world.world_size)
    preset = get_preset(args.preset, device="gpu")
    cfg = Config(**preset["model"])
    B = args.batch_size or preset["train"].batch_size
    T = args.seq_len or preset["train"].seq_len
    trainer = Trainer(cfg, init_params(cfg, 0), backend="gpu", batch_size=B, seq_len=T, lr=1e-3,
                      lr_min=1e-4, warmup=2, steps=args.warmup + args.steps, weight_decay=0.1,
                      grad_clip=1.0, precision=args.precision, world=world)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 1 << 20).astype(np.uint16)
    sampler = BatchSampler(tokens, B, T, seed=2, rank=rank, world_size=ranks)
    losses, seconds = [], []
    for i in range(args.warmup + args.steps):
        x, y = sampler.next()
        t0 = time.perf_counter()
        loss = trainer.step(x, y)
        if i >= args.warmup:
            seconds.append(time.perf_counter() - t0)
            losses.append(loss)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / f"rank{rank}.npz", losses=np.array(losses), seconds=np.array(seconds),
             world_size=ranks, batch_size=B, seq_len=T,
             **{f"p.{n}": v for n, v in trainer.params.items()})
    if world is not None:
        world.barrier()
        world.close()


if __name__ == "__main__":
    main()
