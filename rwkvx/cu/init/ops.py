"""Launch builders for rwkvx/cu/init: the counter-based draws (rng.cu) and the Cholesky QR (cholqr.cu) of
the device initialisation (docs/SPEC.md §2.4, rwkvx/device_init.py runs them).

    ops += init.normal(a, m * n, seed, name, dev)          # a [m, n] float64 standard Gaussians
    ops += init.gram(a, m, n, g)                           # g = aᵀa (fp64 cuBLASLt)
    ops += init.cholesky(g, n, info)                       # g's lower triangle = L, L Lᵀ = g
    ops += init.solve(a, m, n, g)                          # a = a L⁻ᵀ (blocked, in place)
    ops += init.deviation(g, n, dev_out, dev)              # dev_out = max |g - I|
    ops += init.store(out, a, m, n, gain, transpose, dev)  # out float32 = gain · a (or aᵀ)

Every value a kernel shares with this module is a constant here; the kernels' twin is
:mod:`rwkvx.oracle.init`.
"""
from __future__ import annotations

import hashlib
import math
from fractions import Fraction

from rwkvx.runtime.gemm import FP64, linear, matmul_dw
from rwkvx.runtime.kernel import DOUBLE, F32_OUT, F64_IN, F64_OUT, I32_OUT, INT, LONG, KernelFile
from rwkvx.runtime.ops import DevPtr, Memset

from .._common import DeviceInfo, grid_stride_blocks

__all__ = ["normal", "uniform", "gram", "cholesky", "solve", "deviation", "store", "seed_key", "tensor_key", "draw_keys", "KEY_ARGS",
           "NB", "SEED_LIMIT"]

# Philox-4x32-10 (Salmon, Moraes, Dror, Shaw, SC'11): multipliers, Weyl increments of the key, rounds
PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
SEED_LIMIT = 1 << 64                 # a seed is the 64-bit Philox key
# Box-Muller's fixed log, sin and cos (float64, exact to a few ulp): ln m = 2s Σ s^2k / (2k+1) on
# [sqrt(1/2), sqrt(2)); sin, cos by their Taylor series on [0, pi/4] (the last terms < 2^-56).
LOG_TERMS, SIN_TERMS, COS_TERMS = 12, 10, 10
LOG_C = tuple(float(Fraction(1, 2 * k + 1)) for k in range(LOG_TERMS))
SIN_C = tuple(float(Fraction((-1) ** k, math.factorial(2 * k + 1))) for k in range(SIN_TERMS))
COS_C = tuple(float(Fraction((-1) ** k, math.factorial(2 * k))) for k in range(COS_TERMS))
LN2, PI_4, SQRT_HALF = math.log(2.0), math.pi / 4, math.sqrt(0.5)
RNG_THREADS = 256

NB = 64                              # the block size of the Cholesky and of the triangular solves
DIAG_THREADS = 256
TRSM_THREADS = 128                   # rows per block of trsm_rows (one thread each)
THREADS = 256                        # gram_deviation and store_f32


def _doubles(values: tuple) -> str:
    """A C initialiser list of float64 values (repr round-trips, so the kernel reads the same doubles)."""
    return ",".join(repr(v) for v in values)


RNG = KernelFile("init/rng", constants={
    "RNG_THREADS": RNG_THREADS, "RNG_ROUNDS": PHILOX_ROUNDS, "RNG_M0": f"{PHILOX_M[0]}u",
    "RNG_M1": f"{PHILOX_M[1]}u", "RNG_W0": f"{PHILOX_W[0]}u", "RNG_W1": f"{PHILOX_W[1]}u",
    "RNG_LOG_C": _doubles(LOG_C), "RNG_SIN_C": _doubles(SIN_C), "RNG_COS_C": _doubles(COS_C),
    "RNG_LN2": repr(LN2), "RNG_PI_4": repr(PI_4), "RNG_SQRT_HALF": repr(SQRT_HALF)})
KEY_ARGS = ("key0", "key1", "id0", "id1")     # the generator arguments of both kernels (draw_keys)
_KEYS = dict.fromkeys(KEY_ARGS, LONG)
INIT_NORMAL = RNG.kernel("init_normal", out=F64_OUT, count=LONG, **_KEYS)
INIT_UNIFORM = RNG.kernel("init_uniform", out=F32_OUT, count=LONG, **_KEYS, lo=DOUBLE, width=DOUBLE)

CHOLQR = KernelFile("init/cholqr", constants={"CQ_NB": NB, "CQ_DIAG_THREADS": DIAG_THREADS,
                                              "CQ_TRSM_THREADS": TRSM_THREADS, "CQ_THREADS": THREADS})
CHOL_DIAG = CHOLQR.kernel("chol_diag", g=F64_OUT, ld=INT, j0=INT, jb=INT, info=I32_OUT)
TRSM_ROWS = CHOLQR.kernel("trsm_rows", b=F64_OUT, ldb=INT, rows=INT, l=F64_IN, ldl=INT, jb=INT)
GRAM_DEVIATION = CHOLQR.kernel("gram_deviation", g=F64_IN, n=INT, out=F64_OUT)
STORE_F32 = CHOLQR.kernel("store_f32", out=F32_OUT, a=F64_IN, m=INT, n=INT, gain=DOUBLE, transpose=INT)


