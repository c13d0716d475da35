"""CPU check of the tile algorithm of moba.cu's tensor-core kernels (method "mma"), before any GPU.

A numpy emulation of what the kernels compute, in fp32 with their roundings: scores from operands
rounded to the mma type (tf32: cvt.rna, 10 mantissa bits; bf16: inputs already bf16), online softmax
over 64-key tiles in the log2 domain (exp2, running max, rescaling), the past blocks' normalised
partials merged by log-sum-exp in slot order, the backward's P = exp2(s - lse), dS = P (dP - delta)
with P and dS rounded to the operand type for the second products. Compared with the float64 twins
(rwkvx.oracle) on the same rounded inputs: with no operand rounding the algorithm must match to fp32
accuracy; with it, within the GPU tests' tolerances (tf32 5e-3, bf16 1e-2), which checks the error
budget of the design.
"""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.oracle import moba_attention_backward, moba_attention_forward, moba_logsumexp, moba_select, rel_err
from rwkvx.cu import moba
from rwkvx.runtime.dtypes import from_storage, to_storage

from seeding import seeded_rng

TILE = moba.MMA_ROWS                       # keys per tile (forward, dq) and per dk/dv CTA
LOG2E, LN2 = np.float32(np.log2(np.e)), np.float32(np.log(2.0))
MMA_TOL = {"tf32": 5e-3, "bf16": 1e-2}     # the GPU tests' limits (tests/gpu/test_moba.py)


