"""Launch builders for rwkvx/cu/layernorm/layernorm.cu: LayerNorm over C with weight and bias (ln0, ln1, ln2, ln_out).

    y = (x - mean) * rstd * w + b,  mean = sum_c x / C,  rstd = 1 / sqrt(sum_c (x - mean)^2 / C + eps)

Buffers (row-major, aligned to 4 elements, C % 4 == 0): x, dy, dx ``f32 [R, C]`` in every precision
(the residual stream and its gradient, docs/SPEC.md §4); y ``floatX [R, C]`` — its element type selects
the kernels' ``floatX`` (fp32 where a token shift reads it, bf16 where only GEMMs do); dx_copy ``floatX``;
w, b, dw, db ``f32 [C]``; mean, rstd ``f32 [R]`` (saved statistics). Rows up to a few million (tiles <= 65535).
Twin: ``rwkvx.oracle.layernorm_forward`` / ``layernorm_backward``.

Forward::

    ops += layernorm.forward(x, w, b, y, mean, rstd, R, C)      # mean/rstd None: not saved

``y`` may alias ``x`` (in place).

Forward fused with the token shift and its mixes (``ln_shift.cu``, one launch)::

    ops += layernorm.forward_shift(x, w, b, mixes, outs, h, mean, rstd, R, C, T)

``mixes``/``outs``: 6 (the time mix's x_r .. x_g -> xr .. xg) or 1 (the channel mix's x_k -> xk2) f32
``[C]`` vectors and floatX ``[R, C]`` outputs, o_j = h + (shift(h) - h) * m_j over sequences of T rows.
h = LN(x) ``f32 [R, C]`` is stored only when ``h`` is given: the decoder's prefill reads it, while
:func:`backward_shift` recomputes h from x and the forward's GEMMs read only the mixes. h, mean, rstd and the mixes are the
bits of ``forward`` followed by ``timemix.shift_forward`` / ``channelmix.shift_mix``.

Backward (one call: statistics if needed, dweight/dbias partials, their reduction, dx)::

    ops += layernorm.backward(x, w, dy, dx, dw, db, mean, rstd, scratch, R, C, dev,
                              stats_valid=True, accumulate_dx=False, accumulate_dparams=False,
                              dx_copy=None)

* ``mean``/``rstd`` are required: with ``stats_valid=True`` they hold the forward's statistics of this
  same ``x``; with ``stats_valid=False`` they are scratch and a statistics-only ``ln_forward`` is added.
* ``dx``: written (``accumulate_dx=False``) or added to (``True``: dx_total = dx_residual + dLN, the
  usual case for ln1/ln2 in a residual stream). With ``accumulate_dx=False``, ``dx`` may alias ``dy``
  (the dx kernel runs last, after the dweight/dbias partials have read dy). ``dx`` must not alias ``x``.
* ``dx_copy`` (``floatX``, may be None): receives dx (the total, after accumulating) rounded to its
  element type, for the GEMMs that read the gradient next.
* ``dw``/``db`` are written (or added to with ``accumulate_dparams``), deterministically:
  ``ln_backward_dwdb`` writes per-row-tile partials ``f32 [2, n_tiles, C]`` into ``scratch``
  (:func:`scratch_elems` elements, same ``rows_per_tile``), then ``reduce_partials`` sums each half
  in a fixed order. Both None (frozen parameters): neither is formed, only dx.
"""
from __future__ import annotations

import math

from rwkvx.config import LN_EPS
from rwkvx.runtime.kernel import F32_IN, F32_OUT, FLOAT, INT, X_IN, X_OUT, KernelFile

from .. import reduce as _reduce
from .. import timemix as _timemix
from .._common import DeviceInfo, check_rows, xtype_of

WARPS = 4            # rows (one warp each) per block of the row kernels: 128-thread blocks divide the
                     # register file finely (fp32 ln_backward_dx, 130-168 registers: 3 blocks of 4 warps)
BY = 8               # row streams per block of ln_backward_dwdb
REDUCE_BY = 16       # reduce_partials rows (its summation order)
NQS = (1, 2, 4, 6, 8)  # LN_NQ variants: quads per lane the row kernels keep in registers (see _nq)
SHIFT_NQS = NQS + (12, 16)  # ln_shift_fwd's: C = 2048 keeps its row and the previous row's output in registers
SHIFT_WALK = 8       # rows one warp of ln_shift_fwd walks: one row in SHIFT_WALK recomputed at the walk's start
SHIFT_MIXES = (1, 6)  # LNS_M: the channel mix's one mix, the time mix's six

