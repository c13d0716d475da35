"""The bf16 error budget: how much each family of rwkvx's bf16 buffers adds to the gradient error.

An EMULATION on the CPU, not a GPU measurement: the PyTorch twin's ``rwkvx_bf16`` recipe
(tests/torch_twin.py) computes the model in float64 and rounds to bf16 where rwkvx's bf16 step stores a
buffer in bf16 (forward values and backward gradients) and where its GEMMs take bf16 operands, one
family of roundings at a time (``torch_twin.FAMILIES``). For the bf16 yardstick's models
(tests/gpu/test_bf16_yardstick.py: training-like parameters, C = 256, L = 4, V = 512, hybrid and pure
RWKV-7, N = 64) it prints, per variant, the norm-wise relative error of every parameter gradient
against the float64 twin (rwkvx.oracle.rel_err) summarised as the median and the worst tensor over the
tensors, the worst att.k_k, and the yardstick's criterion (every gradient <= SLACK x max(autocast's
error, FLOOR), the median <= autocast's median) as "ratio": the largest error / allowance over the
tensors. Variants: PyTorch autocast bf16 (the yardstick), every family rounded (the emulated rwkvx
plan), each family alone promoted to fp32, each family alone rounded, and the cumulative promotions,
families taken in the order of their single gains, to the fewest that meet the criterion (found by
bisection), and the decay's logit in bf16 instead of the decay (alone, and with the other families of
that set in fp32). The MoBA blocks attend with the float64 twin's selection in every variant.

``--kernels`` prints another table instead: the plan of docs/SPEC.md §4 (PLAN_FP32 families in fp32) with
the kernels' own roundings added (``torch_twin.KERNELS``: the chunked WKV7's tf32 operands in one pass as
the bf16 kernels take them, with the chunk operators split into 3xTF32 or every product in 3xTF32, MoBA's
bf16 P and dS with the backward's delta from the output and its residual, delta from the bf16 output alone
instead, and dS split into a bf16 pair), then the kernels as today with relu² taken from an fp32 kf and
with one more family in fp32 each (KERNEL_VARIANTS).

    python scripts/bf16_error_budget.py --out budget.md [--batch 1 --seq-len 512 --seed 0 --head-size 64]
    python scripts/bf16_error_budget.py --kernels --out kernels.md --seq-len 1024 --head-size 32 64 --seed 0 1 2

(--seed and --head-size take several values: one table per model, and with --kernels the ratios side by
side at the end.)

writes the table (markdown) to ``--out`` atomically and prints it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "tests/gpu")]

import torch_twin  # noqa: E402  (test code: the twin and its recipes)
from conftest import make_training_like_params  # noqa: E402
from test_bf16_yardstick import FLOOR, HEAD_SIZES, KINDS, SIZES, SLACK, allowance  # noqa: E402
from rwkvx import Config  # noqa: E402
from rwkvx.atomic_io import atomic_write  # noqa: E402
from rwkvx.oracle import rel_err  # noqa: E402

FAMILIES = tuple(torch_twin.FAMILIES)
PLAN_FP32 = frozenset({"decay", "residual", "layernorm"})   # rwkvx.arena.FP32_ALWAYS, as families
KERNEL_ROUNDINGS = ("wkv7_tf32", "moba_bf16")                 # the bf16 kernels' own roundings
STEP = KERNEL_ROUNDINGS + ("ffn_kf_fp32",)                    # the bf16 step: relu² from the fp32 key product
# (label, kernel roundings, families promoted beyond the plan) of the --kernels table; "k bf16": the
# kernels' roundings with k rounded to bf16 before relu²
KERNEL_VARIANTS = (
    ("plan, no kernel rounding", (), ()),
    ("plan + WKV7 one-pass TF32", ("wkv7_tf32",), ()),
    ("plan + MoBA bf16 P, dS", ("moba_bf16",), ()),
    ("plan + MoBA bf16 P, dS, delta from the bf16 output", ("moba_bf16_delta",), ()),
    ("k bf16 (both roundings)", KERNEL_ROUNDINGS, ()),
    ("k bf16, WKV7 operators 3xTF32 (SPLIT_OPERATORS)", ("wkv7_split", "moba_bf16"), ()),
    ("k bf16, every WKV7 product 3xTF32", ("wkv7_exact", "moba_bf16"), ()),
    ("k bf16, MoBA's dS a bf16 pair", ("wkv7_tf32", "moba_split_ds"), ()),
    ("relu² from an fp32 kf (the bf16 step)", STEP, ()),
) + tuple((f"k bf16 + {fam} fp32", KERNEL_ROUNDINGS, (fam,)) for fam in ("ffn", "gn_gate", "lora"))


class Case:
    """One model and batch: the float64 reference and the yardstick, then any emulated variant."""

    def __init__(self, kind: str, N: int, B: int, T: int, seed: int):
        self.cfg = Config(**SIZES, **KINDS[kind], head_size=N)
        self.params = make_training_like_params(self.cfg, seed)
        rng = np.random.default_rng(seed)
        self.tokens, self.targets = rng.integers(0, self.cfg.vocab_size, (2, B, T))
        self.targets[rng.random((B, T)) < 0.2] = -100          # ignore_index, as the yardstick's
        self.ref = self._run("float64")
        self.selection = self.ref.selection if self.cfg.n_attn_layer else None
        self.yard = self.errors(self._run("autocast_bf16", selection=self.selection))
        self.kernel_table = False                     # rows list the tensors over the bound (--kernels)

    def _run(self, recipe: str, **kwargs) -> torch_twin.TwinResult:
        return torch_twin.loss_and_grads(self.cfg, self.params, self.tokens, self.targets, recipe, **kwargs)

    def errors(self, result: torch_twin.TwinResult) -> dict[str, float]:
        """rel_err of every gradient of ``result`` against float64."""
        return {n: rel_err(result.grads[n], g) for n, g in self.ref.grads.items()}

    def emulate(self, fp32: frozenset[str], decay_logit: bool = False, kernels: tuple[str, ...] = ()
                ) -> dict[str, float]:
        """The gradient errors of the emulated rwkvx plan with the families ``fp32`` promoted (and with
        ``decay_logit``, the decay's logit in bf16 instead of the decay; ``kernels``, the kernels' own
        roundings of torch_twin.KERNELS)."""
        return self.errors(self._run("rwkvx_bf16", selection=self.selection, fp32_families=fp32,
                                     decay_logit=decay_logit, kernels=kernels))

    def ratio(self, errors: dict[str, float]) -> float:
        """The largest error / allowance over the tensors; the criterion holds where it is <= 1 and the
        median is no more than autocast's."""
        return max(e / allowance(self.yard[n]) for n, e in errors.items())

    def meets(self, errors: dict[str, float]) -> bool:
        """The yardstick's criterion (tests/gpu/test_bf16_yardstick.py) against autocast."""
        return self.ratio(errors) <= 1 and np.median(list(errors.values())) <= np.median(list(self.yard.values()))


