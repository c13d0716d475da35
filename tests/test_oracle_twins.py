"""CPU checks of the op twins of the GPU kernel families not covered elsewhere (channelmix, embedding,
loss, the MoBA log-sum-exp, LayerNorm statistics, reduce) and of the oracle's numerics convention:
float32 in -> computed in float64 -> float32 out, rounded once."""
import numpy as np
import pytest

from rwkvx.oracle import (LN_EPS, channel_mix_shift_backward, channel_mix_shift_forward, column_sums,
                          cross_entropy, cross_entropy_rows, embedding_backward, embedding_forward,
                          layernorm_forward, moba_attention_forward, moba_logsumexp, relu_sq_backward,
                          rel_err, relu_sq_forward, time_mix_prep_forward, wkv7_forward)
from rwkvx.oracle._common import matmul

from finite_differences import numeric_gradient
from seeding import seeded_rng


# ------------------------------------------------------------------ channelmix

@pytest.mark.parametrize("B,T", [(2, 5), (3, 1)])
def test_channel_mix_shift_matches_definition_and_fd(B, T):
    rng = seeded_rng(B * 10 + T)
    C = 6
    x = rng.standard_normal((B * T, C))
    mix = rng.uniform(0, 1, C)
    xk = channel_mix_shift_forward(x, mix, T)
    for r in range(B * T):                       # straight from docs/SPEC.md §2.3: shift(x)[t] = x[t-1], 0 at t = 0
        prev = x[r - 1] if r % T else np.zeros(C)
        np.testing.assert_allclose(xk[r], x[r] + (prev - x[r]) * mix, rtol=1e-15, atol=1e-15)
    dxk = rng.standard_normal(x.shape)
    dx, dmix = channel_mix_shift_backward(dxk, x, mix, T)
    loss = lambda: float((channel_mix_shift_forward(x, mix, T) * dxk).sum())  # noqa: E731
    assert rel_err(dx, numeric_gradient(loss, x)) < 1e-8
    assert rel_err(dmix, numeric_gradient(loss, mix)) < 1e-8
    assert dmix.shape == (C,)


def test_relu_sq_forward_backward():
    rng = seeded_rng(1)
    h = rng.standard_normal((4, 7))
    np.testing.assert_array_equal(relu_sq_forward(h), np.where(h > 0, h * h, 0.0))
    dk = rng.standard_normal(h.shape)
    loss = lambda: float((relu_sq_forward(h) * dk).sum())  # noqa: E731
    assert rel_err(relu_sq_backward(dk, h), numeric_gradient(loss, h)) < 1e-8


# ------------------------------------------------------------------ embedding

def test_embedding_forward_backward():
    rng = seeded_rng(2)
    V, C = 9, 4
    tokens = np.array([[5, 1, 5, 0], [1, 5, 8, 1]])
    emb = rng.standard_normal((V, C)).astype(np.float32)
    x = embedding_forward(tokens, emb)
    assert x.dtype == np.float32 and x.shape == (8, C)
    np.testing.assert_array_equal(x, emb[tokens.reshape(-1)])
    dx = rng.standard_normal((8, C))
    demb = embedding_backward(tokens, dx, V)
    want = np.zeros((V, C))
    for r, t in enumerate(tokens.reshape(-1)):
        want[t] += dx[r]
    np.testing.assert_allclose(demb, want, rtol=1e-15, atol=0)
    assert not demb[[2, 3, 4, 6, 7]].any()       # absent tokens: zero rows
    with pytest.raises(ValueError, match="tokens must lie in"):
        embedding_forward(np.array([0, V]), emb)
    with pytest.raises(TypeError, match="integer"):
        embedding_backward(np.array([0.0]), dx[:1], V)


# ------------------------------------------------------------------ loss

def test_cross_entropy_rows():
    rng = seeded_rng(3)
    R, V = 7, 11
    z = (3 * rng.standard_normal((R, V)) + 20).astype(np.float32)   # a large offset: stable lse
    t = rng.integers(0, V, R)
    t[[1, 4]] = -100
    loss, dz = cross_entropy_rows(z, t)
    assert loss.dtype == np.float64 and dz.dtype == np.float64 and dz.shape == (R, V)
    z64 = z.astype(np.float64)
    lse = np.log(np.exp(z64 - z64.max(1, keepdims=True)).sum(1)) + z64.max(1)
    for r in range(R):
        if t[r] == -100:
            assert loss[r] == 0 and not dz[r].any()
        else:
            assert loss[r] == pytest.approx(lse[r] - z64[r, t[r]], rel=1e-13)
            want = np.exp(z64[r] - lse[r])
            want[t[r]] -= 1
            np.testing.assert_allclose(dz[r], want, rtol=1e-12, atol=1e-15)
    mean, dmean, count = cross_entropy(z, t)
    valid = t != -100
    assert count == 5 and mean == pytest.approx(loss[valid].mean(), rel=1e-15)
    np.testing.assert_allclose(dmean, dz / 5, rtol=1e-15)


