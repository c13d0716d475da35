"""Launch builders for rwkvx/cu/timemix/timemix.cu: the element-wise parts of the RWKV-7 TimeMix block.

Every builder returns ``list[Launch]`` (plain data; no GPU needed to build). Pointers are ints or
objects with an int ``.ptr``; ``0`` / ``None`` means "absent" where a pointer is optional.
All activations are floatX row-major ``[R, C]`` (R = B*T, row r = token r % T of sequence r // T,
channel c = h*N + n), aligned to 4 elements; parameter vectors ``[C]`` and the partials are f32. Some
buffers are f32 in every precision (docs/SPEC.md §4): the token shift's input x = LN1(x) and its
gradient dx, the decay, the WKV7 gradients prep_backward reads and the gradient of v_first.
Twins: ``rwkvx.oracle.time_shift_forward`` / ``time_shift_backward``, ``tanh_*``, ``sigmoid_*``,
``time_mix_prep_forward`` / ``time_mix_prep_backward``, ``time_mix_gn_forward`` / ``time_mix_gn_backward``.

The builders with many buffers (prep, gn) take keyword arguments only: a swapped pair cannot pass
silently. Composition of one TimeMix block (RWKV index i; the integrator's GEMMs in brackets)::

    forward (also the backward's recompute of the block):
      shift_forward(x=LN1(x)) -> xr, xw, xk, xv, xa, xg   (the step fuses LN1 and the shift into one
                                                          launch: layernorm.forward_shift)
      [r = xr Wr^T, k = xk Wk^T, v = xv Wv^T]
      [hw = xw@w1] tanh_forward(hw -> hw, in place ok)   [wl = hw@w2]
      [ha = xa@a1] [al = ha@a2]      (i > 0): [hv = xv@v1] [vl = hv@v2]
      [hg = xg@g1] sigmoid_forward(hg -> hg)              [g = hg@g2]
      prep_forward(k, v, wl, al, vl, v_first, ...) -> decay, kp, vp (i > 0), wa, wb; i == 0 writes v_first
      wkv7 forward(r, decay, kp, v' , wa, wb) -> y        (v' = vp if i > 0 else v)
      gn_forward(y, r, kp, v', g, ...) -> z               [out = z Wo^T]

    backward (after the recompute; keep: xr..xg, r, k, v, hw (tanh act), wl, ha, al, hv, vl, hg
    (sigmoid act), g, kp, v', decay, wa, wb, y, z and the saved v_first — nothing else):
      [dz = dout @ Wo, dWo = dout^T z]
      gn_backward -> dy, dg, dr2, dkp2, dvp2, d ln_x.weight, d ln_x.bias, d r_k
      [dWg2 = hg^T dg, dhg = dg g2^T] sigmoid_backward(hg, dhg -> dhg) [dWg1 = xg^T dhg, dxg = dhg g1^T]
      wkv7 backward -> dr, d decay, dkp, dvp, dwa, dwb
      prep_backward(..., dkp2, dvp2, dr2) -> dk, dv, dwl, dal, dvl, dv_first, dr (= dr + dr2),
                    d w0, d a0, d k_k, d k_a, (d v0)
      [w2/w1 with tanh_backward(hw, dhw -> dhw), a2/a1, v2/v1, receptance/key/value GEMM backward;
       dxv collects value and v1 (beta = 1)]
      shift_backward(x, dxr..dxg) -> dx (= or +=), d x_r..x_g   (the step fuses it with LN1's backward:
                                                            layernorm.backward_shift, the same walks)

    v_first gradient: zero it (Memset) before the backward or pass ``vf_accumulate=False`` at the
    first RWKV block processed (the last one, i = L-1); blocks i > 0 add into it; block 0 reads it.

Parameter gradients (d x_*, d w0 ..., d ln_x.*, d r_k) are computed deterministically: each backward
kernel writes per-(row-tile, row-stream) partial sums into ``partials`` (scratch), then
``reduce_partials`` (reduce.cu) sums them in a fixed order. One scratch of ``scratch_elems(R, C, N, dev)``
fp32 elements serves all three backward kernels (they run one after another on the stream).
"""
from __future__ import annotations

