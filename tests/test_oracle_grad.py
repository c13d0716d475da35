"""Finite-difference checks of the oracle's hand-written backward, every parameter tensor (float64).

Per tensor, a few entries are sampled (half at random, half where the analytic gradient is
largest) and compared with central differences of the loss; the error of a tensor is
||analytic_s - numeric_s|| / ||numeric_s|| over its sampled entries and must be <= 1e-6.
The worst tensor of each config is printed (run with -s to see it).
"""
import numpy as np
import pytest

from rwkvx import Config
from rwkvx.oracle import Oracle

from finite_differences import central_difference
from seeding import seeded_rng

TOL = 1e-6
SAMPLES = 3       # per tensor: 3 random entries + 3 with the largest analytic gradient
STEP = 1e-5       # relative step: truncation O(h^2) and roundoff O(eps/h) balance near here

SMALL = dict(vocab_size=13, n_embd=16, head_size=4, ffn_dim=24, dim_w=3, dim_a=4, dim_v=2, dim_g=5)

CONFIGS = {
    # name: (config kwargs, B, T, ignored targets)
    "rwkv_only": (dict(SMALL, n_rwkv_layer=2), 1, 9, 0),
    # T=19 > chunk*top_k=8: the selection is genuinely sparse; 19 is not a multiple of 4
    "hybrid_sparse": (dict(SMALL, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=4,
                           moba_top_k=2), 1, 19, 0),
    "top_k_1": (dict(SMALL, n_rwkv_layer=1, n_attn_layer=1, moba_chunk_size=3,
                     moba_top_k=1), 1, 10, 0),
    "no_ln0": (dict(SMALL, vocab_size=11, n_embd=24, head_size=8, n_rwkv_layer=2, n_attn_layer=1,
                    moba_chunk_size=4, moba_top_k=3, ln0=False), 1, 14, 0),
    # L=3, M=2: rwkv0 attn0 rwkv1 attn1 rwkv2 (leftover block)
    "leftover": (dict(SMALL, n_rwkv_layer=3, n_attn_layer=2, moba_chunk_size=3,
                      moba_top_k=2), 1, 11, 0),
    # two sequences, some targets ignored, T=7 not a multiple of the chunk 3
    "batch2_ignore": (dict(SMALL, n_rwkv_layer=2, n_attn_layer=1, moba_chunk_size=3,
                           moba_top_k=2), 2, 7, 4),
}


def _loss(oracle, tokens, targets, sel, ignore_index=-100):
    """The loss from the oracle's logits, recomputed independently (float64 log-softmax)."""
    z = oracle.forward(tokens, selection=sel).astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    logp = z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))
    valid = targets != ignore_index
    if not valid.any():
        return 0.0
    return float(-logp[valid, targets[valid]].mean())


def _problem(name, random_params, seed=0):
    kwargs, B, T, n_ignored = CONFIGS[name]
    cfg = Config(**kwargs)
    rng = seeded_rng(seed + 1)
    tokens = rng.integers(0, cfg.vocab_size, (B, T))
    targets = rng.integers(0, cfg.vocab_size, (B, T))
    if n_ignored:
        flat = targets.reshape(-1)
        flat[rng.choice(flat.size, n_ignored, replace=False)] = -100
    oracle = Oracle(cfg, random_params(cfg, seed))
    return cfg, oracle, tokens, targets


def _sample(grad, rng, tokens=None, is_emb=False):
    flat = np.abs(grad.reshape(-1))
    if is_emb:   # rows of tokens absent from the batch have an exactly-zero gradient: skip them
        cols = grad.shape[1]
        rows = np.unique(tokens)
        pool = (rows[:, None] * cols + np.arange(cols)).reshape(-1)
    else:
        pool = np.arange(flat.size)
    rand = rng.choice(pool, min(SAMPLES, pool.size), replace=False)
    top = pool[np.argsort(-flat[pool], kind="stable")[:SAMPLES]]
    return np.unique(np.concatenate([rand, top]))


