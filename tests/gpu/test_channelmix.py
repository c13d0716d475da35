"""GPU tests of rwkvx/cu/channelmix/channelmix.cu through rwkvx.cu.channelmix, against the twins
rwkvx.oracle.channel_mix_shift_forward / _backward and relu_sq_forward / _backward, in fp32 and bf16
(harness.KernelCase). fp32 limits: 1e-5 forward, 1e-4 backward."""
from __future__ import annotations

import numpy as np
import pytest

from harness import check, tolerance
from rwkvx.oracle import (channel_mix_shift_backward, channel_mix_shift_forward, relu_sq_backward,
                          relu_sq_forward)
from rwkvx.cu import channelmix as cm

from seeding import seeded_rng

FWD_TOL = 1e-5
BWD_TOL = 1e-4

# (B, T, C, rows_per_tile)
CASES = [(2, 37, 768, None), (3, 50, 768, 7), (1, 1, 64, None), (5, 1, 8, 3), (2, 300, 4096, None),
         (8, 512, 768, None), (4, 16, 256, 16)]


@pytest.mark.parametrize("B,T,C,rpt", CASES)
def test_shift_mix(case, dev, B, T, C, rpt):
    R = B * T
    rng = seeded_rng()
    px, pm = case.input("x", rng.standard_normal((R, C)), "f32"), case.input("mix", rng.uniform(0, 1, C), "f32")
    po = case.output("xk", (R, C))
    out = case.run(cm.shift_mix(px, pm, po, R, T, C, dev.info))
    check("xk", out["xk"], channel_mix_shift_forward(case.seen["x"], case.seen["mix"], T),
          tolerance(case.xtype, FWD_TOL))


@pytest.mark.parametrize("B,T,C,rpt", CASES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_mix_backward(case, dev, B, T, C, rpt, accumulate):
    R = B * T
    rng = seeded_rng()
    px, pm = case.input("x", rng.standard_normal((R, C)), "f32"), case.input("mix", rng.uniform(0, 1, C), "f32")
    pdxk = case.input("dxk", rng.standard_normal((R, C)))
    if accumulate:       # x and dx: LN2's output and its gradient, f32 in every precision
        pdx, pdm = case.inout("dx", rng.standard_normal((R, C)), "f32"), case.inout("dmix", rng.standard_normal(C), "f32")
    else:
        pdx, pdm = case.output("dx", (R, C), "f32"), case.output("dmix", C, "f32")
    scr = case.scratch("partials", cm.scratch_elems(R, C, dev.info, rpt))
    out = case.run(cm.mix_backward(pdxk, px, pm, pdx, pdm, scr, R, T, C, dev.info, accumulate_dx=accumulate,
                                   accumulate_dparam=accumulate, rows_per_tile=rpt))
    dx, dmix = channel_mix_shift_backward(case.seen["dxk"], case.seen["x"], case.seen["mix"], T)
    tol = tolerance(case.xtype, BWD_TOL)
    check("dx", out["dx"], dx + (case.seen["dx"] if accumulate else 0), BWD_TOL)   # f32, from the inputs as read
    check("dmix", out["dmix"], dmix + (case.seen["dmix"] if accumulate else 0), tol)


@pytest.mark.parametrize("n", [4 * 1000, 3 * 1001, 1, 32768 * 3])
def test_relu_sq(case, dev, n):
    rng = seeded_rng()
    h = 2 * rng.standard_normal(n)
    ph, pdk = case.input("h", h), case.input("dk", rng.standard_normal(n))
    ph32 = case.input("h32", h, "f32")             # the key GEMM's output, fp32 in every precision
    pk, pdh, pdh_k = case.output("k", n), case.output("dh", n), case.output("dh_from_k", n)
    # dh from h, k = relu(h)^2 from the fp32 h, then dh again from k (the model keeps only k)
    out = case.run(cm.relu_sq_backward(pdk, ph, pdh, n, dev.info, src_is_k=False) + cm.relu_sq(ph32, pk, n, dev.info)
                   + cm.relu_sq_backward(pdk, pk, pdh_k, n, dev.info, src_is_k=True))
    tol_f, tol_b = tolerance(case.xtype, FWD_TOL), tolerance(case.xtype, BWD_TOL)
    check("k", out["k"], relu_sq_forward(case.seen["h32"]), tol_f)
    assert (out["k"] >= 0).all()
    check("dh", out["dh"], relu_sq_backward(case.seen["dk"], case.seen["h"]), tol_b)
    # from k the kernel sees relu(h) = sqrt(k) of the stored (rounded) k
    check("dh from k", out["dh_from_k"], relu_sq_backward(case.seen["dk"], np.sqrt(out["k"])), tol_b)


def test_relu_sq_in_place(case, dev):
    """In place on an fp32 h (the model's fp32 and tf32 path)."""
    if case.xtype != "f32":
        pytest.skip("in place needs k of h's type, fp32: bf16 writes k apart")
    n = 4096
    rng = seeded_rng()
    ph = case.inout("h", 2 * rng.standard_normal(n), "f32")
    out = case.run(cm.relu_sq(ph, ph, n, dev.info))
    check("k", out["h"], relu_sq_forward(case.seen["h"]), FWD_TOL)


def test_relu_sq_unaligned(case, dev):
    """Pointers off the vector alignment take the scalar path."""
    n = 1000
    rng = seeded_rng()
    ph, pk = case.input("h", rng.standard_normal(n + 1), "f32"), case.output("k", n + 3)
    out = case.run(cm.relu_sq(ph.offset(1), pk.offset(2), n, dev.info))
    check("k", out["k"][2:2 + n], relu_sq_forward(case.seen["h"][1:]), tolerance(case.xtype, FWD_TOL))
    assert np.isnan(out["k"][:2]).all() and np.isnan(out["k"][2 + n:]).all()
