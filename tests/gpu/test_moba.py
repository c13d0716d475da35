"""GPU tests of the kernels of rwkvx/cu/moba/ through rwkvx.cu.moba, against the twins in rwkvx.oracle
(moba_select, moba_gate_gaps, moba_attention_forward / _backward, moba_logsumexp), in fp32 and bf16
(harness.KernelCase: fresh random q, k, v, do, every output and scratch poisoned, two bit-identical runs).

1. the selection first: it must equal the twin's wherever the twin's gate gap (last selected minus first
   left-out gate) is >= the precision's margin; near-ties may differ (the GPU gate is fp32), and the GPU
   selection is then what the twins are given for everything else;
2. o and lse (fp32: <= 1e-5); 3. dq, dk, dv (fp32: <= 1e-4). bf16: docs/SPEC.md's 1e-2 on the rounded inputs,
   and the output's residual olo (check_residual: o + olo within 1e-4 of the twin, method "exact").
The tensor-core kernels (method "mma": tf32 for f32 activations, bf16 for bf16) against the same twins:
tf32 <= 5e-3, bf16 <= 1e-2 (tests/test_moba_mma_emulation.py checks that budget on CPU).
"""
from __future__ import annotations

import numpy as np
import pytest

from harness import check, tolerance
from rwkvx.oracle import (moba_attention_backward, moba_attention_forward, moba_gate_gaps, moba_logsumexp,
                          moba_select)
from rwkvx.cu import moba

from seeding import seeded_rng

FWD_TOL = 1e-5
BWD_TOL = 1e-4
GAP = {"f32": 1e-4, "bf16": 1e-4}   # the gate is fp32 over the (rounded) q and block means in both
MMA_TOL = {"f32": 5e-3, "bf16": 1e-2}  # tf32 / bf16 tensor cores, every output
RESIDUAL_TOL = 1e-4   # o + olo against the fp32 output: its bf16 rounding alone is ~1e-3

# id: (B, T, H, N, chunk, top_k, concentrated)
CASES = {
    "sparse-N64": (2, 640, 2, 64, 64, 3, False),           # 10 blocks, 2 of up to 9 past selected
    "target-chunk512": (1, 2048, 2, 64, 512, 3, False),    # the target's chunk / top_k / N, shorter T
    "topk1-N32": (2, 300, 2, 32, 64, 1, False),            # own block only
    "T-not-multiple": (2, 300, 3, 32, 64, 2, False),       # last block partial (300 = 4*64 + 44)
    "B3-chunk32": (3, 256, 2, 64, 32, 4, False),
    "small-N8": (2, 160, 4, 8, 16, 3, False),
    "N4-chunk1": (1, 40, 2, 4, 1, 3, False),               # every token its own block
    "N128": (1, 512, 2, 128, 64, 3, False),
    "N16-chunk100": (1, 333, 2, 16, 100, 2, False),        # chunk not a multiple of any tile
    "dense-all-selected": (1, 192, 2, 64, 64, 3, False),   # T <= chunk*top_k: full causal attention
    "T-le-chunk": (2, 50, 2, 32, 64, 3, False),            # no past block at all
    "large-topk": (1, 256, 2, 32, 16, 9, False),
    "concentrated": (2, 512, 2, 64, 32, 3, True),          # every query selects block 0 (long dk/dv lists)
    "N256": (1, 200, 1, 256, 32, 3, False),
}


# id: (B, T, H, N, chunk, top_k, concentrated) for method "mma" (head sizes 32, 64, 128)
MMA_CASES = {
    "sparse-N64": (2, 640, 2, 64, 64, 3, False),
    "target-chunk512": (1, 2048, 2, 64, 512, 3, False),
    "N128-chunk96": (1, 1000, 2, 128, 96, 3, False),        # chunk not a multiple of the 64-row tiles
    "N32-chunk16-topk8": (2, 300, 2, 32, 16, 8, False),     # chunk < tile, T not a multiple of chunk
    "topk1": (2, 300, 2, 64, 64, 1, False),
    "topk2-T-not-multiple": (1, 555, 3, 64, 128, 2, False),
    "topk5-N128": (1, 640, 1, 128, 64, 5, False),
    "T-le-chunk": (2, 50, 2, 64, 64, 3, False),
    "chunk4096": (1, 4500, 1, 64, 4096, 3, False),           # the long-context chunk; one past block
    "concentrated": (2, 512, 2, 64, 32, 3, True),
    "ties": (1, 512, 2, 64, 64, 3, "ties"),                  # blocks 2 and 5 copy block 0: exact gate ties
}


def make_inputs(B, T, H, N, chunk, concentrated, rng):
    q, k, v, do = (rng.standard_normal((B, T, H, N)) for _ in range(4))
    if concentrated == "ties":
        for j in (2, 5):
            k[:, j * chunk:(j + 1) * chunk] = k[:, :chunk]
        q += 2.0 * k[:, :chunk].mean(axis=1, keepdims=True)     # make the tied blocks the likely choice
    elif concentrated:
        e = np.zeros(N)
        e[0] = 1.0
        q += 6.0 * e
        k[:, :chunk] += 6.0 * e          # block 0's mean key points along q: by far the largest gate
    return q, k, v, do


