"""Launch builders for rwkvx/cu/wkv7/sequential.cu and chunked.cu: the RWKV-7 WKV recurrence (forward and backward).

Per sequence b and head h (N = head size), S is N x N (row i = value index, column j = key index),
S = s0[h] before t = 0 (``s0``: an initial state shared by the B sequences, as state tuning trains it;
None: 0)::

    sa_t = S_{t-1} a_t ;  S_t = S_{t-1} diag(w_t) + sa_t b_t^T + v_t k_t^T ;  y_t = S_t r_t

(the model passes a = -kk, b = kk * a_rate; w is the decay in (0, 1)). Twin of
``rwkvx.oracle.wkv7_forward`` / ``wkv7_backward``.

Buffers (16-byte aligned; outputs must not alias inputs):

* r, k, v, a, b, dy, y, dr: floatX ``[B, T, H, N]`` (= row-major ``[B*T, C]``, c = h*N + n);
  w: f32 of the same shape in every precision (near 1, bf16 would move 1 - w, the state's per-token
  forgetting, by up to half its size; docs/SPEC.md §4); dw, dk, dv, da, db: f32 of the same shape (they feed the time mix's parameter-gradient sums, in which
  bf16 rounding of each token's term would not cancel out).
* ``sa`` f32 ``[B, T, H, N]`` (sa_t = S_{t-1} a_t) and ``ckpt`` f32 ``[B, H, nC, N, N]``, nC = ceil(T/CHUNK)
  (slot c = the state after the last token of chunk c): what the forward saves for the backward,
  written by :func:`forward` when given (pass neither for an inference-only forward) and read by
  :func:`backward`, which must get them from a forward over the same r, w, k, v, a, b. The backward
  steps the state back from the checkpoints (no recomputation; see rwkvx/cu/wkv7/sequential.cu).
* ``partials`` f32 ``[5, P, B, T, H, N]``: backward scratch for the row-split column reductions, only
  when the backward split P > 1 (see :func:`backward_split`); ``None`` otherwise.
* ``s0`` f32 ``[H, N, N]`` (optional): the initial state, given to the forward and (same values) to the
  backward. ``ds0`` f32 ``[H, N, N]`` (optional backward output): its gradient, the sum over the B
  sequences of each one's dL/dS_{-1}; the backward writes those per sequence to ``ds0_partials`` f32
  ``[B, H, N, N]`` (:func:`scratch_elems` with ``ds0=True``; B = 1 writes ds0 directly) and
  ``wkv7_state_reduce`` adds them in sequence order, ((b0 + b1) + b2) + ...: bit-identical reruns.
  Without them the kernels take NULL and skip the state's work: one test per block, the per-token
  work unchanged.

Sizes: :func:`scratch_elems`. Use::

    ops += wkv7.forward(r, w, k, v, a, b, y, B, T, H, N, dev, sa=sa, ckpt=ckpt)
    ops += wkv7.backward(r, w, k, v, a, b, dy, sa, ckpt, dr, dw, dk, dv, da, db, B, T, H, N, dev,
                         partials=partials)
    # state tuning: from s0 and with its gradient
    ops += wkv7.forward(..., sa=sa, ckpt=ckpt, s0=s0)
    ops += wkv7.backward(..., partials=partials, s0=s0, ds0=ds0, ds0_partials=ds0_partials)

All gradients are *written* (not accumulated). Deterministic (no atomics): with P > 1 the per-split
partial sums are added in a fixed order (split 0, then 1, ..., P-1) by ``wkv7_backward_reduce``.

Methods (``method=``): ``"sequential"`` (rwkvx/cu/wkv7/sequential.cu, the default: one token at a time, fp32) and
``"chunked"`` (rwkvx/cu/wkv7/chunked.cu, N in {32, 64}: chunks of CHUNKED_L = 16 tokens, intra-chunk
operators for all chunks in parallel, a sequential pass over chunk states with its products on tensor
cores in tf32, the backward's per-chunk gradients in parallel again; for the ``tf32`` and ``bf16``
precisions, error ~1e-3 against float64) and ``"chunked_exact"`` (the same kernels with every product in
3xTF32, each operand a tf32 hi + lo pair, and the chunk records kept in fp32: fp32-class results, error
~3e-7, for the ``fp32`` precision; f32 inputs only). The sequential and chunked methods save different
things: ``sa``/``ckpt`` of one are only valid for the backward of the same method. The chunked methods'
``ckpt`` holds the state *entering* each chunk of 16 tokens, and they need ``partials``, a work buffer of
:func:`scratch_elems`, in the forward and in the backward.

Splits: the forward splits the N state rows of each (b, h) over ``P_f`` blocks (rows are independent);
the backward over ``P_b`` blocks (P_b <= 4; its column reductions then become per-split partials).
Defaults fill the device's multiprocessors for small B*H; both can be forced with ``split=``. The
chunked method's ``split`` is the row split of its state passes, forward and backward alike (8 rows per
group of one or two warps, two each taking half of the keys; :func:`chunked_split`,
:func:`chunked_key_warps`). Where B*H leaves the device idle the chunked state passes also cut each
sequence into ``segments`` (a segmented scan: :func:`chunked_segments`, :func:`segment_layout`; the
work buffer then leads with the segments' states, :func:`scratch_elems`).

Why the chunked forward saves S0 (the state entering each chunk) rather than letting the backward
recompute it: the backward's per-chunk gradient kernel needs S0 of every chunk at once (it runs over
all chunks in parallel); recomputing them is a second sequential pass, as long as the forward's.
"""
from __future__ import annotations

