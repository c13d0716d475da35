"""LoRA in the oracle (float64, seeded): the factors' gradients against central finite differences and
against the merged model's weight gradient projected onto them; zero B is the base model bit for bit;
the merged model computes what the adapted one does; bad factors are refused."""
import numpy as np
import pytest

from rwkvx import Config
from rwkvx.lora import DEFAULT_TARGETS, LoraSettings, factor_names, lora_shapes, merge
from rwkvx.oracle import Oracle

from finite_differences import numeric_gradient
from seeding import seeded_rng

TOL = 1e-7
SMALL = dict(vocab_size=11, n_embd=8, head_size=4, ffn_dim=12, dim_w=2, dim_a=2, dim_v=2, dim_g=3)
MOBA = ("moba.receptance", "moba.key", "moba.value", "moba.output")


def _case(seed, random_params, n_attn_layer=1, zero_b=False):
    """A random model, settings (rank 2, alpha 3: s = 1.5), random factors and a batch."""
    cfg = Config(**SMALL, n_rwkv_layer=2, n_attn_layer=n_attn_layer, moba_chunk_size=3, moba_top_k=2)
    settings = LoraSettings(2, 3.0, DEFAULT_TARGETS + (MOBA if n_attn_layer else ()))
    rng = seeded_rng(seed)
    factors = {n: (np.zeros(s) if zero_b and n.endswith("lora_B") else rng.standard_normal(s) * 0.3)
               for n, s in lora_shapes(cfg, settings).items()}
    tokens = rng.integers(0, cfg.vocab_size, (2, 7))
    targets = rng.integers(0, cfg.vocab_size, (2, 7))
    return cfg, random_params(cfg, seed), settings, factors, tokens, targets


@pytest.mark.parametrize("n_attn_layer", [0, 1], ids=["rwkv", "hybrid"])
def test_factor_gradients_match_finite_differences(n_attn_layer, random_params):
    seed = 20 + n_attn_layer
    cfg, params, settings, factors, tokens, targets = _case(seed, random_params, n_attn_layer)
    oracle = Oracle(cfg, params, lora=factors, lora_scale=settings.scale)
    sel = oracle.moba_selection(tokens) if n_attn_layer else None   # no near-tie may flip
    _, grads = oracle.loss_and_grads(tokens, targets, selection=sel)
    assert set(grads) == set(params) | set(factors)

    def loss():
        return Oracle(cfg, params, lora=factors, lora_scale=settings.scale).loss_and_grads(
            tokens, targets, selection=sel)[0]

    rng = seeded_rng(seed + 100)
    for name, f in factors.items():
        idx = rng.choice(f.size, min(f.size, 4), replace=False)
        numeric = numeric_gradient(loss, f, h=1e-5, indices=idx)
        analytic = grads[name].reshape(-1)[idx]
        assert np.linalg.norm(analytic - numeric) <= TOL * np.linalg.norm(numeric), \
            f"{name} (seed {seed})"


def test_factor_gradients_are_the_weight_gradient_projected(random_params):
    """With y = x·Wᵀ + s·(x·A)·B and G = dL/dy, the merged model W' = W + s·(A·B)ᵀ has dL/dW' = Gᵀ·x
    [out, in], and dL/dA = s·xᵀ·G·Bᵀ = s·(dL/dW')ᵀ·Bᵀ, dL/dB = s·(x·A)ᵀ·G = s·Aᵀ·(dL/dW')ᵀ."""
    seed = 22
    cfg, params, settings, factors, tokens, targets = _case(seed, random_params)
    s = settings.scale
    adapted = Oracle(cfg, params, lora=factors, lora_scale=s)
    merged_params = merge(cfg, params, factors, s)
    merged = Oracle(cfg, merged_params)
    sel = adapted.moba_selection(tokens)
    loss, grads = adapted.loss_and_grads(tokens, targets, selection=sel)
    loss_m, grads_m = merged.loss_and_grads(tokens, targets, selection=sel)
    assert abs(loss - loss_m) <= 1e-12 * abs(loss), f"seed {seed}"
    checked = 0
    for weight in params:
        a, b = factor_names(weight)
        if a not in factors:
            continue
        dW = grads_m[weight]
        np.testing.assert_allclose(grads[a], s * dW.T @ factors[b].T, rtol=1e-9, atol=1e-13,
                                   err_msg=f"{a} (seed {seed})")
        np.testing.assert_allclose(grads[b], s * factors[a].T @ dW.T, rtol=1e-9, atol=1e-13,
                                   err_msg=f"{b} (seed {seed})")
        checked += 1
    assert checked == len(factors) // 2


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merged_model_computes_the_adapted_one(dtype, random_params):
    seed = 23
    cfg, params, settings, factors, tokens, _ = _case(seed, random_params)
    if dtype == np.float32:
        params = {n: p.astype(np.float32) for n, p in params.items()}
    adapted = Oracle(cfg, params, dtype=dtype, lora=factors, lora_scale=settings.scale)
    merged = Oracle(cfg, merge(cfg, params, factors, settings.scale), dtype=dtype)
    base = Oracle(cfg, params, dtype=dtype).forward(tokens)
    out, out_m = adapted.forward(tokens), merged.forward(tokens)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(out_m, out, rtol=tol, atol=tol, err_msg=f"seed {seed}")
    assert np.abs(out - base).max() > 1e3 * tol, f"the factors change nothing (seed {seed})"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_zero_b_is_the_base_model_bit_for_bit(dtype, random_params):
    seed = 24
    cfg, params, settings, factors, tokens, targets = _case(seed, random_params, zero_b=True)
    plain = Oracle(cfg, params, dtype=dtype)
    adapted = Oracle(cfg, params, dtype=dtype, lora=factors, lora_scale=settings.scale)
    assert np.array_equal(plain.forward(tokens), adapted.forward(tokens)), f"seed {seed}"
    loss, grads = plain.loss_and_grads(tokens, targets)
    loss_a, grads_a = adapted.loss_and_grads(tokens, targets)
    assert loss == loss_a, f"seed {seed}"
    for name in grads:
        assert np.array_equal(grads[name], grads_a[name]), f"{name} (seed {seed})"
    assert all(grads_a[n].any() for n in factors if n.endswith("lora_B")), f"seed {seed}"
    logits, state = adapted.stateful_forward(tokens[:, :4])
    np.testing.assert_array_equal(logits, plain.stateful_forward(tokens[:, :4])[0])


def test_factors_are_checked(random_params):
    cfg, params, settings, factors, _, _ = _case(25, random_params)
    bad = dict(factors)
    bad["rwkv.blocks.0.att.key.lora_A"] = np.zeros((8, 3))
    with pytest.raises(ValueError, match=r"att\.key\.lora_A has shape \(8, 3\), .* need \(8, 2\)"):
        Oracle(cfg, params, lora=bad)
    with pytest.raises(ValueError, match=r"missing rwkv\.blocks\.0\.att\.key\.lora_B"):
        Oracle(cfg, params, lora={"rwkv.blocks.0.att.key.lora_A": np.zeros((8, 2))})
    with pytest.raises(ValueError, match=r"unexpected rwkv\.blocks\.0\.att\.w1\.lora_A"):
        Oracle(cfg, params, lora={**factors, "rwkv.blocks.0.att.w1.lora_A": np.zeros((8, 2))})
    with pytest.raises(ValueError, match="scale must be a finite number"):
        Oracle(cfg, params, lora=factors, lora_scale=float("nan"))