def seed_key(seed: int) -> tuple[int, int]:
    """The Philox key of ``seed``: its low and high 32 bits (ValueError outside [0, 2^64))."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"the device initialisation's seed must be an int in [0, 2^64), got {seed!r}")
    return seed & 0xFFFFFFFF, seed >> 32


def tensor_key(name: str) -> tuple[int, int]:
    """The counter's high words for the tensor called ``name``: the 64-bit BLAKE2b digest of the name."""
    digest = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return digest & 0xFFFFFFFF, digest >> 32


def draw_keys(seed: int, name: str) -> dict[str, int]:
    """The generator arguments of tensor ``name``'s draws under ``seed``: the Philox key (key0, key1) and
    the counter's high words (id0, id1)."""
    (k0, k1), (i0, i1) = seed_key(seed), tensor_key(name)
    return dict(zip(KEY_ARGS, (k0, k1, i0, i1)))


def _check_count(what: str, count: int) -> None:
    if count <= 0:
        raise ValueError(f"init.{what}: count={count} must be positive")


def normal(out: DevPtr, count: int, seed: int, name: str, dev: DeviceInfo) -> list:
    """init_normal: out float64 [count] = the standard Gaussians of tensor ``name`` under ``seed``."""
    _check_count("normal", count)
    blocks = grid_stride_blocks((count + 1) // 2, dev, RNG_THREADS)
    return [INIT_NORMAL.launch(blocks, RNG_THREADS, out=out, count=count, **draw_keys(seed, name))]


def uniform(out: DevPtr, count: int, seed: int, name: str, lo: float, width: float, dev: DeviceInfo) -> list:
    """init_uniform: out float32 [count] = lo + width · u, u uniform in [0, 1) (24 bits)."""
    _check_count("uniform", count)
    blocks = grid_stride_blocks((count + 3) // 4, dev, RNG_THREADS)
    return [INIT_UNIFORM.launch(blocks, RNG_THREADS, out=out, count=count, **draw_keys(seed, name), lo=lo,
                                width=width)]


def _check_tall(what: str, m: int, n: int) -> None:
    if not 0 < n <= m:
        raise ValueError(f"init.{what}: need 0 < n <= m, got m={m}, n={n}")


def gram(a: DevPtr, m: int, n: int, g: DevPtr) -> list:
    """g [n, n] = aᵀa for a [m, n] (row-major, float64)."""
    _check_tall("gram", m, n)
    return [matmul_dw(a, a, g, m, n, n, precision=FP64)]


def _blocks(n: int):
    return ((j0, min(NB, n - j0)) for j0 in range(0, n, NB))


def cholesky(g: DevPtr, n: int, info: DevPtr) -> list:
    """The lower Cholesky factor of the symmetric positive definite g [n, n] in g's lower triangle
    (right-looking, blocks of NB: factor the diagonal block, solve the panel below it, update the
    trailing matrix with one fp64 GEMM). A pivot that is not positive sets ``info`` (int32, zeroed by the
    caller) to its column + 1; later blocks then do nothing and the factor is not valid."""
    _check_tall("cholesky", n, n)
    ops: list = []
    for j0, jb in _blocks(n):
        j1, rest = j0 + jb, n - j0 - jb
        ops.append(CHOL_DIAG.launch(1, DIAG_THREADS, g=g, ld=n, j0=j0, jb=jb, info=info))
        if rest:
            panel = g.offset(j1 * n + j0)
            ops.append(TRSM_ROWS.launch(math.ceil(rest / TRSM_THREADS), TRSM_THREADS, b=panel, ldb=n, rows=rest,
                                        l=g.offset(j0 * n + j0), ldl=n, jb=jb))
            ops.append(linear(panel, panel, g.offset(j1 * n + j1), rest, jb, rest, beta=1.0, alpha=-1.0,
                              ld_x=n, ld_w=n, ld_y=n, precision=FP64))
    return ops


def solve(a: DevPtr, m: int, n: int, l: DevPtr) -> list:
    """a [m, n] = a L⁻ᵀ in place, L the lower triangle of l [n, n]: for each column block J, a[:, J] -=
    a[:, :J] L[J, :J]ᵀ (one fp64 GEMM), then each row of a[:, J] is solved against L[J, J]."""
    _check_tall("solve", m, n)
    ops: list = []
    for j0, jb in _blocks(n):
        if j0:
            ops.append(linear(a, l.offset(j0 * n), a.offset(j0), m, j0, jb, beta=1.0, alpha=-1.0, ld_x=n, ld_w=n,
                              ld_y=n, precision=FP64))
        ops.append(TRSM_ROWS.launch(math.ceil(m / TRSM_THREADS), TRSM_THREADS, b=a.offset(j0), ldb=n, rows=m,
                                    l=l.offset(j0 * n + j0), ldl=n, jb=jb))
    return ops


def deviation(g: DevPtr, n: int, out: DevPtr, dev: DeviceInfo) -> list:
    """out[0] (float64) = max |g - I| over g [n, n]."""
    _check_tall("deviation", n, n)
    return [Memset(out, 8), GRAM_DEVIATION.launch(grid_stride_blocks(n * n, dev, THREADS), THREADS, g=g, n=n,
                                                  out=out)]


def store(out: DevPtr, a: DevPtr, m: int, n: int, gain: float, transpose: bool, dev: DeviceInfo) -> list:
    """out float32 = gain · a ([m, n]) or, with ``transpose``, gain · aᵀ ([n, m])."""
    if m <= 0 or n <= 0:
        raise ValueError(f"init.store: m={m} and n={n} must be positive")
    return [STORE_F32.launch(grid_stride_blocks(m * n, dev, THREADS), THREADS, out=out, a=a, m=m, n=n, gain=gain,
                             transpose=int(bool(transpose)))]
