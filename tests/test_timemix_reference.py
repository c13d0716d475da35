"""Float64 numpy references for rwkvx/cu/timemix.cu, and their validation (CPU only).

The reference functions here (``ref_*``) are the twins of the timemix kernels; tests/gpu/test_timemix.py
imports this file and compares the kernels against them. The analytic backward references are checked
here against central finite differences of the forward references, so the GPU tests rest on trusted
references. Also: launch-layout invariants of rwkvx.ops.timemix, and an nvcc compile check of every
HEAD_SIZE when nvcc is on PATH.
"""
from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

EXP_M05 = math.exp(-0.5)
GN_EPS = 64e-5
L2_EPS = 1e-12
MIX_NAMES = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ------------------------------------------------------------------------------------------------
# references (float64 in, float64 out); activations [R, C] with R = B*T
# ------------------------------------------------------------------------------------------------
def _shift(x, T):
    xs = np.zeros_like(x)
    xs[1:] = x[:-1]
    xs[np.arange(x.shape[0]) % T == 0] = 0.0
    return xs


def _unshift(d, T):
    """Adjoint of _shift: out[t] = d[t+1] within the sequence, 0 at the last token."""
    out = np.zeros_like(d)
    out[:-1] = d[1:]
    out[np.arange(d.shape[0]) % T == T - 1] = 0.0
    return out


def ref_shift_forward(x, mix, T):
    """x [R,C], mix [6,C] -> outs [6,R,C]: x + (shift(x) - x) * mix_j."""
    xx = _shift(x, T) - x
    return np.stack([x + xx * m for m in mix])


def ref_shift_backward(x, mix, douts, T):
    """-> dx [R,C], dmix [6,C]."""
    xx = _shift(x, T) - x
    dx = np.zeros_like(x)
    dmix = np.zeros_like(mix)
    for j in range(6):
        dx += douts[j] * (1.0 - mix[j]) + _unshift(douts[j] * mix[j], T)
        dmix[j] = (douts[j] * xx).sum(0)
    return dx, dmix


def ref_tanh_forward(x):
    return np.tanh(x)


def ref_tanh_backward(act, dact):
    return dact * (1.0 - act * act)


def ref_sigmoid_forward(x):
    return sigmoid(x)


def ref_sigmoid_backward(act, dact):
    return dact * act * (1.0 - act)


def _heads(x, N):
    return x.reshape(x.shape[0], -1, N)


def ref_prep_forward(k, v, wl, al, vl, vf, w0, a0, v0, k_k, k_a, N, layer):
    """-> dict(decay, kp, vp, wa, wb, v_first). Layer 0: vp = v and v_first = v."""
    R, C = k.shape
    sw = sigmoid(w0 + wl)
    decay = np.exp(-EXP_M05 * sw)
    a = sigmoid(a0 + al)
    kr = _heads(k * k_k, N)
    nrm = np.sqrt((kr * kr).sum(-1, keepdims=True))
    kk = (kr / np.maximum(nrm, L2_EPS)).reshape(R, C)
    kp = k * (1.0 + (a - 1.0) * k_a)
    if layer > 0:
        sv = sigmoid(v0 + vl)
        vp = v + (vf - v) * sv
        vfo = vf
    else:
        vp = v
        vfo = v
    return dict(decay=decay, kp=kp, vp=vp, wa=-kk, wb=kk * a, v_first=vfo)


