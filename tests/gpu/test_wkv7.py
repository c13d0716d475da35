"""GPU tests of rwkvx/cu/wkv7/sequential.cu through rwkvx.cu.wkv7, against the twins rwkvx.oracle.wkv7_forward /
wkv7_backward, in fp32 and bf16 (harness.KernelCase: fresh inputs, poisoned outputs and scratch, two
bit-identical runs).

Inputs are realistic: r, k, v ~ 0.5 N(0,1); kk unit-norm per head, a = -kk, b = kk * a_rate with a_rate
in (0,1); w = exp(-e^-0.5 * sigmoid(z + shift)), z ~ N(0,1): shift 0 by default, -4 for decays near 1
(long memory, large states), +8 for decays at the clamp's lower end exp(-e^-0.5) (the backward's
step-back amplifies rounding most there). fp32 limits: y 1e-5, gradients 1e-4. The chunked method
(tensor cores, tf32 products) is held to 5e-3 with fp32 inputs (docs/SPEC.md's TF32 kernel limit) and to SPEC's
bf16 limit with bf16 inputs; chunked_exact (3xTF32, the fp32 precision's path) to the fp32 kernel limit
1e-5 for y and every gradient. With an initial state s0 (shared by the batch, as state tuning trains it)
its gradient ds0, summed over the sequences, is held to the gradients' limit. The chunked state passes'
segmented scan (small B*H) is held to the same limits against the twin and against the one walk, and
gives the same bits at every row split."""
from __future__ import annotations

import numpy as np
import pytest

from harness import KernelCase, check, tolerance
from rwkvx.config import DECAY_SCALE
from rwkvx.oracle import wkv7_backward, wkv7_forward
from rwkvx.cu.wkv7 import ops as W

from seeding import seeded_rng

TOLS = {"sequential": (1e-5, 1e-4), "chunked": (5e-3, 5e-3), "chunked_exact": (1e-5, 1e-5)}  # (y, grads), fp32 inputs
GRADS = ("dr", "dw", "dk", "dv", "da", "db")
F32_GRADS = GRADS[1:]          # f32 in every precision (rwkvx/cu/wkv7/ops.py)


SLOW, FAST = -4.0, 8.0           # decay shifts: w near 1, w near its lower end


def make_inputs(B, T, H, N, rng, shift=0.0):
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))     # noqa: E731
    shp = (B, T, H, N)
    kk = rng.standard_normal(shp)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a_rate = sig(rng.standard_normal(shp))
    w = np.exp(-DECAY_SCALE * sig(rng.standard_normal(shp) + shift))
    x = dict(r=0.5 * rng.standard_normal(shp), w=w, k=0.5 * rng.standard_normal(shp),
             v=0.5 * rng.standard_normal(shp), a=-kk, b=kk * a_rate)
    return x, rng.standard_normal(shp)


def initial_state(H, N, rng) -> np.ndarray:
    """A state before t = 0, [1, H, N, N] (shared by the sequences): entries of a state's size."""
    return 0.5 * rng.standard_normal((1, H, N, N))


def wkv_inputs(case, x: dict) -> dict:
    """The device buffers of r, w, k, v, a, b: the decay w f32 in every precision, the rest floatX."""
    return {n: case.input(n, x[n], "f32" if n == "w" else "x") for n in "rwkvab"}


