"""rwkvx's bf16 gradients on the GPU beside their CPU emulation, tensor by tensor.

For one case of the bf16 yardstick (tests/gpu/test_bf16_yardstick.py: the same parameters, tokens,
targets and B·T = 8192 tokens), the gradient error against the float64 twin of: rwkvx's bf16 step on this
GPU, the emulation of it (tests/torch_twin.py ``rwkvx_bf16`` with the plan's fp32 families and the kernels'
own roundings, ``--kernels``; its chunked WKV7 runs as numpy on the CPU) and PyTorch autocast (the
yardstick). Printed: the medians, and every tensor whose error is over the yardstick's bound (ratio > 1)
in rwkvx or in the emulation, with both ratios and the distance between rwkvx's gradient and the
emulation's, then the worst tensor of each, any tensors ``--tensors`` names and the count of tensors over
the bound. Where rwkvx is over the bound and the emulation is not, the GPU has an error source the
emulation leaves out (fp32 arithmetic, an order of sums, or a kernel rounding not modelled).

Each ``--fp32 FAMILY...`` is one more emulated variant: the plan with those families of
``torch_twin.FAMILIES`` also in fp32 (``--fp32`` alone: the plan itself); all variants share one float64
reference and one yardstick, which take nearly all of a CPU run's time. ``--cache DIR`` (with ``--cpu``)
keeps those two in DIR, one file per case and seed, and a later run on the same inputs reads them back
(the file records a hash of the inputs, not of the twin's code).

    python scripts/bf16_emulation_check.py --case rwkv7-N64-T1024 --seed 0 [--kernels wkv7_split moba_bf16]
    python scripts/bf16_emulation_check.py --case hybrid-N64-T1024 --seed 2 --cpu --tensors moba.1.att.
    python scripts/bf16_emulation_check.py --case rwkv7-N64-T1024 --seed 0 --cpu --cache /tmp/bf16ref \
        --fp32 --fp32 r kv --fp32 drkv --tensors ln1.bias

Needs rwkvx's GPU and PyTorch with CUDA (the twins run there; about a minute per case). ``--cpu``: the
emulation and the yardstick alone, on the CPU with the float64 twin's own selection (no GPU; at the
yardstick's B·T = 8192 on one core, about 1.5 minutes for the reference and the yardstick of an RWKV-7 T 1024
case, 4.5 for hybrid T 4096, and half a minute to 1.5 minutes per variant).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "tests/gpu", "scripts")]

import torch_twin  # noqa: E402  (test code: the twin and its recipes)
from bf16_error_budget import PLAN_FP32, STEP  # noqa: E402
from conftest import make_training_like_params  # noqa: E402
from test_bf16_yardstick import BATCH, FLOOR, HEAD_SIZES, KINDS, SLACK, _inputs, allowance  # noqa: E402
from rwkvx import Config  # noqa: E402
from rwkvx.atomic_io import atomic_write  # noqa: E402
from rwkvx.model import Model  # noqa: E402
from rwkvx.oracle import rel_err  # noqa: E402

CASE = re.compile(r"(?P<kind>\w+)-N(?P<N>\d+)-T(?P<T>\d+)")


def compare(ref: dict[str, np.ndarray], got: dict[str, dict[str, np.ndarray]], show: Sequence[str] = ()) -> list[str]:
    """Markdown rows: per source of ``got`` (name -> gradients; "yardstick" among them) the median error
    against ``ref``, then the tensors over the yardstick's bound in any other source, the worst tensor of
    each other source, the tensors whose names contain one of ``show`` and the count of tensors over the
    bound per source. Where "rwkvx" is a source, the last column is its distance to the first emulated one."""
    errors = {src: {n: rel_err(g[n], want) for n, want in ref.items()} for src, g in got.items()}
    yard = errors["yardstick"]
    ratio = {src: {n: e / allowance(yard[n]) for n, e in errs.items()} for src, errs in errors.items()}
    others = [src for src in got if src != "yardstick"]
    emulated = next((src for src in others if src != "rwkvx"), None)
    both = "rwkvx" in got and emulated is not None
    rows = ["| | " + " | ".join(f"{src} error" for src in got) + " | "
            + " | ".join(f"{src} ratio" for src in others) + (f" | rwkvx vs {emulated} |" if both else " |"),
            "|---|" + "---|" * (len(got) + len(others) + both),
            "| median | " + " | ".join(f"{np.median(list(errors[src].values())):.3e}" for src in got) + " |"
            + " |" * (len(others) + both)]
    over = sorted({n for src in others for n, r in ratio[src].items() if r > 1},
                  key=lambda n: -max(ratio[src][n] for src in others))
    worst = [max(ratio[src], key=ratio[src].get) for src in others]
    named = [n for n in ref if any(part in n for part in show)]
    for n in dict.fromkeys(over + worst + named):
        rows.append(f"| {n} | " + " | ".join(f"{errors[src][n]:.3e}" for src in got) + " | "
                    + " | ".join(f"{ratio[src][n]:.3f}" for src in others)
                    + (f" | {rel_err(got['rwkvx'][n], got[emulated][n]):.2e} |" if both else " |"))
    rows.append("| tensors over the bound |" + " |" * len(got) + " "
                + " | ".join(str(sum(r > 1 for r in ratio[src].values())) for src in others) + " |" + " |" * both)
    return rows


def variant(extra: Sequence[str]) -> str:
    """The name of the emulated variant with the families ``extra`` in fp32 beyond the plan's."""
    extra = sorted(set(extra) - PLAN_FP32)
    return "emulation" + (f" + {', '.join(extra)} fp32" if extra else "")


