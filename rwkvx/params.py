"""Parameter names, shapes and the RWKV-LM x070 initialisation (docs/SPEC.md §2.4)."""
from __future__ import annotations

import math
import zlib
from typing import Callable

import numpy as np

from .config import Config

ParamDict = dict[str, np.ndarray]

EMB_INIT_RANGE = 1e-4    # the embedding starts uniform in [-EMB_INIT_RANGE, EMB_INIT_RANGE)
# The orthogonally initialised tensors of a block (docs/SPEC.md §2.4) and their gains; an attention block
# has the last four, with the same gains.
_ORTHOGONAL_GAINS = {"att.w2": 0.1, "att.a2": 0.1, "att.v2": 0.1, "att.g2": 0.1, "att.receptance.weight": 1.0,
                     "att.key.weight": 0.1, "att.value.weight": 1.0, "ffn.key.weight": 1.0}


# The matrices only GEMMs read (as operands of projections, of the time mix's low-rank paths and of the head).
# Every other parameter — the embedding table, the LayerNorm and GroupNorm vectors, the mixes, the decay and
# k/a/v vectors, r_k — is read by element-wise kernels, in float32.
_GEMM_WEIGHT_SUFFIXES = tuple(f".{name}" for name in (
    "att.receptance.weight", "att.key.weight", "att.value.weight", "att.output.weight", "ffn.key.weight",
    "ffn.value.weight", "att.w1", "att.w2", "att.a1", "att.a2", "att.v1", "att.v2", "att.g1", "att.g2"))
HEAD_WEIGHT = "rwkv.head.weight"
EMB_WEIGHT = "rwkv.emb.weight"


def gemm_weights(cfg: Config) -> tuple[str, ...]:
    """The parameters of ``cfg`` that only GEMMs read, in :func:`param_shapes` order (a frozen model keeps
    them only as the GEMMs' operands, ``rwkvx.arena.Layout``)."""
    return tuple(n for n in param_shapes(cfg) if n == HEAD_WEIGHT or n.endswith(_GEMM_WEIGHT_SUFFIXES))


def rwkv_block_shapes(cfg: Config, i: int) -> dict[str, tuple[int, ...]]:
    """Names (under ``rwkv.blocks.{i}.``) and shapes of RWKV block ``i``."""
    C, F, H, N = cfg.n_embd, cfg.ffn_dim, cfg.n_head, cfg.head_size
    vec = (1, 1, C)
    shapes: dict[str, tuple[int, ...]] = {}
    if i == 0 and cfg.ln0:
        shapes["ln0.weight"] = (C,)
        shapes["ln0.bias"] = (C,)
    for ln in ("ln1", "ln2"):
        shapes[f"{ln}.weight"] = (C,)
        shapes[f"{ln}.bias"] = (C,)
    for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "a0"):
        shapes[f"att.{name}"] = vec
    if i > 0:
        shapes["att.v0"] = vec
    shapes["att.k_k"] = vec
    shapes["att.k_a"] = vec
    shapes["att.w1"], shapes["att.w2"] = (C, cfg.dim_w), (cfg.dim_w, C)
    shapes["att.a1"], shapes["att.a2"] = (C, cfg.dim_a), (cfg.dim_a, C)
    if i > 0:
        shapes["att.v1"], shapes["att.v2"] = (C, cfg.dim_v), (cfg.dim_v, C)
    shapes["att.g1"], shapes["att.g2"] = (C, cfg.dim_g), (cfg.dim_g, C)
    shapes["att.r_k"] = (H, N)
    for name in ("receptance", "key", "value", "output"):
        shapes[f"att.{name}.weight"] = (C, C)
    shapes["att.ln_x.weight"] = (C,)
    shapes["att.ln_x.bias"] = (C,)
    shapes["ffn.x_k"] = vec
    shapes["ffn.key.weight"] = (F, C)
    shapes["ffn.value.weight"] = (C, F)
    return shapes


