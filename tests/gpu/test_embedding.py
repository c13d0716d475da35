"""GPU tests of rwkvx/cu/embedding/embedding.cu through rwkvx.cu.embedding, against the twins
rwkvx.oracle.embedding_forward / embedding_backward, in fp32 and bf16 (harness.KernelCase).

Forward gather (exact: the fp32 weights rounded once to the activation type) and the deterministic
backward (host sort + one block column per token segment) with many repeated tokens; the backward's
Memset must zero the rows of absent tokens (the output starts poisoned)."""
from __future__ import annotations

import numpy as np
import pytest

from harness import check, tolerance
from rwkvx.oracle import embedding_backward, embedding_forward
from rwkvx.cu import embedding as emb
from rwkvx.runtime.dtypes import round_to

from seeding import seeded_rng

BWD_TOL = 1e-4

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


def _upload_sort(case, tok):
    order, seg, nseg = emb.sort_tokens(tok)
    return case.input("order", order, "i32"), case.input("seg", seg, "i32"), case.input("nseg", nseg, "i32")


@pytest.mark.parametrize("B,T,V,C,kind", CASES)
def test_embedding_forward_backward(case, dev, B, T, V, C, kind):
    rng = seeded_rng()
    R = B * T
    tok = tokens_for(B, T, V, kind, rng).reshape(-1)
    ptok = case.input("tok", tok, "i32")
    pemb, pdx = case.input("emb", rng.standard_normal((V, C)), "f32"), case.input("dx", rng.standard_normal((R, C)))
    px, pdemb = case.output("x", (R, C)), case.output("demb", (V, C), "f32")
    pord, pseg, pn = _upload_sort(case, tok)
    out = case.run(emb.forward(ptok, pemb, px, R, C, V, dev.info)
                   + emb.backward(pdx, ptok, pord, pseg, pn, pdemb, R, C, V))
    gathered = round_to(case.xtype, embedding_forward(tok, case.seen["emb"]))
    assert np.array_equal(out["x"], gathered)                    # a gather rounds once, nothing else
    ref = embedding_backward(tok, case.seen["dx"], V)
    absent = np.setdiff1d(np.arange(V), tok)
    assert (out["demb"][absent] == 0).all()
    tol = tolerance(case.xtype, BWD_TOL)
    check("demb", out["demb"], ref, tol)
    present = np.unique(tok)
    for t in present[:: max(1, len(present) // 50)]:             # per-row check too
        check(f"demb[{t}]", out["demb"][t], ref[t], tol)


def test_embedding_backward_new_tokens_same_plan(case, dev):
    """The plan is fixed; new tokens (and their sort) are uploaded into the same buffers, as in a step."""
    from rwkvx._core import Plan
    B, T, V, C = 2, 128, 500, 256
    R = B * T
    rng = seeded_rng()
    ptok, pdx = case.input("tok", np.zeros(R), "i32"), case.input("dx", np.zeros((R, C)))
    pord, pseg, pn = _upload_sort(case, np.zeros(R))
    pdemb = case.output("demb", (V, C), "f32")
    plan = Plan(dev, emb.backward(pdx, ptok, pord, pseg, pn, pdemb, R, C, V))
    for step in range(3):
        tok = rng.integers(0, V // (step + 1), size=R)
        for name, values in zip(("tok", "order", "seg", "nseg", "dx"),
                                (tok, *emb.sort_tokens(tok), rng.standard_normal((R, C)))):
            case.set(name, values)
        out = case.run(plan=plan)
        check("demb", out["demb"], embedding_backward(tok, case.seen["dx"], V), tolerance(case.xtype, BWD_TOL))
        assert (out["demb"][np.setdiff1d(np.arange(V), tok)] == 0).all()
