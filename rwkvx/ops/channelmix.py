"""Launch builders for rwkvx/cu/channelmix.cu: the element-wise parts of the channel mix (FFN).

    xk = x + (shift(x) - x) * x_k          shift(x)[r] = x[r-1], 0 at t = r % T == 0
    h  = xk @ key^T                        (cuBLAS, by the model)  [R, F]
    k  = relu(h)^2                         relu_sq (in place on h allowed)
    out = k @ value^T                      (cuBLAS, by the model)

Buffers float32 row-major: x, xk, dxk, dx ``[R, C]`` (R = B*T; C % 4 == 0; 16-byte aligned);
x_k, dx_k ``[C]``; h, k, dk, dh ``[R, F]`` (any n = R*F).

Backward, after the model's GEMMs (dk = dout @ value, d value = dout^T k)::

    ops += channelmix.relu_sq_backward(dk, h, dh, R*F)                 # or src=k, src_is_k=True
    [d key = dh^T xk ; dxk = dh @ key]
    ops += channelmix.mix_backward(dxk, x, x_k, dx, dx_k, scratch, R, T, C, accumulate_dx=...)

``relu_sq_backward``: dh = dk * 2 * relu(h). With ``src_is_k=True`` the source is k = relu(h)^2 (when h
was overwritten in place) and relu(h) = sqrt(k) (exact to 1 ulp). dh may alias dk.
``mix_backward``: dx (= or += with ``accumulate_dx``) and dx_k (= or += with ``accumulate_dparam``);
dx must not alias dxk or x. dx_k goes through per-row-tile partials in ``scratch``
(:func:`scratch_bytes`, same rows_per_tile) and reduce_cols: deterministic.
"""
from __future__ import annotations

import math

from ._common import Launch, ptr
from . import reduce as _reduce

MODULE = "channelmix"
BY = 8                      # CM_BY in channelmix.cu


def _grid1d(n4: int) -> int:
    return max(1, min(math.ceil(n4 / 256), 132 * 16))


def scratch_bytes(R: int, C: int, rows_per_tile: int | None = None) -> int:
    """Bytes of mix_backward's partials scratch: n_tiles * C float32."""
    return _reduce.scratch_bytes(R, C, rows_per_tile)


def shift_mix(x, x_k, xk, R: int, T: int, C: int) -> list:
    """cm_shift_mix: xk [R, C] = x + (shift(x) - x) * x_k. xk must not alias x."""
    _reduce.check_rows("channelmix.shift_mix", R, C, x, x_k, xk)
    if T <= 0 or R % T:
        raise ValueError(f"channelmix.shift_mix: R={R} must be a positive multiple of T={T}")
    if ptr(xk) == ptr(x):
        raise ValueError("channelmix.shift_mix: xk must not alias x")
    return [Launch(MODULE, "cm_shift_mix", grid=(_grid1d(R * C // 4), 1, 1), block=(256, 1, 1),
                   args=(("p", ptr(x)), ("p", ptr(x_k)), ("p", ptr(xk)),
                         ("i", int(R)), ("i", int(T)), ("i", int(C))))]


def relu_sq(h, k, n: int) -> list:
    """cm_relu_sq_forward: k = relu(h)^2 over n floats; k may be h (in place)."""
    if n <= 0:
        raise ValueError("channelmix.relu_sq: n must be positive")
    return [Launch(MODULE, "cm_relu_sq_forward", grid=(_grid1d(math.ceil(n / 4)), 1, 1), block=(256, 1, 1),
                   args=(("p", ptr(h)), ("p", ptr(k)), ("l", int(n))))]


def relu_sq_backward(dk, src, dh, n: int, src_is_k: bool = False) -> list:
    """cm_relu_sq_backward: dh = dk * 2 * relu(h); src = h (or k = relu(h)^2 with src_is_k). dh may be dk."""
    if n <= 0:
        raise ValueError("channelmix.relu_sq_backward: n must be positive")
    return [Launch(MODULE, "cm_relu_sq_backward", grid=(_grid1d(math.ceil(n / 4)), 1, 1), block=(256, 1, 1),
                   args=(("p", ptr(dk)), ("p", ptr(src)), ("p", ptr(dh)), ("l", int(n)),
                         ("i", int(bool(src_is_k)))))]


def mix_backward(dxk, x, x_k, dx, dx_k, scratch, R: int, T: int, C: int,
                 accumulate_dx: bool = False, accumulate_dparam: bool = False,
                 rows_per_tile: int | None = None) -> list:
    """cm_mix_backward + reduce_cols: dx [R, C] and dx_k [C] from dxk [R, C] (see the module docstring)."""
    _reduce.check_rows("channelmix.mix_backward", R, C, dxk, x, x_k, dx, dx_k, scratch)
    if T <= 0 or R % T:
        raise ValueError(f"channelmix.mix_backward: R={R} must be a positive multiple of T={T}")
    if ptr(dx) in (ptr(dxk), ptr(x)):
        raise ValueError("channelmix.mix_backward: dx must not alias dxk or x")
    rpt, n = _reduce.tiles(R, C, rows_per_tile)
    ops = [Launch(MODULE, "cm_mix_backward", grid=(math.ceil(C / 128), n, 1), block=(32, BY, 1),
                  args=(("p", ptr(dxk)), ("p", ptr(x)), ("p", ptr(x_k)), ("p", ptr(dx)), ("p", ptr(scratch)),
                        ("i", int(R)), ("i", int(T)), ("i", int(C)), ("i", int(rpt)),
                        ("i", int(bool(accumulate_dx)))))]
    return ops + _reduce.cols(scratch, dx_k, n, C, accumulate_dparam)
