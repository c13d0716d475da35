"""Named model + training presets for ``python -m rwkvx train --preset NAME``.

Each preset is a model (keyword arguments of :class:`rwkvx.Config`) and changes to the training
defaults of :class:`rwkvx.training.TrainConfig`; command line flags override single fields. ``tiny`` is the default: byte-level (V = 256), small enough that
``python -m rwkvx train`` with no arguments finishes in under 3 minutes on a 2-core CPU with the
oracle, and still learns (the loss ends well below the corpus's unigram byte entropy).
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
