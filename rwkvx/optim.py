"""AdamW and the learning-rate schedule (docs/SPEC.md §3), RWKV-LM conventions, PyTorch AdamW semantics.

This docstring is the contract shared by the numpy optimizer below (CPU backend) and the fused GPU
kernel (``rwkvx/cu/adamw/adamw.cu``). Both implement exactly these formulas.

Learning-rate schedule (``lr_at(t)``), t = 1, 2, ... is the number of the step being taken
(the first update uses t = 1)::

    if t < warmup:            lr(t) = lr_max * t / warmup
    elif t <= total_steps:    progress = (t - warmup) / max(1, total_steps - warmup)
                              lr(t) = lr_min + 0.5 * (lr_max - lr_min) * (1 + cos(pi * progress))
    else:                     lr(t) = lr_min
    (total_steps None: lr(t) = lr_max for every t >= warmup; warmup 0: no warm-up)

So lr(warmup) = lr_max and lr(total_steps) = lr_min.

Parameter groups (RWKV-LM x070):

* weight decay ``wd_p = weight_decay`` only for parameters whose name ends in ``.weight`` and that are
  2-D (emb, head and every linear ``*.weight`` matrix); every other tensor (LayerNorm weights, the
  ``[1,1,C]`` vectors, ``r_k``, the LoRA matrices ``w1 w2 a1 a2 v1 v2 g1 g2``) has ``wd_p = 0``;
* learning-rate multiplier ``mult_p = 2`` for ``*.att.w0``, 1 otherwise.

Gradient clipping (optional, ``grad_clip`` > 0), over all parameters together, before the update::

    total_norm = sqrt(sum over every element g of every gradient of g*g)      # accumulated in float64
    clip = min(1, grad_clip / (total_norm + 1e-6))                            # PyTorch clip_grad_norm_
    g <- g * clip         (no change when grad_clip is None or 0)

One AdamW step t (betas (b1, b2) = (0.9, 0.99), eps = 1e-18) for each parameter p with gradient g,
first moment m and second moment v (m = v = 0 before step 1)::

    lr_p  = lr(t) * mult_p
    bc1   = 1 - b1**t ;  bc2 = 1 - b2**t                         # host, float64, then float32
    p     = p * (1 - lr_p * wd_p)                                  # decoupled weight decay, first
    m     = b1 * m + (1 - b1) * g
    v     = b2 * v + (1 - b2) * g * g
    denom = sqrt(v) / sqrt(bc2) + eps
    p     = p - (lr_p / bc1) * m / denom

Precision: parameters, gradients (cast to float32 on entry), m and v are float32 arrays; the
per-element arithmetic is float32 (the scalars lr_p/bc1, sqrt(bc2), 1 - lr_p*wd_p, b1, 1-b1, b2,
1-b2, eps and clip are computed in float64 on the host and rounded to float32 once). The GPU kernel
uses the same float32 element arithmetic, so the two agree to rounding (fused multiply-adds aside).

State: ``step`` (int, number of updates done), and per parameter ``m`` and ``v``.
:meth:`AdamW.state_dict` / :meth:`AdamW.load_state_dict` save and restore all of it exactly.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

BETAS = (0.9, 0.99)
EPS = 1e-18
CLIP_EPS = 1e-6


def uses_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """True for 2-D ``*.weight`` parameters, the only ones RWKV-LM decays."""
    return name.endswith(".weight") and len(shape) == 2


def lr_multiplier(name: str) -> float:
    """2 for ``att.w0`` (RWKV-LM's lr_2x group), 1 for everything else."""
    return 2.0 if name.endswith("att.w0") else 1.0


@dataclass(frozen=True)
class Schedule:
    """Linear warm-up to ``lr_max`` then cosine decay to ``lr_min`` at ``total_steps`` (see module doc)."""

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
        if t < self.warmup:
            return self.lr_max * t / self.warmup
        if self.total_steps is None:
            return float(self.lr_max)
        if t > self.total_steps:
            return float(self.lr_min)
        progress = (t - self.warmup) / max(1, self.total_steps - self.warmup)
        return self.lr_min + 0.5 * (self.lr_max - self.lr_min) * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Schedule":
        return cls(**dict(data))


def global_grad_norm(grads: Mapping[str, np.ndarray]) -> float:
    """sqrt of the sum of squares of every gradient element, accumulated in float64."""
    total = 0.0
    for g in grads.values():
        g64 = np.asarray(g, dtype=np.float64).ravel()
        total += float(np.dot(g64, g64))
    return math.sqrt(total)


def clip_coefficient(total_norm: float, grad_clip: float | None) -> float:
    """``min(1, grad_clip / (total_norm + 1e-6))``; 1 when clipping is off (None or 0)."""
    if not grad_clip:
        return 1.0
    return min(1.0, grad_clip / (total_norm + CLIP_EPS))


class AdamW:
    """AdamW over a dict of float32 numpy parameters, updated in place (see the module docstring).

    ``step(grads)`` takes one gradient per parameter (any float dtype, cast to float32), computes
    the learning rate of the next step from ``schedule``, clips, updates, and returns a dict of
    statistics (``lr``, ``grad_norm``, ``clip``).
    """

    def __init__(self, params: Mapping[str, np.ndarray], schedule: Schedule,
                 weight_decay: float = 0.0, grad_clip: float | None = None,
                 betas: tuple[float, float] = BETAS, eps: float = EPS) -> None:
        if not isinstance(schedule, Schedule):
            raise TypeError("schedule must be an rwkvx.optim.Schedule")
        if not math.isfinite(weight_decay) or weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        if grad_clip is not None and (not math.isfinite(grad_clip) or grad_clip < 0):
            raise ValueError(f"grad_clip must be >= 0 or None, got {grad_clip!r}")
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
        self.m = {n: np.zeros_like(p, dtype=np.float32) for n, p in params.items()}
        self.v = {n: np.zeros_like(p, dtype=np.float32) for n, p in params.items()}

    def hyperparameters(self) -> dict[str, Any]:
        """JSON-able settings (schedule included)."""
        return {"schedule": self.schedule.to_dict(), "weight_decay": self.weight_decay,
                "grad_clip": self.grad_clip, "betas": list(self.betas), "eps": self.eps}

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
        b1, b2 = self.betas
        bc1 = 1.0 - b1 ** t
        bc2_sqrt = np.float32(math.sqrt(1.0 - b2 ** t))
        f32 = np.float32
        b1f, omb1, b2f, omb2, epsf = f32(b1), f32(1.0 - b1), f32(b2), f32(1.0 - b2), f32(self.eps)
        for name, p in self.params.items():
            g = np.asarray(grads[name], dtype=np.float32)
            if g.shape != p.shape:
                raise ValueError(f"gradient {name} has shape {g.shape}, parameter has {p.shape}")
            if clip != 1.0:
                g = g * f32(clip)
            lr_p = lr * lr_multiplier(name)
            wd_p = self.weight_decay if uses_weight_decay(name, p.shape) else 0.0
            if wd_p:
                p *= f32(1.0 - lr_p * wd_p)
            m, v = self.m[name], self.v[name]
            m *= b1f
            m += omb1 * g
            v *= b2f
            v += omb2 * (g * g)
            denom = np.sqrt(v) / bc2_sqrt + epsf
            p -= f32(lr_p / bc1) * m / denom
        self.step_count = t
        return {"lr": lr, "grad_norm": norm, "clip": clip}

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"tensors": {"optim.m.<name>", "optim.v.<name>": float32}, "meta": {...}}``: the
        shape :func:`rwkvx.checkpoint.save_checkpoint` takes as ``extra`` (merge with other state)."""
        tensors: dict[str, np.ndarray] = {}
        for name in self.params:
            tensors[f"optim.m.{name}"] = self.m[name].copy()
            tensors[f"optim.v.{name}"] = self.v[name].copy()
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
                out[name] = np.array(arr, dtype=np.float32, copy=True)
        self.m, self.v, self.step_count = m, v, step
