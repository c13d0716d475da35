"""numpy model of dec_sample's algorithm (rwkvx/cu/decode/sample.cu), for checking it against the sampling
contract on the CPU (tests/test_sample_descent.py): the 64-bit order keys, and the three radix descents a
byte at a time (the top-k cut, the nucleus, the draw), with the kernel's walk over 32 lanes of 8
buckets. Integer sums make the warps' order irrelevant, so one histogram stands for the kernel's per-warp
ones. The weights are the contract's own (:func:`rwkvx.sampling.contract_exp`), as the kernel computes
them with the same rounded steps.
"""
from __future__ import annotations

import math

import numpy as np

from rwkvx.sampling import WEIGHT_BITS, WEIGHT_CUTOFF, contract_exp

LANES, PER_LANE = 32, 8          # warp 0's walk: lane l holds buckets 255 - 8l .. 248 - 8l


def clean(row: np.ndarray) -> np.ndarray:
    """The logits as the kernel reads them: float32, NaN as -inf, -0 as +0."""
    z = np.asarray(row, np.float32).copy()
    z[np.isnan(z)] = -np.inf
    z[z == 0] = 0.0
    return z


def order_keys(z: np.ndarray) -> np.ndarray:
    """uint64 keys of the clean logits z, larger = earlier in the order: the logit's bits made
    order-preserving, then the complement of the id."""
    b = z.view(np.uint32).astype(np.uint64)
    b = np.where(b & 0x80000000, ~b & 0xFFFFFFFF, b | 0x80000000)
    return (b << np.uint64(32)) | (np.uint64(0xFFFFFFFF) - np.arange(len(z), dtype=np.uint64))


def weights(z: np.ndarray, m: float, temperature: float) -> np.ndarray:
    """The kernel's weight of every clean logit (uint64), given the largest m."""
    z = z.astype(np.float64)
    if math.isinf(m):
        return np.where(z == m, 1 << WEIGHT_BITS, 0).astype(np.uint64)
    x = (z - m) / temperature
    q = np.zeros(len(z), np.uint64)
    on = x >= WEIGHT_CUTOFF
    q[on] = np.floor(np.ldexp(contract_exp(x[on]), WEIGHT_BITS)).astype(np.uint64)
    return q


def descend(keys: np.ndarray, mass: np.ndarray, target: int) -> tuple[int, int]:
    """(K, the mass of the keys >= K): the key at which the running mass (``mass`` uint64 per key) from
    the top reaches target."""
    prefix, above, through = 0, 0, 0
    for shift in range(56, -1, -8):
        hi = 0 if shift == 56 else ((1 << 64) - 1) & ~((1 << (shift + 8)) - 1)
        sel = (keys & np.uint64(hi)) == np.uint64(prefix)
        hist = np.zeros(256, np.uint64)
        np.add.at(hist, ((keys[sel] >> np.uint64(shift)) & np.uint64(255)).astype(np.int64), mass[sel])
        hist = [int(h) for h in hist]
        own = [sum(hist[255 - PER_LANE * lane - j] for j in range(PER_LANE)) for lane in range(LANES)]
        run = np.cumsum(own).tolist()
        lane = next(lane for lane in range(LANES) if run[lane] >= target - above)
        acc, b = above + run[lane] - own[lane], 255 - PER_LANE * lane
        while acc + hist[b] < target:
            acc += hist[b]
            b -= 1
        above, through, prefix = acc, acc + hist[b], prefix | (b << shift)
    return prefix, through


def dec_sample(row: np.ndarray, u: float, temperature: float, top_p: float, top_k: int) -> int:
    """The token dec_sample writes for one row of logits, its draw u and the options."""
    z = clean(row)
    keys = order_keys(z)
    best = int(keys.max())
    token = 0xFFFFFFFF - (best & 0xFFFFFFFF)
    if temperature == 0 or top_k == 1:
        return token
    q = weights(z, float(z[token]), temperature)
    cut = descend(keys, np.ones(len(z), np.uint64), top_k)[0] if 1 < top_k < len(z) else 0
    S = int(q[keys >= np.uint64(cut)].sum())
    N = descend(keys, q, max(1, math.ceil(top_p * float(S))))[1]
    t = min(math.floor(u * float(N)), N - 1)
    return 0xFFFFFFFF - (descend(keys, q, t + 1)[0] & 0xFFFFFFFF)