def inputs_digest(params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray) -> str:
    """A hash of a case's inputs: a cached reference is reused only for the inputs it was computed on."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode() + np.ascontiguousarray(params[name], np.float64).tobytes())
    for a in (tokens, targets):
        h.update(np.ascontiguousarray(a, np.int64).tobytes())
    return h.hexdigest()


References = tuple[dict[str, np.ndarray], list[np.ndarray], dict[str, np.ndarray]]


def references(path: Path | None, digest: str, compute: Callable[[], References]) -> References:
    """(the float64 reference's gradients, its MoBA selection, the yardstick's gradients) of one case: read
    from the file ``path`` where it holds them for the inputs of ``digest``, else ``compute()``-d and, with
    a ``path``, written there."""
    if path is not None and path.exists():
        with np.load(path) as z:
            if str(z["digest"]) == digest:
                print(f"float64 reference and yardstick read from {path}", file=sys.stderr, flush=True)
                part = {p: {k.split(":", 1)[1]: z[k] for k in z.files if k.startswith(p + ":")}
                        for p in ("ref", "sel", "yard")}
                return part["ref"], [part["sel"][str(i)] for i in range(len(part["sel"]))], part["yard"]
        print(f"{path} holds other inputs: computing the reference and the yardstick again", file=sys.stderr)
    ref, selection, yard = compute()
    if path is not None:
        arrays = {f"ref:{n}": g for n, g in ref.items()} | {f"yard:{n}": g for n, g in yard.items()}
        arrays |= {f"sel:{i}": s for i, s in enumerate(selection)}
        atomic_write(path, lambda f: np.savez(f, digest=np.array(digest), **arrays))
    return ref, selection, yard


def emulations(cfg: Config, params: dict[str, np.ndarray], tokens: np.ndarray, targets: np.ndarray,
               variants: Sequence[Sequence[str]], kernels: Sequence[str], device: str = "cpu",
               selection: list[np.ndarray] | None = None, cache: Path | None = None
               ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """(the float64 reference's gradients, by source the gradients of each emulated variant (the plan with
    the families of one entry of ``variants`` also in fp32 and the roundings ``kernels``, named by
    :func:`variant`) and of the yardstick, "yardstick"). The twins run on ``device`` with the MoBA
    ``selection`` given, or with the float64 twin's own (None); ``cache``: the file that keeps the
    reference and the yardstick of these inputs across runs (with the twin's own selection only)."""
    if cache is not None and selection is not None:
        raise ValueError("a cached reference takes the float64 twin's own selection, not a given one")

    def twin(recipe: str, **kwargs) -> torch_twin.TwinResult:
        return torch_twin.loss_and_grads(cfg, params, tokens, targets, recipe, device, selection=selection, **kwargs)

    def compute() -> References:
        t0 = time.time()
        result = twin("float64")
        own = result.selection if selection is None else selection     # [] without MoBA blocks
        yard = torch_twin.loss_and_grads(cfg, params, tokens, targets, "autocast_bf16", device,
                                         selection=own or None).grads
        print(f"float64 reference and yardstick in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
        return result.grads, own, yard

    ref, own, yard = references(cache, inputs_digest(params, tokens, targets), compute)
    selection = own or None
    got = {}
    for extra in variants:
        name = variant(extra)
        if name not in got:
            t0 = time.time()
            got[name] = twin("rwkvx_bf16", fp32_families=PLAN_FP32 | set(extra), kernels=kernels).grads
            print(f"{name} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    got["yardstick"] = yard
    return ref, got


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: ``case`` becomes (kind, N, T) and ``fp32`` the variants' lists of
    families (the plan alone where no --fp32 is given)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", required=True, help="kind-N<head size>-T<sequence length>, e.g. rwkv7-N64-T1024")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", nargs="*", choices=tuple(torch_twin.KERNELS), default=list(STEP),
                    help="the kernels' roundings the emulation adds (default: the bf16 step's)")
    ap.add_argument("--fp32", nargs="*", action="append", choices=tuple(torch_twin.FAMILIES), metavar="FAMILY",
                    help="one emulated variant: the plan with these families also in fp32; repeat for several "
                         "(alone: the plan itself, the default)")
    ap.add_argument("--cpu", action="store_true",
                    help="no GPU: the emulation and the yardstick on the CPU, the float64 twin's selection")
    ap.add_argument("--cache", type=Path, metavar="DIR",
                    help="with --cpu: a folder (outside the repository) that keeps each case's float64 reference "
                         "and yardstick, for later runs on the same inputs (a file is kept for the inputs it was "
                         "computed on; clear the folder after changing the twin's float64 or autocast recipe)")
    ap.add_argument("--tensors", nargs="*", default=[], help="also print the tensors whose names contain these")
    args = ap.parse_args(argv)
    m = CASE.fullmatch(args.case)
    if not m or m["kind"] not in KINDS or int(m["N"]) not in HEAD_SIZES or int(m["T"]) not in BATCH:
        ap.error(f"--case must be kind-N<n>-T<t> with kind in {tuple(KINDS)}, n in {HEAD_SIZES}, "
                 f"t in {tuple(BATCH)}; got {args.case!r}")
    if args.cache is not None and not args.cpu:
        ap.error("--cache needs --cpu (on the GPU the reference takes rwkvx's own selection)")
    args.case = (m["kind"], int(m["N"]), int(m["T"]))
    args.fp32 = args.fp32 or [[]]
    return args


def main() -> None:
    args = parse_args()
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("needs PyTorch with CUDA (the twins run on the GPU), or --cpu")
    kind, N, T = args.case
    case = f"{kind}-N{N}-T{T}"
    torch.set_num_threads(1)   # small float64 ops: threads only add synchronisation (and fight on a shared CPU)
    cfg, params, tokens, targets = _inputs(kind, N, T, args.seed, make_training_like_params)
    kernels = [k for k in args.kernels if cfg.n_attn_layer or not k.startswith("moba_")]
    got = {}
    selection = None
    if not args.cpu:
        model = Model(cfg, params, *tokens.shape, precision="bf16", recompute=False)     # as the yardstick
        _, got["rwkvx"] = model.loss_and_grads(tokens, targets)
        selection = model.moba_selection() if cfg.n_attn_layer else None
        del model
    cache = None if args.cache is None else args.cache / f"{case}-seed{args.seed}.npz"
    ref, emulated = emulations(cfg, params, tokens, targets, args.fp32, kernels, "cpu" if args.cpu else "cuda",
                               selection, cache)
    got.update(emulated)
    print(f"{case} seed {args.seed}: emulation with kernels {', '.join(kernels) or 'none'}; ratio = error / "
          f"({SLACK} x max(yardstick's, {FLOOR}))\n")
    print("\n".join(compare(ref, got, args.tensors)))


if __name__ == "__main__":
    main()
