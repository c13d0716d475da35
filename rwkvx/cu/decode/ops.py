"""Launch builders for rwkvx/cu/decode/decode.cu: the single-token step kernels of generation.

One step feeds one token per sequence (B rows). The parts of a block that look at earlier tokens read
what they need from state carried in device memory and update it:

* :func:`shift`: the token shift of the time mix (6 mixes) or the channel mix (1), from ``prev``
  [B, C] (the previous token's input row), which becomes this token's; :func:`ln_shift` is the
  LayerNorm that makes that row and the shift in one kernel;
* :func:`wkv7_step`: one WKV7 token on ``state`` fp32 [B, H, N, N] (S[i, j], row = value index), in place;
* :func:`tmix_step`: an RWKV block's time mix from its LoRA hidden rows to the GroupNorm's output
  (the LoRA second layers, the prep, the WKV7 token, the GroupNorm) in one kernel per (head, row);
* :func:`moba_step`: MoBA attention of each sequence's new query at its own position ``pos[b]``
  (device int32 [B]): its key and value go into the caches ``kc``, ``vc`` floatX [B, Tmax, H, N]; when
  the token completes a block, that block's key mean goes into ``kmean`` fp32 [B, H, Tmax // chunk, N];
  then the gate over the complete past blocks, the top_k - 1 largest (ties: the lower block), softmax
  attention over them and the query's own block up to itself. ``sel`` int32 [B, H, top_k - 1] (optional) receives the selection.

Activations (outputs, r, k, v, a, b, y, q, o) are floatX [B, C] (c = h*N + n), 16-byte aligned; the shift's
input x and carried row prev (a LayerNorm's output) and the decay w are f32 in every precision.
Twins: ``rwkvx.oracle.decode_shift``, ``decode_wkv7``, ``decode_time_mix``, ``decode_moba`` (built on the
forward twins).

:func:`sample` (rwkvx/cu/decode/sample.cu): the token of each row of logits floatX [B, V] that
:mod:`rwkvx.sampling`'s contract chooses with the row's draw ``u`` f64 [B] and ``opts`` f64 [3]
(temperature, top_p, top_k), into ``out`` int32 [B]. Twin: ``rwkvx.oracle.decode_sample``.

:func:`gemv` (rwkvx/cu/decode/gemv.cu): up to :data:`GEMV_JOBS` independent matrix products of B <=
:data:`GEMV_ROWS` rows (:class:`GemvJob`) in one launch, each with its activation or residual add fused.
Twin: ``rwkvx.oracle.decode_gemv``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.kernel import F32_IN, F32_OUT, F64_IN, FLOAT, I32_IN, I32_OUT, INT, X_IN, X_OUT, KernelFile
from rwkvx.runtime.ops import DevPtr

from ... import sampling
from ...config import DECAY_SCALE, GN_EPS, L2_EPS
from .. import moba, wkv7
from .._common import DeviceInfo, check_buffers, check_rows, grid_stride_blocks, xtype_of

HEAD_SIZES = wkv7.HEAD_SIZES          # every model has RWKV blocks: their head sizes bound the file's
SHIFT_N = HEAD_SIZES[0]               # dec_shift ignores the head size: one build serves all
MOBA_THREADS = moba.KM_THREADS        # dec_moba completes a block mean with moba_kmean's partition

CU = KernelFile("decode/decode", constants={"WKV_Q": wkv7.Q, "DEC_MOBA_THREADS": MOBA_THREADS,
                                           "TM_DECAY_SCALE": DECAY_SCALE, "TM_GN_EPS": GN_EPS, "TM_L2_EPS": L2_EPS},
                variants={"HEAD_SIZE": HEAD_SIZES})
DEC_SHIFT = CU.kernel("dec_shift", x=F32_IN, prev=F32_OUT, **{f"m{j}": F32_IN.opt() for j in range(6)},
                      **{f"o{j}": X_OUT.opt() for j in range(6)}, B=INT, C=INT, nmix=INT)
DEC_LN_SHIFT = CU.kernel("dec_ln_shift", x=F32_IN, w=F32_IN, b=F32_IN, y=F32_OUT,
                         mean_out=F32_OUT.opt(), rstd_out=F32_OUT.opt(), prev=F32_OUT,
                         **{f"m{j}": F32_IN.opt() for j in range(6)}, **{f"o{j}": X_OUT.opt() for j in range(6)},
                         C=INT, nmix=INT, eps=FLOAT)
DEC_WKV7 = CU.kernel("dec_wkv7", r=X_IN, w=F32_IN, k=X_IN, v=X_IN, a=X_IN, b=X_IN, state=F32_OUT, y=X_OUT, H=INT)
LORA2 = ("w", "a", "v", "g")          # dec_tmix's LoRA paths, in its order
DEC_TMIX = CU.kernel("dec_tmix", hw=X_IN.opt(), ha=X_IN, hv=X_IN.opt(), hg=X_IN, w2=X_IN, a2=X_IN, v2=X_IN.opt(),
                     g2=X_IN, dw=INT, da=INT, dv=INT, dg=INT, r=X_IN, k=X_IN, v=X_IN, vf=X_OUT,
                     w0=F32_IN, a0=F32_IN, v0=F32_IN.opt(), k_k=F32_IN, k_a=F32_IN, state=F32_OUT,
                     lnw=F32_IN, lnb=F32_IN, rk=F32_IN, z=X_OUT, H=INT)
DEC_MOBA = CU.kernel("dec_moba", q=X_IN, k=X_IN, v=X_IN, kc=X_OUT, vc=X_OUT, kmean=F32_OUT.opt(), pos=I32_IN,
                     sel_out=I32_OUT.opt(), o=X_OUT, H=INT, Tmax=INT, chunk=INT, K1=INT, maxblk=INT,
                     scale=FLOAT)


SAMPLE_THREADS = 512
SAMPLE_CLUSTER = 8       # dec_sample's blocks per row (a thread block cluster: the portable maximum)
SAMPLE_OPTS = ("temperature", "top_p", "top_k")      # opts[i] of dec_sample
SAMPLE_CU = KernelFile("decode/sample", constants={
    "SMP_THREADS": SAMPLE_THREADS, "SMP_CLUSTER": SAMPLE_CLUSTER, "SMP_WEIGHT_BITS": sampling.WEIGHT_BITS, "SMP_CUTOFF": sampling.WEIGHT_CUTOFF,
    "SMP_INV_LN2": sampling.INV_LN2, "SMP_LN2_HI": sampling.LN2_HI, "SMP_LN2_LO": sampling.LN2_LO,
    "SMP_EXP_COEFFS": ",".join(repr(c) for c in sampling.EXP_COEFFS)})
DEC_SAMPLE = SAMPLE_CU.kernel("dec_sample", logits=X_IN, u=F64_IN, opts=F64_IN, out=I32_OUT, V=INT)

GEMV_JOBS = 8            # products per dec_gemv launch (its prototype's job slots)
GEMV_ROWS = 8            # the most rows (sequences) dec_gemv multiplies
GEMV_WARPS = 8
GEMV_CPW = 2             # columns per warp of a [n, k] weight's tile
GEMV_KN_COLS = 32        # columns of a [k, n] weight's tile (one per lane)
GEMV_EPILOGUES = {"none": 0, "tanh": 1, "sigmoid": 2, "relu_sq": 3}
GEMV_KN = 8              # mode bit: the weight is stored [k, n]
GEMV_KS_SHIFT = 4        # mode >> GEMV_KS_SHIFT: log2 of a [n, k] job's k-slices
GEMV_SLICE_BYTES = 1024  # a [n, k] job's k-slices span at least this much of a weight row (2 vectors a lane)
GEMV_CU = KernelFile("decode/gemv", variants={"GEMV_TF32": (0, 1)}, constants={
    "GEMV_JOBS": GEMV_JOBS, "GEMV_ROWS": GEMV_ROWS, "GEMV_WARPS": GEMV_WARPS, "GEMV_CPW": GEMV_CPW,
    "GEMV_KN": GEMV_KN, "GEMV_KS_SHIFT": GEMV_KS_SHIFT,
    **{f"GEMV_{e.upper()}": c for e, c in GEMV_EPILOGUES.items() if c}})
DEC_GEMV = GEMV_CU.kernel("dec_gemv", **{f"x{j}": X_IN.opt() for j in range(GEMV_JOBS)},
                          **{f"w{j}": X_IN.opt() for j in range(GEMV_JOBS)},
                          **{f"y{j}": X_OUT.opt() for j in range(GEMV_JOBS)},
                          **{f"r{j}": F32_OUT.opt() for j in range(GEMV_JOBS)},
                          **{f"a{j}": F32_IN.opt() for j in range(GEMV_JOBS)},
                          **{f"{p}{j}": INT for p in ("n", "k", "mode") for j in range(GEMV_JOBS)}, B=INT)


@dataclass(frozen=True)
class GemvJob:
    """One product of :func:`gemv`: ``out`` [B, n] = epilogue(x [B, k] @ W), W = ``w`` stored [n, k]
    (a Linear's weight, ``kn`` False) or [k, n] (``kn`` True); with ``residual`` out (fp32) = the
    product + ``addend`` (fp32 [B, n]; None: out itself) instead (epilogue "none"). x and w are floatX;
    out is floatX, or fp32 for a residual. ``tf32``: the operands are rounded to TF32 first (fp32 operands
    of the tf32 precision, as its GEMMs take them)."""
    x: DevPtr
    w: DevPtr
    out: DevPtr
    n: int
    k: int
    kn: bool = False
    epilogue: str = "none"
    residual: bool = False
    addend: DevPtr | None = None
    tf32: bool = False

    def spans(self, B: int) -> tuple[list[tuple[int, int]], tuple[int, int]]:
        """The byte ranges [start, end) it reads (of x, and of the addend) and the one it writes (out)."""
        def span(p, count):
            return int(p), int(p) + count * ELEM_BYTES[p.elem]
        reads = [span(self.x, B * self.k)]
        if self.residual:
            reads.append(span(self.out if self.addend is None else self.addend, B * self.n))
        return reads, span(self.out, B * self.n)


def gemv_slices(job: GemvJob) -> int:
    """log2 of the k-slices dec_gemv splits a [n, k] job's rows into: as many as keep each slice at least
    GEMV_SLICE_BYTES of the row, at most GEMV_WARPS (0 for a [k, n] job)."""
    if job.kn:
        return 0
    slices = min(GEMV_WARPS, max(1, job.k * ELEM_BYTES[job.w.elem] // GEMV_SLICE_BYTES))
    return slices.bit_length() - 1


def gemv_tiles(job: GemvJob) -> int:
    """The blocks of dec_gemv that compute ``job``."""
    cols = GEMV_KN_COLS if job.kn else (GEMV_WARPS * GEMV_CPW) >> gemv_slices(job)
    return -(-job.n // cols)


def gemv_supports(job: GemvJob, B: int, xtype: str) -> bool:
    """Whether dec_gemv computes ``job`` on B rows of element type ``xtype``: B <= GEMV_ROWS, x and w
    floatX, out floatX (fp32 for a residual); a [n, k] weight needs 16-byte rows (k a multiple of 16
    bytes, x and w 16-byte aligned)."""
    want_out = "f32" if job.residual else xtype
    if not 1 <= B <= GEMV_ROWS or job.x.elem != xtype or job.w.elem != xtype or job.out.elem != want_out:
        return False
    if job.n < 1 or job.k < 1 or job.epilogue not in GEMV_EPILOGUES or (job.residual and job.epilogue != "none"):
        return False
    if job.addend is not None and (not job.residual or job.addend.elem != "f32"):
        return False
    if job.tf32 and xtype != "f32":
        return False
    return job.kn or ((job.k * ELEM_BYTES[xtype]) % 16 == 0 and int(job.x) % 16 == 0 and int(job.w) % 16 == 0)


def gemv(jobs: list[GemvJob], B: int) -> list:
    """dec_gemv: 1 to :data:`GEMV_JOBS` independent products of B rows in one launch (none may read
    what another writes)."""
    if not 1 <= len(jobs) <= GEMV_JOBS:
        raise ValueError(f"decode.gemv: 1 to {GEMV_JOBS} jobs, got {len(jobs)}")
    xtype = xtype_of("decode.gemv", *(p for j in jobs for p in (j.x, j.w)))
    for i, job in enumerate(jobs):
        if not gemv_supports(job, B, xtype):
            raise ValueError(f"decode.gemv: job {i} ({job}) is not supported on B={B} {xtype} rows")
    if len({job.tf32 for job in jobs}) > 1:
        raise ValueError("decode.gemv: the jobs of one launch all round to TF32 or none does")
    spans = [job.spans(B) for job in jobs]
    for i, (_, out) in enumerate(spans):
        for j, (reads, wr) in enumerate(spans):
            if i != j and any(out[0] < e and s < out[1] for s, e in (*reads, wr)):
                raise ValueError(f"decode.gemv: job {i} writes what job {j} reads or writes")
    pad = [None] * (GEMV_JOBS - len(jobs))
    args = {}
    for j, job in enumerate([*jobs, *pad]):
        args.update({f"x{j}": job and job.x, f"w{j}": job and job.w,
                     f"y{j}": job.out if job and not job.residual else None,
                     f"r{j}": job.out if job and job.residual else None,
                     f"a{j}": (job.out if job.addend is None else job.addend) if job and job.residual else None,
                     f"n{j}": job.n if job else 0,
                     f"k{j}": job.k if job else 0,
                     f"mode{j}": (GEMV_EPILOGUES[job.epilogue] | (GEMV_KN if job.kn else 0)
                                  | gemv_slices(job) << GEMV_KS_SHIFT) if job else 0})
    grid = sum(gemv_tiles(job) for job in jobs)
    return [DEC_GEMV.launch((grid, 1, 1), (32 * GEMV_WARPS, 1, 1), xtype=xtype,
                            variant={"GEMV_TF32": int(jobs[0].tf32)}, **args, B=B)]


def moba_smem_bytes(N: int, chunk: int, top_k: int, maxblk: int) -> int:
    """Dynamic shared memory of dec_moba (its carve-up in decode.cu): q [N], a reduction buffer
    [threads], the weighted-value partials [threads], the gates [maxblk], the top list (K1 floats, K1
    ints) and the scores of the visible keys [top_k * chunk]."""
    K1 = top_k - 1
    return 4 * (N + 2 * MOBA_THREADS + maxblk + 2 * K1 + top_k * chunk)


def shift(x, prev, mixes, outs, B: int, C: int, dev: DeviceInfo) -> list:
    """dec_shift: outs[j] = x + (prev - x) * mixes[j] (1 to 6 mixes, fp32 [C]), then prev = x.
    x, prev f32 [B, C], outs[j] floatX [B, C]; outs must not alias x or prev."""
    if not 1 <= len(mixes) <= 6 or len(mixes) != len(outs):
        raise ValueError("decode.shift: 1 to 6 mixes, one output each")
    check_rows("decode.shift", B, C, x, prev, *outs)
    pad = [None] * (6 - len(mixes))
    return [DEC_SHIFT.launch((grid_stride_blocks(B * C // 4, dev), 1, 1), (256, 1, 1),
                             xtype=xtype_of("decode.shift", *outs), variant={"HEAD_SIZE": SHIFT_N},
                             x=x, prev=prev, **{f"m{j}": m for j, m in enumerate([*mixes, *pad])},
                             **{f"o{j}": o for j, o in enumerate([*outs, *pad])}, B=B, C=C, nmix=len(mixes))]


def ln_shift(x, w, b, y, mean, rstd, prev, mixes, outs, B: int, C: int, eps: float) -> list:
    """dec_ln_shift: y = LayerNorm(x; w, b) (layernorm.forward's arithmetic; mean and rstd [B] saved
    when not None), then :func:`shift` of y: outs[j] = y + (prev - y) * mixes[j], prev = y.
    x, y, prev f32 [B, C]; outs floatX; nothing may alias."""
    if not 1 <= len(mixes) <= 6 or len(mixes) != len(outs):
        raise ValueError("decode.ln_shift: 1 to 6 mixes, one output each")
    check_rows("decode.ln_shift", B, C, x, w, b, y, prev, *outs)
    pad = [None] * (6 - len(mixes))
    return [DEC_LN_SHIFT.launch((B, 1, 1), (32, 1, 1), xtype=xtype_of("decode.ln_shift", *outs),
                                variant={"HEAD_SIZE": SHIFT_N}, x=x, w=w, b=b, y=y, mean_out=mean,
                                rstd_out=rstd, prev=prev, **{f"m{j}": m for j, m in enumerate([*mixes, *pad])},
                                **{f"o{j}": o for j, o in enumerate([*outs, *pad])}, C=C, nmix=len(mixes),
                                eps=eps)]


def wkv7_step(r, w, k, v, a, b, state, y, B: int, H: int, N: int) -> list:
    """dec_wkv7: y = S_t r_t after S_t = S_{t-1} diag(w) + (S_{t-1} a) b^T + v k^T, with S the carried
    ``state`` fp32 [B, H, N, N] (updated in place); r, k, v, a, b, y floatX [B, H, N], the decay w f32."""
    if N not in HEAD_SIZES or B < 1 or H < 1:
        raise ValueError(f"decode.wkv7_step: B={B}, H={H} must be >= 1 and N={N} one of {HEAD_SIZES}")
    check_buffers("decode.wkv7_step", r=r, w=w, k=k, v=v, a=a, b=b, state=state, y=y)
    return [DEC_WKV7.launch((H, B, 1), (N * wkv7.Q, 1, 1), xtype=xtype_of("decode.wkv7_step", r, k, v, a, b, y),
                            variant={"HEAD_SIZE": N}, r=r, w=w, k=k, v=v, a=a, b=b, state=state, y=y, H=H)]


def tmix_step(hidden: dict, second: dict, ranks: dict, r, k, v, v_first, w0, a0, v0, k_k, k_a, state, ln_w, ln_b,
              r_k, z, B: int, H: int, N: int) -> list:
    """dec_tmix: an RWKV block's time mix of one token from its LoRA hidden rows ``hidden[p]`` floatX
    [B, ranks[p]] (p in :data:`LORA2`; "v" absent in layer 0) and second layers ``second[p]`` [ranks[p],
    C] to z floatX [B, C] (the output GEMM's input): timemix.prep_forward, :func:`wkv7_step` on
    ``state`` and timemix.gn_forward in one kernel per (head, row). r, k, v floatX [B, C]; v_first
    (layer 0: written := v; else read); the parameter vectors fp32 [C]."""
    if N not in HEAD_SIZES or B < 1 or H < 1:
        raise ValueError(f"decode.tmix_step: B={B}, H={H} must be >= 1 and N={N} one of {HEAD_SIZES}")
    if set(hidden) != set(second) or set(hidden) - set(ranks) or not {"w", "a", "g"} <= set(hidden) <= set(LORA2):
        raise ValueError(f"decode.tmix_step: LoRA paths {sorted(hidden)}, {sorted(second)}: w, a, g and in "
                         "later layers v, each with its hidden rows, second layer and rank")
    if ("v" in hidden) != (v0 is not None):
        raise ValueError("decode.tmix_step: v0 goes with the value LoRA (layers after the first)")
    check_buffers("decode.tmix_step", r=r, k=k, v=v, v_first=v_first, state=state, z=z)
    return [DEC_TMIX.launch((H, B, 1), (N * wkv7.Q, 1, 1), xtype=xtype_of("decode.tmix_step", r, k, v, z),
                            variant={"HEAD_SIZE": N}, **{f"h{p}": hidden.get(p) for p in LORA2},
                            **{f"{p}2": second.get(p) for p in LORA2}, **{f"d{p}": ranks.get(p, 0) for p in LORA2},
                            r=r, k=k, v=v, vf=v_first, w0=w0, a0=a0, v0=v0, k_k=k_k, k_a=k_a, state=state,
                            lnw=ln_w, lnb=ln_b, rk=r_k, z=z, H=H)]


def moba_step(q, k, v, kc, vc, kmean, pos, o, B: int, H: int, N: int, Tmax: int, chunk: int, top_k: int,
              dev: DeviceInfo, sel=None) -> list:
    """dec_moba (see the module docstring): o [B, H, N] for the queries q at positions ``pos[b]`` < Tmax.
    kmean is required when top_k > 1 and a block can complete (Tmax >= chunk), else None."""
    for name, val in (("B", B), ("H", H), ("Tmax", Tmax), ("chunk", chunk), ("top_k", top_k)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"decode.moba_step: {name} must be an int >= 1, got {val!r}")
    if N not in HEAD_SIZES:
        raise ValueError(f"decode.moba_step: head size N={N} not supported (one of {HEAD_SIZES})")
    if B * Tmax * H * N >= 2 ** 40:
        raise ValueError("decode.moba_step: cache too large")
    K1 = top_k - 1
    maxblk = Tmax // chunk if K1 else 0          # blocks a cache of Tmax tokens completes (gated)
    check_buffers("decode.moba_step", q=q, k=k, v=v, kc=kc, vc=vc, o=o)
    if maxblk and kmean is None:
        raise ValueError("decode.moba_step: top_k > 1 needs the kmean cache")
    smem = moba_smem_bytes(N, chunk, top_k, maxblk)
    if smem > dev.smem_per_block:
        raise ValueError(f"decode.moba_step: chunk={chunk}, top_k={top_k} and a cache of {Tmax} tokens need "
                         f"{smem} bytes of shared memory, more than the device's {dev.smem_per_block}")
    return [DEC_MOBA.launch((H, B, 1), (MOBA_THREADS, 1, 1), xtype=xtype_of("decode.moba_step", q, k, v, kc, vc, o),
                            variant={"HEAD_SIZE": N}, smem=smem, q=q, k=k, v=v, kc=kc, vc=vc,
                            kmean=kmean if maxblk else None, pos=pos, sel_out=sel if K1 else None, o=o, H=H,
                            Tmax=Tmax, chunk=chunk, K1=K1, maxblk=maxblk, scale=1.0 / math.sqrt(N))]


def sample(logits, u, opts, out, B: int, V: int) -> list:
    """dec_sample: out[b] = the contract's token of logits [B, V] with u[b] and the options ``opts``
    (f64 [3], :data:`SAMPLE_OPTS`); V <= rwkvx.sampling.MAX_VOCAB."""
    if isinstance(B, bool) or not isinstance(B, int) or B < 1:
        raise ValueError(f"decode.sample: B must be an int >= 1, got {B!r}")
    sampling.check_vocab(V)
    check_buffers("decode.sample", logits=logits, u=u, opts=opts, out=out)
    return [DEC_SAMPLE.launch((B * SAMPLE_CLUSTER, 1, 1), (SAMPLE_THREADS, 1, 1), xtype=xtype_of("decode.sample", logits),
                              logits=logits, u=u, opts=opts, out=out, V=V)]
