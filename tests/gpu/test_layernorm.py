"""GPU tests of rwkvx/cu/layernorm.cu (+ reduce.cu) through rwkvx.ops.layernorm.

Fresh random inputs, outputs and scratch poisoned with NaN, float64 references (rwkvx.oracle's
layernorm_forward / layernorm_backward when available, else the numpy formulas below). Norm-wise
relative error: <= 1e-5 forward, <= 1e-4 backward. Every case runs twice from the same initial buffers
and the results must be bit-identical.
"""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.ops import layernorm as ln
from gpu_harness import rel

FWD_TOL = 1e-5
BWD_TOL = 1e-4
EPS = 1e-5
# (R, C): tiny, rows not a multiple of 8, the model width, a wide row, several row tiles
SHAPES = [(5, 8), (301, 768), (2053, 768), (67, 4096), (4100, 256)]


def ref_forward(x, w, b, eps=EPS):
    x = np.asarray(x, np.float64)
    mu = x.mean(axis=1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    try:
        from rwkvx.oracle import layernorm_forward
        y = np.asarray(layernorm_forward(x, np.asarray(w, np.float64), np.asarray(b, np.float64), eps=eps))
    except ImportError:
        y = (x - mu) * rstd * w + b
    return y, mu[:, 0], rstd[:, 0]


def ref_backward(x, w, dy, eps=EPS):
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    dy = np.asarray(dy, np.float64)
    try:
        from rwkvx.oracle import layernorm_backward
        dx, dw, db = layernorm_backward(x, w, dy, eps=eps)
        return np.asarray(dx), np.asarray(dw), np.asarray(db)
    except ImportError:
        pass
    mu = x.mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(axis=1, keepdims=True) + eps)
    xh = (x - mu) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(axis=1, keepdims=True) - xh * (g * xh).mean(axis=1, keepdims=True))
    return dx, (dy * xh).sum(axis=0), dy.sum(axis=0)


def inputs(R, C, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((R, C)) * 1.7 + rng.standard_normal((R, 1)) * 3.0 + 0.5).astype(np.float32)
    w = (1.0 + 0.3 * rng.standard_normal(C)).astype(np.float32)
    b = (0.3 * rng.standard_normal(C)).astype(np.float32)
    dy = rng.standard_normal((R, C)).astype(np.float32)
    return x, w, b, dy


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("save_stats", [True, False])
def test_forward(gpu, R, C, save_stats):
    x, w, b, _ = inputs(R, C, 1 + R + C)
    nan2, nan1 = np.full((R, C), np.nan, np.float32), np.full(R, np.nan, np.float32)
    px, pw, pb = gpu.buf(x), gpu.buf(w), gpu.buf(b)
    py, pm, pr = gpu.buf(nan2), gpu.buf(nan1), gpu.buf(nan1)
    ops = ln.forward(px, pw, pb, py, pm if save_stats else None, pr if save_stats else None, R, C)
    plan = gpu.run(ops)
    y = gpu.get(py, (R, C))
    yr, mur, rsr = ref_forward(x, w, b)
    assert rel(y, yr) <= FWD_TOL
    if save_stats:
        assert rel(gpu.get(pm, R), mur) <= FWD_TOL
        assert rel(gpu.get(pr, R), rsr) <= FWD_TOL
    else:
        assert np.isnan(gpu.get(pm, R)).all()        # untouched
    # second run, same result bit for bit
    gpu.set(py, nan2)
    plan.run()
    gpu.dev.synchronize()
    assert np.array_equal(gpu.get(py, (R, C)), y)


