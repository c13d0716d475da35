"""Named model + training presets for ``python -m rwkvx train --preset NAME`` and :func:`get_preset`.

Each preset is a model (keyword arguments of :class:`rwkvx.Config`) and changes to the training
defaults of :class:`rwkvx.training.TrainConfig`; command line flags override single fields. ``tiny`` is the default: byte-level (V = 256), small enough that
``python -m rwkvx train`` with no arguments finishes in under 3 minutes on a 2-core CPU with the
oracle, and still learns (the loss ends well below the corpus's unigram byte entropy).

``rwkv7-*`` are the shapes of the released RWKV-7 "Goose" models (World tokenizer, V = 65536, N = 64,
FFN 4C, the released LoRA ranks); ``rwkvx-*`` the RWKV-X models built from two of them by adding MoBA
blocks. Their training settings are starting points for one H200 in bf16 (README.md lists the sizes).
"""
from __future__ import annotations

import copy
from typing import Any

from .training.config import TrainConfig

PRESETS: dict[str, dict[str, Any]] = {
    # The no-argument default (corpus: rwkvx/data/README.md). The GPU path runs the same model;
    # it may choose more steps or a bigger batch (GPU_TRAIN below).
    "tiny": {
        # 212k parameters; T = 128 is 4 MoBA blocks of 32, each query sees its own + 1 chosen.
        # Measured alone on the 2-core CI machine: ~54 ms/step (float32 oracle), ~60 s in all;
        # validation loss ~1.6 nats/byte vs the corpus's unigram entropy 3.31.
        "model": {"vocab_size": 256, "n_embd": 64, "n_rwkv_layer": 2, "n_attn_layer": 1,
                  "head_size": 16, "moba_chunk_size": 32, "moba_top_k": 2},
        "train": {"lr": 4e-3, "lr_min": 4e-4, "warmup": 20, "ckpt_every": 250},
    },
    # A small RWKV-X whose GPU step is launch-bound: V=256, C=256, L=4, M=1, B=8, T=512.
    "small": {
        "model": {"vocab_size": 256, "n_embd": 256, "n_rwkv_layer": 4, "n_attn_layer": 1,
                  "head_size": 64, "moba_chunk_size": 64, "moba_top_k": 3},
        "train": {"batch_size": 8, "seq_len": 512, "steps": 2000, "lr": 1e-3, "lr_min": 1e-4,
                  "warmup": 100, "eval_every": 200, "ckpt_every": 500},
    },
    # The 0.22B RWKV-X benchmark config (needs a GPU and a tokenised dataset with V = 65536).
    "base": {
        "model": {"vocab_size": 65536, "n_embd": 768, "n_rwkv_layer": 12, "n_attn_layer": 4,
                  "head_size": 64, "moba_chunk_size": 512, "moba_top_k": 3},
        "train": {"batch_size": 8, "seq_len": 4096, "steps": 10000, "lr": 6e-4, "lr_min": 6e-5,
                  "warmup": 500, "weight_decay": 0.1, "eval_every": 500, "ckpt_every": 1000},
    },
}

# The released RWKV-7 shapes: (C, L, (dim_w, dim_a, dim_v, dim_g)). The LoRA ranks are the released
# checkpoints' (they differ from Config's sqrt(C) defaults from C = 2048 on).
_RWKV7_SHAPES = {
    "0.1b": (768, 12, (64, 64, 32, 128)),
    "0.4b": (1024, 24, (64, 64, 32, 128)),
    "1.5b": (2048, 24, (96, 96, 64, 256)),
    "2.9b": (2560, 32, (96, 96, 64, 320)),
    "7.2b": (4096, 32, (128, 128, 96, 480)),
}


def _rwkv7_model(size: str, **changes: Any) -> dict[str, Any]:
    """The model of the released RWKV-7 ``size`` (with ``changes``, e.g. MoBA blocks)."""
    C, L, (w, a, v, g) = _RWKV7_SHAPES[size]
    return {"vocab_size": 65536, "n_embd": C, "n_rwkv_layer": L, "head_size": 64, "ffn_dim": 4 * C,
            "dim_w": w, "dim_a": a, "dim_v": v, "dim_g": g, "n_attn_layer": 0, **changes}


# Training for the released shapes and the RWKV-X models: bf16, weight decay 0.1, the cosine ending at
# a tenth of the peak, the batch sized so that the arena (rwkvx.arena.Layout, recompute on) fits one
# H200 with room to spare; peak learning rates fall with the width as in RWKV-LM's recipes.
def _large_train(batch_size: int, seq_len: int, lr: float, warmup: int) -> dict[str, Any]:
    return {"precision": "bf16", "batch_size": batch_size, "seq_len": seq_len, "steps": 10000, "lr": lr,
            "lr_min": lr / 10, "warmup": warmup, "weight_decay": 0.1, "eval_every": 500, "ckpt_every": 1000}


PRESETS.update({
    "rwkv7-0.1b": {"model": _rwkv7_model("0.1b"), "train": _large_train(16, 4096, 6e-4, 500)},
    "rwkv7-0.4b": {"model": _rwkv7_model("0.4b"), "train": _large_train(8, 4096, 5e-4, 500)},
    "rwkv7-1.5b": {"model": _rwkv7_model("1.5b"), "train": _large_train(8, 4096, 3e-4, 1000)},
    "rwkv7-2.9b": {"model": _rwkv7_model("2.9b"), "train": _large_train(4, 4096, 2e-4, 1000)},
    # 7.2B: weights, gradients and AdamW moments alone are 16 bytes a parameter (115 GB)
    "rwkv7-7.2b": {"model": _rwkv7_model("7.2b"), "train": _large_train(1, 4096, 1.5e-4, 1000)},
    # RWKV-X (the RWKV-X paper): RWKV-7 0.1B + 4 MoBA blocks (one after every 3 RWKV blocks; 0.22B),
    # RWKV-7 2.9B + 8 MoBA blocks (one after every 4; 3.6B). T = 16384 gives 8 MoBA blocks of 2048.
    "rwkvx-0.2b": {"model": _rwkv7_model("0.1b", n_attn_layer=4, moba_chunk_size=2048, moba_top_k=4),
                   "train": _large_train(4, 16384, 6e-4, 500)},
    "rwkvx-3.6b": {"model": _rwkv7_model("2.9b", n_attn_layer=8, moba_chunk_size=2048, moba_top_k=3),
                   "train": _large_train(1, 16384, 2e-4, 1000)},
})

DEFAULT_PRESET = "tiny"

# Training overrides the GPU backend applies to a preset when the user gave no explicit value:
# the GPU takes 8x the tokens per step of the CPU default in a fraction of the time.
GPU_TRAIN: dict[str, dict[str, Any]] = {"tiny": {"batch_size": 32, "seq_len": 256}}


def get_preset(name: str, device: str = "cpu") -> dict[str, Any]:
    """``{"model": {...}, "train": TrainConfig}``: preset ``name``'s model (keyword arguments of
    :class:`rwkvx.Config`) and training settings on ``device`` ("cpu" or "gpu")."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    preset = PRESETS[name]
    train = TrainConfig(**preset["train"])
    if device == "gpu":
        train = train.replace(**GPU_TRAIN.get(name, {}))
    return {"model": copy.deepcopy(preset["model"]), "train": train}
