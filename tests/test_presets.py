"""The named presets (rwkvx/presets.py): every one builds a Config and a TrainConfig, the released RWKV-7
shapes and the RWKV-X models have their published parameter counts, and their training batch lays out on
an H200 (rwkvx.arena.Layout, no GPU needed)."""
import math

import pytest

from rwkvx import Config
from rwkvx.arena import Layout
from rwkvx.params import param_shapes
from rwkvx.presets import PRESETS, get_preset
from rwkvx.runtime.device import H200

# Parameter counts as published with the models (the RWKV-7 paper's table; the RWKV-X paper): the
# released "0.1B" and "0.4B" names understate their counts, which include the V = 65536 embedding and head.
PUBLISHED = {"rwkv7-0.1b": 0.19e9, "rwkv7-0.4b": 0.45e9, "rwkv7-1.5b": 1.5e9, "rwkv7-2.9b": 2.9e9,
             "rwkv7-7.2b": 7.2e9, "rwkvx-0.2b": 0.22e9, "rwkvx-3.6b": 3.6e9}
H200_BYTES = 139 << 30        # the H200's memory as the driver reports it, less what the context takes


def n_params(cfg: Config) -> int:
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds(name):
    for device in ("cpu", "gpu"):
        preset = get_preset(name, device)
        Config(**preset["model"])
        assert preset["train"].lr_min <= preset["train"].lr


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_released_shapes_have_their_published_size(name):
    cfg = Config(**get_preset(name)["model"])
    assert abs(n_params(cfg) / PUBLISHED[name] - 1) < 0.10
    assert (cfg.vocab_size, cfg.head_size, cfg.ffn_dim) == (65536, 64, 4 * cfg.n_embd)


def test_released_lora_ranks():
    """The released checkpoints' ranks: Config's sqrt(C) defaults agree up to C = 1024, not beyond."""
    ranks = {name: (c.dim_w, c.dim_a, c.dim_v, c.dim_g)
             for name, c in ((n, Config(**get_preset(n)["model"])) for n in PUBLISHED)}
    assert ranks["rwkv7-0.1b"] == ranks["rwkv7-0.4b"] == ranks["rwkvx-0.2b"] == (64, 64, 32, 128)
    assert ranks["rwkv7-1.5b"] == (96, 96, 64, 256)
    assert ranks["rwkv7-2.9b"] == ranks["rwkvx-3.6b"] == (96, 96, 64, 320)
    assert ranks["rwkv7-7.2b"] == (128, 128, 96, 480)


@pytest.mark.parametrize("base, upgraded, blocks", [("rwkv7-0.1b", "rwkvx-0.2b", 4), ("rwkv7-2.9b", "rwkvx-3.6b", 8)])
def test_rwkvx_models_are_their_rwkv7_model_plus_moba_blocks(base, upgraded, blocks):
    rwkv7, rwkvx = get_preset(base)["model"], get_preset(upgraded)["model"]
    assert rwkvx["n_attn_layer"] == blocks and rwkvx["moba_chunk_size"] == 2048
    assert {k: v for k, v in rwkvx.items() if k not in ("n_attn_layer", "moba_chunk_size", "moba_top_k")} == {
        k: v for k, v in rwkv7.items() if k != "n_attn_layer"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_training_batch_lays_out_on_an_h200(name):
    preset = get_preset(name, "gpu")
    cfg, train = Config(**preset["model"]), preset["train"]
    layout = Layout(cfg, train.batch_size, train.seq_len, H200, train.precision, recompute=True)
    assert n_params(cfg) * 16 < layout.total < H200_BYTES   # weights, gradients, 2 moments: 16 bytes each


def test_train_resolves_a_preset_by_name():
    """`train --preset rwkv7-0.1b` takes the preset's model and settings (text data: V from the tokenizer)."""
    from rwkvx.cli import build_parser
    from rwkvx.training.setup import RunRequest, prepare

    args = build_parser().parse_args(["train", "--preset", "rwkv7-0.1b"])
    prep = prepare(RunRequest(preset=args.preset, device="cpu", progress=False))
    assert (prep.cfg.n_embd, prep.cfg.n_rwkv_layer, prep.cfg.dim_g, prep.cfg.vocab_size) == (768, 12, 128, 256)
    assert prep.train == get_preset("rwkv7-0.1b")["train"]
