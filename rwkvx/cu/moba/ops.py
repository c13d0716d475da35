"""Launch builders for rwkvx/cu/moba/select.cu, exact.cu and mma.cu: MoBA sparse attention (docs/SPEC.md §2.3),
fp32 math, flash-style.

No T x T buffer: memory is O(B*T*C*top_k) (see :func:`scratch_sizes`). Every builder returns
``list[Launch]`` (plain data, no GPU needed). Buffers are typed device pointers (DevPtr).
Twins: ``rwkvx.oracle.moba_attention_forward`` / ``moba_attention_backward`` (and ``moba_select``,
``moba_block_means``, ``moba_logsumexp`` for the intermediate buffers).

Shapes (q, k, v, o, do, dq, dk, dv floatX; the rest f32 unless noted; ``K1 = top_k - 1``,
``nblk = ceil(T / chunk)``, ``E = emax(T, chunk, top_k)``):

=========  =========================  ======================================================================
name       shape                      contents
=========  =========================  ======================================================================
q, k, v    [B, T, H, N]               inputs (= row-major [B*T, C], c = h*N + n), 16-byte aligned
o          [B, T, H, N]               forward output
do         [B, T, H, N]               gradient of o (backward input)
dq, dk, dv [B, T, H, N]               backward outputs (written, not accumulated)
sel        int32 [B, H, T, K1]        selected past blocks of query t, ascending, -1 padded (forward output)
lse        [B, H, T]                  logsumexp (natural log) of the scaled scores over the visible keys
kmean      [B, H, nblk, N]            block means of k (forward only)
cnt        int32 [B, H, nblk]         how many queries selected block j (forward only)
idx        int32 [B, H, 3, nblk+1]    per (b,h): offsets of each block's list in qlist, and tile offsets
qlist      int32 [B, H, E]            per (b,h) and block j, the entries t*K1 + s (sel[t,s] == j), ascending t
part       [B, H, T, K1, N]           forward: partial outputs per (query, slot); backward: partial dq
lpart      [B, H, T, K1]              forward: logsumexp of each partial output
delta      [B, H, T]                  backward: sum_n do * o per query
olo        bf16 [B, T, H, N]          bf16 activations only: o - bf16(o), the fp32 output's residual
=========  =========================  ======================================================================

``scratch`` arguments are dicts name -> pointer with the keys of :func:`scratch_sizes` (zero-size
buffers may be None / absent). Nothing needs zeroing. Between :func:`forward` and :func:`backward` on the
same q, k, v, keep ``o``, ``olo``, ``sel``, ``lse``, ``idx`` and ``qlist``; the others are transient
(``part`` is overwritten by the backward; ``kmean``/``cnt``/``lpart`` are only used inside the forward,
``delta`` only inside the backward).

Usage::

    sizes = moba.scratch_sizes(B, T, H, N, chunk, top_k, xtype)   # name -> (elements, element type)
    ops  = moba.forward(q, k, v, o, scratch, B, T, H, N, chunk, top_k, dev)
    ops += moba.backward(q, k, v, o, do, dq, dk, dv, scratch, B, T, H, N, chunk, top_k, dev)

Determinism: no floating-point atomics; replays are bit-identical (see moba.cuh's header).
Numerics: gate in fp32 (fmaf chain over n), scores, online softmax and all sums in fp32. With bf16
activations the forward also writes the residual ``olo`` of the bf16 output, and the backward's
delta = sum_n do * (o + olo) is the fp32 output's: delta taken from the rounded output alone breaks
sum_u dS = 0, which leaks delta's error into dq and dk along the mean of k and q
(docs/PERFORMANCE.md, "bf16 accuracy").

``method`` (forward and backward, the same for both): ``"exact"`` (default) computes the attention in
fp32 on CUDA cores; ``"mma"`` (head sizes :data:`MMA_HEAD_SIZES`) on tensor cores: bf16 m16n8k16 for bf16
activations, tf32 m16n8k8 for f32 ones, fp32 accumulation and softmax statistics, the probabilities
rounded to the operand type for the second product (mma.cu's header). Selection, gate,
scratch and the merge are the same for both methods.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.kernel import F32_IN, F32_OUT, FLOAT, I32_IN, I32_OUT, INT, X_IN, X_OUT, KernelFile

from .. import _common
from .._common import DeviceInfo, check_buffers

HEAD_SIZES = (4, 8, 16, 32, 64, 128, 256)
NTHR = 128          # threads of the attention kernels (16 x 8 per tile; mma fwd/dq: mma_query_threads)
SEL_Q = 64          # threads (= queries) per moba_select block
SEL_J = 32          # block means staged per selection step
SEL_ILP = 4         # gate dot products a selection thread runs at once (divides SEL_J)
KM_THREADS = 256    # moba_kmean threads
FILL_THREADS = 256  # moba_fill threads

METHODS = ("exact", "mma")
MMA_HEAD_SIZES = (32, 64, 128)   # head sizes of the tensor-core kernels
MMA_ROWS = 16 * (NTHR // 32)     # queries (forward, dq) or keys (dk/dv) per mma CTA: 16 per warp

SCRATCH_NAMES = ("sel", "lse", "kmean", "cnt", "idx", "qlist", "part", "lpart", "delta", "olo")


def tiles(N: int) -> dict[str, int]:
    """Tile sizes for head size N."""
    if N <= 64:
        return dict(MOBA_FQ=64, MOBA_FK=64, MOBA_DQ_Q=64, MOBA_DQ_K=32, MOBA_KV_K=64, MOBA_KV_Q=32)
    if N <= 128:
        return dict(MOBA_FQ=64, MOBA_FK=32, MOBA_DQ_Q=32, MOBA_DQ_K=32, MOBA_KV_K=32, MOBA_KV_Q=32)
    return dict(MOBA_FQ=32, MOBA_FK=16, MOBA_DQ_Q=16, MOBA_DQ_K=16, MOBA_KV_K=16, MOBA_KV_Q=16)


def _layout(prefix: str, parts) -> tuple[dict[str, int], int]:
    """Word offsets (defines prefix_NAME) of consecutive shared-memory arrays, and the total words."""
    offsets, word = {}, 0
    for name, words in parts:
        offsets[f"{prefix}_{name}"] = word
        word += words
    return offsets, word


def smem_layouts(N: int) -> dict[str, tuple[dict[str, int], int]]:
    """The shared-memory carve-up of each kernel group for head size N: name -> (offsets, words).

    The offsets reach select.cu and exact.cu as defines; the launches ask for 4 * words bytes (select: plus its
    K1-sized top lists, see :func:`select_smem_bytes`)."""
    t = tiles(N)
    ldh = N + 4                                  # padded row stride: no bank conflicts on columns
    fq, fk, dqq, dqk, kvk, kvq = (t[k] for k in ("MOBA_FQ", "MOBA_FK", "MOBA_DQ_Q", "MOBA_DQ_K",
                                                   "MOBA_KV_K", "MOBA_KV_Q"))
    return {
        "sel": _layout("MOBA_SM_SEL", [("QS", SEL_Q * (N + 4)), ("KM", SEL_J * N), ("TOP", 0)]),
        "fwd": _layout("MOBA_SM_FWD", [("Q", fq * ldh), ("K", fk * ldh), ("V", fk * ldh), ("P", fq * (fk + 4)),
                                       ("QTOK", fq), ("QENT", fq)]),
        "dq": _layout("MOBA_SM_DQ", [("Q", dqq * ldh), ("DO", dqq * ldh), ("K", dqk * ldh), ("V", dqk * ldh),
                                     ("DS", dqq * (dqk + 4)), ("LSE", dqq), ("D", dqq), ("QTOK", dqq),
                                     ("QENT", dqq)]),
        "kv": _layout("MOBA_SM_KV", [("K", kvk * ldh), ("V", kvk * ldh), ("Q", kvq * ldh), ("DO", kvq * ldh),
                                     ("P", kvk * (kvq + 4)), ("DS", kvk * (kvq + 4)), ("LSE", kvq), ("D", kvq),
                                     ("QTOK", kvq)]),
    }


def mma_tiles(N: int, xtype: str) -> dict[str, int]:
    """Tile sizes and the padded row stride (elements) of the tensor-core kernels for head size N."""
    kvq = 64 if N <= 64 else 32          # fewer query columns per dk/dv tile: dk, dv stay in registers
    # rows padded by 16 bytes: 16-byte aligned for cp.async / ldmatrix, and a row stride of 4 banks mod 32
    # (conflict-free ldmatrix phases of 8 rows; conflict-free tf32 scalar fragment loads)
    pad = 16 // ELEM_BYTES[xtype]
    return dict(MOBA_MMA_Q=MMA_ROWS, MOBA_MMA_K=MMA_ROWS, MOBA_MMA_KVQ=kvq, MOBA_MMA_LD=N + pad)


def mma_query_threads(N: int, xtype: str) -> int:
    """Threads of the tensor-core forward and dq CTAs (MMA_ROWS queries each). bf16 at N <= 64: 2 warps of
    32 queries, so each K and V fragment read from shared memory serves two 16-row tiles (3-4 CTAs per SM
    fit in shared memory). Otherwise 4 warps of 16: the f32 tiles take twice the shared memory (2 CTAs
    per SM, which keeps 8 warps), and at N = 128 the accumulators of 32 rows would not fit in registers."""
    return 64 if N <= 64 and xtype == "bf16" else NTHR


def mma_min_blocks(N: int) -> dict[str, int]:
    """CTAs per SM that each tensor-core kernel group's registers are budgeted for (the minimum blocks of
    its __launch_bounds__, define MOBA_MMA_MINB_<group>). N <= 64: MFWD 4, MDQ 3, MKV 3, what shared memory
    allows for bf16; with 128 threads that caps registers at 128 (f32 forward) and 168 (f32 dq, dk/dv),
    with 64 (bf16 forward, dq) it caps nothing. ptxas meets them without spills; left to itself it aims
    one CTA higher at N = 32 (and spills) and lands one register above the 3-CTA budget of bf16 dk/dv at
    N = 64. N = 128: 1 (no cap)."""
    if N <= 64:
        return {"MFWD": 4, "MDQ": 3, "MKV": 3}
    return {"MFWD": 1, "MDQ": 1, "MKV": 1}


def mma_smem_layouts(N: int, xtype: str) -> dict[str, tuple[dict[str, int], int, int]]:
    """The shared-memory carve-up of each tensor-core kernel group: name -> (offsets, side words,
    tile elements). int/float side arrays first (word offsets), then the floatX operand tiles (element
    offsets, from byte 4 * side words; defines MOBA_SM_<group>_SIDE and _<array>). The tiles the kernels
    loop over are double-buffered: keys and values (MFWD, MDQ), queries and their side arrays (MKV, with
    QRAW: the query-list entries of the tile after the next one)."""
    t = mma_tiles(N, xtype)
    rows, kvq, ld = MMA_ROWS, t["MOBA_MMA_KVQ"], t["MOBA_MMA_LD"]
    groups = {
        "MFWD": ([("QTOK", rows), ("QENT", rows)],
                 [("Q", rows * ld), ("K", 2 * rows * ld), ("V", 2 * rows * ld)]),
        "MDQ": ([("QTOK", rows), ("QENT", rows), ("LSE", rows), ("D", rows)],
                [("Q", rows * ld), ("DO", rows * ld), ("K", 2 * rows * ld), ("V", 2 * rows * ld)]),
        "MKV": ([("QTOK", 2 * kvq), ("QRAW", 2 * kvq), ("LSE", 2 * kvq), ("D", 2 * kvq)],
                [("K", rows * ld), ("V", rows * ld), ("Q", 2 * kvq * ld), ("DO", 2 * kvq * ld)]),
    }
    out = {}
    for group, (side, tiles_) in groups.items():
        prefix = f"MOBA_SM_{group}"
        side_offsets, side_words = _layout(prefix, side)
        side_words = -(-side_words // 4) * 4                 # the tiles start 16-byte aligned
        tile_offsets, tile_elems = _layout(prefix, tiles_)
        out[group] = ({**side_offsets, **tile_offsets, f"{prefix}_SIDE": side_words}, side_words, tile_elems)
    return out


def mma_smem_bytes(N: int, group: str, xtype: str) -> int:
    """Dynamic shared memory of a tensor-core kernel group (MFWD, MDQ, MKV) for element type xtype."""
    _, side_words, tile_elems = mma_smem_layouts(N, xtype)[group]
    return 4 * side_words + ELEM_BYTES[xtype] * tile_elems


def _select_defines(variant: dict, xtype: str) -> dict:
    """Defines of select.cu for a head size: the tiles (moba_scan counts tiles of them) and its layout."""
    N = int(variant["HEAD_SIZE"])
    return {**tiles(N), **smem_layouts(N)["sel"][0]}


def _exact_defines(variant: dict, xtype: str) -> dict:
    """Defines of exact.cu for a head size: the tiles, the padded row strides and the layouts."""
    N = int(variant["HEAD_SIZE"])
    t = tiles(N)
    out = dict(t, MOBA_LDH=N + 4, MOBA_FLDP=t["MOBA_FK"] + 4, MOBA_DLDP=t["MOBA_DQ_K"] + 4,
               MOBA_KLDP=t["MOBA_KV_Q"] + 4)
    for group in ("fwd", "dq", "kv"):
        out.update(smem_layouts(N)[group][0])
    return out


def _mma_defines(variant: dict, xtype: str) -> dict:
    """Defines of mma.cu for a head size and element type: the tiles of the selection's lists, the
    tensor-core tiles, thread counts, register budgets and layouts."""
    N = int(variant["HEAD_SIZE"])
    out = dict(tiles(N), **mma_tiles(N, xtype), MOBA_MMA_QTHREADS=mma_query_threads(N, xtype))
    out.update({f"MOBA_MMA_MINB_{group}": blocks for group, blocks in mma_min_blocks(N).items()})
    for offsets, _, _ in mma_smem_layouts(N, xtype).values():
        out.update(offsets)
    return out


# moba.cuh's constants and the selection's, passed to each of the three files
_CONSTANTS = {"MOBA_NTHR": NTHR, "MOBA_SEL_Q": SEL_Q, "MOBA_SEL_J": SEL_J, "MOBA_SEL_ILP": SEL_ILP,
              "MOBA_KM_THREADS": KM_THREADS, "MOBA_FILL_THREADS": FILL_THREADS}
SELECT_CU = KernelFile("moba/select", constants=_CONSTANTS, variants={"HEAD_SIZE": HEAD_SIZES},
                       derived=_select_defines)
EXACT_CU = KernelFile("moba/exact", constants=_CONSTANTS, variants={"HEAD_SIZE": HEAD_SIZES},
                      derived=_exact_defines)
MMA_CU = KernelFile("moba/mma", constants=_CONSTANTS, variants={"HEAD_SIZE": MMA_HEAD_SIZES},
                    derived=_mma_defines)
_FILES = {"exact": EXACT_CU, "mma": MMA_CU}
_SIZES = dict(T=INT, H=INT, chunk=INT)
MOBA_KMEAN = SELECT_CU.kernel("moba_kmean", k=X_IN, kmean=F32_OUT, cnt=I32_OUT, T=INT, H=INT, chunk=INT, nblk=INT)
MOBA_SELECT = SELECT_CU.kernel("moba_select", q=X_IN, kmean=F32_IN, sel=I32_OUT, cnt=I32_OUT, **_SIZES, K1=INT,
                        nblk=INT)
MOBA_SCAN = SELECT_CU.kernel("moba_scan", cnt=I32_IN, idx=I32_OUT, nblk=INT)
MOBA_FILL = SELECT_CU.kernel("moba_fill", sel=I32_IN, idx=I32_IN, qlist=I32_OUT, **_SIZES, K1=INT, nblk=INT, Emax=INT)
MOBA_BWD_DELTA = SELECT_CU.kernel("moba_bwd_delta", o=X_IN, dout=X_IN, delta=F32_OUT, B=INT, T=INT, H=INT,
                                  olo=X_IN.opt())
_QKV = dict(q=X_IN, k=X_IN, v=X_IN)
_BWD_IN = dict(**_QKV, dout=X_IN, lse=F32_IN, delta=F32_IN)
# The attention kernels: the same parameters for both methods (the mma names end in "_mma").
_ATTENTION = {
    "fwd_past": dict(**_QKV, idx=I32_IN, qlist=I32_IN, part=F32_OUT, lpart=F32_OUT, **_SIZES, K1=INT, nblk=INT,
                     Emax=INT, scale=FLOAT),
    "fwd_own": dict(**_QKV, sel=I32_IN.opt(), part=F32_IN.opt(), lpart=F32_IN.opt(), o=X_OUT, lse=F32_OUT,
                    **_SIZES, K1=INT, scale=FLOAT, olo=X_OUT.opt()),
    "bwd_dq_past": dict(**_BWD_IN, idx=I32_IN, qlist=I32_IN, part=F32_OUT, **_SIZES, K1=INT, nblk=INT, Emax=INT,
                        scale=FLOAT),
    "bwd_dq_own": dict(**_BWD_IN, sel=I32_IN.opt(), part=F32_IN.opt(), dq=X_OUT, **_SIZES, K1=INT, scale=FLOAT),
    "bwd_dkdv": dict(**_BWD_IN, idx=I32_IN.opt(), qlist=I32_IN.opt(), dk=X_OUT, dv=X_OUT, **_SIZES, K1=INT,
                     nblk=INT, Emax=INT, scale=FLOAT),
}
_KERNELS = {method: {name: _FILES[method].kernel(f"moba_{name}" + ("_mma" if method == "mma" else ""), **params)
                     for name, params in _ATTENTION.items()} for method in METHODS}


def select_smem_bytes(N: int, K1: int) -> int:
    """Dynamic shared memory of moba_select: the fixed arrays and two K1 x SEL_Q top lists."""
    return 4 * (smem_layouts(N)["sel"][1] + 2 * SEL_Q * max(K1, 0))


def _smem_bytes(N: int, group: str) -> int:
    return 4 * smem_layouts(N)[group][1]


class _Attention(NamedTuple):
    """What the builders need of one method: kernels, query tiles and shared memory per group."""
    kernels: dict
    fq: int          # queries per forward CTA (and per tile of toff_f)
    dqq: int         # queries per dq CTA
    kvk: int         # keys per dk/dv CTA
    smem: dict       # "fwd", "dq", "kv" -> bytes
    qthreads: int    # threads per forward and dq CTA (dk/dv: NTHR)


def _attention(method: str, N: int, xtype: str) -> _Attention:
    if method == "exact":
        t = tiles(N)
        return _Attention(_KERNELS["exact"], t["MOBA_FQ"], t["MOBA_DQ_Q"], t["MOBA_KV_K"],
                          {g: _smem_bytes(N, g) for g in ("fwd", "dq", "kv")}, NTHR)
    if N not in MMA_HEAD_SIZES:
        raise ValueError(f"moba: method 'mma' supports head sizes {MMA_HEAD_SIZES}, got {N}")
    return _Attention(_KERNELS["mma"], MMA_ROWS, MMA_ROWS, MMA_ROWS,
                      {g: mma_smem_bytes(N, G, xtype) for g, G in (("fwd", "MFWD"), ("dq", "MDQ"), ("kv", "MKV"))},
                      mma_query_threads(N, xtype))


def check_shape(B: int, T: int, H: int, N: int, chunk: int, top_k: int, dev: DeviceInfo) -> None:
    """ValueError unless the sizes are supported (N one of HEAD_SIZES, all >= 1, ...)."""
    for name, val, lo in (("B", B, 1), ("T", T, 1), ("H", H, 1), ("N", N, 4), ("chunk", chunk, 1),
                          ("top_k", top_k, 1)):
        if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < lo:
            raise ValueError(f"moba: {name} must be an int >= {lo}, got {val!r}")
    if N not in HEAD_SIZES:
        raise ValueError(f"moba: head size N must be one of {HEAD_SIZES}, got {N}")
    if B * H > 65535 or nblocks(T, chunk) > 65535:
        raise ValueError(f"moba: B*H ({B * H}) and ceil(T/chunk) ({nblocks(T, chunk)}) must be <= 65535")
    if T * top_k >= 2 ** 31 or B * H * T * max(top_k - 1, 1) * N >= 2 ** 40:
        raise ValueError("moba: sizes too large")
    if select_smem_bytes(N, top_k - 1) > dev.smem_per_block:
        raise ValueError(f"moba: top_k={top_k} too large for head size {N} (selection list does not "
                         f"fit in the device's {dev.smem_per_block} bytes of shared memory per block)")


def nblocks(T: int, chunk: int) -> int:
    """Key blocks of a sequence of T tokens."""
    return (T + chunk - 1) // chunk


def emax(T: int, chunk: int, top_k: int) -> int:
    """Entries of qlist per (b, h): sum over t of min(top_k - 1, t // chunk)."""
    K1 = top_k - 1
    total = 0
    for c in range(nblocks(T, chunk)):
        total += min(K1, c) * (min(T, (c + 1) * chunk) - c * chunk)
    return total


def scratch_sizes(B: int, T: int, H: int, N: int, chunk: int, top_k: int,
                  xtype: str = "f32") -> dict[str, tuple[int, str]]:
    """(elements, element type) of each scratch buffer (0 where unused) for activations of type ``xtype``.
    Total, with K1 = top_k-1, nblk = ceil(T/chunk), E <= T*K1:  4 * (B*H*T*(K1*N + 2*K1 + 2) +
    B*H*nblk*(N + 1) + 3*B*H*(nblk+1) + B*H*E) bytes, i.e. about 4*B*T*C*K1 bytes (the partials) plus
    O(B*H*T*K1), and with bf16 activations 2*B*T*C bytes more (olo). The same for both methods (the
    tensor-core kernels keep their tiles in shared memory only)."""
    B, T, H, N, chunk, top_k = (int(x) for x in (B, T, H, N, chunk, top_k))
    K1 = top_k - 1
    nblk = nblocks(T, chunk)
    BH = B * H
    has_sel = K1 > 0
    E = emax(T, chunk, top_k)
    return {
        "sel": (BH * T * K1, "i32"),
        "lse": (BH * T, "f32"),
        "kmean": (BH * nblk * N if has_sel else 0, "f32"),
        "cnt": (BH * nblk if has_sel else 0, "i32"),
        "idx": (BH * 3 * (nblk + 1) if E else 0, "i32"),
        "qlist": (BH * E, "i32"),
        "part": (BH * T * K1 * N if E else 0, "f32"),
        "lpart": (BH * T * K1 if E else 0, "f32"),
        "delta": (BH * T, "f32"),
        "olo": (BH * T * N if xtype == "bf16" else 0, "bf16"),
    }


def carve(base: int, B: int, T: int, H: int, N: int, chunk: int, top_k: int, xtype: str = "f32") -> dict:
    """The scratch buffers laid out from device address ``base``: the dict the builders take."""
    return _common.carve(base, scratch_sizes(B, T, H, N, chunk, top_k, xtype))


def scratch_bytes(B: int, T: int, H: int, N: int, chunk: int, top_k: int, xtype: str = "f32") -> int:
    """Bytes of :func:`carve`'s layout."""
    return _common.carved_bytes(scratch_sizes(B, T, H, N, chunk, top_k, xtype))


def _get(scratch: dict, name: str):
    buf = scratch.get(name) if scratch else None
    if buf is None:
        raise ValueError(f"moba: scratch[{name!r}] is required here (see scratch_sizes)")
    return buf


def _residual(scratch: dict, xtype: str):
    """The output's residual buffer olo: required with bf16 activations, None otherwise."""
    return _get(scratch, "olo") if xtype == "bf16" else None


class _Problem(NamedTuple):
    """What the forward and backward builders derive from the sizes and buffers."""
    xtype: str
    K1: int
    nblk: int
    E: int
    att: _Attention
    variant: dict
    scale: float


def _problem(what: str, B: int, T: int, H: int, N: int, chunk: int, top_k: int, dev: DeviceInfo, method: str,
             **buffers) -> _Problem:
    check_shape(B, T, H, N, chunk, top_k, dev)
    if method not in METHODS:
        raise ValueError(f"moba: method must be one of {METHODS}, got {method!r}")
    check_buffers(f"moba.{what}", **buffers)
    xtype = _common.xtype_of(f"moba.{what}", *buffers.values())
    return _Problem(xtype, top_k - 1, nblocks(T, chunk), emax(T, chunk, top_k), _attention(method, N, xtype),
                    {"HEAD_SIZE": N}, 1.0 / math.sqrt(N))


# ---- builders -------------------------------------------------------------------------------------

def forward(q, k, v, o, scratch: dict, B: int, T: int, H: int, N: int, chunk: int, top_k: int,
            dev: DeviceInfo, method: str = "exact") -> list:
    """o = MoBA attention(q, k, v); also writes scratch sel, lse, kmean, cnt, idx, qlist, part, lpart.

    Launches (K1 = top_k-1 > 0 and T > chunk): moba_kmean, moba_select, moba_scan, moba_fill,
    moba_fwd_past, moba_fwd_own. top_k == 1: moba_fwd_own only; T <= chunk: kmean, select (all -1), own.
    ``method="mma"``: the attention kernels are moba_fwd_past_mma, moba_fwd_own_mma (see the module doc).
    bf16 activations: also writes scratch olo."""
    xtype, K1, nblk, E, att, var, scale = _problem("forward", B, T, H, N, chunk, top_k, dev, method,
                                                   q=q, k=k, v=v, o=o)
    lse, olo = _get(scratch, "lse"), _residual(scratch, xtype)
    ops = []
    sel = cnt = None
    if K1 > 0:
        sel, kmean, cnt = _get(scratch, "sel"), _get(scratch, "kmean"), _get(scratch, "cnt")
        ops.append(MOBA_KMEAN.launch((nblk, H, B), (KM_THREADS, 1, 1), xtype=xtype, variant=var,
                                     k=k, kmean=kmean, cnt=cnt, T=T, H=H, chunk=chunk, nblk=nblk))
        ops.append(MOBA_SELECT.launch((math.ceil(T / SEL_Q), H, B), (SEL_Q, 1, 1), xtype=xtype, variant=var,
                                      smem=select_smem_bytes(N, K1), q=q, kmean=kmean, sel=sel, cnt=cnt,
                                      T=T, H=H, chunk=chunk, K1=K1, nblk=nblk))
    part = lpart = None
    if E > 0:
        idx, qlist = _get(scratch, "idx"), _get(scratch, "qlist")
        part, lpart = _get(scratch, "part"), _get(scratch, "lpart")
        ops.append(MOBA_SCAN.launch((B * H, 1, 1), (32, 1, 1), xtype=xtype, variant=var,
                                    cnt=cnt, idx=idx, nblk=nblk))
        ops.append(MOBA_FILL.launch((nblk, H, B), (FILL_THREADS, 1, 1), xtype=xtype, variant=var,
                                    sel=sel, idx=idx, qlist=qlist, T=T, H=H, chunk=chunk, K1=K1, nblk=nblk,
                                    Emax=E))
        ops.append(att.kernels["fwd_past"].launch(
            (math.ceil(E / att.fq) + nblk, H, B), (att.qthreads, 1, 1), xtype=xtype, variant=var,
            smem=att.smem["fwd"],
            q=q, k=k, v=v, idx=idx, qlist=qlist, part=part, lpart=lpart, T=T, H=H, chunk=chunk, K1=K1,
            nblk=nblk, Emax=E, scale=scale))
    k1_eff = K1 if E > 0 else 0      # no past block anywhere: nothing to merge
    tpc = math.ceil(chunk / att.fq)
    ops.append(att.kernels["fwd_own"].launch((nblk * tpc, H, B), (att.qthreads, 1, 1), xtype=xtype, variant=var,
                                   smem=att.smem["fwd"], q=q, k=k, v=v, sel=sel if k1_eff else None,
                                   part=part, lpart=lpart, o=o, lse=lse, T=T, H=H, chunk=chunk, K1=k1_eff,
                                   scale=scale, olo=olo))
    return ops


def backward(q, k, v, o, do, dq, dk, dv, scratch: dict, B: int, T: int, H: int, N: int, chunk: int,
             top_k: int, dev: DeviceInfo, method: str = "exact") -> list:
    """dq, dk, dv (written) of MoBA attention with the forward's selection held fixed.

    Needs the scratch of the :func:`forward` that produced ``o`` on the same q, k, v (sel, lse, idx,
    qlist; olo with bf16 activations); uses ``delta`` and ``part`` as scratch. Launches: moba_bwd_delta,
    moba_bwd_dq_past (when some query has a past block), moba_bwd_dq_own, moba_bwd_dkdv (``method="mma"``:
    their ``_mma`` versions)."""
    xtype, K1, nblk, E, att, var, scale = _problem("backward", B, T, H, N, chunk, top_k, dev, method, q=q, k=k,
                                                   v=v, o=o, do=do, dq=dq, dk=dk, dv=dv)
    lse, delta = _get(scratch, "lse"), _get(scratch, "delta")
    common = dict(q=q, k=k, v=v, dout=do, lse=lse, delta=delta)
    ops = [MOBA_BWD_DELTA.launch((math.ceil(B * T * H / 4), 1, 1), (128, 1, 1), xtype=xtype, variant=var,
                                 o=o, dout=do, delta=delta, B=B, T=T, H=H, olo=_residual(scratch, xtype))]
    sel = idx = qlist = part = None
    if E > 0:
        sel, idx = _get(scratch, "sel"), _get(scratch, "idx")
        qlist, part = _get(scratch, "qlist"), _get(scratch, "part")
        ops.append(att.kernels["bwd_dq_past"].launch((math.ceil(E / att.dqq) + nblk, H, B), (att.qthreads, 1, 1),
                                           xtype=xtype, variant=var, smem=att.smem["dq"], **common,
                                           idx=idx, qlist=qlist, part=part, T=T, H=H, chunk=chunk, K1=K1,
                                           nblk=nblk, Emax=E, scale=scale))
    k1_eff = K1 if E > 0 else 0
    tpc = math.ceil(chunk / att.dqq)
    ops.append(att.kernels["bwd_dq_own"].launch((nblk * tpc, H, B), (att.qthreads, 1, 1), xtype=xtype,
                                                variant=var,
                                      smem=att.smem["dq"], **common, sel=sel, part=part, dq=dq,
                                      T=T, H=H, chunk=chunk, K1=k1_eff, scale=scale))
    ops.append(att.kernels["bwd_dkdv"].launch((math.ceil(chunk / att.kvk), nblk, B * H), (NTHR, 1, 1),
                                    xtype=xtype, variant=var, smem=att.smem["kv"], **common,
                                    idx=idx, qlist=qlist, dk=dk, dv=dv, T=T, H=H, chunk=chunk, K1=k1_eff,
                                    nblk=nblk, Emax=E, scale=scale))
    return ops