def ref_prep_backward(k, v, wl, al, vl, vf, w0, a0, v0, k_k, k_a, N, layer,
                      d_decay, dkp, dvp, dwa, dwb, dvf_in=None):
    """Gradients of L = <d_decay,decay> + <dkp,kp> + <dvp,vp> + <dwa,wa> + <dwb,wb>
    (+ layer 0: <dvf_in, v_first>, since v_first = v there).

    -> dict(dk, dv, dwl, dal, dvl, dvf, dw0, da0, dk_k, dk_a, dv0).
    Layer > 0: dvf is the contribution to the v_first gradient (the kernel adds it to dv_first).
    dkp / dvp are the total gradients of k' / v' (WKV + bonus)."""
    R, C = k.shape
    sw = sigmoid(w0 + wl)
    decay = np.exp(-EXP_M05 * sw)
    a = sigmoid(a0 + al)
    kr = _heads(k * k_k, N)
    nrm = np.sqrt((kr * kr).sum(-1, keepdims=True))
    den = np.maximum(nrm, L2_EPS)
    kk = kr / den
    dkk = _heads(dwb * a - dwa, N)
    sdot = (dkk * kk).sum(-1, keepdims=True)
    dkr = np.where(nrm > L2_EPS, (dkk - kk * sdot) / den, dkk / den).reshape(R, C)
    kk = kk.reshape(R, C)
    out = {}
    out["dk"] = dkp * (1.0 + (a - 1.0) * k_a) + dkr * k_k
    out["dk_k"] = (dkr * k).sum(0)
    out["dk_a"] = (dkp * k * (a - 1.0)).sum(0)
    da = dwb * kk + dkp * k * k_a
    out["dal"] = da * a * (1.0 - a)
    out["da0"] = out["dal"].sum(0)
    out["dwl"] = d_decay * decay * (-EXP_M05) * sw * (1.0 - sw)
    out["dw0"] = out["dwl"].sum(0)
    if layer > 0:
        sv = sigmoid(v0 + vl)
        out["dv"] = dvp * (1.0 - sv)
        out["dvf"] = dvp * sv
        out["dvl"] = dvp * (vf - v) * sv * (1.0 - sv)
        out["dv0"] = out["dvl"].sum(0)
    else:
        out["dv"] = dvp + (dvf_in if dvf_in is not None else 0.0)
    return out


def ref_gn_forward(y, r, kp, vp, g, ln_w, ln_b, r_k, N):
    R, C = y.shape
    yh = _heads(y, N)
    mean = yh.mean(-1, keepdims=True)
    d = yh - mean
    var = (d * d).mean(-1, keepdims=True)
    xh = (d / np.sqrt(var + GN_EPS)).reshape(R, C)
    s = np.repeat(_heads(r * kp * r_k, N).sum(-1), N, axis=1)
    return (xh * ln_w + ln_b + s * vp) * g


def ref_gn_backward(y, r, kp, vp, g, ln_w, ln_b, r_k, N, dz):
    """-> dict(dy, dr, dkp, dvp, dg, dln_w, dln_b, dr_k)  (dr, dkp, dvp: bonus-term grads)."""
    R, C = y.shape
    yh = _heads(y, N)
    mean = yh.mean(-1, keepdims=True)
    d = yh - mean
    var = (d * d).mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + GN_EPS)
    xh = d * rstd
    s = np.repeat(_heads(r * kp * r_k, N).sum(-1), N, axis=1)
    u = xh.reshape(R, C) * ln_w + ln_b + s * vp
    du = dz * g
    dxh = _heads(du * ln_w, N)
    dy = rstd * (dxh - dxh.mean(-1, keepdims=True) - xh * (dxh * xh).mean(-1, keepdims=True))
    ds = np.repeat(_heads(du * vp, N).sum(-1), N, axis=1)
    return dict(dy=dy.reshape(R, C), dg=dz * u, dvp=du * s, dr=ds * kp * r_k, dkp=ds * r * r_k,
                dln_w=(du * xh.reshape(R, C)).sum(0), dln_b=du.sum(0), dr_k=(ds * r * kp).sum(0))


