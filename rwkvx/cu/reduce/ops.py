"""Launch builder for rwkvx/cu/reduce/reduce.cu: the fixed-order reduction of per-tile partial sums.

The backward kernels of layernorm, channelmix and timemix write partial sums of their parameter
gradients per row tile; :func:`partials` adds them into the gradients. Row tiles of those kernels:
:func:`tiles` (about :data:`BLOCKS_PER_SM` blocks per multiprocessor).

    ops += reduce.partials(part, P, C, outs, by)      # outs[j][c] (= or +=) sum_p part[p, j, c]

Twin: ``rwkvx.oracle.column_sums``.
"""
from __future__ import annotations

import math

from rwkvx.runtime.kernel import F32_IN, F32_OUT, INT, KernelFile

from .._common import DeviceInfo

MAX_BY = 16              # rows of threads per block, at most (the shared-memory tile)
BLOCKS_PER_SM = 8        # target blocks per SM of the row-tiled backward kernels (8 x 256 threads)

CU = KernelFile("reduce/reduce", constants={"RD_MAX_BY": MAX_BY})
REDUCE_PARTIALS = CU.kernel("reduce_partials", part=F32_IN, P=INT, C=INT, nout=INT,
                            o0=F32_OUT, o1=F32_OUT.opt(), o2=F32_OUT.opt(), o3=F32_OUT.opt(),
                            o4=F32_OUT.opt(), o5=F32_OUT.opt(), accumulate=INT)


def default_rows_per_tile(R: int, C: int, dev: DeviceInfo) -> int:
    """Rows per tile giving about BLOCKS_PER_SM blocks of (128 columns x rpt rows) per SM; a multiple of 8."""
    gx = math.ceil(C / 128)
    rpt = max(8, math.ceil(R * gx / (BLOCKS_PER_SM * dev.sm_count)))
    return 8 * math.ceil(rpt / 8)


def tiles(R: int, C: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> tuple[int, int]:
    """(rows_per_tile, n_tiles) for a row-tiled kernel over [R, C]."""
    rpt = default_rows_per_tile(R, C, dev) if rows_per_tile is None else int(rows_per_tile)
    if rpt <= 0:
        raise ValueError(f"rows_per_tile must be positive, got {rows_per_tile}")
    n = math.ceil(R / rpt)
    if n > 65535:
        raise ValueError(f"rows_per_tile={rpt} gives {n} row tiles (> 65535)")
    return rpt, n


def scratch_elems(R: int, C: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> int:
    """fp32 elements of one [n_tiles, C] partials array."""
    return C * tiles(R, C, dev, rows_per_tile)[1]


def partials(part, P: int, C: int, outs, by: int, accumulate: bool = False) -> list:
    """reduce_partials: outs[j] [C] (= or += with accumulate) sum over p of part [P, len(outs), C];
    nothing when every output is None (the gradients of frozen parameters, which nothing reads).

    ``by`` (rows of threads, <= MAX_BY) is part of the summation order: a family keeps its value."""
    outs = list(outs)
    if not 1 <= len(outs) <= 6:
        raise ValueError("reduce.partials: 1..6 outputs")
    if all(o is None for o in outs):
        return []
    if any(o is None for o in outs):
        raise ValueError("reduce.partials: every output or none (None) is needed")
    if P <= 0 or C <= 0:
        raise ValueError(f"reduce.partials: P={P} and C={C} must be positive")
    if not 1 <= by <= MAX_BY:
        raise ValueError(f"reduce.partials: by={by} must be in [1, {MAX_BY}]")
    named = {f"o{j}": (outs[j] if j < len(outs) else None) for j in range(6)}
    return [REDUCE_PARTIALS.launch((math.ceil(len(outs) * C / 32), 1, 1), (32, by, 1), part=part, P=P, C=C,
                                   nout=len(outs), accumulate=int(bool(accumulate)), **named)]