def test_forward_in_place(gpu):
    R, C = 333, 768
    x, w, b, _ = inputs(R, C, 7)
    px, pw, pb = gpu.buf(x), gpu.buf(w), gpu.buf(b)
    gpu.run(ln.forward(px, pw, pb, px, None, None, R, C))
    assert rel(gpu.get(px, (R, C)), ref_forward(x, w, b)[0]) <= FWD_TOL


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("stats_valid", [True, False])
@pytest.mark.parametrize("accumulate", [False, True])
def test_backward(gpu, R, C, stats_valid, accumulate):
    x, w, b, dy = inputs(R, C, 100 + R + C)
    rng = np.random.default_rng(5 + R)
    dx0 = rng.standard_normal((R, C)).astype(np.float32) if accumulate else np.full((R, C), np.nan, np.float32)
    yr, mur, rsr = ref_forward(x, w, b)
    dxr, dwr, dbr = ref_backward(x, w, dy)
    if accumulate:
        dxr = dxr + dx0
    px, pw, pdy, pdx = gpu.buf(x), gpu.buf(w), gpu.buf(dy), gpu.buf(dx0)
    nanC = np.full(C, np.nan, np.float32)
    pdw, pdb = gpu.buf(nanC), gpu.buf(nanC)
    if stats_valid:    # statistics from the GPU forward
        pm, pr = gpu.buf(np.full(R, np.nan, np.float32)), gpu.buf(np.full(R, np.nan, np.float32))
        gpu.run(ln.forward(px, pw, gpu.buf(b), gpu.buf(np.zeros((R, C), np.float32)), pm, pr, R, C))
        m0, r0 = gpu.get(pm, R), gpu.get(pr, R)
    else:
        m0 = r0 = np.full(R, np.nan, np.float32)
        pm, pr = gpu.buf(m0), gpu.buf(r0)
    nscr = ln.scratch_bytes(R, C) // 4
    scr = gpu.buf(np.full(nscr, np.nan, np.float32))
    ops = ln.backward(px, pw, pdy, pdx, pdw, pdb, pm, pr, scr, R, C,
                      stats_valid=stats_valid, accumulate_dx=accumulate)
    plan = gpu.run(ops)
    dx, dw, db = gpu.get(pdx, (R, C)), gpu.get(pdw, C), gpu.get(pdb, C)
    assert rel(dx, dxr) <= BWD_TOL
    assert rel(dw, dwr) <= BWD_TOL
    assert rel(db, dbr) <= BWD_TOL
    # determinism: reset every buffer the plan writes, run again
    gpu.set(pdx, dx0)
    gpu.set(pdw, nanC)
    gpu.set(pdb, nanC)
    gpu.set(pm, m0)
    gpu.set(pr, r0)
    gpu.set(scr, np.full(nscr, np.nan, np.float32))
    plan.run()
    gpu.dev.synchronize()
    assert np.array_equal(gpu.get(pdx, (R, C)), dx)
    assert np.array_equal(gpu.get(pdw, C), dw)
    assert np.array_equal(gpu.get(pdb, C), db)


def test_backward_dx_over_dy_and_accumulate_params(gpu):
    """dx written over dy (allowed without accumulate_dx); dw/db added to existing values."""
    R, C = 517, 768
    x, w, b, dy = inputs(R, C, 11)
    rng = np.random.default_rng(12)
    dw0 = rng.standard_normal(C).astype(np.float32)
    db0 = rng.standard_normal(C).astype(np.float32)
    dxr, dwr, dbr = ref_backward(x, w, dy)
    px, pw, pdy = gpu.buf(x), gpu.buf(w), gpu.buf(dy)
    pdw, pdb = gpu.buf(dw0), gpu.buf(db0)
    pm, pr = gpu.buf(np.full(R, np.nan, np.float32)), gpu.buf(np.full(R, np.nan, np.float32))
    scr = gpu.buf(np.full(ln.scratch_bytes(R, C, 64) // 4, np.nan, np.float32))
    gpu.run(ln.backward(px, pw, pdy, pdy, pdw, pdb, pm, pr, scr, R, C, stats_valid=False,
                        accumulate_dparams=True, rows_per_tile=64))
    assert rel(gpu.get(pdy, (R, C)), dxr) <= BWD_TOL
    assert rel(gpu.get(pdw, C), dwr + dw0) <= BWD_TOL
    assert rel(gpu.get(pdb, C), dbr + db0) <= BWD_TOL
