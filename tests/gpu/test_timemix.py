"""GPU tests of rwkvx/cu/timemix/timemix.cu through rwkvx.cu.timemix, against the twins in rwkvx.oracle
(time_shift_*, tanh_* / sigmoid_*, time_mix_prep_*, time_mix_gn_*; reduce.cu on its own: test_reduce.py), in
fp32 and bf16 (harness.KernelCase: fresh random inputs, poisoned outputs and scratch, two bit-identical runs).
fp32 limits: 1e-5 forward, 1e-4 backward. B = 2, T = 37 (R = 74, not a multiple of 16)."""
from __future__ import annotations

import numpy as np
import pytest

from harness import check, tolerance
from rwkvx import oracle as O
from rwkvx.cu import timemix as tm

from seeding import seeded_rng

B, T = 2, 37
R = B * T
FWD_TOL = 1e-5
BWD_TOL = 1e-4
MIX_NAMES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
# (C, N): the two required shapes first, then layouts that exercise other code paths:
# partial last warp (192: 48 quads x 5 rows = 240 threads), two column blocks (1280), N = 4, 8, 32.
CONFIGS = [(64, 16), (256, 64), (192, 64), (1280, 128), (24, 4), (40, 8), (96, 32)]
CFG_IDS = [f"C{c}-N{n}" for c, n in CONFIGS]
RPTS = [None, 5]          # default row tiles, and 5 rows per tile (not a multiple of the row streams)


@pytest.fixture
def rng():
    return seeded_rng()


def rand(rng, shape, scale=1.0, offset=0.0):
    return rng.standard_normal(shape) * scale + offset


# ------------------------------------------------------------------------------------------------
# 1. token shift
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_shift_forward(case, dev, rng, C, N, rpt):
    x = case.input("x", rand(rng, (R, C)), "f32")          # LN1's output: f32 in every precision
    mix = [case.input(m, rng.uniform(0.05, 0.95, C), "f32") for m in MIX_NAMES]
    outs = [case.output(f"o{j}", (R, C)) for j in range(6)]
    got = case.run(tm.shift_forward(x, mix, outs, R, C, T, dev.info, rows_per_tile=rpt))
    want = O.time_shift_forward(case.seen["x"], np.stack([case.seen[m] for m in MIX_NAMES]), T)
    for j in range(6):
        check(f"o{j}", got[f"o{j}"], want[j], tolerance(case.xtype, FWD_TOL))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_shift_backward(case, dev, rng, C, N, rpt, accumulate):
    x = case.input("x", rand(rng, (R, C)), "f32")
    mix = [case.input(m, rng.uniform(0.05, 0.95, C), "f32") for m in MIX_NAMES]
    douts = [case.input(f"d{j}", rand(rng, (R, C))) for j in range(6)]
    if accumulate:
        dx = case.inout("dx", rand(rng, (R, C)), "f32")
        dmix = [case.inout(f"dm{j}", rand(rng, C), "f32") for j in range(6)]
    else:
        dx = case.output("dx", (R, C), "f32")
        dmix = [case.output(f"dm{j}", C, "f32") for j in range(6)]
    part = case.scratch("partials", tm.scratch_elems(R, C, N, dev.info, rpt))
    got = case.run(tm.shift_backward(x, mix, douts, dx, dmix, part, R, C, T, dev.info, accumulate_dx=accumulate,
                                     accumulate_dmix=accumulate, rows_per_tile=rpt))
    want_dx, want_dmix = O.time_shift_backward(case.seen["x"], np.stack([case.seen[m] for m in MIX_NAMES]),
                                               np.stack([case.seen[f"d{j}"] for j in range(6)]), T)
    tol = tolerance(case.xtype, BWD_TOL)
    check("dx", got["dx"], want_dx + (case.seen["dx"] if accumulate else 0), BWD_TOL)   # f32, from the inputs as read
    for j in range(6):
        check(f"d{MIX_NAMES[j]}", got[f"dm{j}"], want_dmix[j] + (case.seen[f"dm{j}"] if accumulate else 0), tol)