import math

from rwkvx.runtime.kernel import F32_IN, F32_OUT, INT, LONG, X_IN, X_OUT, KernelFile

from rwkvx.runtime.dtypes import ELEM_BYTES

from .._common import DeviceInfo, check_buffers, grid_stride_blocks

HEAD_SIZES = (4, 8, 16, 32, 64, 128)
Q = 4                 # lanes per state row (block = N/P * Q threads)
CHUNK = 8             # checkpoint interval in tokens (the backward steps back at most CHUNK-1 tokens)
BWD_MAXT = 256        # backward threads per block at most (N = 128 needs P_b >= 2)
REDUCE_BLOCKS_PER_SM = 8

METHODS = ("sequential", "chunked", "chunked_exact")
CHUNKED_METHODS = ("chunked", "chunked_exact")
CHUNKED_L = 16        # tokens per chunk of the chunked method
CHUNKED_HEAD_SIZES = (32, 64)
CHUNKED_STAGES = 3    # chunks of inputs in flight in the state passes (2, 4 and 6 measured no faster)
INTRA_THREADS = 128   # wkv7c_intra: one warp per Gram matrix of a chunk
# Chunk operators' products (intra's Gram matrices and products with M, the gradient kernel's [L, L] ones)
# in 3xTF32, per element type; with bf16 inputs one tf32 pass (error ~1e-3) is below their rounding, and
# takes intra 0.473 -> 0.408 ms and the gradient kernel 1.170 -> 1.121 ms at B8 T4096 H12 (H200).
SPLIT_OPERATORS = {"f32": True, "bf16": False}
KEY_WARPS = (1, 2)    # warps per 8 state rows in the state passes (2: each half of the keys)


def _record_floats(N: int, n_square: int) -> int:
    """fp32 size of one chunk record of wkv7c_intra: 4 [L, N] sections, n_square [L, L] ones, PL [N]."""
    return 4 * CHUNKED_L * N + n_square * CHUNKED_L * CHUNKED_L + N


FWD_RECORD, BWD_RECORD = 2, 3     # [L, L] sections of the forward / backward record

CU = KernelFile("wkv7/sequential", constants={"WKV_Q": Q, "WKV_CHUNK": CHUNK, "WKV_BWD_MAXT": BWD_MAXT},
                variants={"HEAD_SIZE": HEAD_SIZES})
_RWKVAB = dict(r=X_IN, w=F32_IN, k=X_IN, v=X_IN, a=X_IN, b=X_IN)
WKV7_FORWARD = CU.kernel("wkv7_forward", **_RWKVAB, y=X_OUT, sa_out=F32_OUT.opt(), ckpt=F32_OUT.opt(),
                         s_init=F32_IN.opt(), T=INT, H=INT)
WKV7_BACKWARD = CU.kernel("wkv7_backward", **_RWKVAB, dy=X_IN, sa=F32_IN, ckpt=F32_IN,
                          dr=X_OUT, dw=F32_OUT, dk=F32_OUT, dv=F32_OUT, da=F32_OUT, db=F32_OUT,
                          part=F32_OUT.opt(), s_init=F32_IN.opt(), ds_part=F32_OUT.opt(), T=INT, H=INT, n=LONG)
WKV7_STATE_REDUCE = CU.kernel("wkv7_state_reduce", part=F32_IN, ds0=F32_OUT, n=LONG, B=INT)
CUC = KernelFile("wkv7/chunked", constants={"WKV_L": CHUNKED_L, "WKV_STAGES": CHUNKED_STAGES,
                                            "WKV_INTRA_THREADS": INTRA_THREADS},
                 variants={"HEAD_SIZE": CHUNKED_HEAD_SIZES, "WKV_KEY_WARPS": KEY_WARPS, "WKV_EXACT": (0, 1)},
                 derived=lambda v, xtype: {"WKV_FREC": _record_floats(v["HEAD_SIZE"], FWD_RECORD),
                                           "WKV_BREC": _record_floats(v["HEAD_SIZE"], BWD_RECORD),
                                           "WKV_SPLIT_OPERATORS": int(SPLIT_OPERATORS[xtype])})
