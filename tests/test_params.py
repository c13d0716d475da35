"""init_params: names, shapes, initial values and determinism (docs/SPEC.md §2.4)."""
import math

import numpy as np
import pytest

from rwkvx import Config, init_params, param_shapes, rwkv7_to_rwkvx
from rwkvx.params import EMB_INIT_RANGE, ORTHOGONALITY_TOL, orthonormal_columns
from seeding import seeded_rng

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


def householder_q(a):
    """The orthogonal init's reference map: Householder QR, signs fixed by R's diagonal (torch's)."""
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))


@pytest.mark.parametrize("shape", [(256, 64), (64, 64), (1000, 16)])
def test_orthonormal_columns_is_householder_qr(shape):
    """The same Gaussian gives the same Q as Householder QR: the orthogonal init keeps its distribution."""
    a = seeded_rng(shape[0] + shape[1]).standard_normal(shape)
    q = orthonormal_columns(a)
    np.testing.assert_allclose(q, householder_q(a), atol=1e-10)
    np.testing.assert_allclose(q.T @ q, np.eye(shape[1]), atol=ORTHOGONALITY_TOL)


def test_orthonormal_columns_reorthogonalises_or_falls_back():
    rng = seeded_rng(11)
    u, v = householder_q(rng.standard_normal((200, 40))), householder_q(rng.standard_normal((40, 40)))
    ill = (u * np.logspace(0, -6, 40)) @ v.T                          # condition number 1e6
    one_pass = ill @ np.linalg.inv(np.linalg.cholesky(ill.T @ ill)).T
    assert np.abs(one_pass.T @ one_pass - np.eye(40)).max() > ORTHOGONALITY_TOL
    q = orthonormal_columns(ill)
    np.testing.assert_allclose(q.T @ q, np.eye(40), atol=ORTHOGONALITY_TOL)
    np.testing.assert_allclose(q, householder_q(ill), atol=1e-6)
    singular = rng.standard_normal((50, 8))
    singular[:, 7] = 0.0                                      # no Cholesky factor: Householder QR
    q = orthonormal_columns(singular)
    np.testing.assert_allclose(q[:, :7].T @ q[:, :7], np.eye(7), atol=1e-12)


def test_init_distributions():
    """Per-tensor statistics of a fresh init against docs/SPEC.md §2.4: the embedding uniform in
    [-1e-4, 1e-4), every orthogonal tensor gain * (a Haar semi-orthogonal matrix), whose entries have mean
    0 and standard deviation gain / sqrt(max(shape)). The bounds are 6 standard errors of the estimates."""
    cfg = Config(vocab_size=4096, n_embd=128, head_size=32, n_rwkv_layer=2, n_attn_layer=1)
    p = init_params(cfg, 4)
    emb = p["rwkv.emb.weight"].astype(np.float64)
    sd = EMB_INIT_RANGE / math.sqrt(3)
    assert -EMB_INIT_RANGE <= emb.min() and emb.max() < EMB_INIT_RANGE
    assert abs(emb.mean()) < 6 * sd / math.sqrt(emb.size)
    assert abs(emb.std() / sd - 1) < 6 / math.sqrt(2 * emb.size)
    for name, gain in (("rwkv.blocks.1.att.w2", 0.1), ("rwkv.blocks.1.att.g2", 0.1),
                       ("rwkv.blocks.1.att.receptance.weight", 1.0), ("rwkv.blocks.0.att.key.weight", 0.1),
                       ("rwkv.blocks.1.ffn.key.weight", 1.0), ("moba.0.att.value.weight", 1.0),
                       ("rwkv.head.weight", 0.5 * math.sqrt(4096 / 128))):
        w = p[name].astype(np.float64) / gain
        sd = 1 / math.sqrt(max(w.shape))
        assert abs(w.mean()) < 6 * sd / math.sqrt(w.size), name
        assert abs(w.std() / sd - 1) < 6 / math.sqrt(2 * w.size), name
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-6, err_msg=name)


def test_a_tensors_values_do_not_depend_on_other_tensors():
    """Each tensor's generator is keyed by (seed, its name): other blocks, the vocabulary and the number
    of attention blocks change nothing else."""
    a = init_params(Config(vocab_size=300, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=1), 9)
    b = init_params(Config(vocab_size=500, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=0), 9)
    for name in ("rwkv.blocks.2.att.key.weight", "rwkv.blocks.0.ffn.key.weight", "rwkv.blocks.1.att.g2"):
        np.testing.assert_array_equal(a[name], b[name])


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
