"""Launch builders for rwkvx/cu/layernorm.cu: LayerNorm over C with weight and bias (ln0, ln1, ln2, ln_out).

    y = (x - mean) * rstd * w + b,  mean = sum_c x / C,  rstd = 1 / sqrt(sum_c (x - mean)^2 / C + eps)

Buffers (float32, row-major, 16-byte aligned, C % 4 == 0): x, y, dy, dx ``[R, C]``; w, b, dw, db ``[C]``;
mean, rstd ``[R]`` (saved statistics).
Rows up to a few million (tiles <= 65535), C up to 4096 (any multiple of 4 works).

Forward::

    ops += layernorm.forward(x, w, b, y, mean, rstd, R, C)      # mean/rstd None: not saved

``y`` may alias ``x`` (in place).

Backward (one call: statistics if needed, dweight/dbias partials, their reduction, dx)::

    ops += layernorm.backward(x, w, dy, dx, dw, db, mean, rstd, scratch, R, C,
                              stats_valid=True, accumulate_dx=False, accumulate_dparams=False)

* ``mean``/``rstd`` are required: with ``stats_valid=True`` they hold the forward's statistics of this
  same ``x``; with ``stats_valid=False`` they are scratch and a statistics-only ``ln_forward`` is added.
* ``dx``: written (``accumulate_dx=False``) or added to (``True``: dx_total = dx_residual + dLN, the
  usual case for ln1/ln2 in a residual stream). With ``accumulate_dx=False``, ``dx`` may alias ``dy``
  (the dx kernel runs last, after the dweight/dbias partials have read dy). ``dx`` must not alias ``x``.
* ``dw``/``db`` are written (or added to with ``accumulate_dparams``), deterministically:
  ``ln_backward_dwdb`` writes per-row-tile partials ``[2, n_tiles, C]`` into ``scratch``
  (:func:`scratch_bytes` bytes, same ``rows_per_tile``), then ``reduce_cols`` (reduce.cu) sums each half
  in a fixed order.
"""
from __future__ import annotations

import math

from ._common import Launch, ptr
from . import reduce as _reduce

MODULE = "layernorm"
WARPS = 8            # LN_WARPS in layernorm.cu (rows per block of the row kernels)
BY = 8               # LN_BY
EPS = 1e-5



def scratch_bytes(R: int, C: int, rows_per_tile: int | None = None) -> int:
    """Bytes of the backward's partials scratch: 2 * n_tiles * C float32."""
    return 2 * _reduce.scratch_bytes(R, C, rows_per_tile)


def forward(x, w, b, y, mean, rstd, R: int, C: int, eps: float = EPS) -> list:
    """ln_forward: y [R,C] = LN(x [R,C]; w, b [C]); mean, rstd [R] saved when not None.
    ``y=None`` computes only the statistics (used by :func:`backward` with stats_valid=False)."""
    _reduce.check_rows("layernorm.forward", R, C, x, w, b, y)
    return [Launch(MODULE, "ln_forward", grid=(math.ceil(R / WARPS), 1, 1), block=(32 * WARPS, 1, 1),
                   args=(("p", ptr(x)), ("p", ptr(w)), ("p", ptr(b)), ("p", ptr(y)),
                         ("p", ptr(mean)), ("p", ptr(rstd)), ("i", int(R)), ("i", int(C)),
                         ("f", float(eps))))]


def backward(x, w, dy, dx, dw, db, mean, rstd, scratch, R: int, C: int, eps: float = EPS,
             stats_valid: bool = True, accumulate_dx: bool = False, accumulate_dparams: bool = False,
             rows_per_tile: int | None = None) -> list:
    """LayerNorm backward; see the module docstring. Returns 4 launches (5 with stats_valid=False)."""
    _reduce.check_rows("layernorm.backward", R, C, x, w, dy, dx, dw, db, scratch)
    if not ptr(mean) or not ptr(rstd):
        raise ValueError("layernorm.backward: mean and rstd buffers [R] are required")
    if not ptr(scratch):
        raise ValueError("layernorm.backward: scratch is required (scratch_bytes(R, C))")
    if ptr(dx) == ptr(x):
        raise ValueError("layernorm.backward: dx must not alias x")
    if accumulate_dx and ptr(dx) == ptr(dy):
        raise ValueError("layernorm.backward: dx may alias dy only without accumulate_dx")
    rpt, n = _reduce.tiles(R, C, rows_per_tile)
    ops = []
    if not stats_valid:
        ops += forward(x, w, w, None, mean, rstd, R, C, eps)
    ops.append(Launch(MODULE, "ln_backward_dwdb", grid=(math.ceil(C / 128), n, 1), block=(32, BY, 1),
                      args=(("p", ptr(x)), ("p", ptr(dy)), ("p", ptr(mean)), ("p", ptr(rstd)),
                            ("p", ptr(scratch)), ("i", int(R)), ("i", int(C)), ("i", int(rpt)))))
    ops += _reduce.cols(ptr(scratch), dw, n, C, accumulate_dparams)
    ops += _reduce.cols(ptr(scratch) + 4 * n * C, db, n, C, accumulate_dparams)
    ops.append(Launch(MODULE, "ln_backward_dx", grid=(math.ceil(R / WARPS), 1, 1), block=(32 * WARPS, 1, 1),
                      args=(("p", ptr(x)), ("p", ptr(w)), ("p", ptr(dy)), ("p", ptr(mean)), ("p", ptr(rstd)),
                            ("p", ptr(dx)), ("i", int(R)), ("i", int(C)), ("i", int(bool(accumulate_dx))))))
    return ops