import math

from rwkvx.config import DECAY_SCALE, GN_EPS, L2_EPS
from rwkvx.runtime.kernel import F32_IN, F32_OUT, INT, LONG, X_IN, X_OUT, KernelFile

from .. import reduce as _reduce
from .._common import DeviceInfo, grid_stride_blocks, xtype_of

HEAD_SIZES = (4, 8, 16, 32, 64, 128)
REDUCE_BY = 8                   # reduce_partials rows (its summation order)
SHIFT_N = 4                     # the shift and LoRA kernels ignore the head size: one build serves all
_MAX_QX = 256
SHIFT_BWD_BLOCKS_PER_SM = 24    # 64-thread blocks: 3 waves of 8 per SM (<= 128 registers), 4 of 6

CU = KernelFile("timemix/timemix", constants={"TM_DECAY_SCALE": DECAY_SCALE, "TM_GN_EPS": GN_EPS, "TM_L2_EPS": L2_EPS},
                variants={"HEAD_SIZE": HEAD_SIZES})
_MIX = {f"m{j}": F32_IN for j in range(6)}
TM_SHIFT_FWD = CU.kernel("tm_shift_fwd", x=F32_IN, **_MIX, **{f"o{j}": X_OUT for j in range(6)},
                         R=INT, C=INT, T=INT, rpt=INT)
TM_SHIFT_BWD = CU.kernel("tm_shift_bwd", x=F32_IN, **_MIX, **{f"d{j}": X_IN for j in range(6)},
                         dx=F32_OUT, partials=F32_OUT, R=INT, C=INT, T=INT, rpt=INT, acc=INT)
_ELEMENTWISE = dict(a=X_IN, b=X_IN.opt(), out=X_OUT, n=LONG)
TM_TANH_FWD = CU.kernel("tm_tanh_fwd", **_ELEMENTWISE)
TM_TANH_BWD = CU.kernel("tm_tanh_bwd", **_ELEMENTWISE)
TM_SIGMOID_FWD = CU.kernel("tm_sigmoid_fwd", **_ELEMENTWISE)
TM_SIGMOID_BWD = CU.kernel("tm_sigmoid_bwd", **_ELEMENTWISE)
_PREP_IN = dict(k=X_IN, v=X_IN, wl=X_IN, al=X_IN, vl=X_IN.opt())
_PREP_PARAMS = dict(w0=F32_IN, a0=F32_IN, v0=F32_IN.opt(), k_k=F32_IN, k_a=F32_IN)
TM_PREP_FWD = CU.kernel("tm_prep_fwd", **_PREP_IN, vf=X_OUT, **_PREP_PARAMS,
                        decay=F32_OUT, kp=X_OUT, vp=X_OUT.opt(), wa=X_OUT, wb=X_OUT, R=INT, C=INT, rpt=INT,
                        layer=INT)
TM_PREP_BWD = CU.kernel("tm_prep_bwd", **_PREP_IN, vf=X_IN.opt(), **_PREP_PARAMS,
                        dd=F32_IN, dkp=F32_IN, dvp=F32_IN, dwa=F32_IN, dwb=F32_IN, dkp2=X_IN.opt(), dvp2=X_IN.opt(),
                        dr=X_IN.opt(), dr2=X_IN.opt(), dr_out=X_OUT.opt(),
                        dk=X_OUT, dv=X_OUT, dwl=X_OUT, dal=X_OUT, dvl=X_OUT.opt(), dvf=F32_OUT.opt(),
                        partials=F32_OUT, R=INT, C=INT, rpt=INT, layer=INT, vf_acc=INT)
_GN_IN = dict(y=X_IN, r=X_IN, kp=X_IN, vp=X_IN, g=X_IN)
_GN_PARAMS = dict(lnw=F32_IN, lnb=F32_IN, rk=F32_IN)
TM_GN_FWD = CU.kernel("tm_gn_fwd", **_GN_IN, **_GN_PARAMS, z=X_OUT, R=INT, C=INT, rpt=INT)
TM_GN_BWD = CU.kernel("tm_gn_bwd", **_GN_IN, dz=X_IN, **_GN_PARAMS, dy=X_OUT, dg=X_OUT, dr2=X_OUT,
                      dkp2=X_OUT, dvp2=X_OUT, partials=F32_OUT, R=INT, C=INT, rpt=INT)