CU = KernelFile("layernorm/layernorm", constants={"LN_WARPS": WARPS, "LN_BY": BY}, variants={"LN_NQ": NQS})
LN_FORWARD = CU.kernel("ln_forward", x=F32_IN, w=F32_IN, b=F32_IN, y=X_OUT.opt(),
                       mean_out=F32_OUT.opt(), rstd_out=F32_OUT.opt(), R=INT, C=INT, eps=FLOAT)
LN_BACKWARD_DX = CU.kernel("ln_backward_dx", x=F32_IN, w=F32_IN, dy=F32_IN, mean=F32_IN, rstd=F32_IN,
                           dx=F32_OUT, dx_copy=X_OUT.opt(), R=INT, C=INT, accumulate=INT)
LN_BACKWARD_DWDB = CU.kernel("ln_backward_dwdb", x=F32_IN, dy=F32_IN, mean=F32_IN, rstd=F32_IN, part=F32_OUT,
                             R=INT, C=INT, rows_per_tile=INT)

SHIFT_CU = KernelFile("layernorm/ln_shift", constants={"LN_WARPS": WARPS, "LNS_WALK": SHIFT_WALK},
                      variants={"LN_NQ": SHIFT_NQS, "LNS_M": SHIFT_MIXES},
                      derived=lambda v, xtype: {"LNS_MIN_BLOCKS": 3 if v["LN_NQ"] <= 6 else 2})
_SHIFT_MIX = {f"m{j}": F32_IN.opt() for j in range(6)}
LN_SHIFT_FWD = SHIFT_CU.kernel("ln_shift_fwd", x=F32_IN, w=F32_IN, b=F32_IN, h=F32_OUT.opt(),
                               mean_out=F32_OUT.opt(), rstd_out=F32_OUT.opt(), **_SHIFT_MIX,
                               **{f"o{j}": X_OUT.opt() for j in range(6)}, R=INT, C=INT, T=INT, eps=FLOAT)

# ln_shift_bwd's LN_NQ (quads per thread in registers) -> (threads per block at most, blocks per SM its
# registers are budgeted for): a row's quads over the block's threads, C <= 768 with one quad a thread,
# C <= 2048 with two; wider rows keep two and read the rest again
SHIFT_BWD_BLOCKS = {1: (192, 2), 2: (256, 1)}
SHIFT_BWD_NQS = tuple(SHIFT_BWD_BLOCKS)
SHIFT_BWD_CU = KernelFile("layernorm/ln_shift_bwd", variants={"LN_NQ": SHIFT_BWD_NQS, "LNS_M": SHIFT_MIXES},
                          derived=lambda v, xtype: dict(zip(("LNB_THREADS", "LNB_MIN_BLOCKS"),
                                                            SHIFT_BWD_BLOCKS[v["LN_NQ"]])))
LN_SHIFT_BWD = SHIFT_BWD_CU.kernel("ln_shift_bwd", x=F32_IN, w=F32_IN, b=F32_IN, mean=F32_IN, rstd=F32_IN,
                                   **_SHIFT_MIX, **{f"d{j}": X_IN.opt() for j in range(6)}, dx=F32_OUT,
                                   dx_copy=X_OUT.opt(), part_mix=F32_OUT.opt(), part_ln=F32_OUT.opt(), R=INT, C=INT,
                                   T=INT, rpt=INT, ry=INT, accumulate=INT)


def _nq(C: int, nqs: tuple = NQS) -> int:
    """LN_NQ for rows of C: the fewest quads per lane that hold the whole row (C <= 128*LN_NQ: the row
    kernels read each element once); wider rows than 128 * nqs[-1] keep nqs[-1] and read the rest again
    in each pass."""
    return next((q for q in nqs if 128 * q >= C), nqs[-1])


def _xtype(out) -> str:
    """The launch's floatX: the element type of its floatX output, fp32 where there is none (the kernels
    then touch only fp32 buffers)."""
    return out.elem if out is not None else "f32"