def fd_errors(oracle, tokens, targets, sel, seed=0):
    """Relative error of every parameter tensor: {name: err}."""
    rng = seeded_rng(seed)
    _, grads = oracle.loss_and_grads(tokens, targets, selection=sel)
    errors = {}
    for name, grad in grads.items():
        p = oracle.params[name].reshape(-1)          # a view: perturb in place
        idx = _sample(grad, rng, tokens, name == "rwkv.emb.weight")
        analytic = grad.reshape(-1)[idx]
        numeric = np.array([central_difference(lambda: _loss(oracle, tokens, targets, sel), p, i,
                                               STEP * max(1.0, abs(p[i]))) for i in idx])
        errors[name] = float(np.linalg.norm(analytic - numeric) / np.linalg.norm(numeric))
    return errors


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_finite_differences(name, random_params):
    cfg, oracle, tokens, targets = _problem(name, random_params)
    # Force the oracle's own selection so perturbations cannot flip a near-tie.
    sel = oracle.moba_selection(tokens) if cfg.n_attn_layer else None
    if name == "hybrid_sparse":
        nsel = cfg.moba_top_k - 1
        assert (sel[0][..., :nsel] >= 0).sum() > 0
        n_past = np.arange(tokens.shape[1]) // cfg.moba_chunk_size   # past blocks per query
        assert (n_past > nsel).any(), "some query must have more past blocks than it selects"
    errors = fd_errors(oracle, tokens, targets, sel)
    assert set(errors) == set(oracle.params)
    worst = max(errors, key=errors.get)
    print(f"\n[{name}] worst FD relative error {errors[worst]:.3e} ({worst}), "
          f"{len(errors)} tensors")
    bad = {n: e for n, e in errors.items() if not e <= TOL}
    assert not bad, f"gradients off for {name}: {bad}"


def test_loss_matches_numpy_log_softmax(random_params):
    cfg, oracle, tokens, targets = _problem("batch2_ignore", random_params)
    loss, grads = oracle.loss_and_grads(tokens, targets)
    logits = oracle.forward(tokens)
    z = logits.reshape(-1, cfg.vocab_size)
    t = targets.reshape(-1)
    valid = t != -100
    lse = np.log(np.sum(np.exp(z - z.max(1, keepdims=True)), axis=1)) + z.max(1)
    expected = np.mean(lse[valid] - z[valid, t[valid]])
    assert abs(loss - expected) <= 1e-12 * abs(expected)
    assert isinstance(loss, float)
    assert set(grads) == set(oracle.params)
    for n, g in grads.items():
        assert g.shape == oracle.params[n].shape and g.dtype == np.float64


def test_all_ignored_targets_give_zero_loss_and_grads(random_params):
    cfg, oracle, tokens, _ = _problem("batch2_ignore", random_params)
    targets = np.full(tokens.shape, -100)
    loss, grads = oracle.loss_and_grads(tokens, targets)
    assert loss == 0.0
    assert all(not g.any() for g in grads.values())
    # a custom ignore_index works the same way
    loss, grads = oracle.loss_and_grads(tokens, np.full(tokens.shape, 7), ignore_index=7)
    assert loss == 0.0 and all(not g.any() for g in grads.values())


def test_ignored_targets_do_not_contribute(random_params):
    cfg, oracle, tokens, targets = _problem("batch2_ignore", random_params)
    loss, grads = oracle.loss_and_grads(tokens, targets)
    other = targets.copy()
    other[targets == -100] = -7     # a different ignore value at the same places
    loss2, grads2 = oracle.loss_and_grads(tokens, other, ignore_index=-7)
    assert loss == loss2
    assert all(np.array_equal(grads[n], grads2[n]) for n in grads)


def test_sequences_are_independent(random_params):
    cfg, oracle, tokens, _ = _problem("batch2_ignore", random_params)
    both = oracle.forward(tokens)
    for b in range(tokens.shape[0]):
        np.testing.assert_allclose(oracle.forward(tokens[b:b + 1]), both[b:b + 1], rtol=1e-12,
                                   atol=1e-12)


def test_full_selection_is_causal_attention(random_params):
    """T <= chunk * top_k: every past block is selected, so no forced selection matters."""
    cfg = Config(**dict(SMALL, n_rwkv_layer=1, n_attn_layer=1, moba_chunk_size=4, moba_top_k=3))
    oracle = Oracle(cfg, random_params(cfg, 3))
    tokens = seeded_rng(3).integers(0, cfg.vocab_size, (1, 12))
    sel = oracle.moba_selection(tokens)[0]
    for t in range(12):
        expect = list(range(t // 4)) + [-1] * (2 - t // 4)
        assert (sel[:, :, t] == expect).all()
