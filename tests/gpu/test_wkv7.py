"""GPU tests of rwkvx/cu/wkv7.cu through rwkvx.ops.wkv7, against the twins rwkvx.oracle.wkv7_forward /
wkv7_backward, in fp32 and bf16 (harness.KernelCase: fresh inputs, poisoned outputs and scratch, two
bit-identical runs).

Inputs are realistic: r, k, v ~ 0.5 N(0,1); kk unit-norm per head, a = -kk, b = kk * a_rate with a_rate
in (0,1); w = exp(-e^-0.5 * sigmoid(z)), z ~ N(0,1) (``slow``: z - 4, decays near 1, long memory).
fp32 limits: y 1e-5, gradients 1e-4."""
from __future__ import annotations

import numpy as np
import pytest

from harness import KernelCase, check, tolerance
from rwkvx.config import DECAY_SCALE
from rwkvx.oracle import wkv7_backward, wkv7_forward
from rwkvx.ops import wkv7 as W
from rwkvx.runtime import DevPtr
from rwkvx.runtime.device import H200

FWD_TOL = 1e-5
BWD_TOL = 1e-4
GRADS = ("dr", "dw", "dk", "dv", "da", "db")


def make_inputs(B, T, H, N, rng, slow=False):
    sig = lambda z: 1.0 / (1.0 + np.exp(-z))     # noqa: E731
    shp = (B, T, H, N)
    kk = rng.standard_normal(shp)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a_rate = sig(rng.standard_normal(shp))
    w = np.exp(-DECAY_SCALE * sig(rng.standard_normal(shp) + (-4.0 if slow else 0.0)))
    x = dict(r=0.5 * rng.standard_normal(shp), w=w, k=0.5 * rng.standard_normal(shp),
             v=0.5 * rng.standard_normal(shp), a=-kk, b=kk * a_rate)
    return x, rng.standard_normal(shp)


def run_case(case, dev, B, T, H, N, fsplit=None, bsplit=None, slow=False, heads=None):
    """Forward + backward of one case; ``heads`` limits the twin check to (sequence 0, those heads)."""
    x, dy = make_inputs(B, T, H, N, np.random.default_rng(), slow)
    shp = (B, T, H, N)
    inp = {n: case.input(n, x[n]) for n in "rwkvab"}
    pdy = case.input("dy", dy)
    P = W.backward_split(B, H, N, dev.info) if bsplit is None else bsplit
    sizes = W.scratch_elems(B, T, H, N, dev.info, split=P)
    y, ckpt = case.output("y", shp), case.output("ckpt", sizes["ckpt"], "f32")
    slab = case.scratch("slab", sizes["slab"])
    part = case.scratch("partials", sizes["partials"]) if sizes["partials"] else None
    outs = {n: case.output(n, shp) for n in GRADS}
    ops = W.forward(*inp.values(), y, ckpt, B, T, H, N, dev.info, split=fsplit)
    ops += W.backward(*inp.values(), pdy, ckpt, slab, *(outs[n] for n in GRADS), B, T, H, N, dev.info,
                      partials=part, split=P)
    out = case.run(ops)
    nC = W.n_chunks(T)
    ck = out["ckpt"].reshape(B, H, nC, N, N)
    assert case.untouched("ckpt", ck[:, :, 0]), "ckpt slot 0 must never be written"
    assert np.isfinite(ck[:, :, 1:]).all(), "ckpt slots >= 1 must all be written"
    sel = (slice(None),) if heads is None else (slice(0, 1), slice(None), slice(0, heads))
    seen = {n: np.ascontiguousarray(case.seen[n][sel]) for n in (*"rwkvab", "dy")}
    args = tuple(seen[n] for n in "rwkvab")
    errs = {"y": check("y", out["y"][sel], wkv7_forward(*args), tolerance(case.xtype, FWD_TOL))}
    for n, g in zip(GRADS, wkv7_backward(*args, seen["dy"])):
        errs[n] = check(f"{n} (P={P})", out[n][sel], g, tolerance(case.xtype, BWD_TOL))
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
    x, _ = make_inputs(B, T, H, N, np.random.default_rng())
    runs = []
    for fs in W._forward_splits(N):
        case = KernelCase(dev, xtype)
        inp = {n: case.input(n, x[n]) for n in "rwkvab"}
        y, ck = case.output("y", (B, T, H, N)), case.output("ckpt", W.scratch_elems(B, T, H, N, dev.info)["ckpt"], "f32")
        runs.append(case.run(W.forward(*inp.values(), y, ck, B, T, H, N, dev.info, split=fs)))
    for fs, out in zip(W._forward_splits(N)[1:], runs[1:]):
        for name in ("y", "ckpt"):
            assert np.array_equal(out[name], runs[0][name], equal_nan=True), f"{name} differs for split {fs}"
    for fs, bs in zip(W._forward_splits(N), W._backward_splits(N) * 4):
        run_case(KernelCase(dev, xtype), dev, B, T, H, N, fsplit=fs, bsplit=bs)


def test_wkv7_slow_decay_long(case, dev):
    """Decays close to 1 (long memory, large states) over T = 1024."""
    run_case(case, dev, 1, 1024, 2, 64, slow=True)


@pytest.mark.parametrize("B,T", [(8, 4096), (1, 16384)])
def test_wkv7_model_shapes(case, dev, B, T):
    """The 0.22B config's shapes (H=12, N=64): sequence 0, heads 0-1 against the twin (float64 states of
    the full sequence), the error growth printed."""
    _, errs = run_case(case, dev, B, T, 12, 64, heads=2)
    print(f"\nwkv7 {case.xtype} B={B} T={T}: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()))


def test_wkv7_builders_validate():
    """Launch-builder checks (no GPU needed, but lives here with the kernel tests)."""
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    with pytest.raises(ValueError):
        W.forward(*[p()] * 8, 1, 10, 1, 48, H200)                                  # unsupported N
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, DevPtr(8, "f32"), 1, 10, 1, 64, H200)                # misaligned ckpt
    with pytest.raises(ValueError):
        W.backward(*[p()] * 15, 1, 10, 1, 128, H200, split=1)                      # N=128 needs P >= 2
    with pytest.raises(ValueError):
        W.backward(*[p()] * 15, 1, 10, 1, 64, H200, split=2)                       # P > 1 needs partials
    ops = W.backward(*[p()] * 15, 1, 10, 1, 64, H200, partials=p(2), split=4)
    assert [o.name for o in ops] == ["wkv7_backward", "wkv7_backward_reduce"]
    assert ops[0].block == (64, 1, 1) and ops[0].grid == (4, 1, 1)
    assert W.scratch_elems(8, 4096, 12, 64, H200) == {"ckpt": 8 * 12 * 256 * 64 * 64,
                                                       "slab": 8 * 12 * 16 * 64 * 64, "partials": 0}
