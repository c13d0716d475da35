"""Twin of rwkvx/cu/decode/decode.cu: the single-token step kernels of generation.

Each is the forward twin of its family run on one token that continues a carried state (a sequence of
length 1 after the state's tokens), so no formula is written twice; ``decode_sample`` is the sampling
contract's own implementation (rwkvx.sampling). Shapes: one row per sequence,
x [B, C] or [B, H, N]; caches [B, T, H, N].
"""
from __future__ import annotations

import numpy as np

from rwkvx.runtime.dtypes import round_to
from rwkvx.sampling import sample_rows

from ._common import float64_op, matmul, shift_mix_forward
from .channelmix import relu_sq_forward
from .moba import moba_attention_cached, moba_block_means
from .timemix import sigmoid_forward, tanh_forward, time_mix_gn_forward, time_mix_prep_forward
from .wkv7 import wkv7_forward

# dec_gemv's epilogues: the forward's activation twins
GEMV_EPILOGUES = {"none": lambda a: a, "tanh": tanh_forward, "sigmoid": sigmoid_forward, "relu_sq": relu_sq_forward}


@float64_op
def decode_shift(x: np.ndarray, prev: np.ndarray, mixes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(outs [n, B, C], new prev [B, C]): outs[j] = x + (prev - x) * mixes[j] for x, prev [B, C] and
    mixes [n, C]; the new prev is x."""
    return shift_mix_forward(x, mixes, 1, prev), x.copy()


def decode_wkv7(r: np.ndarray, w: np.ndarray, k: np.ndarray, v: np.ndarray, a: np.ndarray, b: np.ndarray,
                state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(y [B, H, N], new state [B, H, N, N]): one token of WKV7 (inputs [B, H, N]) from ``state``."""
    y, new = wkv7_forward(*(t[:, None] for t in (r, w, k, v, a, b)), state=state, return_state=True)
    return y[:, 0], new


def decode_time_mix(hidden: dict, second: dict, r: np.ndarray, k: np.ndarray, v: np.ndarray,
                    v_first: np.ndarray, w0: np.ndarray, a0: np.ndarray, v0: np.ndarray | None,
                    k_k: np.ndarray, k_a: np.ndarray, state: np.ndarray, ln_w: np.ndarray, ln_b: np.ndarray,
                    r_k: np.ndarray, N: int, xtype: str | None = None) -> tuple[np.ndarray, ...]:
    """(z [B, C], new state [B, H, N, N], v_first [B, C]): an RWKV block's time mix of one token from its
    LoRA hidden rows ``hidden[p]`` [B, d_p] and second layers ``second[p]`` [d_p, C] (p in w, a, g and,
    after the first layer, v): the LoRA products, the prep, one WKV7 token on ``state`` and the
    GroupNorm with bonus and gate. v_first is read after the first layer, else it becomes v.

    ``xtype`` None: float64 throughout. An element type ("f32", "bf16"): the values dec_tmix keeps in
    that type are rounded to it where the kernel rounds them (the LoRA products, kp, wa, wb, the mixed
    vp, the WKV output y and z), so a comparison with the kernel sees only its own arithmetic."""
    def rnd(a: np.ndarray) -> np.ndarray:
        return a if xtype is None else round_to(xtype, a)

    lora = {p: rnd(matmul(hidden[p], second[p])) for p in hidden}
    layer = int("v" in hidden)
    prep = time_mix_prep_forward(k, v, lora["w"], lora["a"], lora.get("v"), v_first if layer else None, w0, a0,
                                 v0, k_k, k_a, N, layer)
    kp, vp = rnd(prep["kp"]), rnd(prep["vp"])
    B, C = r.shape
    rows = (r, prep["decay"], kp, vp, rnd(prep["wa"]), rnd(prep["wb"]))
    y, new = decode_wkv7(*(np.reshape(t, (B, C // N, N)) for t in rows), state)
    z = time_mix_gn_forward(rnd(y.reshape(B, C)), r, kp, vp, lora["g"], ln_w, ln_b, r_k, N)
    return rnd(z), new, prep["v_first"]


def decode_moba(q: np.ndarray, k: np.ndarray, v: np.ndarray, kc: np.ndarray, vc: np.ndarray, kmean: np.ndarray,
                pos: int, chunk: int, top_k: int) -> tuple[np.ndarray, ...]:
    """MoBA step of the token at position ``pos``: q, k, v [B, H, N] its query, key and value; kc, vc
    [B, >= pos, H, N] the cached keys and values (positions < pos are read); kmean [B, H, >= pos // chunk,
    N] the means of the complete blocks before pos.

    Returns (o [B, H, N], sel int32 [B, H, top_k-1], kc and vc [B, pos+1, H, N] with the new key and
    value, kmean float64 [B, H, (pos+1) // chunk, N] with the block that pos completes, if any)."""
    kc = np.concatenate([kc[:, :pos], k[:, None]], axis=1)
    vc = np.concatenate([vc[:, :pos], v[:, None]], axis=1)
    full = (pos + 1) // chunk
    kmean = np.asarray(kmean, np.float64)[:, :, :pos // chunk]
    if full > pos // chunk:
        kmean = np.concatenate([kmean, moba_block_means(kc[:, -chunk:], chunk)], axis=2)
    o, sel = moba_attention_cached(q[:, None], kc, vc, kmean, chunk, top_k)
    return o[:, 0], sel[:, :, 0], kc, vc, kmean


@float64_op
def decode_gemv(x: np.ndarray, w: np.ndarray, kn: bool, epilogue: str = "none") -> np.ndarray:
    """[B, n]: epilogue(x [B, k] @ W) with W = w as stored [k, n] (``kn``) or w [n, k] transposed (a
    Linear's weight); ``epilogue`` one of "none", "tanh", "sigmoid", "relu_sq" (a residual job adds
    the "none" result to its output)."""
    return GEMV_EPILOGUES[epilogue](matmul(x, w if kn else w.T))


def decode_sample(logits: np.ndarray, u: np.ndarray, opts: np.ndarray) -> np.ndarray:
    """int32 [B]: the token rwkvx.sampling's contract chooses from each row of ``logits`` [B, V] with its
    draw ``u`` [B] and ``opts`` = (temperature, top_p, top_k), as dec_sample takes them."""
    temperature, top_p, top_k = (float(o) for o in opts)
    return sample_rows(logits, u, temperature, int(top_k), top_p).astype(np.int32)