def round_tf32(x: np.ndarray) -> np.ndarray:
    """cvt.rna.tf32.f32: 10 mantissa bits, to nearest, ties away from zero (kept as float32)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def round_bf16(x: np.ndarray) -> np.ndarray:
    return from_storage("bf16", to_storage("bf16", np.asarray(x, np.float32)))


OPERAND = {"exact": lambda x: np.asarray(x, np.float32), "tf32": round_tf32, "bf16": round_bf16}


def _online(Q, K, V, vis, scale2, rnd):
    """Online softmax of rows Q over keys K, V (visibility vis [rows, keys]) in tiles of TILE keys:
    (m log2-domain max, l sum, acc un-normalised output), all fp32."""
    R = Q.shape[0]
    m = np.full(R, -np.inf, np.float32)
    l = np.zeros(R, np.float32)
    acc = np.zeros((R, V.shape[1]), np.float32)
    for u0 in range(0, K.shape[0], TILE):
        s = (Q @ K[u0:u0 + TILE].T).astype(np.float32)
        s = np.where(vis[:, u0:u0 + TILE], s * scale2, np.float32(-np.inf))
        mnew = np.maximum(m, s.max(axis=1))
        mref = np.where(mnew == -np.inf, np.float32(0), mnew)
        alpha = np.exp2(m - mref)
        p = np.exp2(s - mref[:, None])
        l = l * alpha + p.sum(axis=1, dtype=np.float32)
        acc = acc * alpha[:, None] + rnd(p) @ V[u0:u0 + TILE]
        m = mnew
    return m, l, acc


def emulate(q, k, v, do, chunk, sel, operand, store):
    """(o, lse, dq, dk, dv) of the mma kernels' algorithm; q, k, v, do [B, T, H, N] as the kernel reads
    them, sel [B, H, T, K1]; ``store`` rounds what the kernel writes to floatX (o, read back by delta)."""
    rnd = OPERAND[operand]
    B, T, H, N = q.shape
    K1 = sel.shape[3]
    scale = np.float32(1.0 / np.sqrt(N))
    scale2 = scale * LOG2E
    out = {name: np.zeros((B, T, H, N), np.float32) for name in ("o", "dq", "dk", "dv")}
    lse = np.zeros((B, H, T), np.float32)
    tok = np.arange(T)
    for b in range(B):
        for h in range(H):
            Q, K, V, dO = (rnd(x[b, :, h].astype(np.float32)) for x in (q, k, v, do))
            # forward: past partials per (query, slot), then own block + merge in slot order
            part = np.zeros((T, max(K1, 1), N), np.float32)
            lpart = np.zeros((T, max(K1, 1)), np.float32)
            for j in range(-(-T // chunk)):
                t_sel, s_sel = np.nonzero(sel[b, h] == j)
                if t_sel.size == 0:
                    continue
                keys = slice(j * chunk, (j + 1) * chunk)
                vis = np.ones((t_sel.size, chunk), bool)
                m, l, acc = _online(Q[t_sel], K[keys], V[keys], vis, scale2, rnd)
                part[t_sel, s_sel] = acc / l[:, None]
                lpart[t_sel, s_sel] = (m + np.log2(l)) * LN2
            o = np.zeros((T, N), np.float32)
            for c0 in range(0, T, chunk):
                rows = tok[c0:c0 + chunk]
                keys = slice(c0, rows[-1] + 1)
                vis = tok[keys][None, :] <= rows[:, None]
                m, l, acc = _online(Q[rows], K[keys], V[keys], vis, scale2, rnd)
                mi, li = m * LN2, l
                for s in range(K1):
                    ok = sel[b, h, rows, s] >= 0
                    lp = np.where(ok, lpart[rows, s], -np.inf).astype(np.float32)
                    mnew = np.maximum(mi, lp)
                    alpha, beta = np.exp(mi - mnew), np.exp(lp - mnew)
                    li = li * alpha + beta
                    acc = acc * alpha[:, None] + beta[:, None] * part[rows, s]
                    mi = mnew
                o[rows] = acc / li[:, None]
                lse[b, h, rows] = mi + np.log(li)
            o = store(o)
            out["o"][b, :, h] = o
            # backward (the sums' order inside a tile is the hardware's; only the roundings matter here)
            D = (o * store(do[b, :, h].astype(np.float32))).sum(axis=1, dtype=np.float32)
            blk = tok // chunk
            vis = (blk[None, :] == blk[:, None]) & (tok[None, :] <= tok[:, None])
            for s in range(K1):
                vis |= blk[None, :] == sel[b, h, :, s][:, None]
            S = (Q @ K.T).astype(np.float32)
            P = np.where(vis, np.exp2(S * scale2 - lse[b, h][:, None] * LOG2E), np.float32(0))
            dS = P * ((dO @ V.T) - D[:, None])
            out["dq"][b, :, h] = (rnd(dS) @ K) * scale
            out["dk"][b, :, h] = (rnd(dS).T @ Q) * scale
            out["dv"][b, :, h] = rnd(P).T @ dO
    return out["o"], lse, out["dq"], out["dk"], out["dv"]


# (B, T, H, N, chunk, top_k)
SHAPES = [
    (2, 320, 2, 64, 64, 3),       # tiles = blocks
    (1, 300, 2, 32, 16, 4),       # chunk < tile, T not a multiple of the chunk
    (1, 640, 1, 128, 100, 3),     # chunk not a multiple of the tile
    (2, 200, 1, 64, 512, 3),      # T < chunk: own block only
    (1, 256, 2, 64, 32, 1),       # top_k 1
    (1, 320, 1, 64, 32, 8),       # top_k 8
]


def _inputs(shape, operand, rng):
    B, T, H, N = shape[:4]
    store = round_bf16 if operand == "bf16" else OPERAND["exact"]
    return [store(rng.standard_normal((B, T, H, N))).astype(np.float64) for _ in range(4)], store


@pytest.mark.parametrize("operand", ["exact", "tf32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-T{}-H{}-N{}-c{}-k{}".format(*s))
def test_mma_algorithm_matches_the_twins(shape, operand):
    B, T, H, N, chunk, top_k = shape
    (q, k, v, do), store = _inputs(shape, operand, seeded_rng(hash(shape) % 2**32))
    sel = moba_select(q, k, chunk, top_k)
    o, lse, dq, dk, dv = emulate(q, k, v, do, chunk, sel, operand, store)
    o_ref, _ = moba_attention_forward(q, k, v, chunk, top_k, selection=sel)
    lse_ref = moba_logsumexp(q, k, chunk, sel)
    grads_ref = moba_attention_backward(q, k, v, do, chunk, top_k, sel)
    errs = {"o": rel_err(o, o_ref), "lse": rel_err(lse, lse_ref)}
    errs.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), grads_ref)})
    tol = 2e-5 if operand == "exact" else MMA_TOL[operand]
    # bf16: o itself is stored as bf16 (2^-9 relative), which the twin does not do
    assert all(e <= tol for e in errs.values()), {n: f"{e:.2e}" for n, e in errs.items()}


def test_emulation_detects_a_wrong_merge():
    """The comparison can fail: dropping the second slot's partial is far outside the limits."""
    shape = (1, 256, 1, 64, 32, 3)
    (q, k, v, do), store = _inputs(shape, "tf32", seeded_rng(1))
    sel = moba_select(q, k, 32, 3)
    o_ref, _ = moba_attention_forward(q, k, v, 32, 3, selection=sel)
    broken = sel.copy()
    broken[..., 1] = -1
    o = emulate(q, k, v, do, 32, broken, "tf32", store)[0]
    assert rel_err(o, o_ref) > 10 * MMA_TOL["tf32"]
