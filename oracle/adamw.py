"""Twin of rwkvx/cu/adamw/adamw.cu: AdamW and its learning-rate schedule (docs/SPEC.md §3), RWKV-LM
conventions, PyTorch AdamW semantics.

This docstring is the contract shared by the fused GPU kernel and the CPU optimizer (``rwkvx.optim.AdamW``,
which runs the functions below). Unlike the other twins this one does not compute everything in float64:
it does the kernel's arithmetic (scalars in float64 rounded once to float32, the element update in
float32 in the kernel's operation order), so that the two agree to rounding (fused multiply-adds aside).

Learning-rate schedule (:func:`learning_rate`), t = 1, 2, ... is the number of the step being taken
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

Precision: parameters, gradients (float32), m and v are float32 arrays; the per-element arithmetic is
float32 (the scalars lr_p/bc1, sqrt(bc2), 1 - lr_p*wd_p, b1, 1-b1, b2, 1-b2, eps and clip are computed
in float64 and rounded to float32 once).
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

BETAS = (0.9, 0.99)
EPS = 1e-18
CLIP_EPS = 1e-6


def learning_rate(t: int, lr_max: float, lr_min: float, warmup: int, total_steps: int | None) -> float:
    """lr(t) of the schedule above for step ``t`` >= 1."""
    if t < warmup:
        return lr_max * t / warmup
    if total_steps is None:
        return float(lr_max)
    if t > total_steps:
        return float(lr_min)
    progress = (t - warmup) / max(1, total_steps - warmup)
    return lr_min + 0.5 * (lr_max - lr_min) * (1.0 + math.cos(math.pi * progress))


def uses_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """True for 2-D ``*.weight`` parameters, the only ones RWKV-LM decays."""
    return name.endswith(".weight") and len(shape) == 2


def lr_multiplier(name: str) -> float:
    """2 for ``att.w0`` (RWKV-LM's lr_2x group), 1 for everything else."""
    return 2.0 if name.endswith("att.w0") else 1.0


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


def adamw_update(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr_p: float,
                 wd_p: float, clip: float = 1.0, betas: tuple[float, float] = BETAS,
                 eps: float = EPS) -> None:
    """AdamW step ``t`` of one tensor, in place: p, m, v float32 (same shape), g float32 (not modified),
    learning rate ``lr_p`` and weight decay ``wd_p`` of this tensor, the step's clip factor ``clip``."""
    for name, a in (("p", p), ("g", g), ("m", m), ("v", v)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != p.shape:
            raise TypeError(f"{name} must be a float32 numpy array of shape {p.shape}")
    f32 = np.float32
    b1, b2 = betas
    if clip != 1.0:
        g = g * f32(clip)
    if wd_p:
        p *= f32(1.0 - lr_p * wd_p)
    m *= f32(b1)
    m += f32(1.0 - b1) * g
    v *= f32(b2)
    v += f32(1.0 - b2) * (g * g)
    denom = np.sqrt(v) / f32(math.sqrt(1.0 - b2 ** t)) + f32(eps)
    p -= f32(lr_p / (1.0 - b1 ** t)) * m / denom
