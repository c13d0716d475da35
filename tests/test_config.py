"""Config defaults, validation and block order (docs/SPEC.md §2.1, §2.2)."""
import pytest

from rwkvx import Config


@pytest.mark.parametrize("C, ranks", [(256, (32, 32, 32, 64)), (768, (64, 64, 32, 128)),
                                      (2048, (128, 128, 64, 224))])
def test_lora_rank_defaults(C, ranks):
    cfg = Config(vocab_size=10, n_embd=C, n_rwkv_layer=1)
    assert (cfg.dim_w, cfg.dim_a, cfg.dim_v, cfg.dim_g) == ranks
    assert cfg.ffn_dim == 4 * C and cfg.n_head == C // 64


def test_block_order_with_leftovers():
    cfg = Config(vocab_size=10, n_embd=16, head_size=8, n_rwkv_layer=5, n_attn_layer=2)
    assert cfg.block_order() == [("rwkv", 0), ("rwkv", 1), ("attn", 0), ("rwkv", 2), ("rwkv", 3),
                                 ("attn", 1), ("rwkv", 4)]
    assert Config(vocab_size=10, n_embd=16, head_size=8, n_rwkv_layer=2).block_order() == [
        ("rwkv", 0), ("rwkv", 1)]


@pytest.mark.parametrize("kwargs, field", [
    ({"vocab_size": 0}, "vocab_size"), ({"n_embd": 30}, "head_size"), ({"n_rwkv_layer": 0}, "n_rwkv_layer"),
    ({"n_attn_layer": 3}, "n_attn_layer"), ({"n_attn_layer": -1}, "n_attn_layer"),
    ({"moba_chunk_size": 0}, "moba_chunk_size"), ({"moba_top_k": 0}, "moba_top_k"),
    ({"ffn_dim": 0}, "ffn_dim"), ({"dim_w": 0}, "dim_w"),
])
def test_invalid_config_names_field(kwargs, field):
    base = dict(vocab_size=10, n_embd=32, head_size=8, n_rwkv_layer=2)
    base.update(kwargs)
    with pytest.raises(ValueError, match=field):
        Config(**base)


def test_wrong_types():
    with pytest.raises(TypeError, match="n_embd"):
        Config(vocab_size=10, n_embd=32.0, n_rwkv_layer=1)
    with pytest.raises(TypeError, match="ln0"):
        Config(vocab_size=10, n_embd=64, n_rwkv_layer=1, ln0=1)


def test_dict_round_trip():
    cfg = Config(vocab_size=10, n_embd=32, head_size=8, n_rwkv_layer=3, n_attn_layer=1, ln0=False)
    assert Config.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="bogus"):
        Config.from_dict({**cfg.to_dict(), "bogus": 1})