# ------------------------------------------------------------------------------------------------
# 2. activations
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("n", [R * 32, R * 64, 1001])
@pytest.mark.parametrize("kind", ["tanh", "sigmoid"])
def test_activations(case, dev, rng, kind, n, inplace):
    fwd_b, bwd_b = getattr(tm, f"{kind}_forward"), getattr(tm, f"{kind}_backward")
    fwd_r, bwd_r = getattr(O, f"{kind}_forward"), getattr(O, f"{kind}_backward")
    pre = rand(rng, n, 2.0)
    act = case.input("act", fwd_r(pre))                       # the saved activation the backward reads
    if inplace:
        ppre, pdact = case.inout("pre", pre), case.inout("dact", rand(rng, n))
        got = case.run(fwd_b(ppre, ppre, n, dev.info) + bwd_b(act, pdact, pdact, n, dev.info))
        y, dpre = got["pre"], got["dact"]
    else:
        ppre, pdact = case.input("pre", pre), case.input("dact", rand(rng, n))
        py, pdpre = case.output("y", n), case.output("dpre", n)
        got = case.run(fwd_b(ppre, py, n, dev.info) + bwd_b(act, pdact, pdpre, n, dev.info))
        y, dpre = got["y"], got["dpre"]
    check(kind, y, fwd_r(case.seen["pre"]), tolerance(case.xtype, FWD_TOL))
    check(f"d{kind}", dpre, bwd_r(case.seen["act"], case.seen["dact"]), tolerance(case.xtype, BWD_TOL))


# ------------------------------------------------------------------------------------------------
# 3. prep
# ------------------------------------------------------------------------------------------------
def _prep_inputs(case, rng, C, layer) -> dict:
    """The prep's inputs as builder keyword arguments (None where layer 0 has none)."""
    p = dict(k=case.input("k", rand(rng, (R, C))), v=case.input("v", rand(rng, (R, C))),
             wl=case.input("wl", rand(rng, (R, C))), al=case.input("al", rand(rng, (R, C))),
             w0=case.input("w0", rng.uniform(-6.0, 1.5, C), "f32"), a0=case.input("a0", rng.uniform(-1, 1, C), "f32"),
             k_k=case.input("k_k", rng.uniform(0.5, 0.9, C), "f32"),
             k_a=case.input("k_a", rng.uniform(0.8, 1.2, C), "f32"), vl=None, v0=None)
    if layer > 0:
        p.update(vl=case.input("vl", rand(rng, (R, C))), v0=case.input("v0", rng.uniform(-1, 1, C), "f32"))
    return p


def _twin_args(case, layer) -> dict:
    """The same inputs as the kernel read them, for the twins."""
    a = {n: case.seen[n] for n in ("k", "v", "wl", "al", "w0", "a0", "k_k", "k_a")}
    for n in ("vl", "v0"):
        a[n] = case.seen[n] if layer > 0 else None
    a["v_first"] = case.seen["vf"] if layer > 0 else None
    return a


@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_prep_forward(case, dev, rng, C, N, rpt, layer):
    p = _prep_inputs(case, rng, C, layer)
    vf = case.inout("vf", rand(rng, (R, C))) if layer > 0 else case.output("vf", (R, C))
    outs = {n: case.output(n, (R, C), "f32" if n == "decay" else "x") for n in ("decay", "kp", "wa", "wb")}
    vp = case.output("vp", (R, C)) if layer > 0 else None
    got = case.run(tm.prep_forward(**p, v_first=vf, **outs, vp=vp, R=R, C=C, N=N, layer=layer, dev=dev.info,
                                   rows_per_tile=rpt))
    want = O.time_mix_prep_forward(**_twin_args(case, layer), N=N, layer=layer)
    tol = tolerance(case.xtype, FWD_TOL)
    for n in ("decay", "kp", "wa", "wb"):
        check(n, got[n], want[n], FWD_TOL if n == "decay" else tol)     # the decay is f32 in every precision
    if layer > 0:
        check("vp", got["vp"], want["vp"], tol)
        assert np.array_equal(got["vf"], case.seen["vf"]), "v_first must stay untouched for layer > 0"
    else:
        assert np.array_equal(got["vf"], case.seen["v"]), "layer 0 must write v_first = v exactly"


