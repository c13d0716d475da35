"""The CPU optimizer: AdamW over a dict of float32 numpy parameters and the learning-rate schedule
(docs/SPEC.md §3). The formulas are the AdamW twin's, :mod:`rwkvx.oracle.adamw` (its docstring is the contract
the fused GPU kernel shares); here are the optimizer's state (moments, step count), its checks and its
checkpoint format.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from rwkvx.cu.adamw import flat_layout
from rwkvx.oracle.adamw import (BETAS, EPS, MOMENT_TYPES, adamw_update, clip_coefficient,
                                global_grad_norm, learning_rate, lr_multiplier, uses_weight_decay)
from rwkvx.runtime.dtypes import bf16_bits_to_f32, f32_to_bf16_bits


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up to ``lr_max`` then cosine decay to ``lr_min`` at ``total_steps``
    (:func:`rwkvx.oracle.adamw.learning_rate`)."""

    lr_max: float = 1e-3
    lr_min: float = 1e-4
    warmup: int = 0
    total_steps: int | None = None

    def __post_init__(self) -> None:
        for name in ("lr_max", "lr_min"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"Schedule.{name} must be a finite number >= 0, got {value!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"Schedule.warmup must be an int >= 0, got {self.warmup!r}")
        if self.total_steps is not None and (
                isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int)
                or self.total_steps < 1):
            raise ValueError(f"Schedule.total_steps must be an int >= 1 or None, got {self.total_steps!r}")

    def lr_at(self, t: int) -> float:
        """The learning rate of step ``t`` (1-based)."""
        if t < 1:
            raise ValueError(f"step numbers start at 1, got {t}")
        return learning_rate(t, self.lr_max, self.lr_min, self.warmup, self.total_steps)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's fields as a JSON-able dict (the checkpoint's form; :meth:`from_dict` reads it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Schedule":
        """The schedule :meth:`to_dict` wrote: an unknown key raises ``TypeError``, a bad value
        ``ValueError`` (the constructor's checks)."""
        return cls(**dict(data))


