"""GPU tests of rwkvx/cu/moba.cu (via the rwkvx.ops.moba launch builders) against the MoBA oracle.

Each case uploads fresh random q, k, v, do (float32), poisons every output and scratch buffer (NaN bit
pattern 0x7fc00000, which as int32 is a huge positive number), runs forward + backward as one Plan and
compares with the float64 oracle (oracle/_moba.pyx):

1. the selection first: it must equal the oracle's wherever the oracle's gate gap (last selected minus
   first left-out gate) is >= 1e-4; near-ties may differ (the GPU gate is fp32), and the GPU selection
   is then what the oracle is given for everything else;
2. o (relative error <= 1e-5) and lse (<= 1e-5, against a float64 numpy reference);
3. dq, dk, dv (<= 1e-4).

Every case runs twice from re-poisoned buffers; all outputs must be bit-identical (no float atomics).
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from rwkvx.ops import moba

POISON = 0x7FC00000
FWD_TOL = 1e-5
BWD_TOL = 1e-4
GAP = 1e-4


def _oracle():
    for name in ("rwkvx.oracle._moba", "oracle._moba"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("the MoBA oracle extension (rwkvx.oracle._moba) is not built", allow_module_level=True)


om = _oracle()

# id: (B, T, H, N, chunk, top_k, concentrated)
CASES = {
    "sparse-N64": (2, 640, 2, 64, 64, 3, False),           # 10 blocks, 2 of up to 9 past selected
    "target-chunk512": (1, 2048, 2, 64, 512, 3, False),    # the target's chunk / top_k / N, shorter T
    "topk1-N32": (2, 300, 2, 32, 64, 1, False),            # own block only
    "T-not-multiple": (2, 300, 3, 32, 64, 2, False),       # last block partial (300 = 4*64 + 44)
    "B3-chunk32": (3, 256, 2, 64, 32, 4, False),
    "small-N8": (2, 160, 4, 8, 16, 3, False),
    "N4-chunk1": (1, 40, 2, 4, 1, 3, False),               # every token its own block
    "N128": (1, 512, 2, 128, 64, 3, False),
    "N16-chunk100": (1, 333, 2, 16, 100, 2, False),        # chunk not a multiple of any tile
    "dense-all-selected": (1, 192, 2, 64, 64, 3, False),   # T <= chunk*top_k: full causal attention
    "T-le-chunk": (2, 50, 2, 32, 64, 3, False),            # no past block at all
    "large-topk": (1, 256, 2, 32, 16, 9, False),
    "concentrated": (2, 512, 2, 64, 32, 3, True),          # every query selects block 0 (long dk/dv lists)
    "N256": (1, 200, 1, 256, 32, 3, False),
}


# ------------------------------------------------------------------------------------------------
# harness (the device and the plan are reached through these two functions only)
# ------------------------------------------------------------------------------------------------
def _plan(dev, ops):
    from rwkvx.runtime import Plan
    return Plan(dev, ops, precision="fp32")


class Buffers:
    def __init__(self, dev):
        self.dev = dev
        self.buf = {}
        self.shape = {}
        self.dtype = {}
        self.init = {}

    def add(self, name, arr):
        arr = np.ascontiguousarray(arr)
        self.buf[name] = self.dev.alloc(max(arr.nbytes, 256))
        self.shape[name], self.dtype[name], self.init[name] = arr.shape, arr.dtype, arr
        self.dev.upload(self.buf[name], arr)
        return self.buf[name]

    def poisoned(self, name, shape, dtype=np.float32):
        a = np.empty(shape, dtype=dtype)
        a.view(np.uint32)[...] = POISON
        return self.add(name, a)

    def reset(self):
        for name, arr in self.init.items():
            self.dev.upload(self.buf[name], arr)

    def get(self, name):
        self.dev.synchronize()
        return self.dev.download(self.buf[name], self.shape[name], self.dtype[name])


def rel(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def check(name, got, want, tol):
    assert np.all(np.isfinite(got)), f"{name}: {np.count_nonzero(~np.isfinite(got))} non-finite values"
    err = rel(got, want)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def make_inputs(B, T, H, N, chunk, concentrated, seed):
    rng = np.random.default_rng(seed)
    q, k, v, do = (rng.standard_normal((B, T, H, N)) for _ in range(4))
    if concentrated:
        e = np.zeros(N)
        e[0] = 1.0
        q += 6.0 * e
        k[:, :chunk] += 6.0 * e          # block 0's mean key points along q: by far the largest gate
    return [a.astype(np.float32) for a in (q, k, v, do)]


def ref_lse(q, k, sel, chunk):
    """float64 logsumexp of the scaled scores over each query's visible keys, [B, H, T]."""
    B, T, H, N = q.shape
    out = np.empty((B, H, T))
    scale = 1.0 / np.sqrt(N)
    for b in range(B):
        for h in range(H):
            s_all = (q[b, :, h] @ k[b, :, h].T) * scale          # [T, T]
            for t in range(T):
                bt = t // chunk
                idx = [np.arange(j * chunk, (j + 1) * chunk) for j in sel[b, h, t] if j >= 0]
                idx.append(np.arange(bt * chunk, t + 1))
                s = s_all[t, np.concatenate(idx)]
                m = s.max()
                out[b, h, t] = m + np.log(np.exp(s - m).sum())
    return out