# ------------------------------------------------------------------------------------------------
# finite-difference validation of the backward references
# ------------------------------------------------------------------------------------------------
def _fd_grad(f, arrays, name, h=1e-6):
    """Central differences of scalar f(arrays) w.r.t. arrays[name] (every element)."""
    x = arrays[name]
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + h
        fp = f(arrays)
        x[i] = old - h
        fm = f(arrays)
        x[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g


def _close(a, b, tol=1e-6):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err <= tol, f"rel err {err:.3e} > {tol}"


@pytest.mark.parametrize("T", [1, 3])
def test_shift_reference_fd(T):
    rng = np.random.default_rng(1)
    R, C = 2 * T, 5
    A = dict(x=rng.standard_normal((R, C)), mix=rng.uniform(0, 1, (6, C)))
    D = rng.standard_normal((6, R, C))

    def f(A):
        return float((ref_shift_forward(A["x"], A["mix"], T) * D).sum())

    dx, dmix = ref_shift_backward(A["x"], A["mix"], D, T)
    _close(dx, _fd_grad(f, A, "x"))
    _close(dmix, _fd_grad(f, A, "mix"))


def test_activation_references_fd():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 4)) * 2
    D = rng.standard_normal((3, 4))
    for fwd, bwd in ((ref_tanh_forward, ref_tanh_backward), (ref_sigmoid_forward, ref_sigmoid_backward)):
        A = dict(x=x.copy())
        g = _fd_grad(lambda A: float((fwd(A["x"]) * D).sum()), A, "x")
        _close(bwd(fwd(x), D), g)


def _prep_inputs(rng, R, C, layer):
    A = dict(k=rng.standard_normal((R, C)), v=rng.standard_normal((R, C)),
             wl=rng.standard_normal((R, C)), al=rng.standard_normal((R, C)),
             vl=rng.standard_normal((R, C)), vf=rng.standard_normal((R, C)),
             w0=rng.uniform(-3, 1, C), a0=rng.uniform(-1, 1, C), v0=rng.uniform(-1, 1, C),
             k_k=rng.uniform(0.5, 1.0, C), k_a=rng.uniform(0.8, 1.2, C))
    G = dict(d_decay=rng.standard_normal((R, C)), dkp=rng.standard_normal((R, C)),
             dvp=rng.standard_normal((R, C)), dwa=rng.standard_normal((R, C)),
             dwb=rng.standard_normal((R, C)), dvf_in=rng.standard_normal((R, C)))
    return A, G


@pytest.mark.parametrize("layer", [0, 2])
@pytest.mark.parametrize("N", [4, 8])
def test_prep_reference_fd(layer, N):
    rng = np.random.default_rng(3 + layer + N)
    R, C = 3, 2 * N
    A, G = _prep_inputs(rng, R, C, layer)
    # one row of k with a tiny norm would hit the eps branch only at |k| ~ 1e-12: keep generic here

    def f(A):
        o = ref_prep_forward(**A, N=N, layer=layer)
        L = ((o["decay"] * G["d_decay"]).sum() + (o["kp"] * G["dkp"]).sum() + (o["vp"] * G["dvp"]).sum()
             + (o["wa"] * G["dwa"]).sum() + (o["wb"] * G["dwb"]).sum())
        if layer == 0:
            L += (o["v_first"] * G["dvf_in"]).sum()
        return float(L)

    B = ref_prep_backward(**A, N=N, layer=layer, **G)
    _close(B["dk"], _fd_grad(f, A, "k"))
    _close(B["dv"], _fd_grad(f, A, "v"))
    _close(B["dwl"], _fd_grad(f, A, "wl"))
    _close(B["dal"], _fd_grad(f, A, "al"))
    _close(B["dw0"], _fd_grad(f, A, "w0"))
    _close(B["da0"], _fd_grad(f, A, "a0"))
    _close(B["dk_k"], _fd_grad(f, A, "k_k"))
    _close(B["dk_a"], _fd_grad(f, A, "k_a"))
    if layer > 0:
        _close(B["dvl"], _fd_grad(f, A, "vl"))
        _close(B["dvf"], _fd_grad(f, A, "vf"))
        _close(B["dv0"], _fd_grad(f, A, "v0"))


