"""rwkvx's bf16 gradients on the GPU beside their CPU emulation, tensor by tensor.

For one case of the bf16 yardstick (tests/gpu/test_bf16_yardstick.py: the same parameters, tokens,
targets and B·T = 8192 tokens), the gradient error against the float64 twin of: rwkvx's bf16 step on this
GPU, the emulation of it (tests/torch_twin.py ``rwkvx_bf16`` with the plan's fp32 families and the kernels'
own roundings, ``--kernels``; its chunked WKV7 runs as numpy on the CPU) and PyTorch autocast (the
yardstick). Printed: the medians, and every tensor whose error is over the yardstick's bound (ratio > 1)
in rwkvx or in the emulation, with both ratios and the distance between rwkvx's gradient and the
emulation's, then the worst tensor of each and any tensors ``--tensors`` names. Where rwkvx is over the
bound and the emulation is not, the GPU has an error source the emulation leaves out (fp32 arithmetic, an
order of sums, or a kernel rounding not modelled).

    python scripts/bf16_emulation_check.py --case rwkv7-N64-T1024 --seed 0 [--kernels wkv7_split moba_bf16]
    python scripts/bf16_emulation_check.py --case hybrid-N64-T1024 --seed 2 --cpu --tensors moba.1.att.

Needs rwkvx's GPU and PyTorch with CUDA (the twins run there; about a minute per case). ``--cpu``: the
emulation and the yardstick alone, on the CPU with the float64 twin's own selection (no GPU; 3 to 10
minutes per case on one core).
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "tests/gpu", "scripts")]

import torch_twin  # noqa: E402  (test code: the twin and its recipes)
from bf16_error_budget import PLAN_FP32, STEP  # noqa: E402
from conftest import make_training_like_params  # noqa: E402
from test_bf16_yardstick import BATCH, FLOOR, HEAD_SIZES, KINDS, SLACK, _inputs  # noqa: E402
from rwkvx.model import Model  # noqa: E402
from rwkvx.oracle import rel_err  # noqa: E402

CASE = re.compile(r"(?P<kind>\w+)-N(?P<N>\d+)-T(?P<T>\d+)")


def compare(ref: dict[str, np.ndarray], got: dict[str, dict[str, np.ndarray]], show: Sequence[str] = ()) -> list[str]:
    """Markdown rows: per source of ``got`` (name -> gradients; "yardstick" among them) the median error
    against ``ref``, then the tensors over the yardstick's bound in any other source, the worst tensor of
    each other source and the tensors whose names contain one of ``show``."""
    errors = {src: {n: rel_err(g[n], want) for n, want in ref.items()} for src, g in got.items()}
    yard = errors["yardstick"]
    ratio = {src: {n: e / (SLACK * max(yard[n], FLOOR)) for n, e in errs.items()} for src, errs in errors.items()}
    others = [src for src in got if src != "yardstick"]
    both = "rwkvx" in got
    rows = ["| | " + " | ".join(f"{src} error" for src in got) + " | "
            + " | ".join(f"{src} ratio" for src in others) + (" | rwkvx vs emulation |" if both else " |"),
            "|---|" + "---|" * (len(got) + len(others) + both),
            "| median | " + " | ".join(f"{np.median(list(errors[src].values())):.2e}" for src in got) + " |"
            + " |" * (len(others) + both)]
    over = sorted({n for src in others for n, r in ratio[src].items() if r > 1},
                  key=lambda n: -max(ratio[src][n] for src in others))
    worst = [max(ratio[src], key=ratio[src].get) for src in others]
    named = [n for n in ref if any(part in n for part in show)]
    for n in dict.fromkeys(over + worst + named):
        rows.append(f"| {n} | " + " | ".join(f"{errors[src][n]:.2e}" for src in got) + " | "
                    + " | ".join(f"{ratio[src][n]:.2f}" for src in others)
                    + (f" | {rel_err(got['rwkvx'][n], got['emulation'][n]):.2e} |" if both else " |"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", required=True, help="kind-N<head size>-T<sequence length>, e.g. rwkv7-N64-T1024")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", nargs="*", choices=tuple(torch_twin.KERNELS), default=list(STEP),
                    help="the kernels' roundings the emulation adds (default: the bf16 step's)")
    ap.add_argument("--cpu", action="store_true",
                    help="no GPU: the emulation and the yardstick on the CPU, the float64 twin's selection")
    ap.add_argument("--tensors", nargs="*", default=[], help="also print the tensors whose names contain these")
    args = ap.parse_args()
    m = CASE.fullmatch(args.case)
    if not m or m["kind"] not in KINDS or int(m["N"]) not in HEAD_SIZES or int(m["T"]) not in BATCH:
        raise SystemExit(f"--case must be kind-N<n>-T<t> with kind in {tuple(KINDS)}, n in {HEAD_SIZES}, "
                         f"t in {tuple(BATCH)}; got {args.case!r}")
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("needs PyTorch with CUDA (the twins run on the GPU), or --cpu")
    cfg, params, tokens, targets = _inputs(m["kind"], int(m["N"]), int(m["T"]), args.seed, make_training_like_params)
    kernels = [k for k in args.kernels if cfg.n_attn_layer or not k.startswith("moba_")]
    got = {}
    selection = None
    if not args.cpu:
        model = Model(cfg, params, *tokens.shape, precision="bf16", recompute=False)     # as the yardstick
        _, got["rwkvx"] = model.loss_and_grads(tokens, targets)
        selection = model.moba_selection() if cfg.n_attn_layer else None
        del model
    device = "cpu" if args.cpu else "cuda"
    reference = torch_twin.loss_and_grads(cfg, params, tokens, targets, "float64", device, selection=selection)
    if args.cpu:
        selection = reference.selection if cfg.n_attn_layer else None

    def twin(recipe, **kwargs):
        return torch_twin.loss_and_grads(cfg, params, tokens, targets, recipe, device, selection=selection,
                                         **kwargs).grads

    got.update(emulation=twin("rwkvx_bf16", fp32_families=PLAN_FP32, kernels=kernels),
               yardstick=twin("autocast_bf16"))
    print(f"{args.case} seed {args.seed}: emulation with kernels {', '.join(kernels) or 'none'}; ratio = error / "
          f"({SLACK} x max(yardstick's, {FLOOR}))\n")
    print("\n".join(compare(reference.grads, got, args.tensors)))


if __name__ == "__main__":
    main()
