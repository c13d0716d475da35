"""GPU tests of rwkvx/cu/layernorm/layernorm.cu (+ reduce.cu), ln_shift.cu and ln_shift_bwd.cu through
rwkvx.cu.layernorm, against the twins rwkvx.oracle.layernorm_forward / layernorm_backward (and the token shifts'), in fp32 and bf16 (harness.KernelCase: fresh random
inputs, poisoned outputs, two bit-identical runs). x, its copy, dy and dx are fp32 in both (the residual
stream); bf16 changes y and the GEMM copy of dx. fp32 limits: 1e-5 forward, 1e-4 backward."""
from __future__ import annotations

import numpy as np
import pytest

from harness import check, tolerance
from rwkvx.oracle import (channel_mix_shift_backward, channel_mix_shift_forward, layernorm_backward, layernorm_forward,
                          time_shift_backward, time_shift_forward)
from rwkvx.cu import channelmix as cm, layernorm as ln, timemix as tm
from rwkvx.runtime.dtypes import round_to

from seeding import seeded_rng

FWD_TOL = 1e-5
BWD_TOL = 1e-4
# (R, C): tiny, rows not a multiple of 8, the model width, a wide row, several row tiles
SHAPES = [(5, 8), (301, 768), (2053, 768), (67, 4096), (4100, 256)]


def inputs(R, C, rng):
    x = rng.standard_normal((R, C)) * 1.7 + rng.standard_normal((R, 1)) * 3.0 + 0.5
    w = 1.0 + 0.3 * rng.standard_normal(C)
    b = 0.3 * rng.standard_normal(C)
    dy = rng.standard_normal((R, C))
    return x, w, b, dy


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("save_stats", [True, False])
def test_forward(case, dev, R, C, save_stats):
    x, w, b, _ = inputs(R, C, seeded_rng())
    px, pw, pb = case.input("x", x, "f32"), case.input("w", w, "f32"), case.input("b", b, "f32")
    py, pm, pr = case.output("y", (R, C)), case.output("mean", R, "f32"), case.output("rstd", R, "f32")
    out = case.run(ln.forward(px, pw, pb, py, pm if save_stats else None, pr if save_stats else None, R, C))
    y, mean, rstd = layernorm_forward(case.seen["x"], case.seen["w"], case.seen["b"], return_stats=True)
    tol = tolerance(case.xtype, FWD_TOL)
    check("y", out["y"], y, tol)
    if save_stats:
        check("mean", out["mean"], mean, FWD_TOL)
        check("rstd", out["rstd"], rstd, FWD_TOL)
    else:
        assert case.untouched("mean", out["mean"]) and case.untouched("rstd", out["rstd"])


def test_forward_in_place(case):
    """y over x (both fp32: the launch is the fp32 kernel whatever the case's element type)."""
    R, C = 333, 768
    x, w, b, _ = inputs(R, C, seeded_rng())
    px, pw, pb = case.inout("x", x, "f32"), case.input("w", w, "f32"), case.input("b", b, "f32")
    out = case.run(ln.forward(px, pw, pb, px, None, None, R, C))
    check("y", out["x"], layernorm_forward(case.seen["x"], case.seen["w"], case.seen["b"]), FWD_TOL)


@pytest.mark.parametrize("R,C", SHAPES)
@pytest.mark.parametrize("stats_valid", [True, False])
@pytest.mark.parametrize("accumulate", [False, True])
def test_backward(case, dev, R, C, stats_valid, accumulate):
    rng = seeded_rng()
    x, w, b, dy = inputs(R, C, rng)
    px, pw, pdy = case.input("x", x, "f32"), case.input("w", w, "f32"), case.input("dy", dy, "f32")
    pdx = case.inout("dx", rng.standard_normal((R, C)), "f32") if accumulate else case.output("dx", (R, C), "f32")
    pdw, pdb = case.output("dw", C, "f32"), case.output("db", C, "f32")
    pcopy = case.output("dx_copy", (R, C)) if case.xtype != "f32" else None
    if stats_valid:    # the statistics the forward saves for this x, computed by the twin
        _, mean, rstd = layernorm_forward(case.seen["x"], w, b, return_stats=True)
        pm, pr = case.input("mean", mean, "f32"), case.input("rstd", rstd, "f32")
    else:
        pm, pr = case.scratch("mean", R), case.scratch("rstd", R)
    scr = case.scratch("partials", ln.scratch_elems(R, C, dev.info))
    out = case.run(ln.backward(px, pw, pdy, pdx, pdw, pdb, pm, pr, scr, R, C, dev.info,
                               stats_valid=stats_valid, accumulate_dx=accumulate, dx_copy=pcopy))
    dx, dw, db = layernorm_backward(case.seen["x"], case.seen["w"], case.seen["dy"])
    check("dx", out["dx"], dx + (case.seen["dx"] if accumulate else 0), BWD_TOL)
    check("dw", out["dw"], dw, BWD_TOL)
    check("db", out["db"], db, BWD_TOL)
    if pcopy is not None:      # the GEMM copy: dx as written, rounded once
        np.testing.assert_array_equal(out["dx_copy"], round_to("bf16", out["dx"]))