def test_prep_forward_formulas():
    """Spot values straight from SPEC §2.3."""
    rng = np.random.default_rng(4)
    N, R, C = 4, 2, 8
    A, _ = _prep_inputs(rng, R, C, 1)
    o = ref_prep_forward(**A, N=N, layer=1)
    i, c = 1, 5
    h = c // N
    kr = A["k"][i, h * N:(h + 1) * N] * A["k_k"][h * N:(h + 1) * N]
    kk = kr / max(np.linalg.norm(kr), 1e-12)
    a = 1 / (1 + math.exp(-(A["a0"][c] + A["al"][i, c])))
    assert o["decay"][i, c] == pytest.approx(
        math.exp(-math.exp(-0.5) / (1 + math.exp(-(A["w0"][c] + A["wl"][i, c])))), rel=1e-14)
    assert o["wa"][i, c] == pytest.approx(-kk[c % N], rel=1e-14)
    assert o["wb"][i, c] == pytest.approx(kk[c % N] * a, rel=1e-14)
    assert o["kp"][i, c] == pytest.approx(A["k"][i, c] * (1 + (a - 1) * A["k_a"][c]), rel=1e-14)
    sv = 1 / (1 + math.exp(-(A["v0"][c] + A["vl"][i, c])))
    assert o["vp"][i, c] == pytest.approx(A["v"][i, c] + (A["vf"][i, c] - A["v"][i, c]) * sv, rel=1e-14)


@pytest.mark.parametrize("N", [4, 8])
def test_gn_reference_fd(N):
    rng = np.random.default_rng(5 + N)
    R, C = 3, 2 * N
    A = dict(y=rng.standard_normal((R, C)) * 0.3 + 0.1, r=rng.standard_normal((R, C)),
             kp=rng.standard_normal((R, C)), vp=rng.standard_normal((R, C)), g=rng.standard_normal((R, C)),
             ln_w=rng.uniform(0.5, 1.5, C), ln_b=rng.standard_normal(C) * 0.1,
             r_k=rng.standard_normal(C) * 0.5)
    dz = rng.standard_normal((R, C))

    def f(A):
        return float((ref_gn_forward(**A, N=N) * dz).sum())

    B = ref_gn_backward(**A, N=N, dz=dz)
    _close(B["dy"], _fd_grad(f, A, "y"))
    _close(B["dg"], _fd_grad(f, A, "g"))
    _close(B["dr"], _fd_grad(f, A, "r"))
    _close(B["dkp"], _fd_grad(f, A, "kp"))
    _close(B["dvp"], _fd_grad(f, A, "vp"))
    _close(B["dln_w"], _fd_grad(f, A, "ln_w"))
    _close(B["dln_b"], _fd_grad(f, A, "ln_b"))
    _close(B["dr_k"], _fd_grad(f, A, "r_k"))


