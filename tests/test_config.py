"""Config defaults, validation and block order (docs/SPEC.md §2.1, §2.2); TrainConfig validation and resume."""
import numpy as np
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


def test_config_errors_carry_their_fields():
    from rwkvx.validate import FieldError

    with pytest.raises(FieldError) as exc:
        Config(vocab_size=10, n_embd=60, head_size=16, n_rwkv_layer=1)
    assert exc.value.owner == "Config" and exc.value.fields == {"head_size": 16, "n_embd": 60}
    assert str(exc.value) == "Config.head_size=16 must divide Config.n_embd=60"
    spelt = exc.value.render(lambda name, value: f"<{name} {value}>")
    assert spelt == "<head_size 16> must divide <n_embd 60>"


@pytest.mark.parametrize("changes, field", [
    ({"batch_size": 0}, "batch_size"), ({"seq_len": 0}, "seq_len"), ({"steps": 0}, "steps"),
    ({"lr": 0.0}, "lr"), ({"lr_min": -1.0}, "lr_min"), ({"lr": 1e-4, "lr_min": 1e-3}, "lr_min"),
    ({"warmup": -1}, "warmup"), ({"grad_clip": float("nan")}, "grad_clip"),
    ({"val_fraction": 1.0}, "val_fraction"), ({"schedule_steps": 0}, "schedule_steps"),
    ({"cpu_dtype": "float16"}, "cpu_dtype"), ({"eval_batches": 0}, "eval_batches"),
])
def test_train_config_errors_name_the_field(changes, field):
    from rwkvx import TrainConfig
    from rwkvx.validate import FieldError

    with pytest.raises(FieldError, match=f"TrainConfig.{field}=") as exc:
        TrainConfig(**changes)
    assert field in exc.value.fields


def test_train_config_types_round_trip_and_resume():
    from rwkvx import TrainConfig

    with pytest.raises(TypeError, match="recompute"):
        TrainConfig(recompute=1)
    with pytest.raises(TypeError, match="colour"):
        TrainConfig().replace(colour="blue")
    c = TrainConfig(batch_size=np.int64(4), cpu_dtype=np.float64, precision="tf32", lr=1)
    assert (c.batch_size, c.cpu_dtype, c.lr) == (4, "float64", 1.0) and type(c.batch_size) is int
    assert TrainConfig.from_dict(c.to_dict()) == c
    assert c.schedule.total_steps == c.steps

    # a longer resumed run keeps the cosine's length; stretched, the cosine ends at the new steps
    saved = TrainConfig(steps=100)
    assert saved.resumed(steps=300).schedule.total_steps == 100
    assert saved.resumed(True, steps=300).schedule.total_steps == 300
    assert saved.resumed(lr=2e-3) == saved.replace(lr=2e-3)        # no new steps: nothing pinned
    assert saved.resumed(steps=300).resumed(steps=500).schedule.total_steps == 100
