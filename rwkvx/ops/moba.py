"""Launch builders for rwkvx/cu/moba.cu: MoBA sparse attention (SPEC §2.3), fp32, flash-style.

No T x T buffer: memory is O(B*T*C*top_k) (see :func:`scratch_sizes`). Every builder returns
``list[Launch]`` (plain data, no GPU needed). Pointers are ints or objects with an int ``.ptr``.

Shapes (float32 unless noted; ``K1 = top_k - 1``, ``nblk = ceil(T / chunk)``, ``E = emax(T, chunk, top_k)``):

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
=========  =========================  ======================================================================

``scratch`` arguments are dicts name -> pointer with the keys of :func:`scratch_sizes` (zero-size
buffers may be 0 / absent). Nothing needs zeroing. Between :func:`forward` and :func:`backward` on the
same q, k, v, keep ``o``, ``sel``, ``lse``, ``idx`` and ``qlist``; the others are transient
(``part`` is overwritten by the backward; ``kmean``/``cnt``/``lpart`` are only used inside the forward,
``delta`` only inside the backward).

Usage::

    sizes = moba.scratch_sizes(B, T, H, N, chunk, top_k)          # bytes per buffer
    ops  = moba.forward(q, k, v, o, scratch, B, T, H, N, chunk, top_k)
    ops += moba.backward(q, k, v, o, do, dq, dk, dv, scratch, B, T, H, N, chunk, top_k)

Determinism: no floating-point atomics; replays are bit-identical (see moba.cu's header).
Numerics: gate in fp32 (fmaf chain over n), scores, online softmax and all sums in fp32.
"""
from __future__ import annotations

import math
import numbers

from ._common import Launch, ptr

MODULE = "moba"
NTHR = 128          # NTHR in moba.cu (attention kernels)
SEL_Q = 64          # SEL_Q (moba_select block)
KM_THREADS = 256    # KM_THREADS
FILL_THREADS = 256  # FILL_THREADS
SEL_J = 32          # MOBA_SEL_J
MAX_SMEM = 227 * 1024   # dynamic shared memory per block on sm_90 (opt-in; the runtime raises the limit)

SCRATCH_NAMES = ("sel", "lse", "kmean", "cnt", "idx", "qlist", "part", "lpart", "delta")


def tiles(N: int) -> dict[str, int]:
    """Tile sizes for head size N (passed to moba.cu as defines)."""
    if N <= 64:
        t = dict(MOBA_FQ=64, MOBA_FK=64, MOBA_DQ_Q=64, MOBA_DQ_K=32, MOBA_KV_K=64, MOBA_KV_Q=32)
    elif N <= 128:
        t = dict(MOBA_FQ=64, MOBA_FK=32, MOBA_DQ_Q=32, MOBA_DQ_K=32, MOBA_KV_K=32, MOBA_KV_Q=32)
    else:
        t = dict(MOBA_FQ=32, MOBA_FK=16, MOBA_DQ_Q=16, MOBA_DQ_K=16, MOBA_KV_K=16, MOBA_KV_Q=16)
    t["MOBA_SEL_J"] = SEL_J
    return t


def defines(N: int) -> tuple:
    """The define set of every moba launch for head size N (one compiled module per N)."""
    return (("HEAD_SIZE", int(N)),) + tuple(sorted(tiles(N).items()))


def check_shape(B: int, T: int, H: int, N: int, chunk: int, top_k: int) -> None:
    """ValueError unless the sizes are supported (N a multiple of 4 in [4, 256], all >= 1, ...)."""
    for name, val, lo in (("B", B, 1), ("T", T, 1), ("H", H, 1), ("N", N, 4), ("chunk", chunk, 1),
                          ("top_k", top_k, 1)):
        if not isinstance(val, numbers.Integral) or isinstance(val, bool) or val < lo:
            raise ValueError(f"moba: {name} must be an int >= {lo}, got {val!r}")
    if N % 4 or N > 256:
        raise ValueError(f"moba: head size N must be a multiple of 4 in [4, 256], got {N}")
    if B * H > 65535 or nblocks(T, chunk) > 65535:
        raise ValueError(f"moba: B*H ({B * H}) and ceil(T/chunk) ({nblocks(T, chunk)}) must be <= 65535")
    if T * top_k >= 2 ** 31 or B * H * T * max(top_k - 1, 1) * N >= 2 ** 40:
        raise ValueError("moba: sizes too large")
    if _smem_select(N, top_k - 1) > MAX_SMEM:
        raise ValueError(f"moba: top_k={top_k} too large for head size {N} (selection list does not "
                         f"fit in shared memory)")


