"""Launch builders for rwkvx/cu/reduce.cu: deterministic reductions over rows.

Every builder returns ``list[Launch]`` (plain data, no GPU needed). Pointers are ints or objects with an
int ``.ptr``. All buffers float32 row-major.

* :func:`cols` — ``reduce_cols``: ``out[c] (= or +=) sum_p part[p, c]``, part ``[P, C]``, out ``[C]``.
  Any C, any alignment. Fixed summation order (thread row y sums p = y, y+16, ...; then the 16 partial
  sums in order), so the result depends only on the data, P and C.
* :func:`rows_partial` — ``reduce_rows_partial``: ``part[t, c] = sum over rows r of tile t of
  a[r, c] * b[r, c]`` (``b=None``: of ``a[r, c]``), a, b ``[R, C]``, part ``[n_tiles, C]``;
  tile t = rows ``[t*rpt, min(R, (t+1)*rpt))``. Needs C % 4 == 0 and 16-byte aligned a, b, part.
* :func:`rows` — both: ``out[c] (= or +=) sum_r a[r, c] * b[r, c]`` through ``scratch`` of
  :func:`scratch_bytes` bytes. Example (a weight-vector gradient such as ``d x_r = sum_r dxr * xx``)::

      ops += reduce.rows(dxr, xx, d_x_r, scratch, R, C)

``rows_per_tile`` (rpt) defaults to :func:`default_rows_per_tile` (about TARGET_BLOCKS blocks);
pass the same value to :func:`scratch_bytes` as to the builder.
"""
from __future__ import annotations

import math

from ._common import Launch, ptr

MODULE = "reduce"
TARGET_BLOCKS = 1056          # ~8 blocks of 256 threads per SM on an H200 (132 SMs)
COLS_BY = 16                  # RD_COLS_BY in reduce.cu
ROWS_BY = 8                   # RD_ROWS_BY in reduce.cu


def check_rows(what: str, R: int, C: int, *ptrs) -> None:
    """Validate a row-wise [R, C] float4 kernel: R, C > 0, C % 4 == 0, non-null pointers 16-byte aligned."""
    if R <= 0 or C <= 0:
        raise ValueError(f"{what}: rows={R} and C={C} must be positive")
    if C % 4:
        raise ValueError(f"{what}: C={C} must be a multiple of 4")
    for i, q in enumerate(ptrs):
        q = ptr(q)
        if q % 16:
            raise ValueError(f"{what}: pointer argument {i} (0x{q:x}) is not 16-byte aligned")


def default_rows_per_tile(R: int, C: int) -> int:
    """Rows per tile giving about TARGET_BLOCKS blocks of (128 columns x rpt rows); a multiple of 8."""
    gx = math.ceil(C / 128)
    rpt = max(8, math.ceil(R * gx / TARGET_BLOCKS))
    return 8 * math.ceil(rpt / 8)


def tiles(R: int, C: int, rows_per_tile: int | None = None) -> tuple[int, int]:
    """(rows_per_tile, n_tiles) for a row-tiled kernel over [R, C]."""
    rpt = default_rows_per_tile(R, C) if rows_per_tile is None else int(rows_per_tile)
    if rpt <= 0:
        raise ValueError(f"rows_per_tile must be positive, got {rows_per_tile}")
    n = math.ceil(R / rpt)
    if n > 65535:
        raise ValueError(f"rows_per_tile={rpt} gives {n} row tiles (> 65535)")
    return rpt, n


def scratch_bytes(R: int, C: int, rows_per_tile: int | None = None) -> int:
    """Bytes of the partials scratch [n_tiles, C] float32 used by :func:`rows`."""
    return 4 * C * tiles(R, C, rows_per_tile)[1]


def cols(part, out, P: int, C: int, accumulate: bool = False) -> list:
    """reduce_cols: out [C] (= or += with accumulate) sum over p of part [P, C]."""
    if P <= 0 or C <= 0:
        raise ValueError(f"reduce.cols: P={P} and C={C} must be positive")
    return [Launch(MODULE, "reduce_cols", grid=(math.ceil(C / 32), 1, 1), block=(32, COLS_BY, 1),
                   args=(("p", ptr(part)), ("p", ptr(out)), ("i", int(P)), ("i", int(C)),
                         ("i", int(bool(accumulate)))))]


def rows_partial(a, b, part, R: int, C: int, rows_per_tile: int | None = None) -> list:
    """reduce_rows_partial: part [n_tiles, C] = per-tile column sums of a*b (b None: of a)."""
    check_rows("reduce.rows_partial", R, C, a, b, part)
    rpt, n = tiles(R, C, rows_per_tile)
    return [Launch(MODULE, "reduce_rows_partial", grid=(math.ceil(C / 128), n, 1), block=(32, ROWS_BY, 1),
                   args=(("p", ptr(a)), ("p", ptr(b)), ("p", ptr(part)), ("i", int(R)), ("i", int(C)),
                         ("i", int(rpt))))]


def rows(a, b, out, scratch, R: int, C: int, accumulate: bool = False,
         rows_per_tile: int | None = None) -> list:
    """out [C] (= or +=) sum over rows of a*b (b None: of a); a, b [R, C]; scratch >= scratch_bytes."""
    rpt, n = tiles(R, C, rows_per_tile)
    return (rows_partial(a, b, scratch, R, C, rpt)
            + cols(scratch, out, n, C, accumulate))