def _check(R: int, C: int, N: int) -> None:
    if N not in HEAD_SIZES:
        raise ValueError(f"head size N={N} not supported (one of {HEAD_SIZES})")
    if C <= 0 or C % N:
        raise ValueError(f"C={C} must be a positive multiple of N={N}")
    if R <= 0:
        raise ValueError(f"rows R={R} must be positive")


def layout(R: int, C: int, dev: DeviceInfo, N: int = 4, rows_per_tile: int | None = None, *,
           qx: int | None = None, threads: int = _MAX_QX, blocks_per_sm: int | None = None) -> dict:
    """Thread layout of the row kernels (see the header of timemix.cu).

    Returns dict(qx, ry, rpt, tiles, grid, block, pp): block = (qx, ry); grid = (C/4/qx, tiles);
    ``pp`` = tiles*ry partial rows written by a backward kernel. ``rows_per_tile`` defaults to a value
    that gives about ``blocks_per_sm`` (default reduce.BLOCKS_PER_SM) blocks per multiprocessor.
    ``qx`` (a divisor of C/4, a multiple of N/4) and ``threads`` (per block) override the default of
    up to 256 threads per block.
    """
    _check(R, C, N)
    q4 = C // 4
    g = N // 4
    if qx is None:
        qx = q4 if q4 <= threads else max(d for d in range(g, threads + 1, g) if q4 % d == 0)
    elif q4 % qx or qx % g:
        raise ValueError(f"qx={qx} must divide C/4={q4} and be a multiple of N/4={g}")
    ry = max(1, threads // qx)
    gx = q4 // qx
    if rows_per_tile is None:
        rpt = max(1, math.ceil(R * gx / ((blocks_per_sm or _reduce.BLOCKS_PER_SM) * dev.sm_count)))
        rpt = ry * math.ceil(rpt / ry)
    else:
        rpt = int(rows_per_tile)
        if rpt <= 0:
            raise ValueError(f"rows_per_tile must be positive, got {rows_per_tile}")
    tiles = math.ceil(R / rpt)
    if tiles > 65535:
        raise ValueError(f"rows_per_tile={rpt} gives {tiles} row tiles (> 65535)")
    return dict(qx=qx, ry=ry, rpt=rpt, tiles=tiles, grid=(gx, tiles, 1), block=(qx, ry, 1),
                pp=tiles * ry)


def shift_backward_layout(R: int, C: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> dict:
    """tm_shift_bwd's layout: blocks of 64 threads (64 quads of one row, or 32 quads of two) when C/4 is
    a multiple of 32, else the generic one. The kernel takes <= 128 registers, so 64-thread blocks fill
    the register file: 16 warps per SM (192-thread blocks, C = 768's generic layout, fit 2: 12 warps).
    Default rows per tile: about SHIFT_BWD_BLOCKS_PER_SM blocks per SM."""
    q4 = C // 4
    if q4 % 32:
        return layout(R, C, dev, SHIFT_N, rows_per_tile)
    return layout(R, C, dev, SHIFT_N, rows_per_tile, qx=64 if q4 % 64 == 0 else 32, threads=64,
                  blocks_per_sm=SHIFT_BWD_BLOCKS_PER_SM)


def scratch_elems(R: int, C: int, N: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> int:
    """fp32 elements of the ``partials`` scratch needed by shift_backward, prep_backward and gn_backward
    (the maximum of the three; pass the same ``rows_per_tile`` as to the builders)."""
    ls = shift_backward_layout(R, C, dev, rows_per_tile)
    lh = layout(R, C, dev, N, rows_per_tile)
    return C * max(6 * ls["pp"], 5 * lh["pp"], 3 * lh["pp"])


def _row_launch(kernel, L: dict, N: int, xtype: str, **args):
    return kernel.launch(L["grid"], L["block"], xtype=xtype, variant={"HEAD_SIZE": N}, **args)


# ------------------------------------------------------------------------------------------------
# 1. token shift + mix
# ------------------------------------------------------------------------------------------------
def shift_forward(x, mix, outs, R: int, C: int, T: int, dev: DeviceInfo, rows_per_tile: int | None = None) -> list:
    """tm_shift_fwd. x [R,C] f32 (LN1 output; R = B*T); mix = (x_r, x_w, x_k, x_v, x_a, x_g) each [C];
    outs = (xr, xw, xk, xv, xa, xg) each floatX [R,C].
    o_j = x + (shift(x) - x) * mix_j with shift zero at t = 0 of every sequence."""
    if len(mix) != 6 or len(outs) != 6:
        raise ValueError("shift_forward: 6 mix vectors and 6 outputs")
    if R % T:
        raise ValueError(f"R={R} must be a multiple of T={T}")
    L = layout(R, C, dev, SHIFT_N, rows_per_tile)
    return [_row_launch(TM_SHIFT_FWD, L, SHIFT_N, xtype_of("timemix.shift_forward", *outs), x=x,
                        **{f"m{j}": m for j, m in enumerate(mix)}, **{f"o{j}": o for j, o in enumerate(outs)},
                        R=R, C=C, T=T, rpt=L["rpt"])]


def shift_backward(x, mix, douts, dx, dmix, partials, R: int, C: int, T: int, dev: DeviceInfo,
                   accumulate_dx: bool = False, accumulate_dmix: bool = False,
                   rows_per_tile: int | None = None) -> list:
    """tm_shift_bwd + reduce_partials.

    x [R,C] f32, mix 6 x [C] as in shift_forward; douts = (dxr, dxw, dxk, dxv, dxa, dxg) each floatX
    [R,C]; dx [R,C] f32: written (or += with accumulate_dx); must not alias x or any douts.
    dmix = (d x_r, ..., d x_g) each [C]: written (or += with accumulate_dmix).
    partials: scratch of at least scratch_elems(R, C, N, dev) fp32 elements."""
    if len(mix) != 6 or len(douts) != 6 or len(dmix) != 6:
        raise ValueError("shift_backward: 6 mix vectors, 6 output grads, 6 mix grads")
    if R % T:
        raise ValueError(f"R={R} must be a multiple of T={T}")
    L = shift_backward_layout(R, C, dev, rows_per_tile)
    ops = [_row_launch(TM_SHIFT_BWD, L, SHIFT_N, xtype_of("timemix.shift_backward", *douts), x=x,
                       **{f"m{j}": m for j, m in enumerate(mix)}, **{f"d{j}": d for j, d in enumerate(douts)},
                       dx=dx, partials=partials, R=R, C=C, T=T, rpt=L["rpt"], acc=int(bool(accumulate_dx)))]
    return ops + _reduce.partials(partials, L["pp"], C, dmix, REDUCE_BY, accumulate_dmix)


# ------------------------------------------------------------------------------------------------
# 2. LoRA activations (n elements; in place allowed)
# ------------------------------------------------------------------------------------------------
def _elementwise(kernel, a, b, out, n: int, dev: DeviceInfo) -> list:
    if n <= 0:
        raise ValueError(f"{kernel.name}: n must be positive")
    blocks = grid_stride_blocks(math.ceil(n / 4), dev)
    return [kernel.launch((blocks, 1, 1), (256, 1, 1), xtype=xtype_of(kernel.name, a, out),
                          variant={"HEAD_SIZE": SHIFT_N}, a=a, b=b, out=out, n=n)]


def tanh_forward(pre, act, n: int, dev: DeviceInfo) -> list:
    """act = tanh(pre); n = R*Dw elements. Keep ``act`` (the backward and the w2 GEMM need it)."""
    return _elementwise(TM_TANH_FWD, pre, None, act, n, dev)


def tanh_backward(act, dact, dpre, n: int, dev: DeviceInfo) -> list:
    """dpre = dact * (1 - act^2) (act = tanh output; dpre may alias dact)."""
    return _elementwise(TM_TANH_BWD, act, dact, dpre, n, dev)


def sigmoid_forward(pre, act, n: int, dev: DeviceInfo) -> list:
    """act = sigmoid(pre); n = R*Dg elements. Keep ``act``."""
    return _elementwise(TM_SIGMOID_FWD, pre, None, act, n, dev)


def sigmoid_backward(act, dact, dpre, n: int, dev: DeviceInfo) -> list:
    """dpre = dact * act * (1 - act) (act = sigmoid output; dpre may alias dact)."""
    return _elementwise(TM_SIGMOID_BWD, act, dact, dpre, n, dev)


# ------------------------------------------------------------------------------------------------
# 3. prep
# ------------------------------------------------------------------------------------------------
def prep_forward(*, k, v, wl, al, vl, v_first, w0, a0, v0, k_k, k_a,
                 decay, kp, vp, wa, wb, R: int, C: int, N: int, layer: int, dev: DeviceInfo,
                 rows_per_tile: int | None = None) -> list:
    """tm_prep_fwd. Inputs [R,C]: k, v (GEMM outputs), wl = tanh(xw@w1)@w2, al = xa@a1@a2,
    vl = xv@v1@v2 (layer > 0, else None), v_first (layer > 0: read; layer 0: written := v).
    Params [C]: w0, a0, v0 (layer > 0, else None), k_k, k_a.
    Outputs [R,C]: decay (f32) = exp(-e^-0.5 sigmoid(w0+wl)); kp = k*(1+(a-1)*k_a);
    vp = v + (v_first - v)*sigmoid(v0+vl) (layer > 0 only; layer 0 uses v itself, vp may be None);
    wa = -kk, wb = kk*a with kk = l2normalize_head(k*k_k), a = sigmoid(a0+al).
    Outputs must not overwrite k, v, wl, al, vl, v_first (prep_backward re-reads them)."""
    L = layout(R, C, dev, N, rows_per_tile)
    lay = layer > 0
    return [_row_launch(TM_PREP_FWD, L, N, xtype_of("timemix.prep_forward", k, v, kp, wa, wb),
                        k=k, v=v, wl=wl, al=al, vl=vl if lay else None, vf=v_first,
                        w0=w0, a0=a0, v0=v0 if lay else None, k_k=k_k, k_a=k_a,
                        decay=decay, kp=kp, vp=vp if lay else None, wa=wa, wb=wb,
                        R=R, C=C, rpt=L["rpt"], layer=int(lay))]


def prep_backward(*, k, v, wl, al, vl, v_first, w0, a0, v0, k_k, k_a,
                  d_decay, dkp, dvp, dwa, dwb, dkp2, dvp2, dr, dr2, dr_out,
                  dk, dv, dwl, dal, dvl, dv_first, partials, dparams,
                  R: int, C: int, N: int, layer: int, dev: DeviceInfo, vf_accumulate: bool = True,
                  accumulate_dparams: bool = False, rows_per_tile: int | None = None) -> list:
    """tm_prep_bwd + reduce_partials.

    Saved/recomputed inputs as in prep_forward (k, v, wl, al, vl, v_first; v, vl, v_first, v0 only
    used for layer > 0). Gradient inputs [R,C] from the WKV backward (f32): d_decay, dkp, dvp, dwa, dwb;
    optional extra grads from gn_backward's bonus term: dkp2, dvp2 (None = none) and dr2 with
    dr_out = dr + dr2 (skipped when dr2 is None; dr_out may alias dr).
    Outputs [R,C] (may alias the gradient inputs): dk, dv (of the key/value GEMM outputs), dwl,
    dal, dvl (layer > 0).
    dv_first [R,C] f32: layer > 0: dv_first = (vf_accumulate ? dv_first : 0) + dv'*sigmoid(v0+vl);
    layer 0: dv += dv_first (read only; pass None when no later block exists).
    dparams = (d w0, d a0, d k_k, d k_a, d v0) [C] each (d v0 only for layer > 0): written
    (+= with accumulate_dparams)."""
    L = layout(R, C, dev, N, rows_per_tile)
    lay = layer > 0
    np_ = 5 if lay else 4
    dparams = list(dparams)[:np_]
    if len(dparams) != np_:
        raise ValueError(f"prep_backward: {np_} parameter gradients needed for layer {layer}")
    if lay and dv_first is None:
        raise ValueError("prep_backward: layer > 0 needs dv_first")
    if dr2 is not None and dr_out is None:
        raise ValueError("prep_backward: dr2 given without dr_out")
    ops = [_row_launch(TM_PREP_BWD, L, N, xtype_of("timemix.prep_backward", k, v, dk, dv, dwl, dal),
                       k=k, v=v, wl=wl, al=al, vl=vl if lay else None, vf=v_first if lay else None,
                       w0=w0, a0=a0, v0=v0 if lay else None, k_k=k_k, k_a=k_a,
                       dd=d_decay, dkp=dkp, dvp=dvp, dwa=dwa, dwb=dwb, dkp2=dkp2, dvp2=dvp2,
                       dr=dr, dr2=dr2, dr_out=dr_out if dr2 is not None else None,
                       dk=dk, dv=dv, dwl=dwl, dal=dal, dvl=dvl if lay else None, dvf=dv_first,
                       partials=partials, R=R, C=C, rpt=L["rpt"], layer=int(lay),
                       vf_acc=int(bool(vf_accumulate)))]
    return ops + _reduce.partials(partials, L["pp"], C, dparams, REDUCE_BY, accumulate_dparams)


# ------------------------------------------------------------------------------------------------
# 4. GroupNorm + bonus + gate
# ------------------------------------------------------------------------------------------------
def gn_forward(*, y, r, kp, vp, g, ln_w, ln_b, r_k, z, R: int, C: int, N: int, dev: DeviceInfo,
               rows_per_tile: int | None = None) -> list:
    """tm_gn_fwd. y (WKV output), r, kp (k'), vp (v'; for block 0 the v buffer), g (gate GEMM
    output), all [R,C]; ln_w, ln_b, r_k [C]. z [R,C] = (GroupNorm(y)*ln_w + ln_b +
    sum_head(r*kp*r_k)*vp) * g  -> input of the output GEMM. Nothing else is saved: the backward
    recomputes the per-head mean / rstd / bonus sum from y, r, kp."""
    L = layout(R, C, dev, N, rows_per_tile)
    return [_row_launch(TM_GN_FWD, L, N, xtype_of("timemix.gn_forward", y, r, kp, vp, g, z),
                        y=y, r=r, kp=kp, vp=vp, g=g, lnw=ln_w, lnb=ln_b, rk=r_k, z=z,
                        R=R, C=C, rpt=L["rpt"])]


def gn_backward(*, y, r, kp, vp, g, dz, ln_w, ln_b, r_k, dy, dg, dr2, dkp2, dvp2, partials, dparams,
                R: int, C: int, N: int, dev: DeviceInfo, accumulate_dparams: bool = False,
                rows_per_tile: int | None = None) -> list:
    """tm_gn_bwd + reduce_partials. Inputs as gn_forward plus dz [R,C] (after g, before ln_w).
    Outputs [R,C] (may alias inputs element-wise): dy (to WKV backward), dg (to the g2 GEMM),
    dr2, dkp2, dvp2 (bonus-term grads of r, k', v' -> prep_backward).
    dparams = (d ln_x.weight, d ln_x.bias, d r_k) [C] each: written (+= with accumulate_dparams)."""
    L = layout(R, C, dev, N, rows_per_tile)
    if len(dparams) != 3:
        raise ValueError("gn_backward: 3 parameter gradients (ln_x.weight, ln_x.bias, r_k)")
    ops = [_row_launch(TM_GN_BWD, L, N, xtype_of("timemix.gn_backward", y, r, dz, dy, dg),
                       y=y, r=r, kp=kp, vp=vp, g=g, dz=dz, lnw=ln_w, lnb=ln_b, rk=r_k,
                       dy=dy, dg=dg, dr2=dr2, dkp2=dkp2, dvp2=dvp2, partials=partials,
                       R=R, C=C, rpt=L["rpt"])]
    return ops + _reduce.partials(partials, L["pp"], C, dparams, REDUCE_BY, accumulate_dparams)