def _row(case: Case, label: str, errors: dict[str, float]) -> str:
    worst = max(errors, key=errors.get)
    kk = max((e for n, e in errors.items() if n.endswith(".k_k")), default=float("nan"))
    ok = "yes" if case.meets(errors) else "no"
    return (f"| {label} | {np.median(list(errors.values())):.2e} | {errors[worst]:.2e} | {worst} | {kk:.2e} | "
            f"{case.ratio(errors):.2f} | {ok} |{_over(case, errors)}")


def _over(case: Case, errors: dict[str, float]) -> str:
    """The tensors over the allowance, worst first, with their ratios (the --kernels table's last column)."""
    over = sorted(((e / allowance(case.yard[n]), n) for n, e in errors.items()), reverse=True)
    return " " + ", ".join(f"{n} {r:.2f}" for r, n in over if r > 1) + " |" if case.kernel_table else ""


def _header(case: Case, kind: str, B: int, T: int, seed: int) -> list[str]:
    extra = (" over the bound |", "---|") if case.kernel_table else ("", "")
    return [f"\n**{kind}** N {case.cfg.head_size} (B {B} × T {T}, seed {seed})\n",
            "| variant | median | worst | worst tensor | worst k_k | ratio | meets |" + extra[0],
            "|---|---|---|---|---|---|---|" + extra[1], _row(case, "autocast bf16 (yardstick)", case.yard)]


def kernel_table(kind: str, N: int, B: int, T: int, seed: int, log, ratios: dict) -> list[str]:
    """The --kernels table's rows of one model (markdown), logging progress through ``log``; each variant's
    ratio goes to ``ratios[label][(kind, N)][seed]`` for :func:`summary`."""
    t0 = time.time()
    case = Case(kind, N, B, T, seed)
    case.kernel_table = True
    rows = _header(case, kind, B, T, seed)
    done = {}
    for label, kernels, fams in KERNEL_VARIANTS:
        if not case.cfg.n_attn_layer:                 # no MoBA block: no MoBA rounding
            kernels = tuple(k for k in kernels if not k.startswith("moba_"))
        again = (kernels, fams) in done               # without MoBA blocks: an earlier row again
        if not again:
            done[kernels, fams] = case.emulate(PLAN_FP32 | set(fams), kernels=kernels)
        errors = done[kernels, fams]
        ratios.setdefault(label, {}).setdefault((kind, N), {})[seed] = case.ratio(errors)
        if again:
            continue
        rows.append(_row(case, label, errors))
        log(f"{kind} N{N} T{T} seed {seed}: {label} at {time.time() - t0:.0f} s")
    return rows


