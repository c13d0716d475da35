"""Twin of rwkvx/cu/init: the device initialisation computed on the host with numpy.

The draws (:func:`philox`, :func:`normal`, :func:`uniform`) are the kernels' bit for bit: the same
integer operations, and the same float64 operations in the same order, each rounded on its own (numpy
never fuses a multiply and an add), with the same fixed polynomials for log, sin and cos. The Cholesky
QR (:func:`cholesky`, :func:`solve`, :func:`orthonormal_columns`) follows the kernels' blocked algorithm
in float64; its sums run in another order than cuBLAS's, so its Q matches the device's to float64
rounding (times the draw's condition number), far inside float32 rounding.
"""
from __future__ import annotations

import numpy as np

from rwkvx.cu.init.ops import (COS_C, LN2, LOG_C, NB, PHILOX_M, PHILOX_ROUNDS, PHILOX_W, PI_4, SIN_C, SQRT_HALF,
                              draw_keys)

_MASK = np.uint64(0xFFFFFFFF)
_CHUNK = 1 << 20                    # blocks of words per step: bounds the temporary arrays


def philox(c0, c1, c2, c3, k0: int, k1: int) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 of the counters (c0, c1, c2, c3) (uint32 values in arrays) under key (k0, k1): the
    four output words as uint64 arrays holding 32-bit values."""
    c = [np.asarray(x, np.uint64) & _MASK for x in (c0, c1, c2, c3)]
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for _ in range(PHILOX_ROUNDS):
        p0, p1 = m0 * c[0], m1 * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & _MASK, (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1),
             p0 & _MASK]
        k0, k1 = (k0 + PHILOX_W[0]) & 0xFFFFFFFF, (k1 + PHILOX_W[1]) & 0xFFFFFFFF
    return tuple(c)


def block_words(j: np.ndarray, keys: dict[str, int]) -> tuple[np.ndarray, ...]:
    """The four words of blocks ``j`` (int64 array) under the generator arguments ``keys``
    (rwkvx.cu.init.draw_keys: key0, key1, id0, id1)."""
    j = np.asarray(j, np.uint64)
    ids = [np.full(j.shape, keys[k], np.uint64) for k in ("id0", "id1")]
    return philox(j & _MASK, j >> np.uint64(32), *ids, keys["key0"], keys["key1"])


def _horner(coefs: tuple, z: np.ndarray) -> np.ndarray:
    p = np.full_like(z, coefs[-1])
    for c in coefs[-2::-1]:
        p = p * z + c
    return p


def fixed_log(x: np.ndarray) -> np.ndarray:
    """ln x for x in (0, 1), as rng.cu's fixed_log computes it."""
    m, e = np.frexp(x)
    low = m < SQRT_HALF
    m = np.where(low, 2.0 * m, m)
    e = np.where(low, e - 1, e).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)
    return e * LN2 + (2.0 * s) * _horner(LOG_C, s * s)


