"""Random tuned tensors for tests that compare a tuned model on two paths (the decoder and the forward,
an emulated plan and the oracle): initial WKV states or LoRA factors of a Config."""
from __future__ import annotations

import numpy as np

from rwkvx import Config
from rwkvx.lora import TARGETS, LoraSettings, lora_shapes
from rwkvx.state_tuning import state_shapes


def random_states(cfg: Config, rng) -> dict:
    """Initial WKV states of a tuned state's scale (0.5 x a standard normal), float32, drawn from ``rng``."""
    return {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in state_shapes(cfg).items()}


def tuned_model(cfg: Config, tune: str | None, rng) -> dict:
    """Random initial states (``tune="state"``) or LoRA factors (``"lora"``: rank 2 on every target ``cfg``
    has, both factors non-zero) of ``cfg``, or nothing (None): ``{"oracle": keyword arguments of Oracle
    and Model, "layout": those of Layout, "tensors": region -> name-keyed float32 tensors}``."""
    if tune == "state":
        states = random_states(cfg, rng)
        return dict(oracle=dict(states=states), layout=dict(tune_states=True), tensors={"states": states})
    if tune == "lora":
        settings = LoraSettings(2, 3.0, tuple(t for t in TARGETS if t.split(".")[0] != "moba" or cfg.n_attn_layer))
        factors = {n: (0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in lora_shapes(cfg, settings).items()}
        return dict(oracle=dict(lora=factors, lora_scale=settings.scale), layout=dict(lora=settings),
                    tensors={"lora": factors})
    return dict(oracle={}, layout={}, tensors={})
