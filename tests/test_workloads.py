"""CPU tests of rwkvx/workloads.py (what the benchmarks and timing scripts run) and of the argument check of
rwkvx.runtime.warm_time_ms: the named workloads are the presets' models, the kernel shapes are the model's,
the visible-key count is the selection rule's, and the WKV7 benchmark's decay logits give the decay rwkvx's
kernels read as RWKV-LM's clampw kernel computes it."""
import dataclasses
import math

import numpy as np
import pytest

from rwkvx import Config
from rwkvx.presets import PRESETS, get_preset
from rwkvx.config import DECAY_SCALE
from rwkvx.runtime import warm_time_ms
from rwkvx.runtime.dtypes import round_to
from rwkvx.runtime.timing import budget_repeats
from rwkvx.workloads import (BASE, BASE_SHAPES, MOBA_SHAPES, STEP_WORKLOADS, WKV7_SHAPES, KernelShapes,
                             moba_visible_keys, preset_workload, step_model_flops, wkv7_decay, wkv7_decay_logit_grad,
                             wkv7_decay_logits)

from seeding import seeded_rng


def test_base_is_the_base_preset_at_its_training_batch():
    preset = get_preset("base", device="gpu")
    assert BASE.config == Config(**preset["model"])
    assert (BASE.batch_size, BASE.seq_len) == (preset["train"].batch_size, preset["train"].seq_len)
    s = BASE_SHAPES
    cfg = BASE.config
    assert (s.C, s.H, s.N, s.F, s.V) == (cfg.n_embd, cfg.n_head, cfg.head_size, cfg.ffn_dim, cfg.vocab_size)
    assert (s.chunk, s.top_k) == (cfg.moba_chunk_size, cfg.moba_top_k) and s.R == s.B * s.T == 8 * 4096


def test_preset_workload_overrides():
    w = preset_workload("base", 16, 512, n_attn_layer=0)
    assert (w.batch_size, w.seq_len, w.config.n_attn_layer) == (16, 512, 0)
    assert w.config.n_embd == PRESETS["base"]["model"]["n_embd"]
    assert KernelShapes.of(w).R == 16 * 512
    with pytest.raises(ValueError, match="unknown preset"):
        preset_workload("huge")


def test_named_shapes():
    assert STEP_WORKLOADS["base_B8_T4096"] == BASE
    for name, (cfg, B, T) in STEP_WORKLOADS.items():
        assert name.endswith(f"_B{B}_T{T}") and (cfg.n_attn_layer == 0) == name.startswith("pure")
    assert WKV7_SHAPES["B8_T4096_H12"] == (BASE_SHAPES.B, BASE_SHAPES.T, BASE_SHAPES.H)
    wide = KernelShapes.of(preset_workload("rwkv7-1.5b", 4))
    assert WKV7_SHAPES["B4_T4096_H32"] == (wide.B, wide.T, wide.H) and wide.N == BASE_SHAPES.N
    assert MOBA_SHAPES["B8-T4096"] == (BASE_SHAPES.B, BASE_SHAPES.T, BASE_SHAPES.chunk)


def test_step_model_flops():
    """6 flops per GEMM weight element per token: the released 1.5B model (1.53B parameters, 0.13B of them
    the embedding, a lookup) does 6 x ~1.4e9 per token; a MoBA block adds 12 N per visible (query, key) pair
    and head over its projections' 6 per weight."""
    pure = preset_workload("rwkv7-1.5b").config
    per_token = step_model_flops(pure, 1, 1)
    assert 6 * 1.3e9 < per_token < 6 * 1.5e9
    assert step_model_flops(pure, 4, 4096) == pytest.approx(4 * 4096 * per_token)
    cfg = Config(vocab_size=64, n_embd=32, n_rwkv_layer=1, n_attn_layer=1, head_size=16, moba_chunk_size=8,
                 moba_top_k=2)
    T = 8                                 # one chunk: query t sees keys 0..t
    attn = step_model_flops(cfg, 1, T) - step_model_flops(dataclasses.replace(cfg, n_attn_layer=0), 1, T)
    projections = 6 * T * (4 * 32 * 32 + 2 * 32 * 128)     # q, k, v, o and the block's FFN
    assert attn == pytest.approx(projections + 12 * 16 * 2 * T * (T + 1) // 2)


@pytest.mark.parametrize("T,chunk,top_k", [(1, 1, 1), (10, 3, 2), (37, 8, 3), (64, 16, 5), (512, 64, 3)])
def test_moba_visible_keys_counts_each_query(T, chunk, top_k):
    want = 0
    for t in range(T):
        own = t // chunk
        want += t - own * chunk + 1 + min(top_k - 1, own) * chunk      # own block to t, then full blocks
    assert moba_visible_keys(T, chunk, top_k) == want


def test_warm_time_ms_rejects_no_repeats():
    with pytest.raises(ValueError, match="repeats"):
        warm_time_ms(None, lambda: None, 0)


def test_warm_time_ms_budget_repeats():
    assert budget_repeats(1.0, 50.0) == 50
    assert budget_repeats(100.0, 50.0) == 3 and budget_repeats(0.0, 50.0) == 200


def test_wkv7_decay_logits_are_bf16():
    x = wkv7_decay_logits(1 << 14)
    assert np.array_equal(round_to("bf16", x), x)        # a bf16 reader sees these logits exactly
    assert np.array_equal(wkv7_decay_logits(1 << 14), x) and 0.9 < x.std() < 1.1


def test_wkv7_decay_is_the_clampw_kernels():
    """The decay of the logits x, in float64, is RWKV-LM's clampw transform exp(W_SCALE / (1 + e^-x)) with
    its W_SCALE = -e^-0.5 (an fp32 constant in the kernel: DECAY_SCALE rounded to fp32), and equals
    exp(-exp(w)) of RWKV-7's decay parameter w = -softplus(-x) - 0.5 to the last bit."""
    x = np.concatenate([wkv7_decay_logits(1 << 14), np.linspace(-30.0, 30.0, 1201)])
    decay = wkv7_decay(x)
    assert np.array_equal(decay, np.exp(-math.exp(-0.5) / (1 + np.exp(-x))))
    assert np.float32(-0.6065306597) == np.float32(-DECAY_SCALE)
    w = -np.logaddexp(0.0, -x) - 0.5
    np.testing.assert_allclose(decay, np.exp(-np.exp(w)), rtol=2 * np.finfo(np.float64).eps, atol=0)
    assert np.all((decay > math.exp(-DECAY_SCALE)) & (decay < 1))


def test_wkv7_decay_logit_grad_is_the_chain_rule():
    rng = seeded_rng(21)
    x, d_decay = 3 * rng.standard_normal(4096), rng.standard_normal(4096)
    h = 1e-6                # central differences: truncation ~h², rounding ~eps/h (the atol)
    numeric = d_decay * (wkv7_decay(x + h) - wkv7_decay(x - h)) / (2 * h)
    np.testing.assert_allclose(wkv7_decay_logit_grad(d_decay, x), numeric, rtol=1e-7, atol=1e-9)
