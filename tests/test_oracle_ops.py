"""Op-level oracle functions against plain Python/numpy references and finite differences, and the
whole oracle forward against a direct per-token transcription of docs/SPEC.md §2.3."""
import math

import numpy as np
import pytest

from rwkvx import Config
from rwkvx.oracle import (Oracle, group_norm_backward, group_norm_forward, layernorm_backward,
                          layernorm_forward, wkv7_backward, wkv7_forward)

from finite_differences import numeric_gradient
from seeding import seeded_rng


def _wkv7_loop(r, w, k, v, a, b):
    """WKV7 straight from the formula: explicit state matrix, one token at a time."""
    B, T, H, N = r.shape
    y = np.zeros_like(r)
    for bb in range(B):
        for h in range(H):
            S = np.zeros((N, N))
            for t in range(T):
                sa = S @ a[bb, t, h]
                S = S @ np.diag(w[bb, t, h]) + np.outer(sa, b[bb, t, h]) + np.outer(v[bb, t, h], k[bb, t, h])
                y[bb, t, h] = S @ r[bb, t, h]
    return y


def _wkv7_inputs(rng, B=2, T=5, H=2, N=3):
    shape = (B, T, H, N)
    r, k, v = (rng.standard_normal(shape) for _ in range(3))
    w = np.exp(-0.6065306597126334 * rng.uniform(0, 1, shape))
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    a, b = -kk, kk * rng.uniform(0, 1, shape)
    return r, w, k, v, a, b


def test_wkv7_forward_matches_python_loop():
    rng = seeded_rng(0)
    args = _wkv7_inputs(rng)
    np.testing.assert_allclose(wkv7_forward(*args), _wkv7_loop(*args), rtol=1e-12, atol=1e-13)
    y32 = wkv7_forward(*[x.astype(np.float32) for x in args])
    assert y32.dtype == np.float32
    np.testing.assert_allclose(y32, _wkv7_loop(*args), rtol=1e-4, atol=1e-5)


def _fd_check(fn, inputs, grads, dy, rng, samples=6):
    """Compare analytic grads of sum(fn(*inputs) * dy) with central differences."""
    for x, g in zip(inputs, grads):
        idx = rng.choice(x.size, min(samples, x.size), replace=False)
        num = numeric_gradient(lambda: np.sum(fn(*inputs) * dy), x, indices=idx)
        ana = g.reshape(-1)[idx]
        assert np.linalg.norm(ana - num) <= 1e-7 * np.linalg.norm(num) + 1e-12, (ana, num)


def test_wkv7_backward_finite_differences():
    rng = seeded_rng(1)
    args = list(_wkv7_inputs(rng, B=1, T=6, H=2, N=4))
    dy = rng.standard_normal(args[0].shape)
    grads = wkv7_backward(*args, dy)
    assert len(grads) == 6 and all(g.shape == args[0].shape for g in grads)
    _fd_check(wkv7_forward, args, grads, dy, rng)


def test_layernorm_forward_and_backward():
    rng = seeded_rng(2)
    x = rng.standard_normal((5, 8)) * 3 + 1
    w, b = rng.standard_normal(8), rng.standard_normal(8)
    mu, var = x.mean(1, keepdims=True), x.var(1, keepdims=True)
    np.testing.assert_allclose(layernorm_forward(x, w, b), (x - mu) / np.sqrt(var + 1e-5) * w + b,
                               rtol=1e-13, atol=1e-13)
    dy = rng.standard_normal(x.shape)
    dx, dw, db = layernorm_backward(x, w, dy)
    _fd_check(lambda x_, w_, b_: layernorm_forward(x_, w_, b_), [x, w, b], [dx, dw, db], dy, rng)


def test_group_norm_per_head():
    rng = seeded_rng(3)
    x = rng.standard_normal((4, 12))
    w, b = rng.standard_normal(12), rng.standard_normal(12)
    xg = x.reshape(4, 3, 4)
    ref = ((xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + 64e-5)).reshape(4, 12)
    np.testing.assert_allclose(group_norm_forward(x, w, b, 3, 64e-5), ref * w + b, rtol=1e-12, atol=1e-13)
    dy = rng.standard_normal(x.shape)
    dx, dw, db = group_norm_backward(x, w, dy, 3, 64e-5)
    _fd_check(lambda x_, w_, b_: group_norm_forward(x_, w_, b_, 3, 64e-5), [x, w, b], [dx, dw, db],
              dy, rng)


# ------------------------------------------------------------- whole-model forward, per token

def _sig(x):
    return 1 / (1 + np.exp(-x))


def _ln(x, w, b, eps=1e-5):
    return (x - x.mean()) / math.sqrt(x.var() + eps) * w + b