def attn_block_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Names (under ``moba.{j}.``) and shapes of one MoBA attention block."""
    C, F = cfg.n_embd, cfg.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for ln in ("ln1", "ln2"):
        shapes[f"{ln}.weight"] = (C,)
        shapes[f"{ln}.bias"] = (C,)
    for name in ("receptance", "key", "value", "output"):
        shapes[f"att.{name}.weight"] = (C, C)
    shapes["ffn.x_k"] = (1, 1, C)
    shapes["ffn.key.weight"] = (F, C)
    shapes["ffn.value.weight"] = (C, F)
    return shapes


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter name of the model and its shape, in a fixed order."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {EMB_WEIGHT: (V, C)}
    for i in range(cfg.n_rwkv_layer):
        for name, shape in rwkv_block_shapes(cfg, i).items():
            shapes[f"rwkv.blocks.{i}.{name}"] = shape
    for j in range(cfg.n_attn_layer):
        for name, shape in attn_block_shapes(cfg).items():
            shapes[f"moba.{j}.{name}"] = shape
    shapes["rwkv.ln_out.weight"] = (C,)
    shapes["rwkv.ln_out.bias"] = (C,)
    shapes[HEAD_WEIGHT] = (V, C)
    return shapes


def tensor_rng(seed: int, name: str) -> np.random.Generator:
    """The generator of the tensor called ``name`` for ``seed``."""
    # One generator per tensor, keyed by name: the values depend neither on the order of creation nor on
    # the other tensors' sizes (docs/SPEC.md §2.4, "Determinism").
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


# Worst |QᵀQ - I| entry a Cholesky QR may leave before a second pass re-orthogonalises (float64; the
# tensors are stored as float32, whose resolution is 6e-8).
ORTHOGONALITY_TOL = 1e-10


def orthonormal_columns(a: np.ndarray) -> np.ndarray:
    """Q of ``a = QR`` (float64 ``a`` of m x n, m >= n, full column rank) with R's diagonal positive: the
    Q of Householder QR with the signs fixed by R's diagonal, as :func:`orthogonal` needs it.

    Computed as a Cholesky QR (R = chol(aᵀa)ᵀ, Q = a·R⁻¹: BLAS-3 products, about 3x faster than
    Householder QR). Its Gram matrix squares a's condition number, so when QᵀQ is further than
    :data:`ORTHOGONALITY_TOL` from I (an ill-conditioned square Gaussian draw) a second pass
    orthogonalises Q again (R₂ = I up to that error, so Q stays the same matrix up to it); a Gram matrix
    that is not numerically positive definite falls back to Householder QR.
    """
    gram = a.T @ a
    for _ in range(2):
        try:
            lower = np.linalg.cholesky(gram)
        except np.linalg.LinAlgError:
            return householder_columns(a)
        a = a @ np.linalg.inv(lower).T
        gram = a.T @ a
        if np.abs(gram - np.eye(len(gram))).max() <= ORTHOGONALITY_TOL:
            break
    return a


def householder_columns(a: np.ndarray) -> np.ndarray:
    """Q of the Householder QR of ``a`` (m x n, m >= n) with its columns' signs making R's diagonal
    positive: the fallback of a Cholesky QR whose Gram matrix is not numerically positive definite."""
    q, r = np.linalg.qr(a)
    return q * np.sign(np.diag(r))


def orthogonal(rng: np.random.Generator, shape: tuple[int, int], gain: float) -> np.ndarray:
    """A float32 (semi-)orthogonal matrix scaled by ``gain``, as torch.nn.init.orthogonal_ makes it: Q of
    the QR of a standard Gaussian [max(shape), min(shape)] matrix drawn from ``rng``, signs fixed by R's
    diagonal, transposed when ``shape`` is wide."""
    rows, cols = shape
    q = orthonormal_columns(rng.standard_normal((max(rows, cols), min(rows, cols))))
    q *= gain
    return (q.T if rows < cols else q).astype(np.float32)


def _rwkv_block_init(cfg: Config, l: int, prefix: str) -> ParamDict:
    """RWKV block ``l``'s tensors but the orthogonal ones, under ``prefix``."""
    C, H, N, L = cfg.n_embd, cfg.n_head, cfg.head_size, cfg.n_rwkv_layer
    r0 = l / (L - 1) if L > 1 else 0.0
    r1 = 1.0 - l / L
    n = np.arange(C, dtype=np.float64)
    ddd = n / C
    lin = n / (C - 1) - 0.5 if C > 1 else np.zeros(C)
    half = (N - 1) / 2
    z = ((n % N) - half) / half if N > 1 else np.zeros(C)
    zig = z * np.abs(z)
    www = -6 + 6 * (n / (C - 1) if C > 1 else np.zeros(C)) ** (1 + r0 ** 0.3)

    def vec(values: np.ndarray | float) -> np.ndarray:
        return np.broadcast_to(np.asarray(values, np.float64), (C,)).reshape(1, 1, C).astype(np.float32)

    values: dict[str, np.ndarray] = {}
    shapes = rwkv_block_shapes(cfg, l)
    for name, shape in shapes.items():
        if name.startswith(("ln0.", "ln1.", "ln2.")):
            values[name] = np.full(shape, 1.0 if name.endswith("weight") else 0.0, np.float32)
        elif name == "att.x_r" or name == "att.x_g":
            values[name] = vec(1 - ddd ** (0.2 * r1))
        elif name in ("att.x_w", "att.x_a"):
            values[name] = vec(1 - ddd ** (0.9 * r1))
        elif name in ("att.x_k", "att.x_v"):
            values[name] = vec(1 - ddd ** (0.7 * r1))
        elif name == "att.w0":
            values[name] = vec(www + 0.5 + 2.5 * zig)
        elif name == "att.a0":
            values[name] = vec(-0.19 + 0.3 * zig + 0.4 * lin)
        elif name == "att.v0":
            values[name] = vec(0.73 - 0.4 * lin)
        elif name == "att.k_k":
            values[name] = vec(0.71 - 0.1 * lin)
        elif name == "att.k_a":
            values[name] = vec(1.02)
        elif name == "att.r_k":
            values[name] = np.full((H, N), -0.04, np.float32)
        elif name in ("att.w1", "att.a1", "att.v1", "att.g1", "att.output.weight",
                      "ffn.value.weight", "att.ln_x.bias"):
            values[name] = np.zeros(shape, np.float32)
        elif name in _ORTHOGONAL_GAINS:
            continue   # drawn by init_params (orthogonal_tensors)
        elif name == "att.ln_x.weight":
            values[name] = np.full(shape, ((l + 1) / L) ** 0.7, np.float32)
        elif name == "ffn.x_k":
            values[name] = vec(1 - ddd ** (r1 ** 4))
        else:  # pragma: no cover - rwkv_block_shapes and this table must agree
            raise AssertionError(f"no initialiser for {prefix + name}")
    return {prefix + k: v for k, v in values.items()}


