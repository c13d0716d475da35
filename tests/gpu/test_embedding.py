"""GPU tests of rwkvx/cu/embedding.cu through rwkvx.ops.embedding.

Forward gather and the deterministic backward (host sort + one block column per token segment) with
many repeated tokens, against float64 numpy references; outputs poisoned with NaN first (the backward's
Memset must zero the rows of absent tokens). Second runs must be bit-identical.
"""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.ops import embedding as emb
from gpu_harness import rel

FWD_TOL = 1e-5
BWD_TOL = 1e-4


def test_sort_tokens():
    tok = np.array([[5, 1, 5, 0], [1, 5, 9, 1]])
    order, seg, n = emb.sort_tokens(tok)
    assert order.dtype == np.int32 and seg.dtype == np.int32 and n.dtype == np.int32
    assert order.tolist() == [3, 1, 4, 7, 0, 2, 5, 6]
    assert n.tolist() == [4]
    assert seg.tolist() == [0, 1, 4, 7, 8, 8, 8, 8, 8]


# (B, T, V, C, token distribution)
CASES = [
    (2, 37, 50, 768, "uniform"),        # R=74, V=50: almost every token repeats
    (4, 256, 65536, 768, "zipf"),       # realistic vocabulary, a few very frequent tokens
    (3, 100, 7, 64, "uniform"),         # tiny vocabulary, long segments
    (1, 500, 1000, 4096, "one"),        # a single token repeated 400 times among others
    (2, 64, 300, 8, "uniform"),
]


def tokens_for(B, T, V, kind, rng):
    if kind == "uniform":
        return rng.integers(0, V, size=(B, T))
    if kind == "zipf":
        return np.minimum(rng.zipf(1.2, size=(B, T)) - 1, V - 1)
    tok = rng.integers(0, V, size=(B, T))
    tok.reshape(-1)[rng.permutation(B * T)[: int(0.8 * B * T)]] = V // 3
    return tok


@pytest.mark.parametrize("B,T,V,C,kind", CASES)
def test_embedding_forward_backward(gpu, B, T, V, C, kind):
    rng = np.random.default_rng(B * 1000 + T + V + C)
    R = B * T
    tok = tokens_for(B, T, V, kind, rng).astype(np.int32)
    table = rng.standard_normal((V, C)).astype(np.float32)
    dx = rng.standard_normal((R, C)).astype(np.float32)
    order, seg, nseg = emb.sort_tokens(tok)

    ptok, pemb, pdx = gpu.buf(tok.reshape(-1)), gpu.buf(table), gpu.buf(dx)
    px = gpu.buf(np.full((R, C), np.nan, np.float32))
    pdemb = gpu.buf(np.full((V, C), np.nan, np.float32))
    pord, pseg, pn = gpu.buf(order), gpu.buf(seg), gpu.buf(nseg)

    ops = emb.forward(ptok, pemb, px, R, C, V)
    ops += emb.backward(pdx, ptok, pord, pseg, pn, pdemb, R, C, V)
    plan = gpu.run(ops)

    x = gpu.get(px, (R, C))
    assert np.array_equal(x, table[tok.reshape(-1)])           # a gather is exact
    assert rel(x, table[tok.reshape(-1)].astype(np.float64)) <= FWD_TOL

    ref = np.zeros((V, C), np.float64)
    np.add.at(ref, tok.reshape(-1), dx.astype(np.float64))
    demb = gpu.get(pdemb, (V, C))
    assert not np.isnan(demb).any()
    absent = np.setdiff1d(np.arange(V), tok.reshape(-1))
    assert (demb[absent] == 0).all()
    assert rel(demb, ref) <= BWD_TOL
    present = np.unique(tok)
    for t in present[:: max(1, len(present) // 50)]:                # per-row check too
        assert rel(demb[t], ref[t]) <= BWD_TOL

    gpu.set(px, np.full((R, C), np.nan, np.float32))
    gpu.set(pdemb, np.full((V, C), np.nan, np.float32))
    plan.run()
    gpu.dev.synchronize()
    assert np.array_equal(gpu.get(px, (R, C)), x)
    assert np.array_equal(gpu.get(pdemb, (V, C)), demb)


def test_embedding_backward_new_tokens_same_plan(gpu):
    """The plan is fixed; new tokens (and their sort) are uploaded into the same buffers, as in a step."""
    B, T, V, C = 2, 128, 500, 256
    R = B * T
    rng = np.random.default_rng(3)
    ptok = gpu.buf(np.zeros(R, np.int32))
    pord, pseg, pn = gpu.buf(np.zeros(R, np.int32)), gpu.buf(np.zeros(R + 1, np.int32)), gpu.buf(np.zeros(1, np.int32))
    pdx = gpu.buf(np.zeros((R, C), np.float32))
    pdemb = gpu.buf(np.full((V, C), np.nan, np.float32))
    from rwkvx.runtime import Plan
    plan = Plan(gpu.dev, emb.backward(pdx, ptok, pord, pseg, pn, pdemb, R, C, V), precision="fp32")
    for step in range(3):
        tok = rng.integers(0, V // (step + 1), size=R).astype(np.int32)
        dx = rng.standard_normal((R, C)).astype(np.float32)
        order, seg, nseg = emb.sort_tokens(tok)
        for p, a in ((ptok, tok), (pord, order), (pseg, seg), (pn, nseg), (pdx, dx)):
            gpu.set(p, a)
        plan.run()
        gpu.dev.synchronize()
        ref = np.zeros((V, C), np.float64)
        np.add.at(ref, tok, dx.astype(np.float64))
        demb = gpu.get(pdemb, (V, C))
        assert rel(demb, ref) <= BWD_TOL
        assert (demb[np.setdiff1d(np.arange(V), tok)] == 0).all()
