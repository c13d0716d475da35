"""Parameter names, shapes and the RWKV-LM x070 initialisation (docs/SPEC.md §2.4)."""
from __future__ import annotations

import math
import zlib

import numpy as np

from .config import Config

ParamDict = dict[str, np.ndarray]

_EXP_HALF_NEG = math.exp(-0.5)  # the decay scale exp(-0.5) of docs/SPEC.md §2.3


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
    shapes: dict[str, tuple[int, ...]] = {"rwkv.emb.weight": (V, C)}
    for i in range(cfg.n_rwkv_layer):
        for name, shape in rwkv_block_shapes(cfg, i).items():
            shapes[f"rwkv.blocks.{i}.{name}"] = shape
    for j in range(cfg.n_attn_layer):
        for name, shape in attn_block_shapes(cfg).items():
            shapes[f"moba.{j}.{name}"] = shape
    shapes["rwkv.ln_out.weight"] = (C,)
    shapes["rwkv.ln_out.bias"] = (C,)
    shapes["rwkv.head.weight"] = (V, C)
    return shapes


def _rng(seed: int, name: str) -> np.random.Generator:
    # One generator per tensor, keyed by name: the values do not depend on iteration order.
    return np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))


def orthogonal(rng: np.random.Generator, shape: tuple[int, int], gain: float) -> np.ndarray:
    """A (semi-)orthogonal matrix scaled by ``gain``, as torch.nn.init.orthogonal_ makes it."""
    rows, cols = shape
    a = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))
    if rows < cols:
        q = q.T
    return (gain * q).astype(np.float32)


def _rwkv_block_init(cfg: Config, l: int, seed: int, prefix: str) -> ParamDict:
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
        full = prefix + name
        rng = _rng(seed, full)
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
        elif name in ("att.w2", "att.a2", "att.v2", "att.g2"):
            values[name] = orthogonal(rng, shape, 0.1)
        elif name in ("att.receptance.weight", "att.value.weight", "ffn.key.weight"):
            values[name] = orthogonal(rng, shape, 1.0)
        elif name == "att.key.weight":
            values[name] = orthogonal(rng, shape, 0.1)
        elif name == "att.ln_x.weight":
            values[name] = np.full(shape, ((l + 1) / L) ** 0.7, np.float32)
        elif name == "ffn.x_k":
            values[name] = vec(1 - ddd ** (r1 ** 4))
        else:  # pragma: no cover - rwkv_block_shapes and this table must agree
            raise AssertionError(f"no initialiser for {full}")
    return {prefix + k: v for k, v in values.items()}


def _attn_block_from_rwkv(cfg: Config, j: int, source: ParamDict, src_prefix: str,
                          seed: int | None) -> ParamDict:
    """Attention block ``j`` from RWKV block tensors: copied (seed None) or fresh with the same gains."""
    dst = f"moba.{j}."
    out: ParamDict = {}
    gains = {"att.receptance.weight": 1.0, "att.key.weight": 0.1, "att.value.weight": 1.0,
             "ffn.key.weight": 1.0}
    for name, shape in attn_block_shapes(cfg).items():
        src = source[src_prefix + name]
        if seed is not None and name in gains:
            out[dst + name] = orthogonal(_rng(seed, dst + name), shape, gains[name])
        else:
            out[dst + name] = np.array(src, dtype=np.float32, copy=True)
    return out


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


def init_params(cfg: Config, seed: int = 0) -> ParamDict:
    """Fresh float32 parameters for ``cfg``, RWKV-LM x070 initialisation; same seed, same values."""
    if not isinstance(cfg, Config):
        raise TypeError("init_params expects an rwkvx.Config")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    seed = int(seed)
    rng = _rng(seed, "rwkv.emb.weight")
    params: ParamDict = {
        "rwkv.emb.weight": rng.uniform(-1e-4, 1e-4, (cfg.vocab_size, cfg.n_embd)).astype(np.float32)}
    for l in range(cfg.n_rwkv_layer):
        params.update(_rwkv_block_init(cfg, l, seed, f"rwkv.blocks.{l}."))
    for j, l in enumerate(_preceding_rwkv(cfg)):
        params.update(_attn_block_from_rwkv(cfg, j, params, f"rwkv.blocks.{l}.", seed))
    C, V = cfg.n_embd, cfg.vocab_size
    params["rwkv.ln_out.weight"] = np.ones(C, np.float32)
    params["rwkv.ln_out.bias"] = np.zeros(C, np.float32)
    gain = 0.5 * math.sqrt(V / C) if V > C else 0.5
    params["rwkv.head.weight"] = orthogonal(_rng(seed, "rwkv.head.weight"), (V, C), gain)
    return {name: params[name] for name in param_shapes(cfg)}


def rwkv7_to_rwkvx(cfg: Config, params: ParamDict) -> ParamDict:
    """Add ``cfg``'s attention blocks to RWKV-7 parameters by copying the preceding RWKV block.

    ``params`` holds the RWKV-only tensors (any ``moba.*`` entries are replaced). The attention
    block takes ln1, ln2, receptance/key/value/output and the channel-mix of the RWKV block just
    before it in the order: the RWKV-X recipe for upgrading a pretrained RWKV-7 model.
    """
    out = {k: np.asarray(v, dtype=np.float32) for k, v in params.items() if not k.startswith("moba.")}
    for j, l in enumerate(_preceding_rwkv(cfg)):
        out.update(_attn_block_from_rwkv(cfg, j, out, f"rwkv.blocks.{l}.", None))
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