def test_cross_entropy_near_one_hot_rows():
    # p_t = 1 / (1 + 2 e^-30): 1 - p_t ~ 1.9e-13, below what exp(z_t - lse) - 1 or lse - z_t resolve
    # (~1e-3 relative), so the target's loss and gradient must come from the other classes' sum.
    z = np.array([[0.0, -30.0, -30.0], [-30.0, 5.0, -25.0]])
    t = np.array([0, 1])
    loss, dz = cross_entropy_rows(z, t)
    rest = np.array([2 * np.exp(-30.0), np.exp(-35.0) + np.exp(-30.0)])
    np.testing.assert_allclose(loss, np.log1p(rest), rtol=1e-14)
    np.testing.assert_allclose(dz[[0, 1], t], -rest / (1 + rest), rtol=1e-14)
    np.testing.assert_allclose(dz[0, 1:], np.exp(-30.0) / (1 + rest[0]), rtol=1e-14)


# ------------------------------------------------------------------ MoBA log-sum-exp

def test_moba_logsumexp_matches_dense_masked_scores():
    rng = seeded_rng(4)
    B, T, H, N, chunk, top_k = 2, 37, 2, 8, 6, 3
    q, k, v = (rng.standard_normal((B, T, H, N)) for _ in range(3))
    _, sel = moba_attention_forward(q, k, v, chunk, top_k)
    lse = moba_logsumexp(q.astype(np.float32), k.astype(np.float32), chunk, sel)
    assert lse.dtype == np.float64 and lse.shape == (B, H, T)
    q32, k32 = (a.astype(np.float32).astype(np.float64) for a in (q, k))
    for b in range(B):
        for h in range(H):
            s_all = q32[b, :, h] @ k32[b, :, h].T / np.sqrt(N)
            for t in range(T):
                bt = t // chunk
                vis = [u for j in sel[b, h, t] if j >= 0 for u in range(j * chunk, (j + 1) * chunk)]
                s = s_all[t, vis + list(range(bt * chunk, t + 1))]
                assert lse[b, h, t] == pytest.approx(s.max() + np.log(np.exp(s - s.max()).sum()),
                                                     rel=1e-13)


# ------------------------------------------------------------------ LayerNorm statistics, reduce

def test_layernorm_stats_and_column_sums():
    rng = seeded_rng(5)
    x = rng.standard_normal((6, 16)) * 2 + 1
    w, b = rng.standard_normal(16), rng.standard_normal(16)
    y, mean, rstd = layernorm_forward(x, w, b, return_stats=True)
    np.testing.assert_allclose(mean, x.mean(1), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(x.var(1) + LN_EPS), rtol=1e-14)
    np.testing.assert_array_equal(y, layernorm_forward(x, w, b))
    part = rng.standard_normal((5, 16)).astype(np.float32)
    s = column_sums(part)
    assert s.dtype == np.float32
    np.testing.assert_array_equal(s, part.astype(np.float64).sum(0).astype(np.float32))


# ------------------------------------------------------------------ the numerics convention

def test_float32_in_means_float64_math_rounded_once():
    rng = seeded_rng(6)
    R, C, N = 12, 8, 4
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    a, bm = f32(R, C), f32(C, 5)
    np.testing.assert_array_equal(matmul(a, bm), (a.astype(np.float64) @ bm).astype(np.float32))
    prep = (f32(R, C), f32(R, C), f32(R, C), f32(R, C), f32(R, C), f32(R, C), f32(C), f32(C),
            f32(C), f32(C), f32(C))
    got = time_mix_prep_forward(*prep, N, 1)
    want = time_mix_prep_forward(*(p.astype(np.float64) for p in prep), N, 1)
    for name, value in want.items():
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], value.astype(np.float32), err_msg=name)
    shape = (1, 3, 2, N)
    wkv = [f32(*shape) for _ in range(6)]
    wkv[1] = np.exp(-np.abs(wkv[1]))                                   # decay in (0, 1)
    np.testing.assert_array_equal(wkv7_forward(*wkv),
                                  wkv7_forward(*(x.astype(np.float64) for x in wkv)).astype(np.float32))
    # one float64 input: everything float64
    assert wkv7_forward(*wkv[:5], wkv[5].astype(np.float64)).dtype == np.float64