def nblocks(T: int, chunk: int) -> int:
    return (T + chunk - 1) // chunk


def emax(T: int, chunk: int, top_k: int) -> int:
    """Entries of qlist per (b, h): sum over t of min(top_k - 1, t // chunk)."""
    K1 = top_k - 1
    total = 0
    for c in range(nblocks(T, chunk)):
        total += min(K1, c) * (min(T, (c + 1) * chunk) - c * chunk)
    return total


def scratch_sizes(B: int, T: int, H: int, N: int, chunk: int, top_k: int) -> dict[str, int]:
    """Bytes of each scratch buffer (0 where unused). Total, with K1 = top_k-1, nblk = ceil(T/chunk),
    E <= T*K1:  4 * (B*H*T*(K1*N + 2*K1 + 2) + B*H*nblk*(N + 1) + 3*B*H*(nblk+1) + B*H*E)
    i.e. about 4*B*T*C*K1 bytes (the partials) plus O(B*H*T*K1)."""
    check_shape(B, T, H, N, chunk, top_k)
    B, T, H, N, chunk, top_k = (int(x) for x in (B, T, H, N, chunk, top_k))
    K1 = top_k - 1
    nblk = nblocks(T, chunk)
    BH = B * H
    has_sel = K1 > 0
    E = emax(T, chunk, top_k)
    return {
        "sel": 4 * BH * T * K1,
        "lse": 4 * BH * T,
        "kmean": 4 * BH * nblk * N if has_sel else 0,
        "cnt": 4 * BH * nblk if has_sel else 0,
        "idx": 4 * BH * 3 * (nblk + 1) if E else 0,
        "qlist": 4 * BH * E,
        "part": 4 * BH * T * K1 * N if E else 0,
        "lpart": 4 * BH * T * K1 if E else 0,
        "delta": 4 * BH * T,
    }