def summary(ratios: dict) -> list[str]:
    """The --kernels ratios side by side (markdown): per variant and model the ratio of each seed, and how
    many (model, seed) pairs are over the bound (ratio > 1)."""
    models = list(dict.fromkeys(m for per_model in ratios.values() for m in per_model))
    rows = ["\nratio (largest error / allowance) per seed; over: (model, seed) pairs with ratio > 1\n",
            "| variant | " + " | ".join(f"{kind} N{N}" for kind, N in models) + " | over |",
            "|---|" + "---|" * (len(models) + 1)]
    for label, per_model in ratios.items():
        cells = [" / ".join(f"{r:.2f}" for r in per_model[m].values()) if m in per_model else "" for m in models]
        over = sum(r > 1 for by_seed in per_model.values() for r in by_seed.values())
        total = sum(len(by_seed) for by_seed in per_model.values())
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {over} of {total} |")
    return rows


def budget(kind: str, N: int, B: int, T: int, seed: int, log, ratios: dict) -> list[str]:
    """The table's rows of one model (markdown), logging progress through ``log``."""
    t0 = time.time()
    case = Case(kind, N, B, T, seed)
    rows = _header(case, kind, B, T, seed)
    rows.append(_row(case, "rwkvx bf16, every family rounded", case.emulate(frozenset())))
    log(f"{kind}: references and the full plan in {time.time() - t0:.0f} s")
    single = {}
    for fam in FAMILIES:
        single[fam] = case.emulate(frozenset({fam}))
        rows.append(_row(case, f"{fam} fp32", single[fam]))
    for fam in FAMILIES:
        rows.append(_row(case, f"only {fam} bf16", case.emulate(frozenset(FAMILIES) - {fam})))
    log(f"{kind}: single families in {time.time() - t0:.0f} s")
    # cumulative promotions in the order of the single gains: the shortest prefix that meets (bisection;
    # all of them promoted is float64 itself)
    order = sorted(FAMILIES, key=lambda f: (case.ratio(single[f]), np.median(list(single[f].values()))))
    lo, hi, found = 0, len(order), {}
    while lo < hi:
        mid = (lo + hi) // 2
        errors = case.emulate(frozenset(order[:mid]))
        found[mid] = errors
        if case.meets(errors):
            hi = mid
        else:
            lo = mid + 1
    for k in sorted(found):
        rows.append(_row(case, "fp32: " + ", ".join(order[:k]), found[k]))
    # the alternative to an fp32 decay: its logit in bf16 (the decay exact from it), with the rest of the set
    rest = [f for f in order[:lo] if f != "decay"]
    rows.append(_row(case, "decay as a bf16 logit", case.emulate(frozenset(), decay_logit=True)))
    if rest:
        rows.append(_row(case, "decay as a bf16 logit; fp32: " + ", ".join(rest),
                         case.emulate(frozenset(rest), decay_logit=True)))
    rows.append(f"\nfewest fp32 families in gain order that meet the criterion: {', '.join(order[:lo]) or 'none'}")
    log(f"{kind}: done in {time.time() - t0:.0f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write the table (markdown)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, nargs="+", default=[0])
    ap.add_argument("--head-size", type=int, nargs="+", choices=HEAD_SIZES, default=[64])
    ap.add_argument("--kinds", nargs="+", choices=tuple(KINDS), default=tuple(KINDS))
    ap.add_argument("--kernels", action="store_true",
                    help="the plan with the kernels' own roundings and the fixes for them (KERNEL_VARIANTS)")
    args = ap.parse_args()
    if args.batch < 1 or args.seq_len < 2:
        raise ValueError(f"--batch must be >= 1 and --seq-len >= 2, got {args.batch}, {args.seq_len}")
    torch.set_num_threads(1)   # small float64 ops: threads only add synchronisation (and fight on a shared CPU)
    lines = [f"bf16 error budget (CPU emulation, tests/torch_twin.py rwkvx_bf16): gradient rel_err against "
             f"float64; criterion: every tensor <= {SLACK} x max(autocast, {FLOOR}) and median <= autocast's"]
    table, ratios = kernel_table if args.kernels else budget, {}
    for kind in args.kinds:
        for N in args.head_size:
            for seed in args.seed:
                lines += table(kind, N, args.batch, args.seq_len, seed,
                               lambda m: print(m, file=sys.stderr, flush=True), ratios)
    if args.kernels:
        lines += summary(ratios)
    text = "\n".join(lines) + "\n"
    atomic_write(args.out, lambda f: f.write(text.encode()))
    print(text)


if __name__ == "__main__":
    main()
