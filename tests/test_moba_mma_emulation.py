"""CPU check of the tile algorithm of MoBA's tensor-core kernels (method "mma"), before any GPU: their numpy
model (rwkvx/cu/moba/mma_model.py, fp32 with the kernels' roundings) against the float64 twins
(rwkvx.oracle) on the same rounded inputs. With no operand rounding the algorithm must match to fp32
accuracy; with it, within the GPU tests' tolerances (tf32 5e-3, bf16 1e-2), which checks the error budget
of the design.
"""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.cu.moba.mma_model import OPERAND, emulate, round_bf16
from rwkvx.oracle import moba_attention_backward, moba_attention_forward, moba_logsumexp, moba_select, rel_err

from seeding import seeded_rng

MMA_TOL = {"tf32": 5e-3, "bf16": 1e-2}     # the GPU tests' limits (tests/gpu/test_moba.py)


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
