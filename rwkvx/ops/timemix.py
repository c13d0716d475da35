"""Launch builders for rwkvx/cu/timemix.cu: the element-wise parts of the RWKV-7 TimeMix block.

Every builder returns ``list[Launch]`` (plain data; no GPU needed to build). Pointers are ints or
objects with an int ``.ptr``; ``0`` / ``None`` means "absent" where a pointer is optional.
All activations are float32 row-major ``[R, C]`` (R = B*T, row r = token r % T of sequence r // T,
channel c = h*N + n), 16-byte aligned; parameter vectors are ``[C]`` float32.

Composition of one TimeMix block (RWKV index i; the integrator's GEMMs in brackets)::

    forward (also the backward's recompute of the block):
      shift_forward(x=LN1(x)) -> xr, xw, xk, xv, xa, xg
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
      shift_backward(x, dxr..dxg) -> dx (= or +=), d x_r..x_g

    v_first gradient: zero it (Memset) before the backward or pass ``vf_accumulate=False`` at the
    first RWKV block processed (the last one, i = L-1); blocks i > 0 add into it; block 0 reads it.

Parameter gradients (d x_*, d w0 ..., d ln_x.*, d r_k) are computed deterministically: each backward
kernel writes per-(row-tile, row-stream) partial sums into ``partials`` (scratch), then
``tm_reduce_partials`` sums them in a fixed order. One scratch of ``scratch_bytes(R, C, N)`` bytes
serves all three backward kernels (they run one after another on the stream).
"""
from __future__ import annotations

import math

from ._common import Launch, ptr

MODULE = "timemix"
HEAD_SIZES = (4, 8, 16, 32, 64, 128)
TARGET_BLOCKS = 1056            # ~8 blocks per SM on an H200 (132 SMs)
_MAX_QX = 256


def _check(R: int, C: int, N: int) -> None:
    if N not in HEAD_SIZES:
        raise ValueError(f"head size N={N} not supported (one of {HEAD_SIZES})")
    if C <= 0 or C % N:
        raise ValueError(f"C={C} must be a positive multiple of N={N}")
    if R <= 0:
        raise ValueError(f"rows R={R} must be positive")


