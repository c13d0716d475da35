"""GPU tests of rwkvx/cu/channelmix.cu (+ reduce.cu) through rwkvx.ops.channelmix.

Token-shift mix forward, relu^2 forward/backward (in place, and from h or from k), the mix backward
(dx = or +=, dx_k through deterministic partials) against float64 numpy; outputs poisoned with NaN
first; second runs bit-identical.
"""
from __future__ import annotations

import numpy as np
import pytest

from rwkvx.ops import channelmix as cm
from gpu_harness import rel

FWD_TOL = 1e-5
BWD_TOL = 1e-4


def shift(x, T):
    B = x.shape[0] // T
    x3 = x.reshape(B, T, -1)
    s = np.zeros_like(x3)
    s[:, 1:] = x3[:, :-1]
    return s.reshape(x.shape)


def ref_mix(x, mix, T):
    x = x.astype(np.float64)
    return x + (shift(x, T) - x) * mix


def ref_mix_backward(dxk, x, mix, T):
    dxk = dxk.astype(np.float64)
    x = x.astype(np.float64)
    mix = mix.astype(np.float64)
    B = x.shape[0] // T
    d3 = (dxk * mix).reshape(B, T, -1)
    back = np.zeros_like(d3)            # shift^T: row t receives row t+1 of the same sequence
    back[:, :-1] = d3[:, 1:]
    dx = dxk * (1 - mix) + back.reshape(x.shape)
    dmix = (dxk * (shift(x, T) - x)).sum(axis=0)
    return dx, dmix


# (B, T, C, rows_per_tile)
CASES = [(2, 37, 768, None), (3, 50, 768, 7), (1, 1, 64, None), (5, 1, 8, 3), (2, 300, 4096, None),
         (8, 512, 768, None), (4, 16, 256, 16)]


@pytest.mark.parametrize("B,T,C,rpt", CASES)
def test_shift_mix(gpu, B, T, C, rpt):
    R = B * T
    rng = np.random.default_rng(R + C)
    x = rng.standard_normal((R, C)).astype(np.float32)
    mix = rng.uniform(0.0, 1.0, C).astype(np.float32)
    px, pm = gpu.buf(x), gpu.buf(mix)
    po = gpu.buf(np.full((R, C), np.nan, np.float32))
    plan = gpu.run(cm.shift_mix(px, pm, po, R, T, C))
    out = gpu.get(po, (R, C))
    assert rel(out, ref_mix(x, mix, T)) <= FWD_TOL
    gpu.set(po, np.full((R, C), np.nan, np.float32))
    plan.run()
    gpu.dev.synchronize()
    assert np.array_equal(gpu.get(po, (R, C)), out)


@pytest.mark.parametrize("B,T,C,rpt", CASES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_mix_backward(gpu, B, T, C, rpt, accumulate):
    R = B * T
    rng = np.random.default_rng(3 * R + C + accumulate)
    x = rng.standard_normal((R, C)).astype(np.float32)
    mix = rng.uniform(0.0, 1.0, C).astype(np.float32)
    dxk = rng.standard_normal((R, C)).astype(np.float32)
    dx0 = rng.standard_normal((R, C)).astype(np.float32) if accumulate else np.full((R, C), np.nan, np.float32)
    dmix0 = rng.standard_normal(C).astype(np.float32) if accumulate else np.full(C, np.nan, np.float32)
    dxr, dmr = ref_mix_backward(dxk, x, mix, T)
    if accumulate:
        dxr = dxr + dx0
        dmr = dmr + dmix0
    nscr = cm.scratch_bytes(R, C, rpt) // 4
    px, pm, pdxk = gpu.buf(x), gpu.buf(mix), gpu.buf(dxk)
    pdx, pdm, scr = gpu.buf(dx0), gpu.buf(dmix0), gpu.buf(np.full(nscr, np.nan, np.float32))
    plan = gpu.run(cm.mix_backward(pdxk, px, pm, pdx, pdm, scr, R, T, C, accumulate_dx=accumulate,
                                   accumulate_dparam=accumulate, rows_per_tile=rpt))
    dx, dm = gpu.get(pdx, (R, C)), gpu.get(pdm, C)
    assert rel(dx, dxr) <= BWD_TOL
    assert rel(dm, dmr) <= BWD_TOL
    gpu.set(pdx, dx0)
    gpu.set(pdm, dmix0)
    gpu.set(scr, np.full(nscr, np.nan, np.float32))
    plan.run()
    gpu.dev.synchronize()
    assert np.array_equal(gpu.get(pdx, (R, C)), dx)
    assert np.array_equal(gpu.get(pdm, C), dm)


@pytest.mark.parametrize("n", [4 * 1000, 3 * 1001, 1, 32768 * 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_relu_sq(gpu, n, in_place):
    rng = np.random.default_rng(n)
    h = (2 * rng.standard_normal(n)).astype(np.float32)
    dk = rng.standard_normal(n).astype(np.float32)
    hr = h.astype(np.float64)
    kref = np.maximum(hr, 0) ** 2
    dhref = dk * 2 * np.maximum(hr, 0)
    ph, pdk = gpu.buf(h), gpu.buf(dk)
    pk = ph if in_place else gpu.buf(np.full(n, np.nan, np.float32))
    pdh = pdk if in_place else gpu.buf(np.full(n, np.nan, np.float32))
    # backward from h first (before an in-place forward overwrites it), then forward, then from k
    gpu.run(cm.relu_sq_backward(pdk, ph, pdh, n, src_is_k=False))
    dh = gpu.get(pdh, n)
    assert rel(dh, dhref) <= BWD_TOL
    gpu.run(cm.relu_sq(ph, pk, n))
    k = gpu.get(pk, n)
    assert rel(k, kref) <= FWD_TOL
    assert (k >= 0).all()
    gpu.set(pdk, dk)
    gpu.run(cm.relu_sq_backward(pdk, pk, pdh, n, src_is_k=True))
    assert rel(gpu.get(pdh, n), dhref) <= BWD_TOL


def test_relu_sq_unaligned(gpu):
    """Pointers off 16-byte alignment take the scalar path."""
    n = 1000
    rng = np.random.default_rng(0)
    h = rng.standard_normal(n + 1).astype(np.float32)
    ph = gpu.buf(h)
    pk = gpu.buf(np.full(n + 3, np.nan, np.float32))
    gpu.run(cm.relu_sq(ph + 4, pk + 8, n))
    k = gpu.get(pk, n + 3)
    assert rel(k[2:2 + n], np.maximum(h[1:].astype(np.float64), 0) ** 2) <= FWD_TOL
    assert np.isnan(k[:2]).all() and np.isnan(k[2 + n:]).all()
