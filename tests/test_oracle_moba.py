"""CPU tests of the MoBA attention oracle (oracle/moba.pyx)."""
import numpy as np
import pytest

from rwkvx.oracle import moba, rel_err

from finite_differences import numeric_gradient
from seeding import seeded_rng


def rand(shape, seed, scale=1.0):
    return seeded_rng(seed).standard_normal(shape) * scale


def causal_attention(q, k, v, mask=None):
    """Plain softmax attention in float64 numpy; mask [B,H,T,T] boolean (default: causal)."""
    B, T, H, N = q.shape
    s = np.einsum("bthn,buhn->bhtu", q, k) / np.sqrt(N)
    if mask is None:
        mask = np.tril(np.ones((T, T), bool))[None, None]
    s = np.where(mask, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhtu,buhn->bthn", p, v)


def mask_from_selection(sel, T, chunk):
    B, H, _, K1 = sel.shape
    mask = np.zeros((B, H, T, T), bool)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                bt = t // chunk
                mask[b, h, t, bt * chunk:t + 1] = True
                for j in sel[b, h, t]:
                    if j >= 0:
                        mask[b, h, t, j * chunk:(j + 1) * chunk] = True
    return mask


@pytest.mark.parametrize("B,T,H,N,chunk,top_k", [(2, 48, 2, 8, 16, 3), (1, 50, 3, 4, 8, 7),
                                                 (2, 64, 1, 16, 64, 2), (1, 17, 2, 8, 1, 40)])
def test_all_past_blocks_selected_is_causal_attention(B, T, H, N, chunk, top_k):
    assert T <= chunk * top_k
    q, k, v = rand((B, T, H, N), 1), rand((B, T, H, N), 2), rand((B, T, H, N), 3)
    o, sel = moba.moba_attention_forward(q, k, v, chunk, top_k)
    assert o.dtype == np.float64 and o.shape == q.shape
    assert sel.dtype == np.int32 and sel.shape == (B, H, T, top_k - 1)
    bt = np.arange(T) // chunk
    for t in range(T):
        want = list(range(bt[t])) + [-1] * (top_k - 1 - bt[t])
        assert (sel[:, :, t] == want).all()
    assert rel_err(o, causal_attention(q, k, v)) < 1e-13


def test_sparse_matches_masked_attention_and_gate():
    B, T, H, N, chunk, top_k = 2, 100, 2, 8, 10, 3
    q, k, v = rand((B, T, H, N), 4), rand((B, T, H, N), 5), rand((B, T, H, N), 6)
    o, sel = moba.moba_attention_forward(q, k, v, chunk, top_k)
    # the selection follows the gate: top_k-1 largest of q_t . mean(k over block j), j < block(t)
    g = np.einsum("bthn,bhjn->bhtj", q, k.reshape(B, T // chunk, chunk, H, N).mean(2).transpose(0, 2, 1, 3))
    for b in range(B):
        for h in range(H):
            for t in range(T):
                bt = t // chunk
                order = sorted(range(bt), key=lambda j: (-g[b, h, t, j], j))
                want = sorted(order[:top_k - 1])
                want += [-1] * (top_k - 1 - len(want))
                assert list(sel[b, h, t]) == want, (b, h, t)
    assert rel_err(o, causal_attention(q, k, v, mask_from_selection(sel, T, chunk))) < 1e-13
    gates = moba.moba_gates(q, k, chunk)
    past = np.arange(T // chunk)[None, :] < (np.arange(T) // chunk)[:, None]
    assert (np.isneginf(gates) == ~past[None, None]).all()
    assert rel_err(gates[:, :, past], g[:, :, past]) < 1e-13
    assert (moba.moba_select(q, k, chunk, top_k) == sel).all()


def test_forced_selection_is_used_and_validated():
    B, T, H, N, chunk, top_k = 1, 40, 2, 4, 8, 3
    q, k, v = rand((B, T, H, N), 7), rand((B, T, H, N), 8), rand((B, T, H, N), 9)
    forced = np.full((B, H, T, 2), -1, np.int32)
    forced[..., 24:, 0] = 0          # block 0 only, fewer than top_k-1 blocks is allowed
    forced[..., 32:, 1] = 2
    o, sel = moba.moba_attention_forward(q, k, v, chunk, top_k, selection=forced)
    assert (sel == forced).all()
    assert rel_err(o, causal_attention(q, k, v, mask_from_selection(forced, T, chunk))) < 1e-13
    bad_cases = [
        (forced[..., :1], ValueError),                        # shape
        (forced.astype(np.float32), TypeError),               # dtype
        (np.where(np.arange(T)[None, None, :, None] == 10, 1, forced).astype(np.int32), ValueError),  # future
        (np.where(np.arange(T)[None, None, :, None] == 30, -2, forced).astype(np.int32), ValueError),  # < -1
    ]
    desc = forced.copy()
    desc[..., 33, :] = [2, 0]                                  # not ascending
    bad_cases.append((desc, ValueError))
    hole = forced.copy()
    hole[..., 35, :] = [-1, 2]                                 # padding before a block
    bad_cases.append((hole, ValueError))
    for bad, exc in bad_cases:
        with pytest.raises(exc):
            moba.moba_attention_forward(q, k, v, chunk, top_k, selection=bad)
        with pytest.raises(exc):
            moba.moba_attention_backward(q, k, v, q, chunk, top_k, bad)


def test_tie_breaking_lower_block_wins():
    B, T, H, N, chunk, top_k = 1, 48, 1, 4, 8, 3
    rng = seeded_rng(10)
    q = rng.standard_normal((B, T, H, N))
    k = rng.standard_normal((B, T, H, N))
    # blocks 0..4 all have the same mean key: every gate over them ties exactly
    base = rng.standard_normal((chunk, N))
    for j in range(5):
        k[0, j * chunk:(j + 1) * chunk, 0] = base
    km = moba.moba_block_means(k, chunk)
    assert (km[0, 0, :5] == km[0, 0, 0]).all()
    o, sel = moba.moba_attention_forward(q, k, rng.standard_normal((B, T, H, N)), chunk, top_k)
    gaps = moba.moba_gate_gaps(q, k, chunk, top_k)
    for t in range(T):
        bt = t // chunk
        if 3 <= bt <= 5:   # candidates 0..bt-1 all tie
            assert list(sel[0, 0, t]) == [0, 1]
            assert gaps[0, 0, t] == 0.0
    # with exactly two past blocks nothing is ambiguous
    assert np.isinf(gaps[0, 0, 2 * chunk:3 * chunk]).all()


def test_gate_gaps():
    B, T, H, N, chunk, top_k = 2, 60, 2, 8, 6, 3
    q, k = rand((B, T, H, N), 11), rand((B, T, H, N), 12)
    gaps = moba.moba_gate_gaps(q, k, chunk, top_k)
    g = moba.moba_gates(q, k, chunk)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                bt = t // chunk
                if bt <= top_k - 1:
                    assert np.isinf(gaps[b, h, t])
                else:
                    s = np.sort(g[b, h, t, :bt])[::-1]
                    assert gaps[b, h, t] == pytest.approx(s[top_k - 2] - s[top_k - 1], abs=1e-14)
    assert np.isinf(moba.moba_gate_gaps(q, k, chunk, 1)).all()


def test_top_k_one_is_own_block_only():
    B, T, H, N, chunk = 2, 37, 2, 8, 8
    q, k, v = rand((B, T, H, N), 13), rand((B, T, H, N), 14), rand((B, T, H, N), 15)
    o, sel = moba.moba_attention_forward(q, k, v, chunk, 1)
    assert sel.shape == (B, H, T, 0) and sel.dtype == np.int32
    bt = np.arange(T) // chunk
    mask = (bt[:, None] == bt[None, :]) & np.tril(np.ones((T, T), bool))
    assert rel_err(o, causal_attention(q, k, v, mask[None, None])) < 1e-13
    dq, dk, dv = moba.moba_attention_backward(q, k, v, rand(q.shape, 16), chunk, 1, sel)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def loss_and_grads(q, k, v, w, chunk, top_k, sel):
    o, _ = moba.moba_attention_forward(q, k, v, chunk, top_k, selection=sel)
    return float(np.sum(o * w))


@pytest.mark.parametrize("B,T,H,N,chunk,top_k", [(2, 30, 2, 4, 5, 3), (1, 27, 1, 8, 4, 2), (1, 20, 2, 4, 7, 1)])
def test_backward_finite_differences(B, T, H, N, chunk, top_k):
    rng = seeded_rng(17)
    q, k, v, w = (rng.standard_normal((B, T, H, N)) for _ in range(4))
    _, sel = moba.moba_attention_forward(q, k, v, chunk, top_k)
    dq, dk, dv = moba.moba_attention_backward(q, k, v, w, chunk, top_k, sel)
    for x, dx in ((q, dq), (k, dk), (v, dv)):
        num = numeric_gradient(lambda: loss_and_grads(q, k, v, w, chunk, top_k, sel), x)
        assert rel_err(dx, num) <= 1e-6


def test_backward_matches_dense_formula():
    """Backward against an independent dense-matrix derivation with the same mask."""
    B, T, H, N, chunk, top_k = 2, 64, 2, 8, 8, 3
    rng = seeded_rng(18)
    q, k, v, do = (rng.standard_normal((B, T, H, N)) for _ in range(4))
    o, sel = moba.moba_attention_forward(q, k, v, chunk, top_k)
    dq, dk, dv = moba.moba_attention_backward(q, k, v, do, chunk, top_k, sel)
    mask = mask_from_selection(sel, T, chunk)
    s = np.where(mask, np.einsum("bthn,buhn->bhtu", q, k) / np.sqrt(N), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dP = np.einsum("bthn,buhn->bhtu", do, v)
    dS = p * (dP - (p * dP).sum(-1, keepdims=True)) / np.sqrt(N)
    assert rel_err(dq, np.einsum("bhtu,buhn->bthn", dS, k)) < 1e-12
    assert rel_err(dk, np.einsum("bhtu,bthn->buhn", dS, q)) < 1e-12
    assert rel_err(dv, np.einsum("bhtu,bthn->buhn", p, do)) < 1e-12
    # sel=None recomputes the same selection
    for a, b in zip(moba.moba_attention_backward(q, k, v, do, chunk, top_k, None), (dq, dk, dv)):
        assert (a == b).all()


def test_float32_agrees_with_float64():
    B, T, H, N, chunk, top_k = 2, 200, 2, 32, 32, 3
    rng = seeded_rng(19)
    q, k, v, do = (rng.standard_normal((B, T, H, N)) for _ in range(4))
    o64, sel = moba.moba_attention_forward(q, k, v, chunk, top_k)
    q32, k32, v32, do32 = (a.astype(np.float32) for a in (q, k, v, do))
    o32, sel32 = moba.moba_attention_forward(q32, k32, v32, chunk, top_k, selection=sel)
    assert o32.dtype == np.float32 and (sel32 == sel).all()
    assert rel_err(o32, o64) < 1e-5
    g32 = moba.moba_attention_backward(q32, k32, v32, do32, chunk, top_k, sel)
    g64 = moba.moba_attention_backward(q, k, v, do, chunk, top_k, sel)
    for a, b in zip(g32, g64):
        assert a.dtype == np.float32
        assert rel_err(a, b) < 1e-5
    # the float32 gate is still computed in float64: same selection where gaps are not tiny
    gaps = moba.moba_gate_gaps(q, k, chunk, top_k)
    _, sel_f = moba.moba_attention_forward(q32, k32, v32, chunk, top_k)
    clear = gaps > 1e-4
    assert ((sel_f == sel).all(-1) | ~clear).all()


def test_argument_errors():
    q = np.zeros((1, 8, 1, 4))
    with pytest.raises(ValueError):
        moba.moba_attention_forward(q, q, q, 0, 2)
    with pytest.raises(ValueError):
        moba.moba_attention_forward(q, q, q, 4, 0)
    with pytest.raises(ValueError):
        moba.moba_attention_forward(q, q[:, :4], q, 4, 2)
    with pytest.raises(ValueError):
        moba.moba_attention_forward(q[0], q[0], q[0], 4, 2)
    with pytest.raises(ValueError):
        moba.moba_attention_backward(q, q, q, q[:, :4], 4, 2, None)
