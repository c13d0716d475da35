"""Model configuration: the fields of docs/SPEC.md §2.1 and the block order of §2.2."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .validate import FieldError, require_int

# Numerical constants of the model (docs/SPEC.md §2.3), shared by the oracle and the kernels (as NVRTC defines).
LN_EPS = 1e-5                    # every LayerNorm
GN_EPS = 64e-5                   # ln_x GroupNorm, for every head size
L2_EPS = 1e-12                   # l2-normalise: x / max(||x||, 1e-12)
DECAY_SCALE = math.exp(-0.5)     # decay = exp(-DECAY_SCALE * sigmoid(.)) lies in (0.5452, 1)

# LoRA rank multipliers of RWKV-LM x070: rank = max(32, round(k * sqrt(C) / 32) * 32).
_LORA_FACTORS = {"dim_w": 2.5, "dim_a": 2.5, "dim_v": 1.7, "dim_g": 5.0}


def _lora_rank(factor: float, n_embd: int) -> int:
    return max(32, round(factor * math.sqrt(n_embd) / 32) * 32)


def _require_int(name: str, value: Any, minimum: int) -> None:
    require_int("Config", name, value, minimum)


@dataclass(frozen=True)
class Config:
    """An RWKV-X model: RWKV-7 blocks interleaved with MoBA attention blocks.

    Fields left as ``None`` get the derived defaults of docs/SPEC.md §2.1 (``ffn_dim`` = 4·C, LoRA ranks
    from sqrt(C)). Invalid values raise ``ValueError`` (or ``TypeError``) naming the field.
    """

    vocab_size: int
    n_embd: int
    n_rwkv_layer: int
    head_size: int = 64
    ffn_dim: int | None = None
    dim_w: int | None = None
    dim_a: int | None = None
    dim_v: int | None = None
    dim_g: int | None = None
    n_attn_layer: int = 0
    moba_chunk_size: int = 64
    moba_top_k: int = 3
    ln0: bool = True

    def __post_init__(self) -> None:
        _require_int("vocab_size", self.vocab_size, 1)
        _require_int("n_embd", self.n_embd, 1)
        _require_int("head_size", self.head_size, 1)
        if self.n_embd % self.head_size:
            raise FieldError("Config", "{head_size} must divide {n_embd}", head_size=self.head_size,
                             n_embd=self.n_embd)
        _require_int("n_rwkv_layer", self.n_rwkv_layer, 1)
        _require_int("n_attn_layer", self.n_attn_layer, 0)
        if self.n_attn_layer > self.n_rwkv_layer:
            raise FieldError("Config", "{n_attn_layer} must be <= {n_rwkv_layer}",
                             n_attn_layer=self.n_attn_layer, n_rwkv_layer=self.n_rwkv_layer)
        _require_int("moba_chunk_size", self.moba_chunk_size, 1)
        _require_int("moba_top_k", self.moba_top_k, 1)
        if not isinstance(self.ln0, bool):
            raise TypeError(f"Config.ln0 must be a bool, got {type(self.ln0).__name__}")
        if self.ffn_dim is None:
            object.__setattr__(self, "ffn_dim", 4 * self.n_embd)
        _require_int("ffn_dim", self.ffn_dim, 1)
        for name, factor in _LORA_FACTORS.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, _lora_rank(factor, self.n_embd))
            _require_int(name, getattr(self, name), 1)

    @property
    def n_head(self) -> int:
        """Number of heads H = C / N."""
        return self.n_embd // self.head_size

    @property
    def n_blocks(self) -> int:
        """Total number of blocks, RWKV plus attention."""
        return self.n_rwkv_layer + self.n_attn_layer

    def block_order(self) -> list[tuple[str, int]]:
        """The blocks in execution order, as ``("rwkv", i)`` / ``("attn", j)`` (docs/SPEC.md §2.2)."""
        L, M = self.n_rwkv_layer, self.n_attn_layer
        if M == 0:
            return [("rwkv", i) for i in range(L)]
        interval = L // M
        order: list[tuple[str, int]] = []
        for a in range(M):
            order += [("rwkv", i) for i in range(a * interval, (a + 1) * interval)]
            order.append(("attn", a))
        order += [("rwkv", i) for i in range(M * interval, L)]
        return order

    def to_dict(self) -> dict[str, Any]:
        """All fields (derived ones filled in), JSON-serialisable."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError``."""
        if not isinstance(data, dict):
            raise TypeError("Config.from_dict expects a dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown Config field(s): {', '.join(unknown)}")
        return cls(**data)
