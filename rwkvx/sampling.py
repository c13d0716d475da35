"""The sampling contract: which token one row of logits and one uniform draw u in [0, 1) choose.

Both samplers follow it to the bit: :func:`sample_token` (numpy, the CPU path and the reference) and
``dec_sample`` (rwkvx/cu/decode/sample.cu, inside the GPU decoder's step graph). Every quantity that
decides the token is either an exactly rounded float64 operation (no fused multiply-add) or an integer,
so the two choose the same token from the same logits and the same u.

1. **Logits.** z_i = the row's logits as float32 values (the decoder's activation type, widened),
   taken to float64; NaN counts as -inf. Tokens are *ordered* by z descending, ties by the lower id
   first. m = z of the first token.
2. **Greedy.** With ``temperature == 0`` or ``top_k == 1`` the first token in the order is chosen (the
   argmax, ties to the lower id); u is not used.
3. **Weights.** x_i = (z_i - m) / temperature (float64; temperature is given as float64). A token with
   x_i < :data:`WEIGHT_CUTOFF` (-inf included) weighs q_i = 0; otherwise q_i = floor(e(x_i) * 2**32)
   as an integer, where e is :func:`contract_exp` (exp to ~1e-15 relative, with one fixed sequence of
   rounded operations). The first token weighs exactly 2**32. When m is infinite (+inf logits, or no
   finite logit at all), the tokens with z_i == m weigh 2**32 and the others 0.
4. **Top-k.** With ``top_k`` = k > 0, only the first k tokens of the order are kept (all when k >= V;
   0 = no limit). S = the sum of the kept weights (an integer < 2**53: V <= :data:`MAX_VOCAB`).
5. **Top-p (nucleus).** target = max(1, ceil(top_p * S)) (the product in float64). The nucleus is the
   shortest prefix of the kept tokens, in the order, whose weights sum to >= target (``top_p = 1``: all
   kept tokens). N = its sum.
6. **Draw.** t = floor(u * N) (float64 product; N - 1 if that reaches N). The chosen token is the first
   of the order whose running sum of weights (from the first token) exceeds t. So token i of the
   nucleus is chosen for u in an interval of length q_i / N: probability q_i / N.

The probabilities are those of softmax(z / temperature) restricted to the top-k and then to the
nucleus, up to the weights' resolution (2**-32 of the largest; tokens below e**-23 of it are never
drawn).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

WEIGHT_BITS = 32                 # q_i = floor(e(x_i) * 2**WEIGHT_BITS)
WEIGHT_CUTOFF = -23.0            # x below: weight 0 (e**-23 * 2**32 < 1, the weight it would get anyway)
MAX_VOCAB = 1 << 21              # the sums of weights stay below 2**53 (exact in float64)
# e(x) = 2**n * p(r), n = floor(x / ln 2 + 1/2), r = (x - n * LN2_HI) - n * LN2_LO, |r| <= ~0.35, p the
# degree-12 Taylor polynomial (Horner, each step a rounded multiply then a rounded add)
INV_LN2 = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01      # ln 2's high bits: n * LN2_HI is exact for |n| < 2**11
LN2_LO = 1.90821492927058770002e-10      # ln 2 - LN2_HI
EXP_COEFFS = tuple(1.0 / math.factorial(k) for k in range(13))


def contract_exp(x: np.ndarray) -> np.ndarray:
    """e(x) of the contract for float64 x in [WEIGHT_CUTOFF, 0] (see the module docstring)."""
    x = np.asarray(x, np.float64)
    n = np.floor(x * INV_LN2 + 0.5)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = np.full_like(r, EXP_COEFFS[-1])
    for c in EXP_COEFFS[-2::-1]:
        p = p * r + c
    return np.ldexp(p, n.astype(np.int64))


def check_vocab(vocab_size: int) -> None:
    """ValueError for a vocabulary the contract cannot weigh exactly (> :data:`MAX_VOCAB`)."""
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"sampling supports vocabularies of up to {MAX_VOCAB} tokens, got {vocab_size}")


def _first_in_order(idx: np.ndarray, z: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` of the tokens ``idx`` in the contract's order (z descending, then id): only the
    candidates at or above the n-th largest z are sorted, so a short prefix costs about a partition."""
    if n < len(idx):
        zi = z[idx]
        idx = idx[zi >= np.partition(zi, len(idx) - n)[len(idx) - n]]
    return idx[np.lexsort((idx, -z[idx]))][:n]


def sample_token(logits: np.ndarray, u: float, temperature: float, top_k: int = 0, top_p: float = 1.0) -> int:
    """The token the contract (module docstring) chooses from ``logits`` [V] (float32 values) and u."""
    z = np.asarray(logits, np.float32).astype(np.float64)
    z[np.isnan(z)] = -np.inf
    if temperature == 0 or top_k == 1:
        return int(np.argmax(z))                    # the first maximum: ties to the lower id
    m = z.max()
    q = np.zeros(len(z), np.uint64)
    if np.isinf(m):
        weighed = np.flatnonzero(z == m)
        q[weighed] = 1 << WEIGHT_BITS
    else:
        x = (z - m) / float(temperature)
        # x is monotone in z: the weighed tokens lead the order, the rest weigh 0 and are never reached
        weighed = np.flatnonzero(x >= WEIGHT_CUTOFF)
        q[weighed] = np.floor(np.ldexp(contract_exp(x[weighed]), WEIGHT_BITS)).astype(np.uint64)
    kept = len(weighed) if top_k == 0 else min(top_k, len(weighed))
    S = int(q[weighed].sum() if kept == len(weighed) else q[_first_in_order(weighed, z, kept)].sum())
    target = max(1, math.ceil(float(top_p) * float(S)))
    n = 1024
    while True:                                     # a prefix long enough to hold the target
        order = _first_in_order(weighed, z, min(n, kept))
        cum = np.cumsum(q[order], dtype=np.uint64)
        if int(cum[-1]) >= target:
            break
        n *= 8
    N = int(cum[int(np.searchsorted(cum, target))])
    t = min(math.floor(float(u) * float(N)), N - 1)
    return int(order[int(np.searchsorted(cum, t + 1))])


def sample_rows(logits: np.ndarray, u: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """:func:`sample_token` of every row of ``logits`` [B, V] with its own u [B]: int64 [B]."""
    return np.array([sample_token(row, ui, temperature, top_k, top_p) for row, ui in zip(logits, u)], np.int64)


@dataclass(frozen=True)
class Sampling:
    """The options of the contract: ``temperature`` (0: greedy), ``top_k`` (0: no limit), ``top_p``."""
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def rows(self, logits: np.ndarray, u: np.ndarray) -> np.ndarray:
        """:func:`sample_rows` with these options."""
        return sample_rows(logits, u, self.temperature, self.top_k, self.top_p)