def run_case(case, dev, B, T, H, N, fsplit=None, bsplit=None, shift=0.0, heads=None, method="sequential",
             state=False, segments=None, seed=None):
    """Forward + backward of one case; ``heads`` limits the twin check to (sequence 0, those heads);
    ``state``: from a random initial state, its gradient ds0 checked too; ``segments``: the chunked state
    passes' (None: chosen); ``seed``: the inputs' (None: fresh)."""
    assert not (state and heads), "ds0 sums over every sequence: check all of them"
    rng = seeded_rng(seed)
    x, dy = make_inputs(B, T, H, N, rng, shift)
    shp = (B, T, H, N)
    inp = wkv_inputs(case, x)
    pdy = case.input("dy", dy)
    chunked = method in W.CHUNKED_METHODS
    if bsplit is None:
        bsplit = W.chunked_split(B, H, N, dev.info) if chunked else W.backward_split(B, H, N, dev.info)
    P = bsplit
    sizes = W.scratch_elems(B, T, H, N, dev.info, split=None if chunked else P, method=method, ds0=state,
                            segments=segments)
    fwd_state, bwd_state = {}, {}
    if state:
        s0 = case.input("s0", initial_state(H, N, rng), "f32")
        fwd_state = dict(s0=s0)
        bwd_state = dict(s0=s0, ds0=case.output("ds0", (1, H, N, N), "f32"),
                         ds0_partials=case.scratch("ds0_partials", sizes["ds0_partials"]) if B > 1 else None)
    y = case.output("y", shp)
    sa, ckpt = case.output("sa", sizes["sa"], "f32"), case.output("ckpt", sizes["ckpt"], "f32")
    part = case.scratch("partials", sizes["partials"]) if sizes["partials"] else None
    outs = {n: case.output(n, shp, "f32" if n in F32_GRADS else "x") for n in GRADS}
    extra = dict(method=method, partials=part, segments=segments) if chunked else {}
    ops = W.forward(*inp.values(), y, B, T, H, N, dev.info, sa=sa, ckpt=ckpt, split=fsplit, **extra, **fwd_state)
    ops += W.backward(*inp.values(), pdy, sa, ckpt, *(outs[n] for n in GRADS), B, T, H, N, dev.info,
                      partials=part, split=P, **({"method": method, "segments": segments} if chunked else {}),
                      **bwd_state)
    out = case.run(ops)
    sel = (slice(None),) if heads is None else (slice(0, 1), slice(None), slice(0, heads))
    seen = {n: np.ascontiguousarray(case.seen[n][sel]) for n in (*"rwkvab", "dy")}
    args = tuple(seen[n] for n in "rwkvab")
    s0 = {"state": case.seen["s0"]} if state else {}
    fwd_tol, bwd_tol = TOLS[method]
    errs = {"y": check("y", out["y"][sel], wkv7_forward(*args, **s0), tolerance(case.xtype, fwd_tol))}
    twin = wkv7_backward(*args, seen["dy"], **s0)
    if state:
        errs["ds0"] = check(f"ds0 (B={B})", out["ds0"], twin[-1], tolerance(case.xtype, bwd_tol))
    for n, g in zip(GRADS, twin):
        if T == 1 and n == "dw" and not state:   # dw_0 = 0 exactly (S_{-1} = 0): no relative error
            assert not out[n][sel].any(), "dw of the first token must be 0"
            continue
        errs[n] = check(f"{n} (P={P})", out[n][sel], g, tolerance(case.xtype, bwd_tol))
    return out, errs


SHAPES = [  # (B, T, H, N)
    (1, 1, 2, 64), (2, 15, 2, 64), (2, 16, 2, 64), (2, 17, 2, 64), (2, 100, 3, 64), (1, 1024, 2, 64),
    (3, 100, 2, 64), (3, 100, 2, 8), (3, 100, 2, 32), (3, 33, 2, 32), (2, 37, 3, 4), (2, 37, 2, 16),
    (2, 100, 2, 128), (1, 17, 1, 128), (8, 64, 12, 64),
]


@pytest.mark.parametrize("B,T,H,N", SHAPES, ids=[f"B{b}-T{t}-H{h}-N{n}" for b, t, h, n in SHAPES])
def test_wkv7_default_splits(case, dev, B, T, H, N):
    run_case(case, dev, B, T, H, N)


@pytest.mark.parametrize("N", [8, 16, 32, 64, 128])
def test_wkv7_all_splits(dev, xtype, N):
    """Every forward row split gives y and ckpt bit-identical to the others; every backward split is right."""
    B, T, H = 2, 75, 2
    x, _ = make_inputs(B, T, H, N, seeded_rng())
    runs = []
    for fs in W._forward_splits(N):
        case = KernelCase(dev, xtype)
        inp = wkv_inputs(case, x)
        sizes = W.scratch_elems(B, T, H, N, dev.info)
        y = case.output("y", (B, T, H, N))
        sa, ck = case.output("sa", sizes["sa"], "f32"), case.output("ckpt", sizes["ckpt"], "f32")
        runs.append(case.run(W.forward(*inp.values(), y, B, T, H, N, dev.info, sa=sa, ckpt=ck, split=fs)))
    for fs, out in zip(W._forward_splits(N)[1:], runs[1:]):
        for name in ("y", "sa", "ckpt"):
            assert np.array_equal(out[name], runs[0][name], equal_nan=True), f"{name} differs for split {fs}"
    for fs, bs in zip(W._forward_splits(N), W._backward_splits(N) * 4):
        run_case(KernelCase(dev, xtype), dev, B, T, H, N, fsplit=fs, bsplit=bs)


