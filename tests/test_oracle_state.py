"""Initial WKV states in the oracle (state tuning): the WKV7 twin's ds0 and the model's state
gradients against central finite differences (float64), and zero states against today's outputs,
bit for bit."""
import numpy as np
import pytest

from rwkvx import Config
from rwkvx.oracle import Oracle, wkv7_backward, wkv7_forward
from rwkvx.state_tuning import state_shapes, zero_states

from finite_differences import numeric_gradient
from seeding import seeded_rng
from test_oracle_ops import _wkv7_inputs

TOL = 1e-7
SMALL = dict(vocab_size=11, n_embd=8, head_size=4, ffn_dim=12, dim_w=2, dim_a=2, dim_v=2, dim_g=3)


def _wkv7_loss(args, s0, dy):
    return float(np.sum(wkv7_forward(*args, state=s0) * dy))


@pytest.mark.parametrize("shared", [False, True], ids=["per_sequence", "shared"])
def test_wkv7_ds0_matches_finite_differences(shared):
    rng = seeded_rng(10)
    args = _wkv7_inputs(rng, B=2, T=4, H=2, N=3)
    s0 = rng.standard_normal((1 if shared else 2, 2, 3, 3))
    dy = rng.standard_normal(args[0].shape)
    grads = wkv7_backward(*args, dy, state=s0)
    assert len(grads) == 7 and grads[6].shape == s0.shape
    numeric = numeric_gradient(lambda: _wkv7_loss(args, s0, dy), s0)
    assert np.linalg.norm(grads[6] - numeric) <= TOL * np.linalg.norm(numeric)
    # the other gradients see the state too
    x = args[2]
    idx = rng.choice(x.size, 6, replace=False)
    numeric_k = numeric_gradient(lambda: _wkv7_loss(args, s0, dy), x, indices=idx)
    assert np.linalg.norm(grads[2].reshape(-1)[idx] - numeric_k) <= TOL * np.linalg.norm(numeric_k)


def test_wkv7_zero_state_is_the_default_bit_for_bit():
    rng = seeded_rng(11)
    args = _wkv7_inputs(rng)
    dy = rng.standard_normal(args[0].shape)
    zero = np.zeros((1, 2, 3, 3))
    assert np.array_equal(wkv7_forward(*args, state=zero), wkv7_forward(*args))
    with_state, without = wkv7_backward(*args, dy, state=zero), wkv7_backward(*args, dy)
    assert all(np.array_equal(g, h) for g, h in zip(with_state, without))


def test_wkv7_state_shape_is_checked():
    args = _wkv7_inputs(seeded_rng(12))
    with pytest.raises(ValueError, match="state must have shape"):
        wkv7_forward(*args, state=np.zeros((3, 2, 3, 3)))


def _model(seed, random_params, n_attn_layer=0):
    cfg = Config(**SMALL, n_rwkv_layer=2, n_attn_layer=n_attn_layer, moba_chunk_size=3, moba_top_k=2)
    rng = seeded_rng(seed)
    states = {n: rng.standard_normal(s) * 0.5 for n, s in state_shapes(cfg).items()}
    tokens = rng.integers(0, cfg.vocab_size, (2, 7))
    targets = rng.integers(0, cfg.vocab_size, (2, 7))
    return cfg, random_params(cfg, seed), states, tokens, targets


@pytest.mark.parametrize("n_attn_layer", [0, 1], ids=["rwkv", "hybrid"])
def test_model_state_gradients_match_finite_differences(n_attn_layer, random_params):
    cfg, params, states, tokens, targets = _model(13, random_params, n_attn_layer)
    oracle = Oracle(cfg, params, states=states)
    sel = oracle.moba_selection(tokens) if n_attn_layer else None   # no near-tie may flip
    _, grads = oracle.loss_and_grads(tokens, targets, selection=sel)
    assert set(grads) == set(params) | set(states)
    rng = seeded_rng(14)
    for name, s in states.items():
        idx = rng.choice(s.size, 8, replace=False)
        numeric = numeric_gradient(
            lambda: Oracle(cfg, params, states=states).loss_and_grads(tokens, targets, selection=sel)[0],
            s, h=1e-5, indices=idx)
        analytic = grads[name].reshape(-1)[idx]
        assert np.linalg.norm(analytic - numeric) <= TOL * np.linalg.norm(numeric), name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_model_zero_states_change_nothing(dtype, random_params):
    cfg, params, _, tokens, targets = _model(15, random_params, n_attn_layer=1)
    plain = Oracle(cfg, params, dtype=dtype)
    zero = Oracle(cfg, params, dtype=dtype, states=zero_states(cfg))
    assert np.array_equal(plain.forward(tokens), zero.forward(tokens))
    loss, grads = plain.loss_and_grads(tokens, targets)
    loss0, grads0 = zero.loss_and_grads(tokens, targets)
    assert loss == loss0 and all(np.array_equal(grads[n], grads0[n]) for n in grads)


def test_stateful_forward_starts_from_the_states(random_params):
    """The prompt and then one token at a time from the states == the forward with those s0."""
    cfg, params, states, tokens, _ = _model(16, random_params, n_attn_layer=1)
    oracle = Oracle(cfg, params, states=states)
    full = oracle.forward(tokens)
    assert not np.allclose(full, Oracle(cfg, params).forward(tokens))
    logits, carried = oracle.stateful_forward(tokens[:, :4])
    np.testing.assert_allclose(logits, full[:, :4], rtol=1e-12, atol=1e-12)
    for t in range(4, 7):
        logits, carried = oracle.stateful_forward(tokens[:, t:t + 1], carried)
        np.testing.assert_allclose(logits, full[:, t:t + 1], rtol=1e-12, atol=1e-12)


def test_states_are_checked(random_params):
    cfg, params, states, _, _ = _model(17, random_params)
    bad = dict(states)
    bad["blocks.0.att.state"] = np.zeros((2, 4, 3))
    with pytest.raises(ValueError, match=r"blocks\.0\.att\.state has shape"):
        Oracle(cfg, params, states=bad)
    with pytest.raises(ValueError, match="missing blocks.1.att.state"):
        Oracle(cfg, params, states={"blocks.0.att.state": states["blocks.0.att.state"]})