def scratch_elems(R: int, C: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> int:
    """fp32 elements of the backward's partials scratch: 2 * n_tiles * C."""
    return 2 * _reduce.scratch_elems(R, C, dev, rows_per_tile)


def shift_backward_scratch_elems(R: int, C: int, dev: DeviceInfo, n_mixes: int = 6,
                                 rows_per_tile: int | None = None) -> int:
    """fp32 elements of :func:`backward_shift`'s partials scratch: (n_mixes + 2) * walks * C."""
    return (n_mixes + 2) * _timemix.shift_backward_layout(R, C, dev, rows_per_tile)["pp"] * C


def _shift_bwd_block(C: int) -> tuple[int, int]:
    """(LN_NQ, threads) of ln_shift_bwd for rows of C: the fewest quads per thread whose block holds the
    row (SHIFT_BWD_BLOCKS), and as many warps as the row's quads need."""
    q4 = C // 4
    nq = next((q for q, (t, _) in SHIFT_BWD_BLOCKS.items() if t * q >= q4), SHIFT_BWD_NQS[-1])
    return nq, min(SHIFT_BWD_BLOCKS[nq][0], 32 * math.ceil(q4 / (32 * nq)))


def forward(x, w, b, y, mean, rstd, R: int, C: int, eps: float = LN_EPS) -> list:
    """ln_forward: y [R,C] = LN(x [R,C]; w, b [C]); mean, rstd [R] saved when not None. ``y=None``
    computes only the statistics (used by :func:`backward` with stats_valid=False)."""
    check_rows("layernorm.forward", R, C, x, w, b, y)
    return [LN_FORWARD.launch((math.ceil(R / WARPS), 1, 1), (32 * WARPS, 1, 1), xtype=_xtype(y),
                              variant={"LN_NQ": _nq(C)}, x=x, w=w, b=b, y=y,
                              mean_out=mean, rstd_out=rstd, R=R, C=C, eps=eps)]


def forward_shift(x, w, b, mixes, outs, h, mean, rstd, R: int, C: int, T: int, eps: float = LN_EPS) -> list:
    """ln_shift_fwd: h = LN(x [R,C]; w, b [C]) stored in ``h`` when not None, mean, rstd [R] saved when not
    None, outs[j] (floatX [R,C]) = h + (shift(h) - h) * mixes[j] with shift zero at row t = 0 of each
    sequence of T rows; 6 mixes (time mix) or 1 (channel mix). Nothing may alias x."""
    mixes, outs = list(mixes), list(outs)
    if len(mixes) not in SHIFT_MIXES or len(outs) != len(mixes):
        raise ValueError(f"layernorm.forward_shift: {' or '.join(map(str, SHIFT_MIXES))} mixes and as many "
                         f"outputs, got {len(mixes)} and {len(outs)}")
    if any(p is None for p in (x, w, b, *mixes, *outs)):
        raise ValueError("layernorm.forward_shift: x, w, b, the mixes and the outputs are required")
    check_rows("layernorm.forward_shift", R, C, x, w, b, h, *mixes, *outs)
    if T <= 0 or R % T:
        raise ValueError(f"layernorm.forward_shift: R={R} must be a positive multiple of T={T}")
    if any(p is not None and int(p) == int(x) for p in (h, *outs)):
        raise ValueError("layernorm.forward_shift: no output may alias x")
    n, warps = len(mixes), math.ceil(R / SHIFT_WALK)
    xtype = xtype_of("layernorm.forward_shift", *outs)
    return [LN_SHIFT_FWD.launch((math.ceil(warps / WARPS), 1, 1), (32 * WARPS, 1, 1), xtype=xtype,
                                variant={"LN_NQ": _nq(C, SHIFT_NQS), "LNS_M": n}, x=x, w=w, b=b, h=h,
                                mean_out=mean, rstd_out=rstd,
                                **{f"m{j}": mixes[j] if j < n else None for j in range(6)},
                                **{f"o{j}": outs[j] if j < n else None for j in range(6)}, R=R, C=C, T=T, eps=eps)]


def backward(x, w, dy, dx, dw, db, mean, rstd, scratch, R: int, C: int, dev: DeviceInfo,
             eps: float = LN_EPS, stats_valid: bool = True, accumulate_dx: bool = False,
             accumulate_dparams: bool = False, rows_per_tile: int | None = None, dx_copy=None) -> list:
    """LayerNorm backward; see the module docstring. Returns 4 launches (5 with stats_valid=False); with
    ``dw`` and ``db`` None (frozen parameters) only the dx launch."""
    check_rows("layernorm.backward", R, C, x, w, dy, dx, dw, db, scratch, dx_copy)
    if mean is None or rstd is None:
        raise ValueError("layernorm.backward: mean and rstd buffers [R] are required")
    if scratch is None:
        raise ValueError("layernorm.backward: scratch is required (scratch_elems(R, C, dev))")
    if int(dx) == int(x):
        raise ValueError("layernorm.backward: dx must not alias x")
    if accumulate_dx and int(dx) == int(dy):
        raise ValueError("layernorm.backward: dx may alias dy only without accumulate_dx")
    if (dw is None) != (db is None):
        raise ValueError("layernorm.backward: dw and db are both given, or both None (frozen parameters)")
    rpt, n = _reduce.tiles(R, C, dev, rows_per_tile)
    nq = {"LN_NQ": _nq(C)}
    ops = []
    if not stats_valid:
        ops += forward(x, w, w, None, mean, rstd, R, C, eps)
    if dw is not None:
        ops.append(LN_BACKWARD_DWDB.launch((math.ceil(C / 128), n, 1), (32, BY, 1), variant=nq,
                                           x=x, dy=dy, mean=mean, rstd=rstd, part=scratch, R=R, C=C,
                                           rows_per_tile=rpt))
        ops += _reduce.partials(scratch, n, C, [dw], REDUCE_BY, accumulate_dparams)
        ops += _reduce.partials(scratch.offset(n * C), n, C, [db], REDUCE_BY, accumulate_dparams)
    ops.append(LN_BACKWARD_DX.launch((math.ceil(R / WARPS), 1, 1), (32 * WARPS, 1, 1), xtype=_xtype(dx_copy),
                                     variant=nq, x=x, w=w, dy=dy, mean=mean, rstd=rstd, dx=dx, dx_copy=dx_copy,
                                     R=R, C=C,
                                     accumulate=int(bool(accumulate_dx))))
    return ops


def backward_shift(x, w, b, mean, rstd, mixes, douts, dx, dmixes, dw, db, scratch, R: int, C: int, T: int,
                   dev: DeviceInfo, accumulate_dx: bool = False, accumulate_dparams: bool = False,
                   rows_per_tile: int | None = None, dx_copy=None) -> list:
    """ln_shift_bwd + reduce_partials: the backward of :func:`forward_shift` from the mixes' gradients
    ``douts`` (floatX [R,C], 6 or 1, as ``outs``) with h = LN(x) recomputed from x and the saved ``mean``,
    ``rstd`` (w, b: LN's weight and bias). Written or added to (see the module docstring):
    ``dx`` f32 [R,C] (``accumulate_dx``; ``dx_copy`` floatX gets dx rounded), ``dmixes`` f32 [C] each and
    ``dw``, ``db`` (``accumulate_dparams``; all None: frozen, not formed). The mixes' partials are
    timemix.shift_backward's (same walks, same order); ``scratch``: :func:`shift_backward_scratch_elems`.
    dx must not alias x or any of douts."""
    mixes, douts, dmixes = list(mixes), list(douts), list(dmixes)
    n = len(mixes)
    if n not in SHIFT_MIXES or len(douts) != n or len(dmixes) != n:
        raise ValueError(f"layernorm.backward_shift: {' or '.join(map(str, SHIFT_MIXES))} mixes and as many "
                         f"output gradients and mix gradients, got {n}, {len(douts)} and {len(dmixes)}")
    if any(p is None for p in (x, w, b, mean, rstd, dx, scratch, *mixes, *douts)):
        raise ValueError("layernorm.backward_shift: x, w, b, mean, rstd, dx, scratch, the mixes and the output "
                         "gradients are required")
    given = [p is not None for p in (dw, db, *dmixes)]
    if any(given) and not all(given):
        raise ValueError("layernorm.backward_shift: dw, db and the mix gradients are all given, or all None "
                         "(frozen parameters)")
    check_rows("layernorm.backward_shift", R, C, x, w, b, dx, scratch, dx_copy, *mixes, *douts, *dmixes, dw, db)
    if T <= 0 or R % T:
        raise ValueError(f"layernorm.backward_shift: R={R} must be a positive multiple of T={T}")
    if any(int(dx) == int(p) for p in (x, *douts)):
        raise ValueError("layernorm.backward_shift: dx must not alias x or the output gradients")
    if dx_copy is not None and any(int(dx_copy) == int(p) for p in (x, dx, *douts)):
        raise ValueError("layernorm.backward_shift: dx_copy must not alias x, dx or the output gradients")
    L = _timemix.shift_backward_layout(R, C, dev, rows_per_tile)
    nq, threads = _shift_bwd_block(C)
    ln_part = scratch.offset(n * L["pp"] * C)
    ops = [LN_SHIFT_BWD.launch((L["pp"], 1, 1), (threads, 1, 1), xtype=xtype_of("layernorm.backward_shift", *douts),
                               variant={"LN_NQ": nq, "LNS_M": n}, smem=4 * C, x=x, w=w, b=b, mean=mean,
                               rstd=rstd, **{f"m{j}": mixes[j] if j < n else None for j in range(6)},
                               **{f"d{j}": douts[j] if j < n else None for j in range(6)}, dx=dx, dx_copy=dx_copy,
                               part_mix=None if dw is None else scratch, part_ln=None if dw is None else ln_part,
                               R=R, C=C, T=T, rpt=L["rpt"], ry=L["ry"], accumulate=int(bool(accumulate_dx)))]
    ops += _reduce.partials(scratch, L["pp"], C, dmixes, _timemix.REDUCE_BY, accumulate_dparams)
    return ops + _reduce.partials(ln_part, L["pp"], C, [dw, db], REDUCE_BY, accumulate_dparams)