def test_backward_dx_over_dy_and_accumulate_params(case, dev):
    """dx written over dy (allowed without accumulate_dx); dw/db added to existing values."""
    R, C = 517, 768
    rng = seeded_rng()
    x, w, b, dy = inputs(R, C, rng)
    px, pw, pdy = case.input("x", x, "f32"), case.input("w", w, "f32"), case.inout("dy", dy, "f32")
    pdw, pdb = case.inout("dw", rng.standard_normal(C), "f32"), case.inout("db", rng.standard_normal(C), "f32")
    pm, pr = case.scratch("mean", R), case.scratch("rstd", R)
    scr = case.scratch("partials", ln.scratch_elems(R, C, dev.info, 64))
    out = case.run(ln.backward(px, pw, pdy, pdy, pdw, pdb, pm, pr, scr, R, C, dev.info, stats_valid=False,
                               accumulate_dparams=True, rows_per_tile=64))
    dx, dw, db = layernorm_backward(case.seen["x"], case.seen["w"], case.seen["dy"])
    check("dx", out["dy"], dx, BWD_TOL)
    check("dw", out["dw"], dw + case.seen["dw"], BWD_TOL)
    check("db", out["db"], db + case.seen["db"], BWD_TOL)


# ln_shift_fwd: (B, T, C) — T = 1 (every row starts a sequence), T below and past the walk (8) and not a
# multiple of it, a row narrower than a warp's quads, the model widths, a row past the 16 quads per lane
# held in registers (the previous row's output recomputed from x)
SHIFT_SHAPES = [(5, 1, 64), (3, 13, 8), (2, 77, 768), (3, 45, 2048), (2, 19, 2176)]


@pytest.mark.parametrize("B,T,C", SHIFT_SHAPES)
@pytest.mark.parametrize("nmix", ln.SHIFT_MIXES)
@pytest.mark.parametrize("keep_h", [True, False])
def test_forward_shift(case, dev, B, T, C, nmix, keep_h):
    """ln_shift_fwd against the twins (LayerNorm, then the time mix's or the channel mix's token shift) and
    bit for bit against the separate ln_forward and tm_shift_fwd / cm_shift_mix on the same inputs."""
    R = B * T
    rng = seeded_rng()
    x, w, b, _ = inputs(R, C, rng)
    px, pw, pb = case.input("x", x, "f32"), case.input("w", w, "f32"), case.input("b", b, "f32")
    pmix = [case.input(f"m{j}", rng.uniform(0, 1, C), "f32") for j in range(nmix)]
    fused = [case.output(f"o{j}", (R, C)) for j in range(nmix)]
    ph = case.output("h", (R, C), "f32") if keep_h else None
    pm, pr = case.output("mean", R, "f32"), case.output("rstd", R, "f32")
    sep = [case.output(f"sep_o{j}", (R, C)) for j in range(nmix)]
    sh = case.output("sep_h", (R, C), "f32")
    sm, sr = case.output("sep_mean", R, "f32"), case.output("sep_rstd", R, "f32")
    separate = ln.forward(px, pw, pb, sh, sm, sr, R, C)
    separate += (tm.shift_forward(sh, pmix, sep, R, C, T, dev.info) if nmix == 6
                 else cm.shift_mix(sh, pmix[0], sep[0], R, T, C, dev.info))
    out = case.run(ln.forward_shift(px, pw, pb, pmix, fused, ph, pm, pr, R, C, T) + separate)
    h, mean, rstd = layernorm_forward(case.seen["x"], case.seen["w"], case.seen["b"], return_stats=True)
    mixes = np.stack([case.seen[f"m{j}"] for j in range(nmix)])
    want = time_shift_forward(h, mixes, T) if nmix == 6 else [channel_mix_shift_forward(h, mixes[0], T)]
    tol = tolerance(case.xtype, FWD_TOL)
    for j in range(nmix):
        check(f"o{j}", out[f"o{j}"], want[j], tol)
        np.testing.assert_array_equal(out[f"o{j}"], out[f"sep_o{j}"], err_msg=f"o{j}: not the separate kernels' bits")
    check("mean", out["mean"], mean, FWD_TOL)
    check("rstd", out["rstd"], rstd, FWD_TOL)
    for name in ("mean", "rstd"):
        np.testing.assert_array_equal(out[name], out["sep_" + name], err_msg=f"{name}: not ln_forward's bits")
    if keep_h:
        check("h", out["h"], h, FWD_TOL)
        np.testing.assert_array_equal(out["h"], out["sep_h"], err_msg="h: not ln_forward's bits")