def _attn_block_from_rwkv(cfg: Config, j: int, source: ParamDict, src_prefix: str, fresh: bool) -> ParamDict:
    """Attention block ``j`` copied from RWKV block tensors; with ``fresh`` all but its orthogonal tensors
    (those init_params draws with the RWKV block's gains)."""
    dst = f"moba.{j}."
    return {dst + name: np.array(source[src_prefix + name], dtype=np.float32, copy=True)
            for name in attn_block_shapes(cfg) if not (fresh and name in _ORTHOGONAL_GAINS)}


def _preceding_rwkv(cfg: Config) -> list[int]:
    """For each attention block j, the RWKV index of the block just before it in the order."""
    prev: list[int] = []
    last = -1
    for kind, idx in cfg.block_order():
        if kind == "rwkv":
            last = idx
        else:
            prev.append(last)
    return prev


def orthogonal_tensors(cfg: Config) -> dict[str, tuple[tuple[int, int], float]]:
    """Every orthogonally initialised tensor of ``cfg``: name -> (shape, gain)."""
    shapes = param_shapes(cfg)
    out = {name: (shapes[name], gain) for name in shapes
           for suffix, gain in _ORTHOGONAL_GAINS.items() if name.endswith("." + suffix)}
    C, V = cfg.n_embd, cfg.vocab_size
    out[HEAD_WEIGHT] = ((V, C), 0.5 * math.sqrt(V / C) if V > C else 0.5)
    return out


DEVICES = ("cpu", "gpu")           # where init_params draws the random tensors (docs/SPEC.md §2.4)