WKV7C_INTRA = CUC.kernel("wkv7c_intra", r=X_IN, w=F32_IN, k=X_IN, a=X_IN, b=X_IN, rec=F32_OUT, brec=F32_OUT.opt(),
                         T=INT, H=INT, mode=INT)
INTRA_FORWARD, INTRA_BACKWARD, INTRA_BOTH = 0, 1, 2     # wkv7c_intra's modes: which records it writes
# the state passes' outputs are NULL in a segmented scan's summary walk (it writes only seg)
WKV7C_FORWARD_STATE = CUC.kernel("wkv7c_forward_state", rec=F32_IN, v=X_IN, y=X_OUT.opt(), sa_out=F32_OUT.opt(),
                                 s0=F32_OUT.opt(), s_init=F32_IN.opt(), seg=F32_OUT.opt(), T=INT, H=INT, m=INT,
                                 summary=INT)
WKV7C_BACKWARD_STATE = CUC.kernel("wkv7c_backward_state", rec=F32_IN, dy=X_IN, dv=F32_OUT.opt(), dx=F32_OUT.opt(),
                                  ds=F32_OUT.opt(), ds_part=F32_OUT.opt(), seg=F32_OUT.opt(), T=INT, H=INT, m=INT,
                                  summary=INT)
WKV7C_SEGMENT_CARRY = CUC.kernel("wkv7c_segment_carry", seg=F32_OUT, S=INT, reverse=INT)
WKV7C_BACKWARD_GRADS = CUC.kernel("wkv7c_backward_grads", **_RWKVAB, dy=X_IN, sa=F32_IN, s0=F32_IN, ds=F32_IN,
                                  dx=F32_IN, dr=X_OUT, dw=F32_OUT, dk=F32_OUT, da=F32_OUT, db=F32_OUT,
                                  T=INT, H=INT)
WKV7_BACKWARD_REDUCE = CU.kernel("wkv7_backward_reduce", part=F32_IN, dr=X_OUT, dw=F32_OUT, dk=F32_OUT,
                                 da=F32_OUT, db=F32_OUT, n=LONG, P=INT)


def n_chunks(T: int, method: str = "sequential") -> int:
    """Checkpointed chunks of a sequence of T tokens (CHUNK tokens each, CHUNKED_L for the chunked method)."""
    size = CHUNKED_L if method in CHUNKED_METHODS else CHUNK
    return (int(T) + size - 1) // size