@pytest.mark.parametrize("shift", [SLOW, FAST], ids=["slow", "fast"])
@pytest.mark.parametrize("N", [32, 64, 128])
def test_wkv7_decay_extremes_long(case, dev, shift, N):
    """Decays close to 1 (long memory, large states) and at the lower end of the clamp (the step-back's
    worst case) over T = 1024."""
    run_case(case, dev, 1, 1024, 2, N, shift=shift)


def test_wkv7_forward_saves_only_when_asked(case, dev):
    """The inference forward (no sa/ckpt) gives the same y bit for bit; the saving forward writes every
    checkpoint slot and sa equal to the twin's S_{t-1} a_t (checked through the last slot: the final
    state, whose y_t = S_t r_t)."""
    B, T, H, N = 2, 21, 2, 32
    x, _ = make_inputs(B, T, H, N, seeded_rng())
    inp = wkv_inputs(case, x)
    sizes = W.scratch_elems(B, T, H, N, dev.info)
    y0, y1 = case.output("y0", (B, T, H, N)), case.output("y1", (B, T, H, N))
    sa, ck = case.output("sa", sizes["sa"], "f32"), case.output("ckpt", sizes["ckpt"], "f32")
    ops = W.forward(*inp.values(), y0, B, T, H, N, dev.info)
    ops += W.forward(*inp.values(), y1, B, T, H, N, dev.info, sa=sa, ckpt=ck)
    out = case.run(ops)
    assert np.array_equal(out["y0"], out["y1"])
    assert np.isfinite(out["ckpt"]).all() and np.isfinite(out["sa"]).all()
    seen = {n: case.seen[n].astype(np.float64) for n in "rwkvab"}
    last = out["ckpt"].reshape(B, H, W.n_chunks(T), N, N)[:, :, -1]           # S_{T-1} [B, H, N, N]
    y_last = np.einsum("bhij,bhj->bhi", last, seen["r"][:, -1])
    check("y(T-1) from the last checkpoint", y_last, wkv7_forward(*seen.values())[:, -1], 1e-5)
    # sa_0 = 0 (S_{-1} = 0); sa_1 = (v_0 k_0^T) a_1 = v_0 (k_0 . a_1)
    sa_t = out["sa"].reshape(B, T, H, N)
    assert not sa_t[:, 0].any()
    check("sa_1", sa_t[:, 1], seen["v"][:, 0] * (seen["k"][:, 0] * seen["a"][:, 1]).sum(-1, keepdims=True),
          1e-5)


