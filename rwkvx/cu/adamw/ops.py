"""Launch builders for rwkvx/cu/adamw/adamw.cu: fused AdamW over every parameter in one flat float32 buffer,
replayable in a CUDA graph (the step count, learning rate and clip factor live in device memory).

The formulas are those of the twin :mod:`rwkvx.oracle.adamw` (its module docstring is the shared contract;
the CPU optimizer ``rwkvx.optim.AdamW`` runs it). Restated, for step t = 1, 2, ... (t = number of the update
being made)::

    lr(t) = lr_max * t / warmup                                      if t < warmup
          = lr_max                                                   elif total_steps is None
          = lr_min                                                   elif t > total_steps
          = lr_min + 0.5*(lr_max - lr_min)*(1 + cos(pi * progress))  otherwise,
            progress = (t - warmup) / max(1, total_steps - warmup)
    (so lr(warmup) = lr_max, lr(total_steps) = lr_min; warmup = 0: no warm-up)

    clip  = min(1, grad_clip / (total_norm + 1e-6)), total_norm = sqrt(sum of g*g over all gradients)
            (float64 sums); clip = 1 without clipping
    per tensor: lr_p = lr(t) * mult_p (mult 2 for *.att.w0, else 1);
                wd_p = weight_decay for 2-D *.weight tensors, else 0
    bc1 = 1 - b1**t ; bc2 = 1 - b2**t                                  (float64)
    g = g * clip
    p = p * (1 - lr_p * wd_p)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p = p - (lr_p / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)
    betas (0.9, 0.99), eps 1e-18. Scalars (lr_p/bc1, sqrt(bc2), 1 - lr_p*wd_p, b1, 1-b1, b2, 1-b2, eps,
    clip) in float64, rounded once to float32; element arithmetic in float32, each operation rounded (no FMA
    contraction: the twin's bits).
    The gradient buffer itself is not modified by clipping.

Device state ``state`` float64 ``[STATE_DOUBLES]`` (:func:`state_array` builds it; upload once, or again
to change the schedule / resume; download to read lr, norm, step)::

    [ST_STEP]  updates done so far (adamw_step_begin adds 1 first, so the first update is t = 1)
    [ST_LR_MAX], [ST_LR_MIN], [ST_WARMUP], [ST_TOTAL] (total_steps; None stored as -1)
    [ST_CLIP]  grad_clip (0: off — the clip launches may still run and then only measure the norm)
    written by the kernels each step: [ST_LR] lr(t), [ST_BC1] bc1, [ST_BC2] bc2, [ST_SCALE] clip,
    [ST_NORM] total_norm (-1 when the clip launches are not in the plan)

Flat layout and chunk table: :func:`flat_layout` assigns each tensor an offset (aligned to 4 floats, so
the kernel uses float4) in the flat ``params``/``grads``/``m``/``v`` buffers (same offsets in all four;
m and v start at zero). :func:`build_table` cuts the tensors into chunks of at most ``chunk`` floats
(one block each) and returns ``table`` int32 ``[n_chunks, 4]`` = (offset low 32 bits, offset high 32 bits,
length, weight-decay flag) and ``lrmul`` float32 ``[n_chunks]``; upload both once.

Per step (:func:`step`): ``adamw_step_begin`` (1 thread: t += 1, lr, bc1, bc2, clip = 1), with
``clip=True`` ``adamw_sumsq_partial`` (float64 sum of squares per chunk into ``partials``, float64
``[n_chunks]``, :func:`scratch_elems`) and ``adamw_clip_finalize`` (one block, fixed order), then
``adamw_update``. Run it after every gradient is final (all gradient buffers written for this step).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

from rwkvx.oracle.adamw import BETAS, CLIP_EPS, EPS, lr_multiplier, uses_weight_decay
from rwkvx.runtime.kernel import BF16_OUT, DOUBLE, F32_IN, F32_OUT, F64_IN, F64_OUT, I32_IN, INT, X_OUT, KernelFile

THREADS = 256            # threads of the per-chunk kernels
FIN_THREADS = 1024       # threads of the norm's final reduction
CHUNK = 8192

STATE_DOUBLES = 16
ST_STEP, ST_LR_MAX, ST_LR_MIN, ST_WARMUP, ST_TOTAL, ST_CLIP = 0, 1, 2, 3, 4, 5
ST_LR, ST_BC1, ST_BC2, ST_SCALE, ST_NORM = 6, 7, 8, 9, 10
_STATE_INDICES = dict(ST_STEP=ST_STEP, ST_LR_MAX=ST_LR_MAX, ST_LR_MIN=ST_LR_MIN, ST_WARMUP=ST_WARMUP,
                      ST_TOTAL=ST_TOTAL, ST_CLIP=ST_CLIP, ST_LR=ST_LR, ST_BC1=ST_BC1, ST_BC2=ST_BC2,
                      ST_SCALE=ST_SCALE, ST_NORM=ST_NORM)

CU = KernelFile("adamw/adamw", constants={**_STATE_INDICES, "ADAMW_THREADS": THREADS, "ADAMW_FIN_THREADS": FIN_THREADS,
                                    "ADAMW_CLIP_EPS": CLIP_EPS})
ADAMW_STEP_BEGIN = CU.kernel("adamw_step_begin", st=F64_OUT, b1=DOUBLE, b2=DOUBLE)
ADAMW_SUMSQ_PARTIAL = CU.kernel("adamw_sumsq_partial", g=F32_IN, table=I32_IN, part=F64_OUT, n_chunks=INT)
ADAMW_CLIP_FINALIZE = CU.kernel("adamw_clip_finalize", part=F64_IN, n_parts=INT, st=F64_OUT)
_UPDATE_ARGS = dict(table=I32_IN, lrmul=F32_IN, st=F64_IN, b1=DOUBLE, b2=DOUBLE, eps=DOUBLE, wd=DOUBLE, n_chunks=INT,
                    px=X_OUT.opt())
ADAMW_UPDATE = CU.kernel("adamw_update", p=F32_OUT, g=F32_IN, m=F32_OUT, v=F32_OUT, **_UPDATE_ARGS)
ADAMW_UPDATE_LEAN = CU.kernel("adamw_update_lean", p=F32_OUT, g=F32_IN, m=BF16_OUT, v=BF16_OUT, **_UPDATE_ARGS)
# The update kernel by the moments' element type (oracle.adamw.MOMENT_TYPES)
UPDATE_KERNELS = {"f32": ADAMW_UPDATE, "bf16": ADAMW_UPDATE_LEAN}



def flat_layout(shapes: Mapping[str, Sequence[int]], align: int = 4):
    """Offsets of each tensor in the flat buffers.

    ``shapes``: name -> shape, in the order wanted. Returns ``(segments, total)``: segments is a list of
    ``(name, offset, size, lr_mult, wd_flag)`` (offsets in floats, multiples of ``align``), ``total`` the
    flat buffer length in floats (padding between tensors is never read or written by the kernels)."""
    segs, off = [], 0
    for name, shape in shapes.items():
        size = int(np.prod(tuple(shape), dtype=np.int64))
        off = align * math.ceil(off / align)
        segs.append((name, off, size, lr_multiplier(name), int(uses_weight_decay(name, shape))))
        off += size
    return segs, off


def build_table(segments, chunk: int = CHUNK) -> tuple[np.ndarray, np.ndarray]:
    """Chunk table for the kernels: ``segments`` = iterable of (name, offset, size, lr_mult, wd_flag)
    (or (offset, size, lr_mult, wd_flag)). Returns (table int32 [n_chunks, 4], lrmul float32 [n_chunks])."""
    if chunk <= 0 or chunk % 4:
        raise ValueError(f"chunk={chunk} must be a positive multiple of 4")
    rows, mults = [], []
    for s in segments:
        if len(s) == 5:
            s = s[1:]
        off, size, mult, wd = int(s[0]), int(s[1]), float(s[2]), int(bool(s[3]))
        if off < 0 or size < 0:
            raise ValueError(f"bad segment {s}")
        for start in range(0, size, chunk):
            o = off + start
            rows.append((o & 0xFFFFFFFF, o >> 32, min(chunk, size - start), wd))
            mults.append(mult)
    table = np.array(rows, dtype=np.int64).reshape(-1, 4)
    table[:, 0] = np.where(table[:, 0] >= 1 << 31, table[:, 0] - (1 << 32), table[:, 0])
    return table.astype(np.int32), np.array(mults, dtype=np.float32)


def state_array(lr_max: float, lr_min: float, warmup: int = 0, total_steps: int | None = None,
                grad_clip: float | None = None, step: int = 0) -> np.ndarray:
    """The float64 [STATE_DOUBLES] device state (upload with dev.upload)."""
    st = np.zeros(STATE_DOUBLES, dtype=np.float64)
    st[ST_STEP] = step
    st[ST_LR_MAX] = lr_max
    st[ST_LR_MIN] = lr_min
    st[ST_WARMUP] = warmup
    st[ST_TOTAL] = -1.0 if total_steps is None else total_steps
    st[ST_CLIP] = grad_clip or 0.0
    st[ST_SCALE] = 1.0
    st[ST_NORM] = -1.0
    return st


def state_from_schedule(schedule, grad_clip: float | None = None, step: int = 0) -> np.ndarray:
    """state_array from an :class:`rwkvx.optim.Schedule`."""
    return state_array(schedule.lr_max, schedule.lr_min, schedule.warmup, schedule.total_steps,
                       grad_clip, step)


def scratch_elems(n_chunks: int) -> int:
    """f64 elements of the clipping partials (one per chunk)."""
    return int(n_chunks)


def step(params, grads, m, v, table, lrmul, state, n_chunks: int, partials=None,
         weight_decay: float = 0.0, betas: tuple[float, float] = BETAS, eps: float = EPS,
         clip: bool = False, params_x=None) -> list:
    """One AdamW update of the flat buffers (see the module docstring). ``clip=True`` adds the global
    gradient-norm launches (needs ``partials``); the clip threshold itself is ``state[ST_CLIP]``. ``m`` and
    ``v`` f32 buffers run ``adamw_update``; bf16 ones ``adamw_update_lean`` (stochastically rounded moments).
    ``params_x`` (optional, bf16): a copy of ``params`` at the same offsets, refreshed with the update."""
    if n_chunks <= 0:
        raise ValueError("adamw.step: n_chunks must be positive")
    b1, b2 = float(betas[0]), float(betas[1])
    ops = [ADAMW_STEP_BEGIN.launch((1, 1, 1), (1, 1, 1), st=state, b1=b1, b2=b2)]
    if clip:
        if partials is None:
            raise ValueError("adamw.step: clip=True needs partials (scratch_elems(n_chunks))")
        ops.append(ADAMW_SUMSQ_PARTIAL.launch((n_chunks, 1, 1), (THREADS, 1, 1), g=grads, table=table,
                                              part=partials, n_chunks=n_chunks))
        ops.append(ADAMW_CLIP_FINALIZE.launch((1, 1, 1), (FIN_THREADS, 1, 1), part=partials, n_parts=n_chunks,
                                              st=state))
    kernel = UPDATE_KERNELS.get(getattr(m, "elem", "f32"))
    if kernel is None or getattr(v, "elem", "f32") != getattr(m, "elem", "f32"):
        raise TypeError(f"adamw.step: m and v must both be f32 or both bf16 buffers, got "
                        f"{getattr(m, 'elem', 'f32')} and {getattr(v, 'elem', 'f32')}")
    ops.append(kernel.launch((n_chunks, 1, 1), (THREADS, 1, 1), p=params, g=grads, m=m, v=v, table=table,
                                   lrmul=lrmul, st=state, b1=b1, b2=b2, eps=float(eps),
                                   wd=float(weight_decay), n_chunks=n_chunks, px=params_x,
                                   xtype=params_x.elem if params_x is not None else "f32"))
    return ops
