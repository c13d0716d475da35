"""init_params: names, shapes, initial values and determinism (docs/SPEC.md §2.4)."""
import math

import numpy as np
import pytest

from rwkvx import Config, init_params, param_shapes, rwkv7_to_rwkvx

CFG = Config(vocab_size=300, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=2)


def test_names_and_shapes():
    params = init_params(CFG, seed=1)
    shapes = param_shapes(CFG)
    assert list(params) == list(shapes)
    assert all(params[n].shape == s and params[n].dtype == np.float32 for n, s in shapes.items())
    assert "rwkv.blocks.0.att.v0" not in params and "rwkv.blocks.1.att.v1" in params
    assert "rwkv.blocks.0.ln0.weight" in params and "rwkv.blocks.1.ln0.weight" not in params
    assert shapes["rwkv.blocks.0.att.r_k"] == (4, 16) and shapes["moba.1.ffn.value.weight"] == (64, 256)
    no_ln0 = Config(vocab_size=10, n_embd=16, head_size=8, n_rwkv_layer=1, ln0=False)
    assert "rwkv.blocks.0.ln0.weight" not in param_shapes(no_ln0)


def test_deterministic_and_seed_dependent():
    a, b, c = init_params(CFG, 7), init_params(CFG, 7), init_params(CFG, 8)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["rwkv.head.weight"], c["rwkv.head.weight"])


@pytest.mark.parametrize("name, gain", [
    ("rwkv.blocks.1.att.w2", 0.1), ("rwkv.blocks.1.att.g2", 0.1), ("rwkv.blocks.1.att.v2", 0.1),
    ("rwkv.blocks.0.att.receptance.weight", 1.0), ("rwkv.blocks.0.att.key.weight", 0.1),
    ("rwkv.blocks.2.ffn.key.weight", 1.0), ("moba.0.att.value.weight", 1.0),
    ("moba.1.att.key.weight", 0.1), ("rwkv.head.weight", 0.5 * math.sqrt(300 / 64)),
])
def test_orthogonal(name, gain):
    w = init_params(CFG, 3)[name].astype(np.float64) / gain
    gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
    np.testing.assert_allclose(gram, np.eye(gram.shape[0]), atol=1e-5)


def test_x070_values():
    p = init_params(CFG, 0)
    C, L = 64, 3
    n = np.arange(C) / C
    l = 1
    r1 = 1 - l / L
    np.testing.assert_allclose(p["rwkv.blocks.1.att.x_w"].ravel(), 1 - n ** (0.9 * r1), rtol=1e-6)
    np.testing.assert_allclose(p["rwkv.blocks.1.ffn.x_k"].ravel(), 1 - n ** (r1 ** 4), rtol=1e-6)
    np.testing.assert_allclose(p["rwkv.blocks.2.att.ln_x.weight"], 1.0)
    np.testing.assert_allclose(p["rwkv.blocks.0.att.ln_x.weight"], (1 / 3) ** 0.7, rtol=1e-6)
    w0 = p["rwkv.blocks.0.att.w0"].ravel()
    assert w0[0] == pytest.approx(-6 + 0.5 - 2.5, abs=1e-6)  # zig = -1 at n = 0
    for zero in ("att.w1", "att.a1", "att.g1", "att.output.weight", "ffn.value.weight"):
        assert not p[f"rwkv.blocks.1.{zero}"].any()
    assert np.abs(p["rwkv.emb.weight"]).max() <= 1e-4
    assert np.all(p["rwkv.blocks.0.att.r_k"] == np.float32(-0.04))


def test_attention_blocks_follow_preceding_rwkv_block():
    # order: r0 a0 r1 a1 r2 -> moba.0 follows block 0, moba.1 follows block 1
    cfg = Config(vocab_size=30, n_embd=32, head_size=8, n_rwkv_layer=3, n_attn_layer=2)
    p = init_params(cfg, 0)
    np.testing.assert_array_equal(p["moba.1.ffn.x_k"], p["rwkv.blocks.1.ffn.x_k"])
    assert not np.array_equal(p["moba.1.ffn.x_k"], p["rwkv.blocks.0.ffn.x_k"])
    assert not p["moba.0.att.output.weight"].any()


def test_rwkv7_to_rwkvx_copies_preceding_block():
    rwkv_only = Config(vocab_size=30, n_embd=32, head_size=8, n_rwkv_layer=4)
    hybrid = Config(vocab_size=30, n_embd=32, head_size=8, n_rwkv_layer=4, n_attn_layer=2)
    base = init_params(rwkv_only, 5)
    out = rwkv7_to_rwkvx(hybrid, base)
    assert list(out) == list(param_shapes(hybrid))
    for j, l in ((0, 1), (1, 3)):
        for name in ("att.key.weight", "ln2.weight", "ffn.value.weight", "ffn.x_k"):
            np.testing.assert_array_equal(out[f"moba.{j}.{name}"], base[f"rwkv.blocks.{l}.{name}"])


def test_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        init_params(CFG, -1)