@pytest.mark.parametrize("B,T", [(8, 4096), (1, 16384)])
def test_wkv7_model_shapes(case, dev, B, T):
    """The 0.22B config's shapes (H=12, N=64): sequence 0, heads 0-1 against the twin (float64 states of
    the full sequence), the error growth printed."""
    _, errs = run_case(case, dev, B, T, 12, 64, heads=2)
    print(f"\nwkv7 {case.xtype} B={B} T={T}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))



# ------------------------------------------------------------------------------------------------ chunked
CHUNKED_SHAPES = [  # (B, T, H, N): B*H from 1x1 to 8x12, T = 1, < 16, 16 + 1, long
    (1, 1, 1, 64), (2, 3, 2, 64), (1, 15, 1, 64), (2, 16, 1, 64), (1, 17, 2, 64), (3, 100, 2, 64), (2, 37, 3, 32),
    (1, 1024, 1, 64), (1, 4096, 2, 64), (8, 64, 12, 64), (8, 33, 12, 32),
]


@pytest.mark.parametrize("B,T,H,N", CHUNKED_SHAPES, ids=[f"B{b}-T{t}-H{h}-N{n}" for b, t, h, n in CHUNKED_SHAPES])
def test_wkv7_chunked(case, dev, B, T, H, N):
    run_case(case, dev, B, T, H, N, method="chunked")


@pytest.mark.parametrize("shift", [SLOW, FAST], ids=["slow", "fast"])
@pytest.mark.parametrize("N", [32, 64])
def test_wkv7_chunked_decay_extremes(case, dev, shift, N):
    """Decays near 1 (large states) and at the clamp's lower end (1/cw up to 1.6e4 inside a chunk)."""
    run_case(case, dev, 2, 1000, 2, N, shift=shift, method="chunked")


@pytest.mark.parametrize("key_warps", W.KEY_WARPS)
@pytest.mark.parametrize("B,T,H,N", [(2, 75, 3, 64), (8, 64, 12, 64), (2, 37, 3, 32)])
def test_wkv7_chunked_key_warps(case, dev, monkeypatch, key_warps, B, T, H, N):
    """Each state-pass group shape (one warp per 8 state rows, or two each with half the keys) whatever
    chunked_key_warps would choose for the grid."""
    monkeypatch.setattr(W, "chunked_key_warps", lambda *_: key_warps)
    run_case(case, dev, B, T, H, N, method="chunked")


def chunked_run(dev, xtype, method, inputs, split=None, kept_records=False, segments=None) -> dict:
    """Forward + backward of a chunked method on ``inputs`` (make_inputs' pair, B, T, H, N = the shapes')
    at state-pass row split ``split`` and ``segments``, the backward's records kept by the forward or
    computed by itself."""
    x, dy = inputs
    shp = x["r"].shape
    B, T, H, N = shp
    case = KernelCase(dev, xtype)
    inp = wkv_inputs(case, x)
    sizes = W.scratch_elems(B, T, H, N, dev.info, method=method, kept_records=kept_records, segments=segments)
    y = case.output("y", shp)
    sa, ck = case.output("sa", sizes["sa"], "f32"), case.output("ckpt", sizes["ckpt"], "f32")
    part = case.scratch("partials", sizes["partials"])
    rec = case.scratch("records", sizes["records"]) if kept_records else None
    outs = [case.output(n, shp, "f32" if n in F32_GRADS else "x") for n in GRADS]
    ops = W.forward(*inp.values(), y, B, T, H, N, dev.info, sa=sa, ckpt=ck, split=split, method=method,
                    partials=part, records=rec, segments=segments)
    ops += W.backward(*inp.values(), case.input("dy", dy), sa, ck, *outs, B, T, H, N, dev.info, partials=part,
                      split=split, method=method, records=rec, segments=segments)
    return case.run(ops)


@pytest.mark.parametrize("key_warps", W.KEY_WARPS)
@pytest.mark.parametrize("N", [32, 64])
@pytest.mark.parametrize("xtype, method", [("f32", "chunked"), ("bf16", "chunked"), ("f32", "chunked_exact")])
def test_wkv7_chunked_all_splits(dev, monkeypatch, xtype, method, N, key_warps):
    """Every state-pass row split gives the same y, sa, ckpt and gradients bit for bit (at one group shape:
    the two sum the products over the keys in different orders)."""
    monkeypatch.setattr(W, "chunked_key_warps", lambda *_: key_warps)
    inputs = make_inputs(2, 75, 2, N, seeded_rng())
    runs = [chunked_run(dev, xtype, method, inputs, split=P) for P in W._chunked_splits(N)]
    for P, out in zip(W._chunked_splits(N)[1:], runs[1:]):
        for name in ("y", "sa", "ckpt", *GRADS):
            assert np.array_equal(out[name], runs[0][name], equal_nan=True), f"{name} differs for split {P}"


@pytest.mark.parametrize("N", [32, 64])
@pytest.mark.parametrize("xtype, method", [("f32", "chunked"), ("bf16", "chunked"), ("f32", "chunked_exact")])
def test_wkv7_chunked_kept_records(dev, xtype, method, N):
    """A forward that keeps the backward's chunk records (intra mode 2, the recompute's forward) gives the
    same y, sa, ckpt and gradients bit for bit as a backward that computes its records itself."""
    inputs = make_inputs(2, 75, 2, N, seeded_rng())
    runs = [chunked_run(dev, xtype, method, inputs, kept_records=kept) for kept in (False, True)]
    for name in ("y", "sa", "ckpt", *GRADS):
        assert np.array_equal(runs[1][name], runs[0][name], equal_nan=True), f"{name} differs with kept records"


def test_wkv7_chunked_inference_forward(case, dev):
    """Without sa/ckpt the chunked forward gives the same y bit for bit; ckpt slot c is the state
    entering chunk c (checked through y of the chunk's first token)."""
    B, T, H, N = 2, 40, 2, 64
    x, _ = make_inputs(B, T, H, N, seeded_rng())
    inp = wkv_inputs(case, x)
    sizes = W.scratch_elems(B, T, H, N, dev.info, method="chunked")
    y0, y1 = case.output("y0", (B, T, H, N)), case.output("y1", (B, T, H, N))
    sa, ck = case.output("sa", sizes["sa"], "f32"), case.output("ckpt", sizes["ckpt"], "f32")
    part = case.scratch("partials", sizes["partials"])
    ops = W.forward(*inp.values(), y0, B, T, H, N, dev.info, method="chunked", partials=part)
    ops += W.forward(*inp.values(), y1, B, T, H, N, dev.info, sa=sa, ckpt=ck, method="chunked", partials=part)
    out = case.run(ops)
    assert np.array_equal(out["y0"], out["y1"])
    seen = {n: case.seen[n] for n in "rwkvab"}
    S0 = out["ckpt"].reshape(B, H, W.n_chunks(T, "chunked"), N, N)
    assert not S0[:, :, 0].any()
    c = 2                                                   # chunk 2 starts at token 32
    t = c * W.CHUNKED_L
    S = S0[:, :, c]
    sa_t = np.einsum("bhij,bhj->bhi", S, seen["a"][:, t])
    check("sa from ckpt", out["sa"].reshape(B, T, H, N)[:, t], sa_t, 5e-3)
    S1 = (S * seen["w"][:, t][:, :, None, :] + sa_t[..., None] * seen["b"][:, t][:, :, None, :]
          + seen["v"][:, t][..., None] * seen["k"][:, t][:, :, None, :])
    check("y from ckpt", out["y1"][:, t], np.einsum("bhij,bhj->bhi", S1, seen["r"][:, t]),
          tolerance(case.xtype, 5e-3))


@pytest.mark.parametrize("B,T", [(8, 4096), (1, 16384)])
def test_wkv7_chunked_model_shapes(case, dev, B, T):
    """The 0.22B config's shapes (H=12, N=64), sequence 0 heads 0-1 against the twin, errors printed."""
    _, errs = run_case(case, dev, B, T, 12, 64, heads=2, method="chunked")
    print(f"\nwkv7 chunked {case.xtype} B={B} T={T}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))


# ------------------------------------------------------------------------------------------ chunked_exact
@pytest.mark.parametrize("B,T,H,N", CHUNKED_SHAPES, ids=[f"B{b}-T{t}-H{h}-N{n}" for b, t, h, n in CHUNKED_SHAPES])
def test_wkv7_chunked_exact(dev, B, T, H, N):
    """The fp32 precision's chunked path (every product 3xTF32) within the fp32 kernel limit."""
    run_case(KernelCase(dev, "f32"), dev, B, T, H, N, method="chunked_exact")


@pytest.mark.parametrize("key_warps", W.KEY_WARPS)
@pytest.mark.parametrize("shift", [0.0, SLOW, FAST], ids=["mid", "slow", "fast"])
@pytest.mark.parametrize("N", [32, 64])
def test_wkv7_chunked_exact_decays_and_groups(dev, monkeypatch, key_warps, shift, N):
    """Decays at both ends over T = 1000, with each state-pass group shape."""
    monkeypatch.setattr(W, "chunked_key_warps", lambda *_: key_warps)
    run_case(KernelCase(dev, "f32"), dev, 2, 1000, 2, N, shift=shift, method="chunked_exact")


@pytest.mark.parametrize("B,T", [(8, 4096), (1, 16384)])
def test_wkv7_chunked_exact_model_shapes(dev, B, T):
    """The 0.22B config's shapes (H=12, N=64), sequence 0 heads 0-1 against the twin, errors printed."""
    _, errs = run_case(KernelCase(dev, "f32"), dev, B, T, 12, 64, heads=2, method="chunked_exact")
    print(f"\nwkv7 chunked_exact f32 B={B} T={T}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))


# ------------------------------------------------------------------------------------------ initial state
STATE_CASES = [  # (method, B, T, H, N): B = 1 (ds0 written directly) and B > 1 (the batch sum), T = 1,
    # T not a multiple of the chunk, long T, every head size of the method
    ("sequential", 1, 1, 2, 64), ("sequential", 3, 100, 2, 64), ("sequential", 2, 37, 3, 32),
    ("sequential", 2, 75, 2, 128), ("sequential", 1, 1024, 2, 64), ("sequential", 4, 33, 2, 16),
    ("chunked", 1, 1, 1, 64), ("chunked", 3, 100, 2, 64), ("chunked", 2, 37, 3, 32), ("chunked", 8, 33, 12, 64),
    ("chunked", 1, 1024, 2, 64),
]


@pytest.mark.parametrize("method,B,T,H,N", STATE_CASES, ids=[f"{m}-B{b}-T{t}-H{h}-N{n}" for m, b, t, h, n in STATE_CASES])
def test_wkv7_initial_state(case, dev, method, B, T, H, N):
    """From a shared initial state s0: y, every gradient and ds0 (summed over the sequences) against the twin."""
    _, errs = run_case(case, dev, B, T, H, N, method=method, state=True)
    print(f"\nwkv7 {method} {case.xtype} s0 B={B} T={T} N={N}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))


@pytest.mark.parametrize("B,T,H,N", [(1, 1, 1, 64), (3, 100, 2, 64), (2, 37, 3, 32), (8, 33, 12, 64)])
def test_wkv7_chunked_exact_initial_state(dev, B, T, H, N):
    """The fp32 precision's chunked path from an initial state, within the fp32 kernel limit."""
    run_case(KernelCase(dev, "f32"), dev, B, T, H, N, method="chunked_exact", state=True)


# draws of run_case (B = H = T = 1, N = 64, from s0) on which one of r.b, r.k, dy.v cancels: chunked_model's
# emulation of 3xTF32 Gram diagonals (r and b scaled by cw and 1/cw first) put da 5.9e-5 / 3.8e-4 / 3.6e-4,
# dk 1.7e-4, dv 1.3e-4 from the twin there; with the compensated diagonals every gradient <= 3e-6
CANCELLING_SEEDS = [("da", 917), ("da", 1481), ("da", 2958), ("dk", 1078), ("dv", 1789)]


@pytest.mark.parametrize("seed", [s for _, s in CANCELLING_SEEDS], ids=[f"{g}-{s}" for g, s in CANCELLING_SEEDS])
def test_wkv7_chunked_exact_t1_cancelling_dots(dev, seed):
    """T = 1 from s0: dv, da, dk are dy, s0^T dy, r scaled by r.k, r.b, dy.v alone, so each one's relative
    error is that dot's; chunked_exact takes them as compensated dots, within the fp32 kernel limit also
    where their terms cancel."""
    x, dy = make_inputs(1, 1, 1, 64, seeded_rng(seed))      # the draws run_case makes with this seed
    grad = dict((s, g) for g, s in CANCELLING_SEEDS)[seed]
    u, w = {"da": (x["r"], x["b"]), "dk": (dy, x["v"]), "dv": (x["r"], x["k"])}[grad]
    assert abs(np.sum(u * w)) < 1e-2 * np.sum(np.abs(u * w)), "the draw no longer cancels: pick a new seed"
    run_case(KernelCase(dev, "f32"), dev, 1, 1, 1, 64, method="chunked_exact", state=True, seed=seed)


@pytest.mark.parametrize("N", [32, 64, 128])
def test_wkv7_initial_state_splits(dev, xtype, N):
    """The sequential kernels from an initial state at every forward and backward row split (each split's
    rows write their part of ds0)."""
    for fs, bs in zip(W._forward_splits(N), W._backward_splits(N) * 4):
        run_case(KernelCase(dev, xtype), dev, 3, 75, 2, N, fsplit=fs, bsplit=bs, state=True)


@pytest.mark.parametrize("key_warps", W.KEY_WARPS)
@pytest.mark.parametrize("N", [32, 64])
@pytest.mark.parametrize("xtype, method", [("f32", "chunked"), ("bf16", "chunked"), ("f32", "chunked_exact")])
def test_wkv7_chunked_initial_state_groups(dev, monkeypatch, xtype, method, N, key_warps):
    """The chunked state passes from an initial state at every row split and group shape."""
    monkeypatch.setattr(W, "chunked_key_warps", lambda *_: key_warps)
    for P in W._chunked_splits(N):
        run_case(KernelCase(dev, xtype), dev, 3, 75, 2, N, fsplit=P, bsplit=P, method=method, state=True)


@pytest.mark.parametrize("xtype, method", [("f32", "sequential"), ("bf16", "sequential"), ("f32", "chunked"),
                                           ("bf16", "chunked"), ("f32", "chunked_exact")])
def test_wkv7_zero_state_is_stateless(dev, xtype, method):
    """s0 = 0 gives y, the saved state and every gradient bit for bit as without s0; its ds0 matches the twin's."""
    B, T, H, N = 3, 75, 2, 64
    x, dy = make_inputs(B, T, H, N, seeded_rng())
    shp = (B, T, H, N)
    sizes = W.scratch_elems(B, T, H, N, dev.info, method=method, ds0=True)
    runs = []
    for with_state in (False, True):
        case = KernelCase(dev, xtype)
        inp = wkv_inputs(case, x)
        y, sa, ck = case.output("y", shp), case.output("sa", sizes["sa"], "f32"), case.output("ckpt", sizes["ckpt"], "f32")
        part = case.scratch("partials", sizes["partials"]) if sizes["partials"] else None
        outs = [case.output(n, shp, "f32" if n in F32_GRADS else "x") for n in GRADS]
        state = {}
        if with_state:
            s0 = case.input("s0", np.zeros((1, H, N, N)), "f32")
            state = dict(s0=s0, ds0=case.output("ds0", (1, H, N, N), "f32"),
                         ds0_partials=case.scratch("ds0_partials", sizes["ds0_partials"]))
        ops = W.forward(*inp.values(), y, B, T, H, N, dev.info, sa=sa, ckpt=ck, method=method, partials=part,
                        **({"s0": state["s0"]} if with_state else {}))
        ops += W.backward(*inp.values(), case.input("dy", dy), sa, ck, *outs, B, T, H, N, dev.info, partials=part,
                          method=method, **state)
        runs.append(case.run(ops))
    for name in ("y", "sa", "ckpt", *GRADS):
        assert np.array_equal(runs[1][name], runs[0][name], equal_nan=True), f"{name} differs with s0 = 0"
    seen = {n: case.seen[n] for n in (*"rwkvab", "dy")}
    ds0 = wkv7_backward(*(seen[n] for n in "rwkvab"), seen["dy"], state=case.seen["s0"])[-1]
    check("ds0 at s0 = 0", runs[1]["ds0"], ds0, tolerance(xtype, TOLS[method][1]))


# ------------------------------------------------------------------------------------------ segmented scan
SEGMENT_CASES = [  # (B, T, H, N, segments): B*H = 1x1, 1x12, 2x32; T no multiple of the segments; None: the
    # default, which cuts these shapes into segments
    (1, 1000, 1, 64, 3), (1, 1000, 1, 32, 63), (1, 4096, 1, 64, None), (1, 4096, 12, 64, 3),
    (1, 16384, 12, 64, None), (1, 16384, 12, 64, 5), (2, 4096, 32, 64, 5), (2, 4096, 32, 32, None),
    (2, 8192, 32, 64, 7),
]
SEGMENT_IDS = [f"B{b}-T{t}-H{h}-N{n}-S{s or 'chosen'}" for b, t, h, n, s in SEGMENT_CASES]


def _segment_heads(B, T, H):
    """The heads a segmented case checks against the (float64, CPU) twin: all of them up to B*T*H = 12*4096
    tokens of heads, else 2 of sequence 0."""
    return None if B * T * H <= 12 * 4096 else 2


def _check_segments(dev, B, T, H, N, segments):
    """The case cuts its sequences; forced segment counts leave the last segment shorter."""
    m, used = W.segment_layout(T, segments or W.chunked_segments(B, T, H, N, dev.info))
    assert used > 1, "a segmented case must cut its sequences"
    assert segments is None or T % (m * W.CHUNKED_L) != 0


@pytest.mark.parametrize("B,T,H,N,segments", SEGMENT_CASES, ids=SEGMENT_IDS)
def test_wkv7_chunked_segments(case, dev, B, T, H, N, segments):
    """The segmented state passes (summary walk, carry over the segments, walk of every segment; forced
    and chosen segment counts) against the twin; the harness's second run is bit-identical."""
    _check_segments(dev, B, T, H, N, segments)
    _, errs = run_case(case, dev, B, T, H, N, heads=_segment_heads(B, T, H), method="chunked", segments=segments)
    print(f"\nwkv7 chunked {case.xtype} B={B} T={T} H={H} N={N} segments={segments}: "
          + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))


@pytest.mark.parametrize("B,T,H,N,segments", SEGMENT_CASES[:6], ids=SEGMENT_IDS[:6])
def test_wkv7_chunked_exact_segments(dev, B, T, H, N, segments):
    """The fp32 precision's chunked path, segmented, within the fp32 kernel limit."""
    _check_segments(dev, B, T, H, N, segments)
    run_case(KernelCase(dev, "f32"), dev, B, T, H, N, heads=_segment_heads(B, T, H), method="chunked_exact",
             segments=segments)


SEGMENT_STATE_CASES = [(1, 1000, 1, 64, 3), (3, 500, 2, 32, 5), (1, 4096, 12, 64, None)]


@pytest.mark.parametrize("method", W.CHUNKED_METHODS)
@pytest.mark.parametrize("B,T,H,N,segments", SEGMENT_STATE_CASES,
                         ids=[f"B{b}-T{t}-H{h}-N{n}-S{s or 'chosen'}" for b, t, h, n, s in SEGMENT_STATE_CASES])
def test_wkv7_chunked_segments_initial_state(dev, xtype, method, B, T, H, N, segments):
    """Segmented from an initial state: the first segment's walks start from s0, ds0 is the reverse scan's
    exit of segment 0 (summed over the sequences for B > 1)."""
    if method == "chunked_exact" and xtype != "f32":
        pytest.skip("chunked_exact takes f32 inputs only")
    _check_segments(dev, B, T, H, N, segments)
    run_case(KernelCase(dev, xtype), dev, B, T, H, N, method=method, state=True, segments=segments)


@pytest.mark.parametrize("shift", [0.0, SLOW, FAST], ids=["mid", "slow", "fast"])
@pytest.mark.parametrize("xtype, method", [("f32", "chunked"), ("bf16", "chunked"), ("f32", "chunked_exact")])
def test_wkv7_chunked_segments_match_one_walk(dev, xtype, method, shift):
    """Segments (6 of 32 chunks, the last one shorter) against the one walk of the same chunk steps: the
    checkpoints the backward reads, y, sa and every gradient within the method's limits of each other,
    for decays in the middle and near both ends of their range."""
    inputs = make_inputs(1, 3000, 2, 64, seeded_rng(), shift)
    one, seg = (chunked_run(dev, xtype, method, inputs, segments=s) for s in (1, 6))
    fwd_tol, bwd_tol = TOLS[method]
    for name in ("ckpt", "y", "sa", *GRADS):
        check(f"{name} segmented", seg[name], one[name], tolerance(xtype, fwd_tol if name == "y" else bwd_tol))


@pytest.mark.parametrize("N", [32, 64])
@pytest.mark.parametrize("xtype, method", [("f32", "chunked"), ("bf16", "chunked"), ("f32", "chunked_exact")])
def test_wkv7_chunked_segments_all_splits(dev, xtype, method, N):
    """Segmented, every state-pass row split gives the same bits (each state row's walks, transition rows
    included, and its carry over the segments are the same arithmetic whatever block holds it)."""
    inputs = make_inputs(1, 700, 2, N, seeded_rng())
    runs = [chunked_run(dev, xtype, method, inputs, split=P, segments=4) for P in W._chunked_splits(N)]
    for P, out in zip(W._chunked_splits(N)[1:], runs[1:]):
        for name in ("y", "sa", "ckpt", *GRADS):
            assert np.array_equal(out[name], runs[0][name], equal_nan=True), f"{name} differs for split {P}"