def _reference_logits(cfg, P, tokens):
    """docs/SPEC.md §2.3 transcribed token by token (one sequence), dense causal MoBA by masking."""
    C, H, N, T = cfg.n_embd, cfg.n_head, cfg.head_size, len(tokens)
    vec = lambda name: P[name].reshape(-1)
    x = np.array([P["rwkv.emb.weight"][t] for t in tokens])
    if cfg.ln0:
        x = np.array([_ln(row, P["rwkv.blocks.0.ln0.weight"], P["rwkv.blocks.0.ln0.bias"]) for row in x])
    v_first = None
    for kind, i in cfg.block_order():
        pre = f"rwkv.blocks.{i}." if kind == "rwkv" else f"moba.{i}."
        h = np.array([_ln(row, P[pre + "ln1.weight"], P[pre + "ln1.bias"]) for row in x])
        out = np.zeros_like(h)
        if kind == "rwkv":
            a = pre + "att."
            S = np.zeros((H, N, N))
            vs_all = []
            for t in range(T):
                prev = h[t - 1] if t > 0 else np.zeros(C)
                xx = prev - h[t]
                xr, xw, xk, xv, xa, xg = (h[t] + xx * vec(a + m) for m in
                                          ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
                r = P[a + "receptance.weight"] @ xr
                k = P[a + "key.weight"] @ xk
                v = P[a + "value.weight"] @ xv
                decay = np.exp(-math.exp(-0.5) * _sig(vec(a + "w0") + np.tanh(xw @ P[a + "w1"]) @ P[a + "w2"]))
                if i == 0:
                    vs_all.append(v.copy())
                else:
                    v = v + (v_first[t] - v) * _sig(vec(a + "v0") + (xv @ P[a + "v1"]) @ P[a + "v2"])
                ar = _sig(vec(a + "a0") + (xa @ P[a + "a1"]) @ P[a + "a2"])
                g = _sig(xg @ P[a + "g1"]) @ P[a + "g2"]
                kk = k * vec(a + "k_k")
                k = k * (1 + (ar - 1) * vec(a + "k_a"))
                y = np.zeros(C)
                for hh in range(H):
                    sl = slice(hh * N, (hh + 1) * N)
                    kkh = kk[sl] / max(np.linalg.norm(kk[sl]), 1e-12)
                    sa = S[hh] @ (-kkh)
                    S[hh] = S[hh] * decay[sl][None, :] + np.outer(sa, kkh * ar[sl]) + np.outer(v[sl], k[sl])
                    yh = S[hh] @ r[sl]
                    yh = _ln(yh, P[a + "ln_x.weight"][sl], P[a + "ln_x.bias"][sl], 64e-5)
                    y[sl] = yh + np.sum(r[sl] * k[sl] * P[a + "r_k"][hh]) * v[sl]
                out[t] = P[a + "output.weight"] @ (y * g)
            if i == 0:
                v_first = np.array(vs_all)
        else:
            a = pre + "att."
            q, k, v = (h @ P[a + n + ".weight"].T for n in ("receptance", "key", "value"))
            ch, nsel = cfg.moba_chunk_size, cfg.moba_top_k - 1
            o = np.zeros_like(h)
            for hh in range(H):
                sl = slice(hh * N, (hh + 1) * N)
                for t in range(T):
                    bt = t // ch
                    gates = [q[t, sl] @ k[j * ch:(j + 1) * ch, sl].mean(0) for j in range(bt)]
                    chosen = sorted(sorted(range(bt), key=lambda j: (-gates[j], j))[:nsel])
                    vis = [u for j in chosen for u in range(j * ch, (j + 1) * ch)] + list(range(bt * ch, t + 1))
                    s = np.array([q[t, sl] @ k[u, sl] for u in vis]) / math.sqrt(N)
                    p = np.exp(s - s.max())
                    p /= p.sum()
                    o[t, sl] = p @ v[vis, sl]
            out = o @ P[a + "output.weight"].T
        x1 = x + out
        h2 = np.array([_ln(row, P[pre + "ln2.weight"], P[pre + "ln2.bias"]) for row in x1])
        cm = np.zeros_like(h2)
        for t in range(T):
            prev = h2[t - 1] if t > 0 else np.zeros(C)
            xk = h2[t] + (prev - h2[t]) * vec(pre + "ffn.x_k")
            kk = np.maximum(P[pre + "ffn.key.weight"] @ xk, 0) ** 2
            cm[t] = P[pre + "ffn.value.weight"] @ kk
        x = x1 + cm
    hn = np.array([_ln(row, P["rwkv.ln_out.weight"], P["rwkv.ln_out.bias"]) for row in x])
    return hn @ P["rwkv.head.weight"].T


@pytest.mark.parametrize("ln0", [True, False])
def test_oracle_forward_matches_per_token_reference(ln0, random_params):
    cfg = Config(vocab_size=19, n_embd=16, head_size=4, ffn_dim=20, dim_w=3, dim_a=3, dim_v=3,
                 dim_g=3, n_rwkv_layer=3, n_attn_layer=1, moba_chunk_size=3, moba_top_k=2, ln0=ln0)
    P = random_params(cfg, 5)
    tokens = seeded_rng(5).integers(0, cfg.vocab_size, (2, 11))
    logits = Oracle(cfg, P).forward(tokens)
    for b in range(2):
        np.testing.assert_allclose(logits[b], _reference_logits(cfg, P, tokens[b]), rtol=1e-10,
                                   atol=1e-10)