def scratch_bytes(B: int, T: int, H: int, N: int, chunk: int, top_k: int, align: int = 256) -> int:
    """Total bytes of :func:`carve`'s layout (each buffer aligned to ``align``)."""
    return sum(-(-n // align) * align for n in scratch_sizes(B, T, H, N, chunk, top_k).values())


def carve(base, B: int, T: int, H: int, N: int, chunk: int, top_k: int, align: int = 256) -> dict[str, int]:
    """Lay the scratch buffers out from device address ``base`` (:func:`scratch_bytes` bytes); returns
    the name -> pointer dict the builders take (0 for empty buffers)."""
    addr = ptr(base)
    out = {}
    for name, n in scratch_sizes(B, T, H, N, chunk, top_k).items():
        out[name] = addr if n else 0
        addr += -(-n // align) * align
    return out


# ---- shared memory (bytes), mirrors moba.cu -----------------------------------------------------

def _smem_select(N: int, K1: int) -> int:
    return 4 * (SEL_Q * (N + 1) + SEL_J * N + 2 * SEL_Q * max(K1, 0))


def _smem_fwd(N: int) -> int:
    t = tiles(N)
    ldh = N + 4
    fq, fk = t["MOBA_FQ"], t["MOBA_FK"]
    return 4 * (fq * ldh + 2 * fk * ldh + fq * (fk + 4) + 2 * fq)


def _smem_dq(N: int) -> int:
    t = tiles(N)
    ldh = N + 4
    qq, kk = t["MOBA_DQ_Q"], t["MOBA_DQ_K"]
    return 4 * (2 * qq * ldh + 2 * kk * ldh + qq * (kk + 4) + 2 * qq + 2 * qq)


def _smem_kv(N: int) -> int:
    t = tiles(N)
    ldh = N + 4
    kk, qq = t["MOBA_KV_K"], t["MOBA_KV_Q"]
    return 4 * (2 * kk * ldh + 2 * qq * ldh + 2 * kk * (qq + 4) + 3 * qq)


def _get(scratch: dict, name: str, needed: bool) -> int:
    addr = ptr(scratch.get(name)) if scratch else 0
    if needed and not addr:
        raise ValueError(f"moba: scratch[{name!r}] is required here (see scratch_sizes)")
    return addr


def _check_ptrs(what: str, **ptrs) -> None:
    for name, p in ptrs.items():
        if not p:
            raise ValueError(f"moba.{what}: {name} is required")
        if p % 16:
            raise ValueError(f"moba.{what}: {name} must be 16-byte aligned (got 0x{p:x})")


# ---- builders -------------------------------------------------------------------------------------

def forward(q, k, v, o, scratch: dict, B: int, T: int, H: int, N: int, chunk: int, top_k: int) -> list:
    """o = MoBA attention(q, k, v); also writes scratch sel, lse, kmean, cnt, idx, qlist, part, lpart.

    Launches (K1 = top_k-1 > 0 and T > chunk): moba_kmean, moba_select, moba_scan, moba_fill,
    moba_fwd_past, moba_fwd_own. top_k == 1: moba_fwd_own only; T <= chunk: kmean, select (all -1), own."""
    check_shape(B, T, H, N, chunk, top_k)
    B, T, H, N, chunk, top_k = (int(x) for x in (B, T, H, N, chunk, top_k))
    q, k, v, o = ptr(q), ptr(k), ptr(v), ptr(o)
    _check_ptrs("forward", q=q, k=k, v=v, o=o)
    K1 = top_k - 1
    nblk = nblocks(T, chunk)
    E = emax(T, chunk, top_k)
    t = tiles(N)
    defs = defines(N)
    scale = 1.0 / math.sqrt(N)
    lse = _get(scratch, "lse", True)
    ops = []
    sel = 0
    if K1 > 0:
        sel = _get(scratch, "sel", True)
        kmean = _get(scratch, "kmean", True)
        cnt = _get(scratch, "cnt", True)
        ops.append(Launch(MODULE, "moba_kmean", grid=(nblk, H, B), block=(KM_THREADS, 1, 1),
                          args=(("p", k), ("p", kmean), ("p", cnt), ("i", T), ("i", H), ("i", chunk),
                                ("i", nblk)), defines=defs))
        ops.append(Launch(MODULE, "moba_select", grid=(math.ceil(T / SEL_Q), H, B), block=(SEL_Q, 1, 1),
                          smem=_smem_select(N, K1),
                          args=(("p", q), ("p", kmean), ("p", sel), ("p", cnt), ("i", T), ("i", H),
                                ("i", chunk), ("i", K1), ("i", nblk)), defines=defs))
    part = lpart = 0
    if E > 0:
        idx = _get(scratch, "idx", True)
        qlist = _get(scratch, "qlist", True)
        part = _get(scratch, "part", True)
        lpart = _get(scratch, "lpart", True)
        ops.append(Launch(MODULE, "moba_scan", grid=(B * H, 1, 1), block=(32, 1, 1),
                          args=(("p", cnt), ("p", idx), ("i", nblk)), defines=defs))
        ops.append(Launch(MODULE, "moba_fill", grid=(nblk, H, B), block=(FILL_THREADS, 1, 1),
                          args=(("p", sel), ("p", idx), ("p", qlist), ("i", T), ("i", H), ("i", chunk),
                                ("i", K1), ("i", nblk), ("i", E)), defines=defs))
        ops.append(Launch(MODULE, "moba_fwd_past", grid=(math.ceil(E / t["MOBA_FQ"]) + nblk, H, B),
                          block=(NTHR, 1, 1), smem=_smem_fwd(N),
                          args=(("p", q), ("p", k), ("p", v), ("p", idx), ("p", qlist), ("p", part),
                                ("p", lpart), ("i", T), ("i", H), ("i", chunk), ("i", K1), ("i", nblk),
                                ("i", E), ("f", scale)), defines=defs))
    k1_eff = K1 if E > 0 else 0      # no past block anywhere: nothing to merge
    tpc = math.ceil(chunk / t["MOBA_FQ"])
    ops.append(Launch(MODULE, "moba_fwd_own", grid=(nblk * tpc, H, B), block=(NTHR, 1, 1),
                      smem=_smem_fwd(N),
                      args=(("p", q), ("p", k), ("p", v), ("p", sel if k1_eff else 0), ("p", part),
                            ("p", lpart), ("p", o), ("p", lse), ("i", T), ("i", H), ("i", chunk),
                            ("i", k1_eff), ("f", scale)), defines=defs))
    return ops


def backward(q, k, v, o, do, dq, dk, dv, scratch: dict, B: int, T: int, H: int, N: int, chunk: int,
             top_k: int) -> list:
    """dq, dk, dv (written) of MoBA attention with the forward's selection held fixed.

    Needs the scratch of the :func:`forward` that produced ``o`` on the same q, k, v (sel, lse, idx,
    qlist); uses ``delta`` and ``part`` as scratch. Launches: moba_bwd_delta, moba_bwd_dq_past (when some
    query has a past block), moba_bwd_dq_own, moba_bwd_dkdv."""
    check_shape(B, T, H, N, chunk, top_k)
    B, T, H, N, chunk, top_k = (int(x) for x in (B, T, H, N, chunk, top_k))
    q, k, v, o, do, dq, dk, dv = (ptr(x) for x in (q, k, v, o, do, dq, dk, dv))
    _check_ptrs("backward", q=q, k=k, v=v, o=o, do=do, dq=dq, dk=dk, dv=dv)
    K1 = top_k - 1
    nblk = nblocks(T, chunk)
    E = emax(T, chunk, top_k)
    t = tiles(N)
    defs = defines(N)
    scale = 1.0 / math.sqrt(N)
    lse = _get(scratch, "lse", True)
    delta = _get(scratch, "delta", True)
    ops = [Launch(MODULE, "moba_bwd_delta", grid=(math.ceil(B * T * H / 4), 1, 1), block=(128, 1, 1),
                  args=(("p", o), ("p", do), ("p", delta), ("i", B), ("i", T), ("i", H)), defines=defs)]
    sel = idx = qlist = part = 0
    if E > 0:
        sel = _get(scratch, "sel", True)
        idx = _get(scratch, "idx", True)
        qlist = _get(scratch, "qlist", True)
        part = _get(scratch, "part", True)
        ops.append(Launch(MODULE, "moba_bwd_dq_past", grid=(math.ceil(E / t["MOBA_DQ_Q"]) + nblk, H, B),
                          block=(NTHR, 1, 1), smem=_smem_dq(N),
                          args=(("p", q), ("p", k), ("p", v), ("p", do), ("p", lse), ("p", delta),
                                ("p", idx), ("p", qlist), ("p", part), ("i", T), ("i", H), ("i", chunk),
                                ("i", K1), ("i", nblk), ("i", E), ("f", scale)), defines=defs))
    k1_eff = K1 if E > 0 else 0
    tpc = math.ceil(chunk / t["MOBA_DQ_Q"])
    ops.append(Launch(MODULE, "moba_bwd_dq_own", grid=(nblk * tpc, H, B), block=(NTHR, 1, 1),
                      smem=_smem_dq(N),
                      args=(("p", q), ("p", k), ("p", v), ("p", do), ("p", lse), ("p", delta),
                            ("p", sel), ("p", part), ("p", dq), ("i", T), ("i", H), ("i", chunk),
                            ("i", k1_eff), ("f", scale)), defines=defs))
    ops.append(Launch(MODULE, "moba_bwd_dkdv", grid=(math.ceil(chunk / t["MOBA_KV_K"]), nblk, B * H),
                      block=(NTHR, 1, 1), smem=_smem_kv(N),
                      args=(("p", q), ("p", k), ("p", v), ("p", do), ("p", lse), ("p", delta),
                            ("p", idx), ("p", qlist), ("p", dk), ("p", dv), ("i", T), ("i", H),
                            ("i", chunk), ("i", k1_eff), ("i", nblk), ("i", E), ("f", scale)),
                      defines=defs))
    return ops