def segment_layout(T: int, segments: int) -> tuple[int, int]:
    """How the chunked state passes cut a sequence of T tokens into ``segments`` segments: (m, S) with m =
    ceil(n_c / segments) chunks per segment and S = ceil(n_c / m) <= segments segments (the last one
    shorter where m does not divide n_c)."""
    if not isinstance(segments, int) or isinstance(segments, bool) or segments < 1:
        raise ValueError(f"wkv7: segments must be an int >= 1, got {segments!r}")
    nc = n_chunks(T, "chunked")
    m = -(-nc // segments)
    return m, -(-nc // m)


def _check_method(method: str, N: int) -> None:
    if method not in METHODS:
        raise ValueError(f"wkv7: method must be one of {METHODS}, got {method!r}")
    if method in CHUNKED_METHODS and N not in CHUNKED_HEAD_SIZES:
        raise ValueError(f"wkv7: the chunked method supports head sizes {CHUNKED_HEAD_SIZES}, got N={N}")


def _check_exact_inputs(what: str, method: str, r) -> None:
    if method == "chunked_exact" and r.elem != "f32":
        raise ValueError(f"{what}: method chunked_exact takes f32 inputs (fp32 precision), got {r.elem}")


def _check(B: int, T: int, H: int, N: int) -> None:
    for name, x in (("B", B), ("T", T), ("H", H), ("N", N)):
        if not isinstance(x, int) or isinstance(x, bool):
            raise TypeError(f"wkv7: {name} must be an int, got {type(x).__name__}")
        if x < 1:
            raise ValueError(f"wkv7: {name} must be >= 1, got {x}")
    if N not in HEAD_SIZES:
        raise ValueError(f"wkv7: head size N={N} not supported (one of {HEAD_SIZES})")
    if B > 65535 or H > 65535:
        raise ValueError(f"wkv7: B={B} and H={H} must be <= 65535 (grid dimensions)")
    if B * T * H * N >= 2 ** 40:
        raise ValueError("wkv7: tensor too large")


# ------------------------------------------------------------------------------------------------
# splits
# ------------------------------------------------------------------------------------------------
def _forward_splits(N: int) -> list[int]:
    pmax = max(1, min(8, N * Q // 32))          # keep >= one full warp per block
    return [p for p in (1, 2, 4, 8) if p <= pmax]


def _backward_splits(N: int) -> list[int]:
    pmax = max(1, min(Q, N // 8))
    return [p for p in (1, 2, 4) if p <= pmax and N * Q // p <= BWD_MAXT]


def forward_split(B: int, H: int, N: int, dev: DeviceInfo) -> int:
    """Default forward row split: the P minimising the busiest SM's threads, ceil(B*H*P/SMs) * N*Q/P
    (ties: the smaller P, i.e. less redundant input staging)."""
    best, best_load = 1, None
    for p in _forward_splits(N):
        load = math.ceil(B * H * p / dev.sm_count) * (N * Q // p)
        if best_load is None or load < best_load:
            best, best_load = p, load
    return best


def backward_split(B: int, H: int, N: int, dev: DeviceInfo) -> int:
    """Default backward row split: the largest allowed P with B*H*P <= SMs (at least the smallest
    allowed P; N = 128 needs P >= 2). P > 1 costs a reduction pass over 5*(P+1) [B,T,H,N] tensors, so
    it is used only where B*H alone leaves more than half of the SMs idle."""
    ok = _backward_splits(N)
    best = ok[0]
    for p in ok:
        if B * H * p <= dev.sm_count:
            best = p
    return best


def _chunked_splits(N: int) -> list[int]:
    return [p for p in (1, 2, 4, 8) if N // p >= 8]          # >= one group (8 state rows) per block


STATE_BLOCKS_PER_SM = 3   # blocks per SM of chunked_split's one wave (by shared memory 16-row blocks fit 3, 32-row 2)
STATE_WARPS_PER_SM = 12   # state-pass warps per SM up to which two warps per 8 rows pay (see chunked_key_warps)


def chunked_split(B: int, H: int, N: int, dev: DeviceInfo) -> int:
    """Default state-pass row split of the chunked method: the largest P that leaves a block two groups of
    8 state rows or more and puts the B*H*P blocks in one wave (STATE_BLOCKS_PER_SM per SM), else 1. The
    passes are latency-bound per warp: more, smaller blocks hide each other's latency while they fit at
    once (H200, N64 bf16, forward state pass at P = 1 / 2 / 4, one warp per 8 rows: B8 T4096 0.654 /
    0.681 / 0.595 ms; B1 T16384 2.80 / 2.00 / 1.90; B16 T512 0.142 / 0.111 / 0.153; B8 T4096 H64 2.09 /
    2.40 / 3.21)."""
    ok = [p for p in _chunked_splits(N) if N // p >= 16] or _chunked_splits(N)[:1]
    fits = [p for p in ok if B * H * p <= STATE_BLOCKS_PER_SM * dev.sm_count]
    return fits[-1] if fits else ok[0]


def _chunked_work(B: int, T: int, H: int, N: int) -> dict[str, int]:
    """The chunked method's buffers: the forward's records, the backward's records, dS, dX."""
    nc = B * H * n_chunks(T, "chunked")
    return {"frec": nc * _record_floats(N, FWD_RECORD), "brec": nc * _record_floats(N, BWD_RECORD),
            "ds": nc * N * N, "dx": B * T * H * N}


def chunked_key_warps(B: int, H: int, N: int, dev: DeviceInfo) -> int:
    """Warps per 8 state rows of the state passes: two (each half of the keys, then their partial sums
    added: half the chain of dependent products per chunk) while the pass's warps stay within
    STATE_WARPS_PER_SM per SM, else one (no exchange work). H200, N64 bf16, forward / backward state
    pass, one -> two warps: B8 T4096 (P4) 0.595 / 0.636 ms -> 0.542 / 0.589; B1 T16384 (P4) 1.90 / 1.95
    -> 1.39 / 1.43; B16 T512 (P2) 0.111 / 0.122 -> 0.134 / 0.144; B8 T4096 H64 (P1) 2.09 / 2.25 ->
    2.50 / 2.72 (P2)."""
    return 2 if B * H * (N // 8) * 2 <= STATE_WARPS_PER_SM * dev.sm_count else 1


MAX_SEGMENTS = 32         # segments per sequence at most (the pass over them is sequential)
CARRY_STEPS = 2           # wkv7c_segment_carry's time per segment, in chunk steps of a state pass (modelled)
SEGMENT_GAIN = 0.8        # segments only where the model gives at most this fraction of the one-walk time


def _scan_steps(B: int, T: int, H: int, N: int, S: int, dev: DeviceInfo) -> int:
    """The modelled time of a state pass cut into S segments, in chunk steps of one block: each walk
    takes its segment's m chunk steps per wave of blocks (STATE_BLOCKS_PER_SM per SM, as chunked_split
    counts; the segments keep its row split P and chunked_key_warps' group shape), whole waves (its blocks
    walk equally long); S > 1 adds the summary walk (P (2S - 3) blocks per sequence and head: exits of
    S - 1 segments, transitions of S - 2) and the pass over the segments."""
    m, S = segment_layout(T, S)
    seqs = B * H * chunked_split(B, H, N, dev)
    waves = lambda blocks: -(-blocks // (STATE_BLOCKS_PER_SM * dev.sm_count))   # noqa: E731
    if S == 1:
        return m * waves(seqs)
    return m * (waves(seqs * (2 * S - 3)) + waves(seqs * S)) + CARRY_STEPS * (S - 2)


def chunked_segments(B: int, T: int, H: int, N: int, dev: DeviceInfo) -> int:
    """Default segments of the chunked state passes (:func:`segment_layout`): the S <= MAX_SEGMENTS with the
    fewest modelled chunk steps (:func:`_scan_steps`; ties: the fewer segments), where they are at most
    SEGMENT_GAIN of the one walk's (the model is rough: a small gain is no gain), else 1. The passes walk a
    sequence's chunks one after another, so at small B*H they leave the device idle (B1 T16384 H12: 48
    blocks on 132 SMs); segments trade a second walk (summary, then plain) for S-times shorter walks.
    Where B*H fills a wave the model's gain is nil and S = 1 keeps the whole-sequence launches."""
    one = best_steps = _scan_steps(B, T, H, N, 1, dev)
    best = 1
    for S in range(2, min(MAX_SEGMENTS, n_chunks(T, "chunked"), 65535 // B) + 1):
        steps = _scan_steps(B, T, H, N, S, dev)
        if steps < best_steps:
            best, best_steps = segment_layout(T, S)[1], steps
    return best if best_steps <= SEGMENT_GAIN * one else 1


def _segment_elems(B: int, H: int, N: int, S: int) -> int:
    """The segmented scan's scratch, seg [B, H, S, 2, N, N] (each segment's exit and transition); 0 for S = 1."""
    return B * H * S * 2 * N * N if S > 1 else 0


def _operators_variant(N: int, method: str) -> dict:
    """The variant of the per-chunk kernels (intra, grads): no state rows, so one warp per group."""
    return {"HEAD_SIZE": N, "WKV_KEY_WARPS": 1, "WKV_EXACT": int(method == "chunked_exact")}


def _state_launch(B: int, H: int, N: int, P: int, dev: DeviceInfo, n_square: int, xtype: str,
                  method: str) -> tuple[tuple, dict]:
    """A state pass's block at row split P, and its variant (head size, warps per 8 rows, 3xTF32) and
    shared memory as launch arguments."""
    kw = chunked_key_warps(B, H, N, dev)
    variant = {"HEAD_SIZE": N, "WKV_KEY_WARPS": kw, "WKV_EXACT": int(method == "chunked_exact")}
    return (4 * kw * N // P, 1, 1), dict(variant=variant, smem=_state_smem_bytes(N, P, kw, n_square, xtype))


def _state_smem_bytes(N: int, P: int, kw: int, n_square: int, xtype: str) -> int:
    """Dynamic shared memory of wkv7c_forward_state / wkv7c_backward_state (state_smem_floats in
    rwkvx/cu/wkv7/chunked.cu, which traps when given less)."""
    L, NR, NS = CHUNKED_L, N // P, CHUNKED_STAGES
    rows = -(-NS * L * (NR + 8) * ELEM_BYTES[xtype] // 16) * 4
    group = 8 * (N + 4) + kw * 2 * L * 8 + (kw * 8 * 32 if kw > 1 else 0)    # GROUP_FLOATS
    return 4 * (NS * _record_floats(N, n_square) + rows + NR // 8 * group)


def _chunked_plan(B: int, T: int, H: int, N: int, dev: DeviceInfo, split: int | None, segments: int | None,
                  what: str) -> tuple[int, int, int]:
    """The chunked state passes' row split P, segments S and chunks per segment m: given or the defaults
    (:func:`chunked_split`, :func:`chunked_segments`)."""
    m, S = segment_layout(T, chunked_segments(B, T, H, N, dev) if segments is None else segments)
    if B * S > 65535:
        raise ValueError(f"{what}: B*segments={B * S} must be <= 65535 (grid dimension)")
    return _split(split, chunked_split(B, H, N, dev), _chunked_splits(N), what, N), S, m


def scratch_elems(B: int, T: int, H: int, N: int, dev: DeviceInfo, split: int | None = None,
                  method: str = "sequential", kept_records: bool = False, ds0: bool = False,
                  segments: int | None = None) -> dict[str, int]:
    """fp32 scratch sizes in elements::

        sa       [B, T, H, N]               forward -> backward (sa_t of every token)
        ckpt     [B, H, ceil(T/CHUNK), N, N]  forward -> backward (state checkpoints)
        partials [5, P, B, T, H, N]         backward scratch, 0 when the backward split P == 1

    and with ``ds0`` (a backward that writes the initial state's gradient) ``ds0_partials``
    [B, H, N, N], each sequence's share of it (0 for B = 1, which writes ds0 directly).

    ``split`` is the backward split (default :func:`backward_split`). For the chunked methods: ckpt is
    [B, H, ceil(T/16), N, N] (the states entering the chunks) and partials the work buffer of the forward
    and the backward (chunk records; dS and dX), whatever the split; with ``kept_records`` the backward's
    records are a buffer of their own, ``records`` (written by a forward given it, read by the backward:
    see :func:`forward`), and partials holds the rest, after the segmented scan's seg [B, H, S, 2, N, N]
    where the state passes cut the sequences into S > 1 segments (``segments``, default
    :func:`chunked_segments`)."""
    _check(B, T, H, N)
    _check_method(method, N)
    sizes = _method_scratch(B, T, H, N, dev, split, method, kept_records, segments)
    return {**sizes, "ds0_partials": B * H * N * N if B > 1 else 0} if ds0 else sizes


def _method_scratch(B: int, T: int, H: int, N: int, dev: DeviceInfo, split: int | None, method: str,
                    kept_records: bool, segments: int | None) -> dict[str, int]:
    """:func:`scratch_elems` without the initial state's gradient."""
    if method in CHUNKED_METHODS:
        work = _chunked_work(B, T, H, N)
        seg = _segment_elems(B, H, N, _chunked_plan(B, T, H, N, dev, split, segments, "wkv7")[1])
        sizes = {"sa": B * T * H * N, "ckpt": B * H * n_chunks(T, method) * N * N}
        if kept_records:
            return {**sizes, "records": work["brec"], "partials": seg + max(work["frec"], work["ds"] + work["dx"])}
        return {**sizes, "partials": seg + max(work["frec"], work["brec"] + work["ds"] + work["dx"])}
    for name, x in (("kept_records", kept_records), ("segments", segments)):
        if x:
            raise ValueError(f"wkv7: {name} needs a chunked method, got {method!r}")
    P = backward_split(B, H, N, dev) if split is None else int(split)
    if P not in _backward_splits(N):
        raise ValueError(f"wkv7: backward split {P} not allowed for N={N} (one of {_backward_splits(N)})")
    return {"sa": B * T * H * N,
            "ckpt": B * H * n_chunks(T) * N * N,
            "partials": 5 * P * B * T * H * N if P > 1 else 0}


# ------------------------------------------------------------------------------------------------
# launches
# ------------------------------------------------------------------------------------------------
def _split(split: int | None, default: int, allowed: list[int], what: str, N: int) -> int:
    P = default if split is None else int(split)
    if P not in allowed:
        raise ValueError(f"{what}: split {P} not allowed for N={N} (one of {allowed})")
    return P


def forward(r, w, k, v, a, b, y, B: int, T: int, H: int, N: int, dev: DeviceInfo, sa=None, ckpt=None,
            split: int | None = None, method: str = "sequential", partials=None, records=None, s0=None,
            segments: int | None = None) -> list:
    """wkv7_forward: y = WKV(r, w, k, v, a, b) from the initial state ``s0`` (f32 [H, N, N]; None: 0),
    and with ``sa`` and ``ckpt`` what the backward needs (see module doc). The chunked methods also need
    ``partials`` (the work buffer); given ``records`` (with sa and ckpt; scratch_elems(...,
    kept_records=True)), their forward also writes the backward's chunk records there, computed in the
    same pass as its own, for a backward given the same ``records`` (which then skips computing them).
    ``segments`` (chunked methods; default :func:`chunked_segments`, the same for :func:`scratch_elems`):
    the segments the state pass cuts each sequence into."""
    _check(B, T, H, N)
    _check_method(method, N)
    check_buffers("wkv7.forward", r=r, w=w, k=k, v=v, a=a, b=b, y=y)
    if s0 is not None:
        check_buffers("wkv7.forward", s0=s0)
    if (sa is None) != (ckpt is None):
        raise ValueError("wkv7.forward: pass both sa and ckpt (for a backward) or neither")
    if sa is not None:
        check_buffers("wkv7.forward", sa=sa, ckpt=ckpt)
    if method in CHUNKED_METHODS:
        check_buffers("wkv7.forward", partials=partials)
        _check_exact_inputs("wkv7.forward", method, r)
        if records is not None:
            if sa is None:
                raise ValueError("wkv7.forward: records are kept for a backward: pass sa and ckpt too")
            check_buffers("wkv7.forward", records=records)
        P, S, m = _chunked_plan(B, T, H, N, dev, split, segments, "wkv7.forward")
        rec = partials.offset(_segment_elems(B, H, N, S))
        return [WKV7C_INTRA.launch((n_chunks(T, method), H, B), (INTRA_THREADS, 1, 1), xtype=r.elem,
                                   variant=_operators_variant(N, method), r=r, w=w, k=k, a=a, b=b, rec=rec,
                                   brec=records, T=T, H=H,
                                   mode=INTRA_FORWARD if records is None else INTRA_BOTH),
                *_state_walks(WKV7C_FORWARD_STATE, False, B, H, N, P, S, m, dev, FWD_RECORD, r.elem, method,
                              partials, dict(rec=rec, v=v, s_init=s0, T=T), dict(y=y, sa_out=sa, s0=ckpt))]
    if segments is not None:
        raise ValueError(f"wkv7.forward: segments cut the chunked methods' state passes only, not {method!r}'s")
    if records is not None:
        raise ValueError(f"wkv7.forward: records are kept by the chunked methods only, not {method!r}")
    P = forward_split(B, H, N, dev) if split is None else int(split)
    if P not in _forward_splits(N):
        raise ValueError(f"wkv7.forward: split {P} not allowed for N={N} (one of {_forward_splits(N)})")
    return [WKV7_FORWARD.launch((P, H, B), (N * Q // P, 1, 1), xtype=r.elem, variant={"HEAD_SIZE": N},
                                r=r, w=w, k=k, v=v, a=a, b=b, y=y, sa_out=sa, ckpt=ckpt, s_init=s0, T=T, H=H)]


def backward(r, w, k, v, a, b, dy, sa, ckpt, dr, dw, dk, dv, da, db, B: int, T: int, H: int, N: int,
             dev: DeviceInfo, partials=None, split: int | None = None, method: str = "sequential",
             records=None, s0=None, ds0=None, ds0_partials=None, segments: int | None = None) -> list:
    """wkv7_backward (+ wkv7_backward_reduce when the split P > 1): writes dr, dw, dk, dv, da, db.

    ``sa`` and ``ckpt`` from :func:`forward` on the same inputs, ``s0`` and ``method``; (P > 1 or
    a chunked method) ``partials`` is scratch of :func:`scratch_elems` with the same ``split``; ``records``
    the chunk records that forward kept (chunked methods), or None to compute them here. Given ``ds0``
    (f32 [H, N, N]) it also writes the initial state's gradient, summed over the sequences in order
    (+ wkv7_state_reduce when B > 1, through ``ds0_partials`` of :func:`scratch_elems` with ``ds0=True``).
    ``segments``: as :func:`forward`'s (the reverse state pass's)."""
    _check(B, T, H, N)
    _check_method(method, N)
    check_buffers("wkv7.backward", r=r, w=w, k=k, v=v, a=a, b=b, dy=dy, sa=sa, ckpt=ckpt,
                  dr=dr, dw=dw, dk=dk, dv=dv, da=da, db=db)
    if s0 is not None:
        check_buffers("wkv7.backward", s0=s0)
    ds_part, reduce = _state_gradient(ds0, ds0_partials, B, H, N, dev, r.elem)
    if method in CHUNKED_METHODS:
        return _chunked_backward(r, w, k, v, a, b, dy, sa, ckpt, dr, dw, dk, dv, da, db, B, T, H, N, dev,
                                 partials, split, method, records, ds_part, segments) + reduce
    if segments is not None:
        raise ValueError(f"wkv7.backward: segments cut the chunked methods' state passes only, not {method!r}'s")
    if records is not None:
        raise ValueError(f"wkv7.backward: records are kept by the chunked methods only, not {method!r}")
    P = backward_split(B, H, N, dev) if split is None else int(split)
    if P not in _backward_splits(N):
        raise ValueError(f"wkv7.backward: split {P} not allowed for N={N} (one of {_backward_splits(N)})")
    n = B * T * H * N
    if P > 1:
        check_buffers("wkv7.backward", partials=partials)
    grads = dict(dr=dr, dw=dw, dk=dk, da=da, db=db)
    variant = {"HEAD_SIZE": N}
    ops = [WKV7_BACKWARD.launch((P, H, B), (N * Q // P, 1, 1), xtype=r.elem, variant=variant,
                                r=r, w=w, k=k, v=v, a=a, b=b, dy=dy, sa=sa, ckpt=ckpt, dv=dv, **grads,
                                part=partials if P > 1 else None, s_init=s0, ds_part=ds_part, T=T, H=H, n=n)]
    if P > 1:
        grid = max(1, min(math.ceil(n // 4 / 256), REDUCE_BLOCKS_PER_SM * dev.sm_count))
        ops.append(WKV7_BACKWARD_REDUCE.launch((grid, 1, 1), (256, 1, 1), xtype=r.elem, variant=variant,
                                               part=partials, **grads, n=n, P=P))
    return ops + reduce


def _state_gradient(ds0, ds0_partials, B: int, H: int, N: int, dev: DeviceInfo, xtype: str) -> tuple:
    """Where the backward writes each sequence's gradient of the initial state (ds0 itself when B = 1,
    else ``ds0_partials`` [B, H, N, N]; None without ``ds0``) and the launches that add them into ds0 in
    sequence order."""
    if ds0 is None:
        if ds0_partials is not None:
            raise ValueError("wkv7.backward: ds0_partials is scratch for ds0: pass ds0 too")
        return None, []
    check_buffers("wkv7.backward", ds0=ds0)
    if B == 1:
        return ds0, []
    check_buffers("wkv7.backward", ds0_partials=ds0_partials)
    n = H * N * N
    return ds0_partials, [WKV7_STATE_REDUCE.launch((grid_stride_blocks(n // 4, dev), 1, 1), (256, 1, 1),
                                                   xtype=xtype, variant={"HEAD_SIZE": N}, part=ds0_partials,
                                                   ds0=ds0, n=n, B=B)]


def _chunked_backward(r, w, k, v, a, b, dy, sa, ckpt, dr, dw, dk, dv, da, db, B, T, H, N, dev, partials,
                      split, method, records, ds_part, segments) -> list:
    """A chunked method's backward: records (unless kept by the forward), the reverse state pass (dv, dX,
    dS, and into ``ds_part`` the initial state's gradient per sequence), the per-chunk gradients. The
    initial state itself comes in ``ckpt`` (the state entering chunk 0)."""
    check_buffers("wkv7.backward", partials=partials)
    _check_exact_inputs("wkv7.backward", method, r)
    P, S, m = _chunked_plan(B, T, H, N, dev, split, segments, "wkv7.backward")
    work = _chunked_work(B, T, H, N)
    nc = n_chunks(T, "chunked")
    x = dict(xtype=r.elem, variant=_operators_variant(N, method))
    ops = []
    rest = partials.offset(_segment_elems(B, H, N, S))
    if records is None:
        rec, ds = rest, rest.offset(work["brec"])
        ops.append(WKV7C_INTRA.launch((nc, H, B), (INTRA_THREADS, 1, 1), **x, r=r, w=w, k=k, a=a, b=b, rec=rec,
                                      brec=None, T=T, H=H, mode=INTRA_BACKWARD))
    else:
        check_buffers("wkv7.backward", records=records)
        rec, ds = records, rest
    dx = ds.offset(work["ds"])
    return ops + [*_state_walks(WKV7C_BACKWARD_STATE, True, B, H, N, P, S, m, dev, BWD_RECORD, r.elem, method,
                                partials, dict(rec=rec, dy=dy, T=T), dict(dv=dv, dx=dx, ds=ds, ds_part=ds_part)),
                  WKV7C_BACKWARD_GRADS.launch((nc, H, B), (4 * N, 1, 1), **x, r=r, w=w, k=k, v=v, a=a, b=b,
                                              dy=dy, sa=sa, s0=ckpt, ds=ds, dx=dx, dr=dr, dw=dw, dk=dk, da=da,
                                              db=db, T=T, H=H)]


def _state_walks(kernel, reverse: bool, B: int, H: int, N: int, P: int, S: int, m: int, dev: DeviceInfo,
                 n_square: int, xtype: str, method: str, seg, inputs: dict, outputs: dict) -> list:
    """A state pass (``kernel``, the forward's or the ``reverse`` one) as launches: the walk over whole
    sequences (S = 1), or the segmented scan over S segments of m chunks: the summary walk (the segments'
    exits and transitions into ``seg``, ``outputs`` NULL), wkv7c_segment_carry (the true exits; nothing
    to carry for S = 2) and the walk of every segment from its entering state, writing ``outputs``."""
    block, state = _state_launch(B, H, N, P, dev, n_square, xtype, method)
    walk = dict(xtype=xtype, **state, **inputs, H=H, m=m, seg=seg if S > 1 else None)
    ops = [kernel.launch((P, H, B * S), block, **walk, **outputs, summary=0)]
    if S == 1:
        return ops
    summary = [kernel.launch((2 * P, H, B * S), block, **walk, **dict.fromkeys(outputs), summary=1)]
    if S > 2:
        summary.append(WKV7C_SEGMENT_CARRY.launch((N // 8, H, B), (32, 8, 1), xtype=xtype, variant=state["variant"],
                                                  seg=seg, S=S, reverse=int(reverse)))
    return summary + ops
