"""CPU tests of rwkvx/workloads.py (what the benchmarks and timing scripts run) and of the argument check of
rwkvx.runtime.warm_time_ms: the named workloads are the presets' models, the kernel shapes are the model's,
the visible-key count is the selection rule's."""
import pytest

from rwkvx import Config
from rwkvx.presets import PRESETS, get_preset
from rwkvx.runtime import warm_time_ms
from rwkvx.workloads import (BASE, BASE_SHAPES, MOBA_SHAPES, STEP_WORKLOADS, WKV7_SHAPES, KernelShapes,
                             moba_visible_keys, preset_workload)


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
    assert MOBA_SHAPES["B8-T4096"] == (BASE_SHAPES.B, BASE_SHAPES.T, BASE_SHAPES.chunk)


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