def layout(R: int, C: int, N: int = 4, rows_per_tile: int | None = None) -> dict:
    """Thread layout of the row kernels (see the header of timemix.cu).

    Returns dict(qx, ry, rpt, tiles, grid, block, pp): block = (qx, ry); grid = (C/4/qx, tiles);
    ``pp`` = tiles*ry partial rows written by a backward kernel. ``rows_per_tile`` defaults to a value
    that gives about TARGET_BLOCKS blocks.
    """
    _check(R, C, N)
    q4 = C // 4
    g = N // 4
    if q4 <= _MAX_QX:
        qx = q4
    else:
        qx = max(d for d in range(g, _MAX_QX + 1, g) if q4 % d == 0)
    ry = max(1, _MAX_QX // qx)
    gx = q4 // qx
    if rows_per_tile is None:
        rpt = max(1, math.ceil(R * gx / TARGET_BLOCKS))
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


def _defs(N: int) -> tuple:
    return (("HEAD_SIZE", int(N)),)


def scratch_bytes(R: int, C: int, N: int = 64, rows_per_tile: int | None = None) -> int:
    """Bytes of the ``partials`` scratch needed by shift_backward, prep_backward and gn_backward
    (the maximum of the three; pass the same ``rows_per_tile`` as to the builders)."""
    ls = layout(R, C, 4, rows_per_tile)
    lh = layout(R, C, N, rows_per_tile)
    return 4 * C * max(6 * ls["pp"], 5 * lh["pp"], 3 * lh["pp"])


def reduce_partials(partials, Pp: int, C: int, outs, accumulate: bool = False) -> list:
    """tm_reduce_partials: outs[j][c] (=|+=) sum_p partials[p, j, c], fixed order.

    partials [Pp, len(outs), C]; outs: 1..6 pointers to [C] vectors."""
    outs = [ptr(o) for o in outs]
    if not 1 <= len(outs) <= 6:
        raise ValueError("reduce_partials: 1..6 outputs")
    nout = len(outs)
    ptrs = outs + [0] * (6 - nout)
    width = nout * C
    return [Launch(MODULE, "tm_reduce_partials", grid=(math.ceil(width / 32), 1, 1), block=(32, 8, 1),
                   args=(("p", ptr(partials)), ("i", Pp), ("i", C), ("i", nout),
                         *(("p", q) for q in ptrs), ("i", int(bool(accumulate)))))]


# ------------------------------------------------------------------------------------------------
# 1. token shift + mix
# ------------------------------------------------------------------------------------------------
def shift_forward(x, mix, outs, R: int, C: int, T: int, rows_per_tile: int | None = None) -> list:
    """tm_shift_fwd. x [R,C] (LN1 output; R = B*T); mix = (x_r, x_w, x_k, x_v, x_a, x_g) each [C];
    outs = (xr, xw, xk, xv, xa, xg) each [R,C], must not alias x.
    o_j = x + (shift(x) - x) * mix_j with shift zero at t = 0 of every sequence."""
    if len(mix) != 6 or len(outs) != 6:
        raise ValueError("shift_forward: 6 mix vectors and 6 outputs")
    if R % T:
        raise ValueError(f"R={R} must be a multiple of T={T}")
    L = layout(R, C, 4, rows_per_tile)
    return [Launch(MODULE, "tm_shift_fwd", grid=L["grid"], block=L["block"],
                   args=(("p", ptr(x)), *(("p", ptr(m)) for m in mix), *(("p", ptr(o)) for o in outs),
                         ("i", R), ("i", C), ("i", T), ("i", L["rpt"])))]


def shift_backward(x, mix, douts, dx, dmix, partials, R: int, C: int, T: int,
                   accumulate_dx: bool = False, accumulate_dmix: bool = False,
                   rows_per_tile: int | None = None) -> list:
    """tm_shift_bwd + tm_reduce_partials.

    x [R,C], mix 6 x [C] as in shift_forward; douts = (dxr, dxw, dxk, dxv, dxa, dxg) each [R,C];
    dx [R,C]: written (or += with accumulate_dx); must not alias x or any douts.
    dmix = (d x_r, ..., d x_g) each [C]: written (or += with accumulate_dmix).
    partials: scratch of at least scratch_bytes(R, C, ...) bytes."""
    if len(mix) != 6 or len(douts) != 6 or len(dmix) != 6:
        raise ValueError("shift_backward: 6 mix vectors, 6 output grads, 6 mix grads")
    if R % T:
        raise ValueError(f"R={R} must be a multiple of T={T}")
    L = layout(R, C, 4, rows_per_tile)
    ops = [Launch(MODULE, "tm_shift_bwd", grid=L["grid"], block=L["block"],
                  args=(("p", ptr(x)), *(("p", ptr(m)) for m in mix), *(("p", ptr(d)) for d in douts),
                        ("p", ptr(dx)), ("p", ptr(partials)),
                        ("i", R), ("i", C), ("i", T), ("i", L["rpt"]), ("i", int(bool(accumulate_dx)))))]
    return ops + reduce_partials(partials, L["pp"], C, dmix, accumulate_dmix)


# ------------------------------------------------------------------------------------------------
# 2. LoRA activations (n floats; in place allowed)
# ------------------------------------------------------------------------------------------------
def _elementwise(name: str, a, b, out, n: int) -> list:
    if n <= 0:
        raise ValueError(f"{name}: n must be positive")
    threads = 256
    blocks = max(1, min(math.ceil(math.ceil(n / 4) / threads), 132 * 16))
    return [Launch(MODULE, name, grid=(blocks, 1, 1), block=(threads, 1, 1),
                   args=(("p", ptr(a)), ("p", ptr(b)), ("p", ptr(out)), ("l", int(n))))]


def tanh_forward(pre, act, n: int) -> list:
    """act = tanh(pre); n = R*Dw floats. Keep ``act`` (the backward and the w2 GEMM need it)."""
    return _elementwise("tm_tanh_fwd", pre, 0, act, n)


def tanh_backward(act, dact, dpre, n: int) -> list:
    """dpre = dact * (1 - act^2) (act = tanh output; dpre may alias dact)."""
    return _elementwise("tm_tanh_bwd", act, dact, dpre, n)


def sigmoid_forward(pre, act, n: int) -> list:
    """act = sigmoid(pre); n = R*Dg floats. Keep ``act``."""
    return _elementwise("tm_sigmoid_fwd", pre, 0, act, n)


def sigmoid_backward(act, dact, dpre, n: int) -> list:
    """dpre = dact * act * (1 - act) (act = sigmoid output; dpre may alias dact)."""
    return _elementwise("tm_sigmoid_bwd", act, dact, dpre, n)


# ------------------------------------------------------------------------------------------------
# 3. prep
# ------------------------------------------------------------------------------------------------
def prep_forward(k, v, wl, al, vl, v_first, w0, a0, v0, k_k, k_a,
                 decay, kp, vp, wa, wb, R: int, C: int, N: int, layer: int,
                 rows_per_tile: int | None = None) -> list:
    """tm_prep_fwd. Inputs [R,C]: k, v (GEMM outputs), wl = tanh(xw@w1)@w2, al = xa@a1@a2,
    vl = xv@v1@v2 (layer > 0, else 0), v_first (layer > 0: read; layer 0: written := v).
    Params [C]: w0, a0, v0 (layer > 0, else 0), k_k, k_a.
    Outputs [R,C]: decay = exp(-e^-0.5 sigmoid(w0+wl)); kp = k*(1+(a-1)*k_a);
    vp = v + (v_first - v)*sigmoid(v0+vl) (layer > 0 only; layer 0 uses v itself, vp may be 0);
    wa = -kk, wb = kk*a with kk = l2normalize_head(k*k_k), a = sigmoid(a0+al).
    Outputs must not overwrite k, v, wl, al, vl, v_first (prep_backward re-reads them)."""
    L = layout(R, C, N, rows_per_tile)
    lay = int(layer > 0)
    return [Launch(MODULE, "tm_prep_fwd", grid=L["grid"], block=L["block"], defines=_defs(N),
                   args=(("p", ptr(k)), ("p", ptr(v)), ("p", ptr(wl)), ("p", ptr(al)),
                         ("p", ptr(vl) if lay else 0), ("p", ptr(v_first)),
                         ("p", ptr(w0)), ("p", ptr(a0)), ("p", ptr(v0) if lay else 0),
                         ("p", ptr(k_k)), ("p", ptr(k_a)),
                         ("p", ptr(decay)), ("p", ptr(kp)), ("p", ptr(vp) if lay else 0),
                         ("p", ptr(wa)), ("p", ptr(wb)),
                         ("i", R), ("i", C), ("i", L["rpt"]), ("i", lay)))]


def prep_backward(k, v, wl, al, vl, v_first, w0, a0, v0, k_k, k_a,
                  d_decay, dkp, dvp, dwa, dwb, dkp2, dvp2, dr, dr2, dr_out,
                  dk, dv, dwl, dal, dvl, dv_first, partials, dparams,
                  R: int, C: int, N: int, layer: int, vf_accumulate: bool = True,
                  accumulate_dparams: bool = False, rows_per_tile: int | None = None) -> list:
    """tm_prep_bwd + tm_reduce_partials.

    Saved/recomputed inputs as in prep_forward (k, v, wl, al, vl, v_first; v, vl, v_first, v0 only
    used for layer > 0). Gradient inputs [R,C] from the WKV backward: d_decay, dkp, dvp, dwa, dwb;
    optional extra grads from gn_backward's bonus term: dkp2, dvp2 (0 = none) and dr2 with
    dr_out = dr + dr2 (skipped when dr2 is 0; dr_out may alias dr).
    Outputs [R,C] (may alias the gradient inputs): dk, dv (of the key/value GEMM outputs), dwl,
    dal, dvl (layer > 0).
    dv_first [R,C]: layer > 0: dv_first = (vf_accumulate ? dv_first : 0) + dv'*sigmoid(v0+vl);
    layer 0: dv += dv_first (read only; pass 0 when no later block exists).
    dparams = (d w0, d a0, d k_k, d k_a, d v0) [C] each (d v0 only for layer > 0): written
    (+= with accumulate_dparams)."""
    L = layout(R, C, N, rows_per_tile)
    lay = int(layer > 0)
    np_ = 5 if lay else 4
    dparams = list(dparams)[:np_]
    if len(dparams) != np_:
        raise ValueError(f"prep_backward: {np_} parameter gradients needed for layer {layer}")
    ops = [Launch(MODULE, "tm_prep_bwd", grid=L["grid"], block=L["block"], defines=_defs(N),
                  args=(("p", ptr(k)), ("p", ptr(v)), ("p", ptr(wl)), ("p", ptr(al)),
                        ("p", ptr(vl) if lay else 0), ("p", ptr(v_first) if lay else 0),
                        ("p", ptr(w0)), ("p", ptr(a0)), ("p", ptr(v0) if lay else 0),
                        ("p", ptr(k_k)), ("p", ptr(k_a)),
                        ("p", ptr(d_decay)), ("p", ptr(dkp)), ("p", ptr(dvp)), ("p", ptr(dwa)), ("p", ptr(dwb)),
                        ("p", ptr(dkp2)), ("p", ptr(dvp2)),
                        ("p", ptr(dr)), ("p", ptr(dr2)), ("p", ptr(dr_out) if ptr(dr2) else 0),
                        ("p", ptr(dk)), ("p", ptr(dv)), ("p", ptr(dwl)), ("p", ptr(dal)),
                        ("p", ptr(dvl) if lay else 0), ("p", ptr(dv_first)), ("p", ptr(partials)),
                        ("i", R), ("i", C), ("i", L["rpt"]), ("i", lay), ("i", int(bool(vf_accumulate)))))]
    if lay and not ptr(dv_first):
        raise ValueError("prep_backward: layer > 0 needs dv_first")
    if ptr(dr2) and not ptr(dr_out):
        raise ValueError("prep_backward: dr2 given without dr_out")
    return ops + reduce_partials(partials, L["pp"], C, dparams, accumulate_dparams)


# ------------------------------------------------------------------------------------------------
# 4. GroupNorm + bonus + gate
# ------------------------------------------------------------------------------------------------
def gn_forward(y, r, kp, vp, g, ln_w, ln_b, r_k, z, R: int, C: int, N: int,
               rows_per_tile: int | None = None) -> list:
    """tm_gn_fwd. y (WKV output), r, kp (k'), vp (v'; for block 0 the v buffer), g (gate GEMM
    output), all [R,C]; ln_w, ln_b, r_k [C]. z [R,C] = (GroupNorm(y)*ln_w + ln_b +
    sum_head(r*kp*r_k)*vp) * g  -> input of the output GEMM. Nothing else is saved: the backward
    recomputes the per-head mean / rstd / bonus sum from y, r, kp."""
    L = layout(R, C, N, rows_per_tile)
    return [Launch(MODULE, "tm_gn_fwd", grid=L["grid"], block=L["block"], defines=_defs(N),
                   args=(("p", ptr(y)), ("p", ptr(r)), ("p", ptr(kp)), ("p", ptr(vp)), ("p", ptr(g)),
                         ("p", ptr(ln_w)), ("p", ptr(ln_b)), ("p", ptr(r_k)), ("p", ptr(z)),
                         ("i", R), ("i", C), ("i", L["rpt"])))]


def gn_backward(y, r, kp, vp, g, dz, ln_w, ln_b, r_k, dy, dg, dr2, dkp2, dvp2, partials, dparams,
                R: int, C: int, N: int, accumulate_dparams: bool = False,
                rows_per_tile: int | None = None) -> list:
    """tm_gn_bwd + tm_reduce_partials. Inputs as gn_forward plus dz [R,C] (after g, before ln_w).
    Outputs [R,C] (may alias inputs element-wise): dy (to WKV backward), dg (to the g2 GEMM),
    dr2, dkp2, dvp2 (bonus-term grads of r, k', v' -> prep_backward).
    dparams = (d ln_x.weight, d ln_x.bias, d r_k) [C] each: written (+= with accumulate_dparams)."""
    L = layout(R, C, N, rows_per_tile)
    if len(dparams) != 3:
        raise ValueError("gn_backward: 3 parameter gradients (ln_x.weight, ln_x.bias, r_k)")
    ops = [Launch(MODULE, "tm_gn_bwd", grid=L["grid"], block=L["block"], defines=_defs(N),
                  args=(("p", ptr(y)), ("p", ptr(r)), ("p", ptr(kp)), ("p", ptr(vp)), ("p", ptr(g)),
                        ("p", ptr(dz)), ("p", ptr(ln_w)), ("p", ptr(ln_b)), ("p", ptr(r_k)),
                        ("p", ptr(dy)), ("p", ptr(dg)), ("p", ptr(dr2)), ("p", ptr(dkp2)), ("p", ptr(dvp2)),
                        ("p", ptr(partials)), ("i", R), ("i", C), ("i", L["rpt"])))]
    return ops + reduce_partials(partials, L["pp"], C, dparams, accumulate_dparams)
