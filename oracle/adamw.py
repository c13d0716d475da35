"""Twin of rwkvx/cu/adamw/adamw.cu: AdamW and its learning-rate schedule (docs/SPEC.md §3), RWKV-LM
conventions, PyTorch AdamW semantics.

This docstring is the contract shared by the fused GPU kernel and the CPU optimizer (``rwkvx.optim.AdamW``,
which runs the functions below). Unlike the other twins this one does not compute everything in float64:
it does the kernel's arithmetic (scalars in float64 rounded once to float32, the element update in
float32 in the kernel's operation order, which contracts no operation into an FMA), so that the two agree
bit for bit (m and v always; p but for the device's float64 pow and cos in the scalars).

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

Lean moments (``MOMENT_TYPES`` "bf16"): m and v are stored as bf16 (uint16 arrays of their bits). An
update widens them to float32, computes exactly as above (p takes the float32 m and v), then stores
each new moment **stochastically rounded** to bf16: with u its float32 bits and r the low 16 bits of
:func:`rounding_bits` (t, e, which) — e the element's index in the flat parameter buffer
(rwkvx.cu.adamw.flat_layout), which 0 for m and 1 for v — the stored bits are (u + r) >> 16 (a carry
out of the low half rounds the magnitude up; inf stays inf, NaN becomes 0x7fc0). So the stored value is
one of the two bf16 neighbours of the float32 one, the upper with probability (its distance from the
lower) / (their gap): unbiased, E[stored] = the float32 moment, and deterministic (a rerun stores the
same bits). Rounding to nearest would be biased: an update of v by (1 - b2) = 1% of its value is below
half a bf16 step (2^-9 relative) unless g*g differs from v by 20% or more, so v would stop following
g*g. The hash (murmur3's 32-bit finaliser ``fmix32``)::

    rounding_bits(t, e, which) = fmix32(fmix32(fmix32(2t + which) ^ (e >> 32)) ^ (e & 0xffffffff))
"""
from __future__ import annotations

import math
from typing import Mapping

import numpy as np

from rwkvx.runtime.dtypes import bf16_bits_to_f32

BETAS = (0.9, 0.99)
EPS = 1e-18
CLIP_EPS = 1e-6
MOMENT_TYPES = ("f32", "bf16")    # how m and v are stored: float32, or bf16 stochastically rounded
_MASK32 = np.uint64(0xFFFFFFFF)


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


def _fmix32(h: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser on a uint32 array (wrapping arithmetic)."""
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def rounding_bits(t: int, index: np.ndarray, which: int) -> np.ndarray:
    """The stochastic rounding's pseudo-random bits (uint32; the low 16 are used) of step ``t`` for the
    flat element indices ``index`` (int64/uint64 array), ``which`` 0 for m and 1 for v."""
    e = np.asarray(index, dtype=np.uint64)
    h = _fmix32(np.full(e.shape, (2 * int(t) + int(which)) & 0xFFFFFFFF, dtype=np.uint32))
    h = _fmix32(h ^ (e >> np.uint64(32)).astype(np.uint32))
    return _fmix32(h ^ (e & _MASK32).astype(np.uint32))


def bf16_stochastic(x: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """float32 ``x`` rounded to bf16 with the random ``bits`` (low 16 used): the bf16 bits, uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    special = (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    out = ((u + (bits & np.uint32(0xFFFF))) >> np.uint32(16)).astype(np.uint16)
    nan = special & ((u & np.uint32(0x007FFFFF)) != 0)
    out[special] = (u[special] >> np.uint32(16)).astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def adamw_update(p: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, t: int, lr_p: float,
                 wd_p: float, clip: float = 1.0, betas: tuple[float, float] = BETAS,
                 eps: float = EPS, offset: int | None = None) -> None:
    """AdamW step ``t`` of one tensor, in place: p float32, g float32 (not modified), m and v float32 or
    lean (bf16 bits, uint16; then ``offset``, the tensor's offset in the flat parameter buffer, is
    required: the stochastic rounding's hash reads each element's flat index); learning rate ``lr_p``
    and weight decay ``wd_p`` of this tensor, the step's clip factor ``clip``."""
    lean = isinstance(m, np.ndarray) and m.dtype == np.uint16
    want = np.uint16 if lean else np.float32
    for name, a, dt in (("p", p, np.float32), ("g", g, np.float32), ("m", m, want), ("v", v, want)):
        if not isinstance(a, np.ndarray) or a.dtype != dt or a.shape != p.shape:
            raise TypeError(f"{name} must be a {np.dtype(dt).name} numpy array of shape {p.shape}")
    if lean and (offset is None or offset < 0):
        raise ValueError("adamw_update: bf16 moments need the tensor's flat offset (>= 0)")
    f32 = np.float32
    b1, b2 = betas
    mf, vf = (bf16_bits_to_f32(m), bf16_bits_to_f32(v)) if lean else (m, v)
    if clip != 1.0:
        g = g * f32(clip)
    if wd_p:
        p *= f32(1.0 - lr_p * wd_p)
    mf *= f32(b1)
    mf += f32(1.0 - b1) * g
    vf *= f32(b2)
    vf += f32(1.0 - b2) * (g * g)
    denom = np.sqrt(vf) / f32(math.sqrt(1.0 - b2 ** t)) + f32(eps)
    p -= f32(lr_p / (1.0 - b1 ** t)) * mf / denom
    if lean:
        index = offset + np.arange(p.size, dtype=np.uint64).reshape(p.shape)
        m[...] = bf16_stochastic(mf, rounding_bits(t, index, 0))
        v[...] = bf16_stochastic(vf, rounding_bits(t, index, 1))