@pytest.mark.parametrize("vf_acc", [False, True])
@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_prep_backward(case, dev, rng, C, N, rpt, layer, extras, vf_acc):
    """extras: bonus-term grads dkp2/dvp2/dr2 given (else None), dr_out = dr (in place, as the model does).
    vf_acc: layer > 0 accumulates into dv_first (else writes it); layer 0 reads dv_first (vf_acc) or gets
    none (NULL)."""
    p = _prep_inputs(case, rng, C, layer)
    vf = case.input("vf", rand(rng, (R, C))) if layer > 0 else None
    grads = {n: case.input(n, rand(rng, (R, C)), "f32") for n in ("dd", "dkp", "dvp", "dwa", "dwb")}  # WKV7's f32 grads
    dr = case.inout("dr", rand(rng, (R, C)))
    extra = {n: (case.input(n, rand(rng, (R, C))) if extras else None) for n in ("dkp2", "dvp2", "dr2")}
    if vf_acc:
        dvf = case.inout("dvf", rand(rng, (R, C)), "f32")
    else:
        dvf = case.output("dvf", (R, C), "f32") if layer > 0 else None
    outs = {n: case.output(n, (R, C)) for n in ("dk", "dv", "dwl", "dal")}
    dvl = case.output("dvl", (R, C)) if layer > 0 else None
    pnames = ["dw0", "da0", "dk_k", "dk_a"] + (["dv0"] if layer > 0 else [])
    dparams = [case.output(n, C, "f32") for n in pnames]
    part = case.scratch("partials", tm.scratch_elems(R, C, N, dev.info, rpt))
    got = case.run(tm.prep_backward(**p, v_first=vf, d_decay=grads["dd"], dkp=grads["dkp"], dvp=grads["dvp"],
                                    dwa=grads["dwa"], dwb=grads["dwb"], **extra, dr=dr,
                                    dr_out=dr if extras else None, **outs, dvl=dvl, dv_first=dvf, partials=part,
                                    dparams=dparams, R=R, C=C, N=N, layer=layer, dev=dev.info,
                                    vf_accumulate=vf_acc, rows_per_tile=rpt))
    s = case.seen
    dkp = s["dkp"] + (s["dkp2"] if extras else 0)
    dvp = s["dvp"] + (s["dvp2"] if extras else 0)
    want = O.time_mix_prep_backward(**_twin_args(case, layer), N=N, layer=layer, d_decay=s["dd"], dkp=dkp,
                                    dvp=dvp, dwa=s["dwa"], dwb=s["dwb"],
                                    dvf_in=s["dvf"] if (layer == 0 and vf_acc) else None)
    tol = tolerance(case.xtype, BWD_TOL)
    for n in [*outs, *(["dvl"] if layer > 0 else []), *pnames]:
        check(n, got[n], want[n], tol)
    if extras:
        check("dr (+= dr2, in place)", got["dr"], s["dr"] + s["dr2"], tolerance(case.xtype, FWD_TOL))
    else:
        assert np.array_equal(got["dr"], s["dr"]), "without dr2, dr is untouched"
    if layer > 0:
        check("dv_first", got["dvf"], want["dvf"] + (s["dvf"] if vf_acc else 0.0), tol)
    elif vf_acc:
        assert np.array_equal(got["dvf"], s["dvf"]), "layer 0 must only read dv_first"


# ------------------------------------------------------------------------------------------------
# 4. GroupNorm + bonus + gate
# ------------------------------------------------------------------------------------------------
def _gn_inputs(case, rng, C) -> dict:
    return dict(y=case.input("y", rand(rng, (R, C), 0.7, 0.2)), r=case.input("r", rand(rng, (R, C))),
                kp=case.input("kp", rand(rng, (R, C))), vp=case.input("vp", rand(rng, (R, C))),
                g=case.input("g", rand(rng, (R, C))), ln_w=case.input("ln_w", rng.uniform(0.5, 1.5, C), "f32"),
                ln_b=case.input("ln_b", rand(rng, C, 0.1), "f32"), r_k=case.input("r_k", rand(rng, C, 0.3), "f32"))


_GN_NAMES = ("y", "r", "kp", "vp", "g", "ln_w", "ln_b", "r_k")


@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_gn_forward(case, dev, rng, C, N, rpt):
    gn = _gn_inputs(case, rng, C)
    z = case.output("z", (R, C))
    got = case.run(tm.gn_forward(**gn, z=z, R=R, C=C, N=N, dev=dev.info, rows_per_tile=rpt))
    check("z", got["z"], O.time_mix_gn_forward(*[case.seen[n] for n in _GN_NAMES], N),
          tolerance(case.xtype, FWD_TOL))


@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_gn_backward(case, dev, rng, C, N, rpt):
    gn = _gn_inputs(case, rng, C)
    dz = case.input("dz", rand(rng, (R, C)))
    outs = {n: case.output(n, (R, C)) for n in ("dy", "dg", "dr2", "dkp2", "dvp2")}
    pnames = ["dln_w", "dln_b", "dr_k"]
    part = case.scratch("partials", tm.scratch_elems(R, C, N, dev.info, rpt))
    got = case.run(tm.gn_backward(**gn, dz=dz, **outs, partials=part,
                                  dparams=[case.output(n, C, "f32") for n in pnames], R=R, C=C, N=N,
                                  dev=dev.info, rows_per_tile=rpt))
    want = O.time_mix_gn_backward(*[case.seen[n] for n in _GN_NAMES], N, case.seen["dz"])
    twin = dict(dy="dy", dg="dg", dr2="dr", dkp2="dkp", dvp2="dvp", dln_w="dln_w", dln_b="dln_b", dr_k="dr_k")
    for n in [*outs, *pnames]:
        check(n, got[n], want[twin[n]], tolerance(case.xtype, BWD_TOL))