# ln_shift_bwd: (B, T, C, rows per tile) — T = 1, walks of several rows (a tile's rows over its row
# walkers) crossing sequences and not dividing T, a row narrower than a warp, the model widths (one and
# two quads per thread), a row past the 2048 channels held in registers (the rest read again, their
# partial sums added in memory)
SHIFT_BWD_SHAPES = [(5, 1, 64, None), (3, 13, 64, 40), (2, 77, 768, 12), (2, 45, 2048, 20), (2, 19, 2176, 5)]


@pytest.mark.parametrize("B,T,C,rpt", SHIFT_BWD_SHAPES)
@pytest.mark.parametrize("nmix", ln.SHIFT_MIXES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_backward_shift(case, dev, B, T, C, rpt, nmix, accumulate):
    """ln_shift_bwd against the twins (the time mix's or the channel mix's shift backward of h = LN(x), then
    the LayerNorm backward) and against the separate kernels on the same inputs (h stored by ln_forward,
    then tm_shift_bwd / cm_mix_backward and the LayerNorm backward): dx and its copy bit for bit (h
    recomputed from the saved statistics is the stored h, dh the separate kernels' dh), the time mix's
    mix gradients too (the same walks); the LayerNorm's dw, db and the channel mix's x_k gradient sum in
    another order."""
    R = B * T
    rng = seeded_rng()
    x, w, b, _ = inputs(R, C, rng)
    px, pw, pb = case.input("x", x, "f32"), case.input("w", w, "f32"), case.input("b", b, "f32")
    pmix = [case.input(f"m{j}", rng.uniform(0, 1, C), "f32") for j in range(nmix)]
    pd = [case.input(f"d{j}", rng.standard_normal((R, C))) for j in range(nmix)]
    dx0 = rng.standard_normal((R, C))
    pdx, sdx = ((case.inout(n, dx0, "f32") for n in ("dx", "sep_dx")) if accumulate
                else (case.output(n, (R, C), "f32") for n in ("dx", "sep_dx")))
    copies = [case.output(n, (R, C)) if case.xtype != "f32" else None for n in ("dx_copy", "sep_dx_copy")]
    grads = {n: case.output(n, C, "f32") for p in ("", "sep_") for n in
             [f"{p}dm{j}" for j in range(nmix)] + [p + "dw", p + "db"]}
    sh, sm, sr = case.output("h", (R, C), "f32"), case.output("mean", R, "f32"), case.output("rstd", R, "f32")
    sdh = case.scratch("dh", R * C)
    fused = ln.backward_shift(px, pw, pb, sm, sr, pmix, pd, pdx, [grads[f"dm{j}"] for j in range(nmix)],
                              grads["dw"], grads["db"], case.scratch("partials", ln.shift_backward_scratch_elems(
                                  R, C, dev.info, nmix, rpt)), R, C, T, dev.info, accumulate_dx=accumulate,
                              rows_per_tile=rpt, dx_copy=copies[0])
    sep_dmix = [grads[f"sep_dm{j}"] for j in range(nmix)]
    if nmix == 6:
        separate = tm.shift_backward(sh, pmix, pd, sdh, sep_dmix, case.scratch(
            "sep_partials", tm.scratch_elems(R, C, 4, dev.info, rpt)), R, C, T, dev.info, rows_per_tile=rpt)
    else:
        separate = cm.mix_backward(pd[0], sh, pmix[0], sdh, sep_dmix[0], case.scratch(
            "sep_partials", cm.scratch_elems(R, C, dev.info)), R, T, C, dev.info)
    separate += ln.backward(px, pw, sdh, sdx, grads["sep_dw"], grads["sep_db"], sm, sr,
                            case.scratch("sep_ln_partials", ln.scratch_elems(R, C, dev.info)), R, C, dev.info,
                            accumulate_dx=accumulate, dx_copy=copies[1])
    out = case.run(ln.forward(px, pw, pb, sh, sm, sr, R, C) + fused + separate)
    seen = case.seen
    h = layernorm_forward(seen["x"], seen["w"], seen["b"])
    mixes, douts = np.stack([seen[f"m{j}"] for j in range(nmix)]), np.stack([seen[f"d{j}"] for j in range(nmix)])
    if nmix == 6:
        dh, dmix = time_shift_backward(h, mixes, douts, T)
    else:
        dh, dm = channel_mix_shift_backward(douts[0], h, mixes[0], T)
        dmix = dm[None]
    dx, dw, db = layernorm_backward(seen["x"], seen["w"], dh)
    check("dx", out["dx"], dx + (seen["dx"] if accumulate else 0), BWD_TOL)
    check("dw", out["dw"], dw, BWD_TOL)
    check("db", out["db"], db, BWD_TOL)
    for j in range(nmix):
        check(f"dm{j}", out[f"dm{j}"], dmix[j], tolerance(case.xtype, BWD_TOL))
    same = (["dx"] + (["dx_copy"] if copies[0] is not None else [])
            + ([f"dm{j}" for j in range(nmix)] if nmix == 6 else []))
    for name in same:
        np.testing.assert_array_equal(out[name], out["sep_" + name], err_msg=f"{name}: not the separate kernels' bits")