def init_params(cfg: Config, seed: int = 0, device: str = "cpu",
                progress: Callable[[int, int], None] | None = None) -> ParamDict:
    """Fresh float32 parameters for ``cfg``, RWKV-LM x070 initialisation; same seed and device, same
    values (docs/SPEC.md §2.4, "Determinism").

    ``device="cpu"`` draws each random tensor on the host from its own PCG64 generator; ``"gpu"`` draws
    them on the GPU from a counter-based generator and orthonormalises them there (seconds for a
    7B model; other values than the host's for the same seed, with the same distribution;
    :mod:`rwkvx.device_init`). ``progress(done, total)``, when given, is called after each random tensor of
    the GPU path with the parameters drawn so far and in all."""
    if not isinstance(cfg, Config):
        raise TypeError("init_params expects an rwkvx.Config")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    seed = int(seed)
    if device == "gpu":
        from .device_init import random_params
        return complete_params(cfg, random_params(cfg, seed, progress=progress))
    emb = tensor_rng(seed, EMB_WEIGHT).random((cfg.vocab_size, cfg.n_embd), dtype=np.float32)
    emb *= np.float32(2 * EMB_INIT_RANGE)
    emb -= np.float32(EMB_INIT_RANGE)
    random = {EMB_WEIGHT: emb}
    for name, (shape, gain) in orthogonal_tensors(cfg).items():
        random[name] = orthogonal(tensor_rng(seed, name), shape, gain)
    return complete_params(cfg, random)


def complete_params(cfg: Config, random: ParamDict) -> ParamDict:
    """Every parameter of ``cfg`` in :func:`param_shapes` order: the random tensors (the embedding and
    :func:`orthogonal_tensors`) taken from ``random``, the others computed (docs/SPEC.md §2.4)."""
    params: ParamDict = {EMB_WEIGHT: random[EMB_WEIGHT]}
    for l in range(cfg.n_rwkv_layer):
        params.update(_rwkv_block_init(cfg, l, f"rwkv.blocks.{l}."))
    for j, l in enumerate(_preceding_rwkv(cfg)):
        params.update(_attn_block_from_rwkv(cfg, j, params, f"rwkv.blocks.{l}.", fresh=True))
    params["rwkv.ln_out.weight"] = np.ones(cfg.n_embd, np.float32)
    params["rwkv.ln_out.bias"] = np.zeros(cfg.n_embd, np.float32)
    for name in orthogonal_tensors(cfg):
        params[name] = random[name]
    return {name: params[name] for name in param_shapes(cfg)}


def rwkv7_to_rwkvx(cfg: Config, params: ParamDict) -> ParamDict:
    """Add ``cfg``'s attention blocks to RWKV-7 parameters by copying the preceding RWKV block.

    ``params`` holds the RWKV-only tensors (any ``moba.*`` entries are replaced). The attention
    block takes ln1, ln2, receptance/key/value/output and the channel-mix of the RWKV block just
    before it in the order: the RWKV-X recipe for upgrading a pretrained RWKV-7 model.
    """
    out = {k: np.asarray(v, dtype=np.float32) for k, v in params.items() if not k.startswith("moba.")}
    for j, l in enumerate(_preceding_rwkv(cfg)):
        out.update(_attn_block_from_rwkv(cfg, j, out, f"rwkv.blocks.{l}.", fresh=False))
    check_params(cfg, out)
    return {name: out[name] for name in param_shapes(cfg)}


def check_params(cfg: Config, params: ParamDict) -> None:
    """Raise ``ValueError`` unless ``params`` has exactly ``cfg``'s names, shapes and float dtypes."""
    if not isinstance(params, dict):
        raise TypeError("params must be a dict of name -> numpy array")
    shapes = param_shapes(cfg)
    missing = [n for n in shapes if n not in params]
    if missing:
        raise ValueError(f"missing parameter(s): {', '.join(missing[:5])}"
                         + (" ..." if len(missing) > 5 else ""))
    extra = [n for n in params if n not in shapes]
    if extra:
        raise ValueError(f"unexpected parameter(s): {', '.join(sorted(extra)[:5])}")
    for name, shape in shapes.items():
        value = params[name]
        if not isinstance(value, np.ndarray):
            raise TypeError(f"parameter {name} must be a numpy array, got {type(value).__name__}")
        if value.shape != shape:
            raise ValueError(f"parameter {name} has shape {value.shape}, expected {shape}")
        if value.dtype.kind != "f":
            raise ValueError(f"parameter {name} has dtype {value.dtype}, expected a float type")
