"""Launch builders for rwkvx/cu/channelmix/channelmix.cu: the element-wise parts of the channel mix (FFN).

    xk = x + (shift(x) - x) * x_k          shift(x)[r] = x[r-1], 0 at t = r % T == 0
    h  = xk @ key^T                        (cuBLAS, by the model)  [R, F]
    k  = relu(h)^2                         relu_sq (h fp32, the key GEMM's output; in place allowed in fp32)
    out = k @ value^T                      (cuBLAS, by the model)

Buffers row-major: x, dx f32 ``[R, C]`` in every precision (LN2's output and its gradient, docs/SPEC.md §4);
xk, dxk floatX ``[R, C]`` (R = B*T; C % 4 == 0; aligned to 4 elements);
x_k, dx_k f32 ``[C]``; h f32 and k, dk, dh floatX ``[R, F]`` (any n = R*F).
Twins: ``rwkvx.oracle.channel_mix_shift_forward`` / ``channel_mix_shift_backward``, ``relu_sq_forward`` /
``relu_sq_backward``.

Backward, after the model's GEMMs (dk = dout @ value, d value = dout^T k)::

    ops += channelmix.relu_sq_backward(dk, h, dh, R*F, dev)          # or src=k, src_is_k=True
    [d key = dh^T xk ; dxk = dh @ key]
    ops += channelmix.mix_backward(dxk, x, x_k, dx, dx_k, scratch, R, T, C, dev, accumulate_dx=...)

(the step fuses LN2, the shift and their backwards: layernorm.forward_shift / backward_shift; shift_mix and
mix_backward are their references in tests and benchmarks)

``relu_sq_backward``: dh = dk * 2 * relu(h). With ``src_is_k=True`` the source is k = relu(h)^2 (when h
was overwritten in place) and relu(h) = sqrt(k) (exact to 1 ulp). dh may alias dk.
``mix_backward``: dx (= or += with ``accumulate_dx``) and dx_k (= or += with ``accumulate_dparam``);
dx must not alias dxk or x. dx_k goes through per-row-tile partials in ``scratch``
(:func:`scratch_elems`, same rows_per_tile) and reduce_partials: deterministic.
"""
from __future__ import annotations

import math

from rwkvx.runtime.kernel import F32_IN, F32_OUT, INT, LONG, X_IN, X_OUT, KernelFile

from .. import reduce as _reduce
from .._common import DeviceInfo, check_rows, grid_stride_blocks, xtype_of

BY = 8                      # row streams per block of cm_mix_backward
REDUCE_BY = 16              # reduce_partials rows (its summation order)

CU = KernelFile("channelmix/channelmix", constants={"CM_BY": BY})
CM_SHIFT_MIX = CU.kernel("cm_shift_mix", x=F32_IN, mix=F32_IN, xk=X_OUT, R=INT, T=INT, C=INT)
CM_RELU_SQ_FORWARD = CU.kernel("cm_relu_sq_forward", h=F32_IN, k=X_OUT, n=LONG)
CM_RELU_SQ_BACKWARD = CU.kernel("cm_relu_sq_backward", dk=X_IN, src=X_IN, dh=X_OUT, n=LONG, src_is_k=INT)
CM_MIX_BACKWARD = CU.kernel("cm_mix_backward", dxk=X_IN, x=F32_IN, mix=F32_IN, dx=F32_OUT, part=F32_OUT,
                            R=INT, T=INT, C=INT, rows_per_tile=INT, accumulate=INT)


def scratch_elems(R: int, C: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> int:
    """fp32 elements of mix_backward's partials scratch: n_tiles * C."""
    return _reduce.scratch_elems(R, C, dev, rows_per_tile)


def _check_seq(what: str, R: int, T: int) -> None:
    if T <= 0 or R % T:
        raise ValueError(f"{what}: R={R} must be a positive multiple of T={T}")


def shift_mix(x, x_k, xk, R: int, T: int, C: int, dev: DeviceInfo) -> list:
    """cm_shift_mix: xk [R, C] = x + (shift(x) - x) * x_k. xk must not alias x."""
    check_rows("channelmix.shift_mix", R, C, x, x_k, xk)
    _check_seq("channelmix.shift_mix", R, T)
    if int(xk) == int(x):
        raise ValueError("channelmix.shift_mix: xk must not alias x")
    return [CM_SHIFT_MIX.launch((grid_stride_blocks(R * C // 4, dev), 1, 1), (256, 1, 1),
                                xtype=xk.elem, x=x, mix=x_k, xk=xk,
                                R=R, T=T, C=C)]


def relu_sq(h, k, n: int, dev: DeviceInfo) -> list:
    """cm_relu_sq_forward: k (floatX) = relu(h)^2 over n elements of fp32 h; k may be h (in place, fp32)."""
    if n <= 0:
        raise ValueError("channelmix.relu_sq: n must be positive")
    return [CM_RELU_SQ_FORWARD.launch((grid_stride_blocks(math.ceil(n / 4), dev), 1, 1), (256, 1, 1),
                                      xtype=xtype_of("channelmix.relu_sq", k), h=h, k=k, n=n)]


def relu_sq_backward(dk, src, dh, n: int, dev: DeviceInfo, src_is_k: bool = False) -> list:
    """cm_relu_sq_backward: dh = dk * 2 * relu(h); src = h (or k = relu(h)^2 with src_is_k). dh may be dk."""
    if n <= 0:
        raise ValueError("channelmix.relu_sq_backward: n must be positive")
    return [CM_RELU_SQ_BACKWARD.launch((grid_stride_blocks(math.ceil(n / 4), dev), 1, 1), (256, 1, 1),
                                       xtype=xtype_of("channelmix.relu_sq_backward", dk, src, dh),
                                       dk=dk, src=src, dh=dh, n=n, src_is_k=int(bool(src_is_k)))]


def mix_backward(dxk, x, x_k, dx, dx_k, scratch, R: int, T: int, C: int, dev: DeviceInfo,
                 accumulate_dx: bool = False, accumulate_dparam: bool = False,
                 rows_per_tile: int | None = None) -> list:
    """cm_mix_backward + reduce_partials: dx [R, C] and dx_k [C] from dxk [R, C] (see the module docstring)."""
    check_rows("channelmix.mix_backward", R, C, dxk, x, x_k, dx, dx_k, scratch)
    _check_seq("channelmix.mix_backward", R, T)
    if int(dx) in (int(dxk), int(x)):
        raise ValueError("channelmix.mix_backward: dx must not alias dxk or x")
    rpt, n = _reduce.tiles(R, C, dev, rows_per_tile)
    ops = [CM_MIX_BACKWARD.launch((math.ceil(C / 128), n, 1), (32, BY, 1),
                                  xtype=dxk.elem, dxk=dxk, x=x,
                                  mix=x_k, dx=dx, part=scratch, R=R, T=T, C=C, rows_per_tile=rpt,
                                  accumulate=int(bool(accumulate_dx)))]
    return ops + _reduce.partials(scratch, n, C, [dx_k], REDUCE_BY, accumulate_dparam)