def run_case(case, dev, B, T, H, N, chunk, top_k, concentrated, method="exact"):
    K1 = top_k - 1
    shape = (B, T, H, N)
    q, k, v, do = (case.input(n, a) for n, a in zip(("q", "k", "v", "do"),
                                                    make_inputs(B, T, H, N, chunk, concentrated,
                                                                seeded_rng())))
    o, dq, dk, dv = (case.output(n, shape) for n in ("o", "dq", "dk", "dv"))
    scratch = {}
    for name, (count, elem) in moba.scratch_sizes(B, T, H, N, chunk, top_k, case.xtype).items():
        make = case.output if name in ("sel", "lse", "olo") else case.scratch
        scratch[name] = make(name, count, elem) if count else None
    ops = moba.forward(q, k, v, o, scratch, B, T, H, N, chunk, top_k, dev.info, method=method)
    ops += moba.backward(q, k, v, o, do, dq, dk, dv, scratch, B, T, H, N, chunk, top_k, dev.info, method=method)
    got = case.run(ops)
    s = case.seen
    # 1. selection
    sel = got["sel"].astype(np.int32).reshape(B, H, T, K1) if K1 > 0 else np.zeros((B, H, T, 0), np.int32)
    differs = ~np.all(sel == moba_select(s["q"], s["k"], chunk, top_k), axis=-1)
    clear = moba_gate_gaps(s["q"], s["k"], chunk, top_k) >= GAP[case.xtype]
    assert not np.any(differs & clear), (
        f"selection differs from the twin at {np.argwhere(differs & clear)[:5].tolist()} (b, h, t) with clear "
        "gate gaps")
    if concentrated == "ties":
        # blocks 0, 2 and 5 have bit-identical means, hence identical fp32 gates: ties go to the lower block
        has = [np.any(sel == j, axis=-1) for j in (0, 2, 5)]
        assert not np.any(has[1] & ~has[0]) and not np.any(has[2] & ~has[1]), "a tie went to the higher block"
        assert np.any(has[0] & has[1]), "no query selected the tied blocks: the case tests nothing"
    elif concentrated:
        assert np.all(sel[:, :, chunk:, 0] == 0), "block 0 should be selected by every later query"
    # 2. forward (the twin validates the GPU selection: shape, range, ascending, padding)
    fwd_tol = tolerance(case.xtype, FWD_TOL) if method == "exact" else MMA_TOL[case.xtype]
    bwd_tol = tolerance(case.xtype, BWD_TOL) if method == "exact" else MMA_TOL[case.xtype]
    o_ref, _ = moba_attention_forward(s["q"], s["k"], s["v"], chunk, top_k, selection=sel)
    check("o", got["o"], o_ref, fwd_tol)
    if case.xtype == "bf16":
        check_residual(got["o"], got["olo"], o_ref if method == "exact" else None)
    check("lse", got["lse"].reshape(B, H, T), moba_logsumexp(s["q"], s["k"], chunk, sel),
          FWD_TOL if method == "exact" else MMA_TOL[case.xtype])
    # 3. backward with the selection fixed
    for name, ref in zip(("dq", "dk", "dv"), moba_attention_backward(s["q"], s["k"], s["v"], s["do"], chunk,
                                                                     top_k, sel)):
        check(name, got[name], ref, bwd_tol)
    return got, sel


def check_residual(o, olo, o_fp32=None):
    """bf16 olo is the residual of the output's rounding: below half an ulp of o, so that o + olo rounds to
    o; where the forward's fp32 output is known (``o_fp32``, method "exact": the twin's, to fp32 sums),
    o + olo holds it far closer than o (~2^-17 against ~2^-9 relative: the backward's delta is taken
    from it)."""
    o, olo = o.reshape(-1), olo.reshape(-1)
    half_ulp = np.ldexp(1.0, np.frexp(o)[1] - 9)         # bf16: 8 mantissa bits, o = m * 2^e, 0.5 <= |m| < 1
    assert np.all(np.abs(olo) <= half_ulp), "olo is not the residual of o's rounding"
    if o_fp32 is not None:
        check("o + olo", o + olo, o_fp32.reshape(-1), RESIDUAL_TOL)


@pytest.mark.parametrize("name", list(CASES))
def test_moba_forward_backward(case, dev, name):
    run_case(case, dev, *CASES[name])


@pytest.mark.parametrize("name", list(MMA_CASES))
def test_moba_mma_forward_backward(case, dev, name):
    """Tensor-core kernels: every output poisoned first, two bit-identical runs (harness), the twins'
    limits; the selection is the exact method's (same kernels)."""
    run_case(case, dev, *MMA_CASES[name], method="mma")


def test_moba_dense_is_causal_attention(case, dev):
    """T <= chunk*top_k: every past block is selected, so o is plain causal softmax attention."""
    B, T, H, N, chunk, top_k = 1, 192, 2, 64, 64, 3
    got, sel = run_case(case, dev, B, T, H, N, chunk, top_k, False)
    q, k, v = (case.seen[n] for n in "qkv")
    s = np.einsum("bthn,buhn->bhtu", q, k) / np.sqrt(N)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    check("o(causal)", got["o"], np.einsum("bhtu,buhn->bthn", p, v), tolerance(case.xtype, FWD_TOL))
    bt = np.arange(T) // chunk
    for t in range(T):
        assert (sel[:, :, t] == list(range(bt[t])) + [-1] * (top_k - 1 - bt[t])).all()