def box_muller(w: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The two standard Gaussians (z0, z1) of each block of words ``w``, as rng.cu's box_muller."""
    a = ((w[0] << np.uint64(32)) | w[1]) >> np.uint64(12)
    b = ((w[2] << np.uint64(32)) | w[3]) >> np.uint64(11)
    u1 = (np.uint64(2) * a + np.uint64(1)).astype(np.float64) * 2.0 ** -53
    r = np.sqrt(-2.0 * fixed_log(u1))
    octant = (b >> np.uint64(50)).astype(np.int64)
    f = (b & np.uint64((1 << 50) - 1)).astype(np.float64) * 2.0 ** -50
    t = np.where(octant & 1, 1.0 - f, f)
    phi = t * PI_4
    zz = phi * phi
    sa, ca = phi * _horner(SIN_C, zz), _horner(COS_C, zz)
    swap = ((octant + 1) & 2) != 0
    sn, cs = np.where(swap, ca, sa), np.where(swap, sa, ca)
    sn = np.where(octant & 4, -sn, sn)
    cs = np.where((octant + 2) & 4, -cs, cs)
    return r * cs, r * sn


def normal(count: int, keys: dict[str, int]) -> np.ndarray:
    """init_normal's float64 [count] under ``keys``: block j gives elements 2j (r cos) and 2j + 1 (r sin)."""
    pairs = np.empty(((count + 1) // 2, 2), np.float64)
    for start in range(0, len(pairs), _CHUNK):
        j = np.arange(start, min(start + _CHUNK, len(pairs)), dtype=np.int64)
        pairs[j[0]:j[-1] + 1, 0], pairs[j[0]:j[-1] + 1, 1] = box_muller(block_words(j, keys))
    return pairs.ravel()[:count]


def uniform(count: int, keys: dict[str, int], lo: float, width: float) -> np.ndarray:
    """init_uniform's float32 [count] under ``keys``: element 4j + q = lo + width · (word q of block j >> 8)
    / 2^24."""
    quads = np.empty(((count + 3) // 4, 4), np.float32)
    for start in range(0, len(quads), _CHUNK):
        j = np.arange(start, min(start + _CHUNK, len(quads)), dtype=np.int64)
        u = (np.stack(block_words(j, keys), axis=1) >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
        quads[j[0]:j[-1] + 1] = u * width + lo
    return quads.ravel()[:count]


def solve_rows(b: np.ndarray, l: np.ndarray) -> np.ndarray:
    """b L⁻ᵀ for the lower triangle L of the small square l, by forward substitution (trsm_rows; the part
    of l above its diagonal is not read)."""
    x = np.array(b, np.float64)
    for k in range(len(l)):
        x[:, k] = (x[:, k] - x[:, :k] @ l[k, :k]) / l[k, k]
    return x


def chol_block(d: np.ndarray) -> tuple[np.ndarray, int]:
    """chol_diag on the small block d: (its lower Cholesky factor, -1), or (the part factored so far, the
    column k whose pivot is not positive)."""
    s = np.array(d, np.float64)
    for k in range(len(s)):
        if not s[k, k] > 0.0:
            return np.tril(s), k
        s[k, k] = np.sqrt(s[k, k])
        s[k + 1:, k] /= s[k, k]
        s[k + 1:, k + 1:] -= np.outer(s[k + 1:, k], s[k + 1:, k])
    return np.tril(s), -1


def cholesky(g: np.ndarray) -> np.ndarray | None:
    """The lower L with L Lᵀ = g by init.cholesky's blocks of NB, or None when a pivot is not positive."""
    g = np.array(g, np.float64)
    n = len(g)
    for j0 in range(0, n, NB):
        j1 = min(j0 + NB, n)
        block, failed = chol_block(g[j0:j1, j0:j1])
        if failed >= 0:
            return None
        g[j0:j1, j0:j1] = block
        g[j1:, j0:j1] = solve_rows(g[j1:, j0:j1], block)
        g[j1:, j1:] -= g[j1:, j0:j1] @ g[j1:, j0:j1].T
    return np.tril(g)


def solve(a: np.ndarray, l: np.ndarray) -> np.ndarray:
    """a L⁻ᵀ by init.solve's column blocks of NB."""
    a = np.array(a, np.float64)
    for j0 in range(0, a.shape[1], NB):
        j1 = min(j0 + NB, a.shape[1])
        a[:, j0:j1] -= a[:, :j0] @ l[j0:j1, :j0].T
        a[:, j0:j1] = solve_rows(a[:, j0:j1], l[j0:j1, j0:j1])
    return a


def orthonormal_columns(a: np.ndarray) -> np.ndarray:
    """Q of a = QR (float64 [m, n], m >= n) with R's diagonal positive, as the device computes it: a
    Cholesky QR, a second pass when QᵀQ is further than ORTHOGONALITY_TOL from I, Householder QR of the
    draw (on the host) when a Gram matrix is not numerically positive definite."""
    from rwkvx.params import ORTHOGONALITY_TOL, householder_columns
    q, g = a, a.T @ a
    for second in (False, True):
        lower = cholesky(g)
        if lower is None:
            return householder_columns(a)
        q = solve(q, lower)
        if second:
            break
        g = q.T @ q
        if np.abs(g - np.eye(len(g))).max() <= ORTHOGONALITY_TOL:
            break
    return q


def orthogonal(seed: int, name: str, shape: tuple[int, int], gain: float) -> np.ndarray:
    """The device's float32 orthogonal tensor ``name`` of ``shape``: its [max, min] Gaussian draw
    orthonormalised, times ``gain``, transposed when ``shape`` is wide."""
    rows, cols = shape
    m, n = max(rows, cols), min(rows, cols)
    q = orthonormal_columns(normal(m * n, draw_keys(seed, name)).reshape(m, n))
    q = (q * gain).astype(np.float32)
    return q.T.copy() if rows < cols else q


def random_params(cfg, seed: int) -> dict[str, np.ndarray]:
    """The random tensors of ``cfg`` as ``init_params(cfg, seed, device="gpu")`` makes them."""
    from rwkvx.params import EMB_INIT_RANGE, EMB_WEIGHT, orthogonal_tensors
    V, C = cfg.vocab_size, cfg.n_embd
    emb = uniform(V * C, draw_keys(seed, EMB_WEIGHT), -EMB_INIT_RANGE, 2 * EMB_INIT_RANGE)
    out = {EMB_WEIGHT: emb.reshape(V, C)}
    for name, (shape, gain) in orthogonal_tensors(cfg).items():
        out[name] = orthogonal(seed, name, shape, gain)
    return out
