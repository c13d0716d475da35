"""GPU tests of rwkvx/cu/timemix.cu (via the rwkvx.ops.timemix launch builders).

Each kernel runs on fresh random inputs with its outputs (and the partial-sum scratch) poisoned with
NaN, and is compared with the float64 numpy references of tests/test_timemix_reference.py (which are
themselves checked against finite differences there). Norm-wise relative error per tensor:
<= 1e-5 forward, <= 1e-4 backward. Every case runs twice (buffers reset in between) and the two results
must be bit-identical. B = 2, T = 37 (R = 74, not a multiple of 16).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from rwkvx.ops import timemix as tm

_REF_PATH = Path(__file__).resolve().parents[1] / "test_timemix_reference.py"
_spec = importlib.util.spec_from_file_location("_timemix_reference", _REF_PATH)
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

B, T = 2, 37
R = B * T
FWD_TOL = 1e-5
BWD_TOL = 1e-4
# (C, N): the two required shapes first, then layouts that exercise other code paths:
# partial last warp (192: 48 quads x 5 rows = 240 threads), two column blocks (1280), N = 4, 8, 32.
CONFIGS = [(64, 16), (256, 64), (192, 64), (1280, 128), (24, 4), (40, 8), (96, 32)]
CFG_IDS = [f"C{c}-N{n}" for c, n in CONFIGS]
RPTS = [None, 5]          # default row tiles, and 5 rows per tile (not a multiple of the row streams)


# ------------------------------------------------------------------------------------------------
# harness
# ------------------------------------------------------------------------------------------------
class GpuRunner:
    def __init__(self):
        from rwkvx.runtime import Device
        self.dev = Device.get()
        self._keep = []

    def alloc(self, arr: np.ndarray):
        b = self.dev.alloc(max(arr.nbytes, 256))
        self._keep.append(b)
        self.upload(b, arr)
        return b

    def upload(self, b, arr: np.ndarray) -> None:
        self.dev.upload(b.ptr, np.ascontiguousarray(arr))
        self.dev.synchronize()

    def download(self, b, shape) -> np.ndarray:
        self.dev.synchronize()
        return np.array(self.dev.download(b.ptr, shape, np.float32), dtype=np.float32)

    def program(self, ops):
        from rwkvx.runtime import Plan
        plan = Plan(self.dev, ops, precision="fp32")

        def run():
            plan.run()
            self.dev.synchronize()
        return run


@pytest.fixture(scope="module")
def runner():
    try:
        return GpuRunner()
    except (RuntimeError, ImportError) as e:   # conftest normally skips first
        pytest.skip(f"no CUDA GPU: {e}")


class Bufs:
    """Named device buffers with their initial contents (inputs, NaN-poisoned outputs)."""

    def __init__(self, runner):
        self.runner = runner
        self.init: dict[str, np.ndarray] = {}
        self.buf: dict = {}

    def add(self, name: str, arr) -> object:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        self.init[name] = arr
        self.buf[name] = self.runner.alloc(arr)
        return self.buf[name]

    def nan(self, name: str, shape) -> object:
        return self.add(name, np.full(shape, np.nan, np.float32))

    def __getitem__(self, name):
        return self.buf[name]

    def x64(self, name: str) -> np.ndarray:
        return self.init[name].astype(np.float64)

    def reset(self) -> None:
        for n, a in self.init.items():
            self.runner.upload(self.buf[n], a)

    def get(self, name: str) -> np.ndarray:
        return self.runner.download(self.buf[name], self.init[name].shape)


def run_twice(bufs: Bufs, ops, outs) -> dict:
    """Run the ops twice from identical initial buffers; results must be bit-identical."""
    prog = bufs.runner.program(ops)
    results = []
    for _ in range(2):
        bufs.reset()
        prog()
        results.append({n: bufs.get(n) for n in outs})
    for n in outs:
        a, b = results[0][n], results[1][n]
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{n}: runs differ (not deterministic)"
    return results[0]


def check(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> None:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64).reshape(got.shape)
    assert np.all(np.isfinite(got)), f"{name}: {np.count_nonzero(~np.isfinite(got))} non-finite values"
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def rand(rng, shape, scale=1.0, offset=0.0):
    return (rng.standard_normal(shape) * scale + offset).astype(np.float32)


def unif(rng, shape, lo, hi):
    return rng.uniform(lo, hi, shape).astype(np.float32)


def scratch(bufs: Bufs, C: int, N: int, rpt) -> object:
    n = tm.scratch_bytes(R, C, N, rpt) // 4
    return bufs.nan("partials", (n,))


# ------------------------------------------------------------------------------------------------
# 1. token shift
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_shift_forward(runner, C, N, rpt):
    rng = np.random.default_rng(100 + C)
    bf = Bufs(runner)
    bf.add("x", rand(rng, (R, C)))
    for j, m in enumerate(ref.MIX_NAMES):
        bf.add(m, unif(rng, (C,), 0.05, 0.95))
        bf.nan(f"o{j}", (R, C))
    ops = tm.shift_forward(bf["x"], [bf[m] for m in ref.MIX_NAMES], [bf[f"o{j}"] for j in range(6)],
                           R, C, T, rows_per_tile=rpt)
    got = run_twice(bf, ops, [f"o{j}" for j in range(6)])
    want = ref.ref_shift_forward(bf.x64("x"), np.stack([bf.x64(m) for m in ref.MIX_NAMES]), T)
    for j in range(6):
        check(f"o{j}", got[f"o{j}"], want[j], FWD_TOL)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_shift_backward(runner, C, N, rpt, accumulate):
    rng = np.random.default_rng(200 + C + accumulate)
    bf = Bufs(runner)
    bf.add("x", rand(rng, (R, C)))
    for j, m in enumerate(ref.MIX_NAMES):
        bf.add(m, unif(rng, (C,), 0.05, 0.95))
        bf.add(f"d{j}", rand(rng, (R, C)))
        if accumulate:
            bf.add(f"dm{j}", rand(rng, (C,)))
        else:
            bf.nan(f"dm{j}", (C,))
    if accumulate:
        bf.add("dx", rand(rng, (R, C)))
    else:
        bf.nan("dx", (R, C))
    scratch(bf, C, N, rpt)
    ops = tm.shift_backward(bf["x"], [bf[m] for m in ref.MIX_NAMES], [bf[f"d{j}"] for j in range(6)],
                            bf["dx"], [bf[f"dm{j}"] for j in range(6)], bf["partials"], R, C, T,
                            accumulate_dx=accumulate, accumulate_dmix=accumulate, rows_per_tile=rpt)
    outs = ["dx"] + [f"dm{j}" for j in range(6)]
    got = run_twice(bf, ops, outs)
    dx, dmix = ref.ref_shift_backward(bf.x64("x"), np.stack([bf.x64(m) for m in ref.MIX_NAMES]),
                                      np.stack([bf.x64(f"d{j}") for j in range(6)]), T)
    if accumulate:
        dx = dx + bf.x64("dx")
        dmix = dmix + np.stack([bf.x64(f"dm{j}") for j in range(6)])
    check("dx", got["dx"], dx, BWD_TOL)
    for j in range(6):
        check(f"d{ref.MIX_NAMES[j]}", got[f"dm{j}"], dmix[j], BWD_TOL)


# ------------------------------------------------------------------------------------------------
# 2. activations
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("n", [R * 32, R * 64, 1001])
@pytest.mark.parametrize("kind", ["tanh", "sigmoid"])
def test_activations(runner, kind, n, inplace):
    rng = np.random.default_rng(300 + n)
    fwd_b = getattr(tm, f"{kind}_forward")
    bwd_b = getattr(tm, f"{kind}_backward")
    fwd_r = getattr(ref, f"ref_{kind}_forward")
    bwd_r = getattr(ref, f"ref_{kind}_backward")
    bf = Bufs(runner)
    bf.add("pre", rand(rng, (n,), 2.0))
    bf.add("act", np.asarray(fwd_r(bf.x64("pre")), np.float32))       # backward input
    bf.add("dact", rand(rng, (n,)))
    if inplace:
        ops = fwd_b(bf["pre"], bf["pre"], n) + bwd_b(bf["act"], bf["dact"], bf["dact"], n)
        got = run_twice(bf, ops, ["pre", "dact"])
        y, dpre = got["pre"], got["dact"]
    else:
        bf.nan("y", (n,))
        bf.nan("dpre", (n,))
        ops = fwd_b(bf["pre"], bf["y"], n) + bwd_b(bf["act"], bf["dact"], bf["dpre"], n)
        got = run_twice(bf, ops, ["y", "dpre"])
        y, dpre = got["y"], got["dpre"]
    check(f"{kind}", y, fwd_r(bf.x64("pre")), FWD_TOL)
    check(f"d{kind}", dpre, bwd_r(bf.x64("act"), bf.x64("dact")), BWD_TOL)


# ------------------------------------------------------------------------------------------------
# 3. prep
# ------------------------------------------------------------------------------------------------
def _prep_inputs(bf: Bufs, rng, C: int, layer: int) -> None:
    bf.add("k", rand(rng, (R, C)))
    bf.add("v", rand(rng, (R, C)))
    bf.add("wl", rand(rng, (R, C)))
    bf.add("al", rand(rng, (R, C)))
    bf.add("w0", unif(rng, (C,), -6.0, 1.5))
    bf.add("a0", unif(rng, (C,), -1.0, 1.0))
    bf.add("k_k", unif(rng, (C,), 0.5, 0.9))
    bf.add("k_a", unif(rng, (C,), 0.8, 1.2))
    if layer > 0:
        bf.add("vl", rand(rng, (R, C)))
        bf.add("vf", rand(rng, (R, C)))
        bf.add("v0", unif(rng, (C,), -1.0, 1.0))


def _prep_ref_args(bf: Bufs, layer: int) -> dict:
    A = {n: bf.x64(n) for n in ("k", "v", "wl", "al", "w0", "a0", "k_k", "k_a")}
    for n in ("vl", "vf", "v0"):
        A[n] = bf.x64(n) if layer > 0 else None
    return A


@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_prep_forward(runner, C, N, rpt, layer):
    rng = np.random.default_rng(400 + C + layer)
    bf = Bufs(runner)
    _prep_inputs(bf, rng, C, layer)
    if layer == 0:
        bf.nan("vf", (R, C))
    for n in ("decay", "kp", "wa", "wb") + (("vp",) if layer > 0 else ()):
        bf.nan(n, (R, C))
    g = bf.buf.get
    ops = tm.prep_forward(bf["k"], bf["v"], bf["wl"], bf["al"], g("vl"), bf["vf"],
                          bf["w0"], bf["a0"], g("v0"), bf["k_k"], bf["k_a"],
                          bf["decay"], bf["kp"], g("vp"), bf["wa"], bf["wb"], R, C, N, layer,
                          rows_per_tile=rpt)
    outs = ["decay", "kp", "wa", "wb", "vf"] + (["vp"] if layer > 0 else [])
    got = run_twice(bf, ops, outs)
    want = ref.ref_prep_forward(**_prep_ref_args(bf, layer), N=N, layer=layer)
    for n in ("decay", "kp", "wa", "wb"):
        check(n, got[n], want[n], FWD_TOL)
    if layer > 0:
        check("vp", got["vp"], want["vp"], FWD_TOL)
        assert np.array_equal(got["vf"], bf.init["vf"]), "v_first must stay untouched for layer > 0"
    else:
        assert np.array_equal(got["vf"], bf.init["v"]), "layer 0 must write v_first = v exactly"


@pytest.mark.parametrize("vf_acc", [False, True])
@pytest.mark.parametrize("extras", [False, True])
@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_prep_backward(runner, C, N, rpt, layer, extras, vf_acc):
    """extras: bonus-term grads dkp2/dvp2/dr2 given (else 0), dr_out = dr (in place, as the model
    does). vf_acc: layer > 0 accumulates into
    dv_first (else writes it); layer 0 reads dv_first (vf_acc) or gets none (pointer 0)."""
    rng = np.random.default_rng(500 + C + 7 * layer + 3 * extras + vf_acc)
    bf = Bufs(runner)
    _prep_inputs(bf, rng, C, layer)
    for n in ("dd", "dkp", "dvp", "dwa", "dwb", "dr"):
        bf.add(n, rand(rng, (R, C)))
    if extras:
        for n in ("dkp2", "dvp2", "dr2"):
            bf.add(n, rand(rng, (R, C)))
    if vf_acc:
        bf.add("dvf", rand(rng, (R, C)))
    elif layer > 0:
        bf.nan("dvf", (R, C))
    outs = ["dk", "dv", "dwl", "dal"] + (["dvl"] if layer > 0 else [])
    for n in outs:
        bf.nan(n, (R, C))
    pnames = ["dw0", "da0", "dk_k", "dk_a"] + (["dv0"] if layer > 0 else [])
    for n in pnames:
        bf.nan(n, (C,))
    scratch(bf, C, N, rpt)
    g = bf.buf.get
    ops = tm.prep_backward(bf["k"], bf["v"], bf["wl"], bf["al"], g("vl"), g("vf"),
                           bf["w0"], bf["a0"], g("v0"), bf["k_k"], bf["k_a"],
                           bf["dd"], bf["dkp"], bf["dvp"], bf["dwa"], bf["dwb"],
                           g("dkp2"), g("dvp2"), bf["dr"], g("dr2"), bf["dr"] if extras else None,
                           bf["dk"], bf["dv"], bf["dwl"], bf["dal"], g("dvl"), g("dvf"),
                           bf["partials"], [bf[n] for n in pnames], R, C, N, layer,
                           vf_accumulate=vf_acc, rows_per_tile=rpt)
    all_outs = outs + pnames + (["dr"] if extras else []) + (["dvf"] if "dvf" in bf.init else [])
    got = run_twice(bf, ops, all_outs)

    dkp, dvp = bf.x64("dkp"), bf.x64("dvp")
    if extras:
        dkp = dkp + bf.x64("dkp2")
        dvp = dvp + bf.x64("dvp2")
    dvf_in = bf.x64("dvf") if (layer == 0 and vf_acc) else None
    want = ref.ref_prep_backward(**_prep_ref_args(bf, layer), N=N, layer=layer, d_decay=bf.x64("dd"),
                                 dkp=dkp, dvp=dvp, dwa=bf.x64("dwa"), dwb=bf.x64("dwb"), dvf_in=dvf_in)
    for n in outs:
        check(n, got[n], want[n], BWD_TOL)
    for n in pnames:
        check(n, got[n], want[n], BWD_TOL)
    if extras:
        check("dr (+= dr2, in place)", got["dr"], bf.x64("dr") + bf.x64("dr2"), FWD_TOL)
    if layer > 0:
        dvf = want["dvf"] + (bf.x64("dvf") if vf_acc else 0.0)
        check("dv_first", got["dvf"], dvf, BWD_TOL)
    elif vf_acc:
        assert np.array_equal(got["dvf"], bf.init["dvf"]), "layer 0 must only read dv_first"


# ------------------------------------------------------------------------------------------------
# 4. GroupNorm + bonus + gate
# ------------------------------------------------------------------------------------------------
def _gn_inputs(bf: Bufs, rng, C: int) -> None:
    bf.add("y", rand(rng, (R, C), 0.7, 0.2))
    bf.add("r", rand(rng, (R, C)))
    bf.add("kp", rand(rng, (R, C)))
    bf.add("vp", rand(rng, (R, C)))
    bf.add("g", rand(rng, (R, C)))
    bf.add("ln_w", unif(rng, (C,), 0.5, 1.5))
    bf.add("ln_b", rand(rng, (C,), 0.1))
    bf.add("r_k", rand(rng, (C,), 0.3))


_GN_NAMES = ("y", "r", "kp", "vp", "g", "ln_w", "ln_b", "r_k")


@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_gn_forward(runner, C, N, rpt):
    rng = np.random.default_rng(600 + C)
    bf = Bufs(runner)
    _gn_inputs(bf, rng, C)
    bf.nan("z", (R, C))
    ops = tm.gn_forward(*[bf[n] for n in _GN_NAMES], bf["z"], R, C, N, rows_per_tile=rpt)
    got = run_twice(bf, ops, ["z"])
    check("z", got["z"], ref.ref_gn_forward(*[bf.x64(n) for n in _GN_NAMES], N), FWD_TOL)


@pytest.mark.parametrize("rpt", RPTS)
@pytest.mark.parametrize("C,N", CONFIGS, ids=CFG_IDS)
def test_gn_backward(runner, C, N, rpt):
    rng = np.random.default_rng(700 + C)
    bf = Bufs(runner)
    _gn_inputs(bf, rng, C)
    bf.add("dz", rand(rng, (R, C)))
    outs = ["dy", "dg", "dr2", "dkp2", "dvp2"]
    for n in outs:
        bf.nan(n, (R, C))
    pnames = ["dln_w", "dln_b", "dr_k"]
    for n in pnames:
        bf.nan(n, (C,))
    scratch(bf, C, N, rpt)
    ops = tm.gn_backward(*[bf[n] for n in _GN_NAMES[:5]], bf["dz"], *[bf[n] for n in _GN_NAMES[5:]],
                         *[bf[n] for n in outs], bf["partials"], [bf[n] for n in pnames], R, C, N,
                         rows_per_tile=rpt)
    got = run_twice(bf, ops, outs + pnames)
    want = ref.ref_gn_backward(*[bf.x64(n) for n in _GN_NAMES], N, bf.x64("dz"))
    key = dict(dy="dy", dg="dg", dr2="dr", dkp2="dkp", dvp2="dvp", dln_w="dln_w", dln_b="dln_b", dr_k="dr_k")
    for n in outs + pnames:
        check(n, got[n], want[key[n]], BWD_TOL)


# ------------------------------------------------------------------------------------------------
# 5. the fixed-order column reduction on its own, accumulating into existing gradients
# ------------------------------------------------------------------------------------------------
def test_reduce_partials_accumulate(runner):
    rng = np.random.default_rng(800)
    C, Pp = 40, 37
    bf = Bufs(runner)
    bf.add("partials", rand(rng, (Pp, 3, C)))
    for j in range(3):
        bf.add(f"o{j}", rand(rng, (C,)))
    ops = tm.reduce_partials(bf["partials"], Pp, C, [bf[f"o{j}"] for j in range(3)], accumulate=True)
    got = run_twice(bf, ops, [f"o{j}" for j in range(3)])
    for j in range(3):
        check(f"o{j}", got[f"o{j}"], bf.x64(f"o{j}") + bf.x64("partials")[:, j].sum(0), FWD_TOL)