def run_case(dev, B, T, H, N, chunk, top_k, concentrated, seed=0):
    K1 = top_k - 1
    q, k, v, do = make_inputs(B, T, H, N, chunk, concentrated, seed)
    shape = (B, T, H, N)
    bf = Buffers(dev)
    for name, arr in (("q", q), ("k", k), ("v", v), ("do", do)):
        bf.add(name, arr)
    for name in ("o", "dq", "dk", "dv"):
        bf.poisoned(name, shape)
    sizes = moba.scratch_sizes(B, T, H, N, chunk, top_k)
    scratch = {}
    for name, nbytes in sizes.items():
        if nbytes:
            dtype = np.int32 if name in ("sel", "cnt", "idx", "qlist") else np.float32
            scratch[name] = bf.poisoned(name, (nbytes // 4,), dtype)
        else:
            scratch[name] = 0
    ops = moba.forward(bf.buf["q"], bf.buf["k"], bf.buf["v"], bf.buf["o"], scratch,
                       B, T, H, N, chunk, top_k)
    ops += moba.backward(bf.buf["q"], bf.buf["k"], bf.buf["v"], bf.buf["o"], bf.buf["do"],
                         bf.buf["dq"], bf.buf["dk"], bf.buf["dv"], scratch, B, T, H, N, chunk, top_k)
    plan = _plan(dev, ops)
    outs = ["o", "dq", "dk", "dv", "lse"] + (["sel"] if K1 > 0 else [])
    runs = []
    for _ in range(2):
        bf.reset()
        plan.run()
        dev.synchronize()
        runs.append({n: bf.get(n) for n in outs})
    for n in outs:
        assert np.array_equal(runs[0][n].view(np.uint32), runs[1][n].view(np.uint32)), \
            f"{n}: the two runs differ (not deterministic)"
    got = runs[0]

    q64, k64, v64, do64 = (a.astype(np.float64) for a in (q, k, v, do))
    # 1. selection
    if K1 > 0:
        sel = got["sel"][: B * H * T * K1].reshape(B, H, T, K1)
    else:
        sel = np.zeros((B, H, T, 0), np.int32)
    sel_ref = om.moba_select(q64, k64, chunk, top_k)
    gaps = om.moba_gate_gaps(q64, k64, chunk, top_k)
    differs = ~np.all(sel == sel_ref, axis=-1)
    clear = gaps >= GAP
    assert not np.any(differs & clear), (
        f"selection differs from the oracle at {np.argwhere(differs & clear)[:5].tolist()} "
        f"(b, h, t) with clear gate gaps")
    if concentrated:
        assert np.all(sel[:, :, chunk:, 0] == 0), "block 0 should be selected by every later query"
    # 2. forward (the oracle validates the GPU selection: shape, range, ascending, padding)
    o_ref, _ = om.moba_attention_forward(q64, k64, v64, chunk, top_k, selection=sel)
    check("o", got["o"], o_ref, FWD_TOL)
    lse = got["lse"][: B * H * T].reshape(B, H, T)
    check("lse", lse, ref_lse(q64, k64, sel, chunk), FWD_TOL)
    # 3. backward with the selection fixed
    dq_ref, dk_ref, dv_ref = om.moba_attention_backward(q64, k64, v64, do64, chunk, top_k, sel)
    check("dq", got["dq"], dq_ref, BWD_TOL)
    check("dk", got["dk"], dk_ref, BWD_TOL)
    check("dv", got["dv"], dv_ref, BWD_TOL)
    return got, sel


@pytest.mark.parametrize("case", list(CASES))
def test_moba_forward_backward(dev, case):
    B, T, H, N, chunk, top_k, concentrated = CASES[case]
    run_case(dev, B, T, H, N, chunk, top_k, concentrated, seed=sum(map(ord, case)))


def test_moba_dense_is_causal_attention(dev):
    """T <= chunk*top_k: every past block is selected, so o is plain causal softmax attention."""
    B, T, H, N, chunk, top_k = 1, 192, 2, 64, 64, 3
    got, sel = run_case(dev, B, T, H, N, chunk, top_k, False, seed=7)
    q, k, v, _ = (a.astype(np.float64) for a in make_inputs(B, T, H, N, chunk, False, 7))
    s = np.einsum("bthn,buhn->bhtu", q, k) / np.sqrt(N)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    check("o(causal)", got["o"], np.einsum("bhtu,buhn->bthn", p, v), FWD_TOL)
    bt = np.arange(T) // chunk
    for t in range(T):
        assert (sel[:, :, t] == list(range(bt[t])) + [-1] * (top_k - 1 - bt[t])).all()

