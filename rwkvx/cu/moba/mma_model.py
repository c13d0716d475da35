"""A numpy model of MoBA's tensor-core attention (rwkvx/cu/moba/mma.cu, method "mma"): what the kernels
compute, tile by tile, in fp32 with their roundings.

Scores from operands rounded to the mma type (tf32: cvt.rna, 10 mantissa bits; bf16: inputs already bf16),
online softmax over tiles of :data:`TILE` keys in the log2 domain (exp2, running max, rescaling), the past
blocks' normalised partials merged by log-sum-exp in slot order, the backward's P = exp2(s - lse),
dS = P (dP - delta) with P and dS rounded to the operand type for the second products, delta from the
output as the forward computed it (stored rounded plus the residual of that rounding, olo). The order of the
sums inside a tile is the hardware's; only the roundings are modelled. Checked against the float64 twins
(rwkvx.oracle) in tests/test_moba_mma_emulation.py.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from rwkvx.runtime.dtypes import from_storage, round_tf32, to_storage

from .ops import MMA_ROWS

TILE = MMA_ROWS                            # keys per tile (forward, dq) and per dk/dv CTA
LOG2E, LN2 = np.float32(np.log2(np.e)), np.float32(np.log(2.0))


def round_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values of ``x`` rounded to bf16 (what a bf16 operand or store holds)."""
    return from_storage("bf16", to_storage("bf16", np.asarray(x, np.float32)))


# how each arithmetic rounds the operands of a tensor-core product ("exact": not at all)
OPERAND = {"exact": lambda x: np.asarray(x, np.float32), "tf32": round_tf32, "bf16": round_bf16}


def online_softmax(Q: np.ndarray, K: np.ndarray, V: np.ndarray, vis: np.ndarray, scale2: np.float32,
                   rnd: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def emulate(q: np.ndarray, k: np.ndarray, v: np.ndarray, do: np.ndarray, chunk: int, sel: np.ndarray, operand: str,
            store: Callable[[np.ndarray], np.ndarray]) -> tuple[np.ndarray, ...]:
    """(o, lse, dq, dk, dv) of the mma kernels' algorithm; q, k, v, do [B, T, H, N] as the kernel reads
    them, sel [B, H, T, K1]; ``operand`` a key of :data:`OPERAND` (how the products' operands are rounded);
    ``store`` rounds what the kernel writes to floatX (o and its residual olo, read back by delta)."""
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
                m, l, acc = online_softmax(Q[t_sel], K[keys], V[keys], vis, scale2, rnd)
                part[t_sel, s_sel] = acc / l[:, None]
                lpart[t_sel, s_sel] = (m + np.log2(l)) * LN2
            o = np.zeros((T, N), np.float32)
            for c0 in range(0, T, chunk):
                rows = tok[c0:c0 + chunk]
                keys = slice(c0, rows[-1] + 1)
                vis = tok[keys][None, :] <= rows[:, None]
                m, l, acc = online_softmax(Q[rows], K[keys], V[keys], vis, scale2, rnd)
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
            o_hi = store(o)
            out["o"][b, :, h] = o_hi
            # backward (the sums' order inside a tile is the hardware's; only the roundings matter here)
            D = ((o_hi + store(o - o_hi)) * store(do[b, :, h].astype(np.float32))).sum(axis=1, dtype=np.float32)
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
