"""Random tuned tensors for tests that compare a tuned model on two paths (the decoder and the forward,
an emulated plan and the oracle, the GPU step and the oracle): initial WKV states or LoRA factors of a
Config, and the small models the tuned gradients are checked on."""
from __future__ import annotations

import numpy as np

from rwkvx import Config
from rwkvx.lora import TARGETS, LoraSettings, lora_shapes
from rwkvx.state_tuning import state_shapes


# The models of the tuned-gradient tests. T <= chunk * top_k: every past block is selected, so no selection
# near-ties between CPU and GPU; T = 45 is not a multiple of the chunked WKV7's 16 tokens
CFG = Config(vocab_size=97, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=1,
             moba_chunk_size=16, moba_top_k=3)
CFG64 = Config(vocab_size=97, n_embd=128, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
               moba_chunk_size=16, moba_top_k=3)
T = 45
# the tuned-gradient tests' adapter: rank 4 on every projection of both block kinds
GRADIENT_LORA = LoraSettings(4, 8.0, tuple(TARGETS))


def random_batch(cfg: Config, rng: np.random.Generator, B: int, length: int = T) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and targets [B, length] of ``cfg``, drawn from ``rng``."""
    tokens, targets = rng.integers(0, cfg.vocab_size, (2, B, length))
    return tokens, targets


def random_states(cfg: Config, rng) -> dict:
    """Initial WKV states of a tuned state's scale (0.5 x a standard normal), float32, drawn from ``rng``."""
    return {n: (0.5 * rng.standard_normal(s)).astype(np.float32) for n, s in state_shapes(cfg).items()}


# the std of a random LoRA B factor; A's is 1/sqrt(in), so h = x·A is of x's size. The update s·h·B then
# changes the logits by about their own size, as a trained adapter may, and the adapted model is as
# sensitive to fp32 rounding as the base model (the oracle's float32 logits within ~5e-7 of its float64
# ones). Factors of 0.3 x a standard normal make it some 30 times as sensitive (up to ~1e-5 from float64
# alone), more than two fp32 paths can agree to within their 1e-5 limit, and its MoBA gate gaps some 1000
# times the base model's, so TF32's relative error in them passes the absolute near-tie margin of the tf32
# decoder test (these factors: gaps of 2 to 4 times the base model's).
LORA_B_STD = 0.1


def random_factors(cfg: Config, settings: LoraSettings, rng: np.random.Generator) -> dict:
    """LoRA factors of ``settings`` for ``cfg``, float32, drawn from ``rng``: A [in, r] normal with std
    1/sqrt(in), B [r, out] normal with std :data:`LORA_B_STD` (both non-zero)."""
    return {n: (rng.standard_normal(s) * (1 / np.sqrt(s[0]) if n.endswith(".lora_A") else LORA_B_STD))
            .astype(np.float32) for n, s in lora_shapes(cfg, settings).items()}


def adapter_factors(cfg: Config, settings: LoraSettings, rng: np.random.Generator) -> dict:
    """LoRA factors of ``settings`` for ``cfg`` of a large adapter (A and B both 0.3 x a standard normal
    over sqrt(their rows): every factor gets a gradient, and the update is as large as the training-like
    weights it adapts, or larger), float32, drawn from ``rng``."""
    return {n: (0.3 * rng.standard_normal(s) / np.sqrt(s[0])).astype(np.float32)
            for n, s in lora_shapes(cfg, settings).items()}


# tuned_model's LoRA kinds -> alpha of rank 2: scale 1.5, and scale 1 (the default settings' scale, under
# which the step's update GEMM y += h·B is a plain residual add that the fused step takes as a dec_gemv job)
LORA_ALPHA = {"lora": 3.0, "lora_unit": 2.0}


def tuned_model(cfg: Config, tune: str | None, rng) -> dict:
    """Random initial states (``tune="state"``) or LoRA factors (a key of :data:`LORA_ALPHA`: rank 2 on
    every target ``cfg`` has, :func:`random_factors`) of ``cfg``, or nothing (None): ``{"oracle": keyword
    arguments of Oracle and Model, "layout": those of Layout, "tensors": region -> name-keyed float32
    tensors}``."""
    if tune == "state":
        states = random_states(cfg, rng)
        return dict(oracle=dict(states=states), layout=dict(tune_states=True), tensors={"states": states})
    if tune in LORA_ALPHA:
        settings = LoraSettings(2, LORA_ALPHA[tune],
                                tuple(t for t in TARGETS if t.split(".")[0] != "moba" or cfg.n_attn_layer))
        factors = random_factors(cfg, settings, rng)
        return dict(oracle=dict(lora=factors, lora_scale=settings.scale), layout=dict(lora=settings),
                    tensors={"lora": factors})
    return dict(oracle={}, layout={}, tensors={})