def test_gn_forward_matches_groupnorm_definition():
    rng = np.random.default_rng(6)
    N, R, C = 8, 2, 16
    y = rng.standard_normal((R, C))
    one, zero = np.ones(C), np.zeros(C)
    z = ref_gn_forward(y, np.zeros((R, C)), np.zeros((R, C)), np.zeros((R, C)), np.ones((R, C)),
                       one, zero, zero, N)
    for i in range(R):
        for h in range(C // N):
            seg = y[i, h * N:(h + 1) * N]
            want = (seg - seg.mean()) / math.sqrt(seg.var() + 64e-5)
            np.testing.assert_allclose(z[i, h * N:(h + 1) * N], want, rtol=1e-13)


# ------------------------------------------------------------------------------------------------
# launch layout (rwkvx.ops.timemix) and compilation
# ------------------------------------------------------------------------------------------------
LAYOUT_CASES = [(74, 64, 16), (74, 256, 64), (74, 192, 64), (74, 1280, 128), (74, 24, 4), (74, 40, 8),
                (74, 96, 32), (32768, 768, 64), (32768, 4096, 64), (65536, 2560, 128), (5, 3072, 4)]


@pytest.mark.parametrize("R,C,N", LAYOUT_CASES)
@pytest.mark.parametrize("rpt", [None, 5, 1])
def test_layout_invariants(R, C, N, rpt):
    from rwkvx.ops import timemix as tm
    if rpt is not None and -(-R // rpt) > 65535:
        with pytest.raises(ValueError):
            tm.layout(R, C, N, rpt)
        return
    for n in (4, N):
        L = tm.layout(R, C, n, rpt)
        qx, ry = L["qx"], L["ry"]
        assert (C // 4) % qx == 0 and qx % (n // 4) == 0
        assert qx * ry <= 1024 and L["grid"][0] * qx == C // 4
        assert L["tiles"] * L["rpt"] >= R > (L["tiles"] - 1) * L["rpt"]
        assert L["pp"] == L["tiles"] * ry and L["tiles"] <= 65535
    assert tm.scratch_bytes(R, C, N, rpt) >= 4 * C * 6 * tm.layout(R, C, 4, rpt)["pp"]
    assert tm.scratch_bytes(R, C, N, rpt) >= 4 * C * 5 * tm.layout(R, C, N, rpt)["pp"]


def test_builders_make_launches():
    pytest.importorskip("rwkvx.runtime.ops")
    from rwkvx.ops import timemix as tm
    R, C, N, T = 74, 256, 64, 37
    p = iter(range(0x10000, 0x10000 + 4096 * 256, 4096))
    P = lambda: next(p)  # noqa: E731
    ops = []
    ops += tm.shift_forward(P(), [P() for _ in range(6)], [P() for _ in range(6)], R, C, T)
    ops += tm.shift_backward(P(), [P() for _ in range(6)], [P() for _ in range(6)], P(),
                             [P() for _ in range(6)], P(), R, C, T)
    ops += tm.tanh_forward(P(), P(), R * 32) + tm.tanh_backward(P(), P(), P(), R * 32)
    ops += tm.sigmoid_forward(P(), P(), R * 64) + tm.sigmoid_backward(P(), P(), P(), R * 64)
    for layer in (0, 1):
        ops += tm.prep_forward(*[P() for _ in range(16)], R, C, N, layer)
        ops += tm.prep_backward(*[P() for _ in range(28)], [P() for _ in range(5)], R, C, N, layer)
    ops += tm.gn_forward(*[P() for _ in range(9)], R, C, N)
    ops += tm.gn_backward(*[P() for _ in range(15)], [P() for _ in range(3)], R, C, N)
    names = [o.name for o in ops]
    assert names.count("tm_reduce_partials") == 4
    for o in ops:
        assert o.module == "timemix"
        assert all(k in "pilfd" for k, _ in o.args)
    # every launch matches its kernel's signature in timemix.cu
    sigs = _kernel_signatures()
    assert set(names) <= set(sigs)
    for o in ops:
        assert tuple(k for k, _ in o.args) == sigs[o.name], o.name
    # the layer-0 prep launches pass no v0/vl/vp
    pf0 = [o for o in ops if o.name == "tm_prep_fwd"][0]
    assert pf0.args[4] == ("p", 0) and pf0.args[8] == ("p", 0) and pf0.args[13] == ("p", 0)
    assert pf0.args[-1] == ("i", 0)


_CU = Path(__file__).resolve().parents[1] / "rwkvx" / "cu" / "timemix.cu"


def _kernel_signatures() -> dict:
    """name -> tuple of Launch arg kinds, parsed from the extern "C" kernels of timemix.cu."""
    import re
    src = _CU.read_text()
    out = {}

    def kinds(params):
        ks = []
        for prm in params.split(","):
            prm = " ".join(prm.split())
            if "*" in prm:
                ks.append("p")
            elif prm.startswith("long long"):
                ks.append("l")
            elif prm.startswith("int"):
                ks.append("i")
            elif prm.startswith("float"):
                ks.append("f")
            else:
                raise AssertionError(f"unparsed parameter {prm!r}")
        return tuple(ks)

    for m in re.finditer(r'extern "C" __global__ void (\w+)\(([^)]*)\)', src):
        if m.group(1) == "NAME":      # the element-wise macro
            macro_params = m.group(2).replace("\\", " ")
            continue
        out[m.group(1)] = kinds(m.group(2))
    for m in re.finditer(r"^TM_ELEMENTWISE\((\w+),", src, re.M):
        out[m.group(1)] = kinds(macro_params)
    return out


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("N", [4, 8, 16, 32, 64, 128])
def test_timemix_cu_compiles(N, tmp_path):
    res = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", f"-DHEAD_SIZE={N}",
                          "-o", str(tmp_path / "tm.cubin"), str(_CU)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "spill" not in res.stderr.replace("0 bytes spill", "")