class AdamW:
    """AdamW over a dict of float32 numpy parameters, updated in place (rwkvx.oracle.adamw's formulas).

    ``step(grads)`` takes one gradient per parameter (any float dtype, cast to float32), computes
    the learning rate of the next step from ``schedule``, clips, updates, and returns a dict of
    statistics (``lr``, ``grad_norm``, ``clip``). ``moments``: "f32", or "bf16" (the lean moments of
    :mod:`rwkvx.oracle.adamw`: stored as bf16 bits, stochastically rounded by a hash of each element's
    index in the flat layout of ``params``, in their order, as the GPU arena lays them out).
    """

    def __init__(self, params: Mapping[str, np.ndarray], schedule: Schedule,
                 weight_decay: float = 0.0, grad_clip: float | None = None,
                 betas: tuple[float, float] = BETAS, eps: float = EPS, moments: str = "f32") -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError("schedule must be an rwkvx.optim.Schedule")
        if not math.isfinite(weight_decay) or weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if grad_clip is not None and (not math.isfinite(grad_clip) or grad_clip < 0):
            raise ValueError(f"grad_clip must be >= 0 or None, got {grad_clip!r}")
        if moments not in MOMENT_TYPES:
            raise ValueError(f"moments must be one of {', '.join(MOMENT_TYPES)}, got {moments!r}")
        for name, p in params.items():
            if not isinstance(p, np.ndarray) or p.dtype != np.float32:
                raise TypeError(f"parameter {name} must be a float32 numpy array")
        self.params = params
        self.schedule = schedule
        self.weight_decay = float(weight_decay)
        self.grad_clip = float(grad_clip) if grad_clip else None
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.step_count = 0
        self.moments = moments
        self._moment_dtype = np.uint16 if moments == "bf16" else np.float32       # bf16: the bits
        self.offsets = {seg[0]: seg[1] for seg in flat_layout({n: p.shape for n, p in params.items()})[0]}
        self.m = {n: np.zeros_like(p, dtype=self._moment_dtype) for n, p in params.items()}
        self.v = {n: np.zeros_like(p, dtype=self._moment_dtype) for n, p in params.items()}

    def hyperparameters(self) -> dict[str, Any]:
        """JSON-able settings (schedule included)."""
        return {"schedule": self.schedule.to_dict(), "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip, "betas": list(self.betas), "eps": self.eps, "moments": self.moments}

    def step(self, grads: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Apply one AdamW update to every parameter; returns ``{"lr", "grad_norm", "clip"}``."""
        missing = [n for n in self.params if n not in grads]
        if missing:
            raise ValueError(f"missing gradient(s) for {', '.join(missing[:5])}")
        norm = global_grad_norm({n: grads[n] for n in self.params})
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm ({norm}) at step {self.step_count + 1}")
        clip = clip_coefficient(norm, self.grad_clip)
        t = self.step_count + 1
        lr = self.schedule.lr_at(t)
        for name, p in self.params.items():
            g = np.asarray(grads[name], dtype=np.float32)
            if g.shape != p.shape:
                raise ValueError(f"gradient {name} has shape {g.shape}, parameter has {p.shape}")
            wd_p = self.weight_decay if uses_weight_decay(name, p.shape) else 0.0
            adamw_update(p, g, self.m[name], self.v[name], t, lr * lr_multiplier(name), wd_p, clip,
                         self.betas, self.eps, offset=self.offsets[name])
        self.step_count = t
        return {"lr": lr, "grad_norm": norm, "clip": clip}

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {"optim.m.<name>", "optim.v.<name>": float32}, "meta": {...}}``: the
        shape :func:`rwkvx.checkpoint.save_checkpoint` takes as ``extra`` (merge with other state);
        bf16 moments are saved as their float32 values (exact)."""
        tensors: dict[str, np.ndarray] = {}
        for name in self.params:
            tensors[f"optim.m.{name}"] = self._values(self.m[name])
            tensors[f"optim.v.{name}"] = self._values(self.v[name])
        return {"tensors": tensors,
                "meta": {"optim_step": self.step_count, "optim": self.hyperparameters()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore moments and step count saved by :meth:`state_dict` (hyperparameters are kept)."""
        tensors, meta = state.get("tensors") or {}, state.get("meta") or {}
        if "optim_step" not in meta:
            raise ValueError("optimizer state has no step count ('optim_step')")
        step = meta["optim_step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"optimizer step count must be an int >= 0, got {step!r}")
        m, v = {}, {}
        for name, p in self.params.items():
            for key, out in (("m", m), ("v", v)):
                full = f"optim.{key}.{name}"
                if full not in tensors:
                    raise ValueError(f"optimizer state is missing {full}")
                arr = np.asarray(tensors[full])
                if arr.shape != p.shape:
                    raise ValueError(f"optimizer state {full} has shape {arr.shape}, expected {p.shape}")
                out[name] = self._stored(np.array(arr, dtype=np.float32, copy=True), full)
        self.m, self.v, self.step_count = m, v, step

    def _values(self, moment: np.ndarray) -> np.ndarray:
        """A moment's values as float32 (a copy)."""
        return bf16_bits_to_f32(moment) if self.moments == "bf16" else moment.copy()

    def _stored(self, values: np.ndarray, name: str) -> np.ndarray:
        """float32 moment ``values`` in this optimizer's storage."""
        return bf16_moment_bits(values, name) if self.moments == "bf16" else values


def bf16_moment_bits(values: np.ndarray, name: str) -> np.ndarray:
    """The bf16 bits (uint16) of saved moment ``values`` (float32) for bf16 moments; ``ValueError`` naming
    ``name`` unless every value is a bf16 value (the moments of a run with bf16 moments), so that resuming
    is exact."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    bits = f32_to_bf16_bits(values)
    if not np.array_equal(bf16_bits_to_f32(bits), values, equal_nan=True):
        raise ValueError(f"optimizer state {name} holds values that are not bf16: saved by a run with "
                         "float32 moments, which cannot resume with bf16 moments")
    return bits
