"""Checkpoints in the safetensors format, written atomically, read with strict validation; RWKV-LM
``.pth`` state dicts read and exported.

The file is plain safetensors (8-byte little-endian header length, JSON header, raw little-endian
tensor data), so saved models open in any safetensors reader. rwkvx adds metadata: the format
version and the Config as JSON. Extra state (optimizer moments, step, data sampler) travels as
tensors under the ``extra.`` prefix plus a JSON ``extra_meta`` entry.

:func:`load_checkpoint` also reads plain RWKV-7 (RWKV-LM x070) state dicts, as safetensors or as
PyTorch ``.pth`` files (:mod:`rwkvx.pth`, no PyTorch needed), inferring their Config from the shapes;
:func:`export_rwkv7_pth` writes a model's RWKV-7 part as a ``.pth`` that RWKV-LM's code loads.
"""
from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .atomic_io import atomic_write
from .config import Config
from .params import ParamDict, check_params, param_shapes, rwkv_block_shapes
from .pth import WRITE_DTYPES, is_zip, read_pth, write_pth
from .runtime.dtypes import bf16_bits_to_f32

FORMAT_VERSION = 1
_EXTRA_PREFIX = "extra."
_MAX_HEADER = 100 * 1024 * 1024

_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
           "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"),
           "I8": np.dtype("i1"), "U8": np.dtype("u1"), "U16": np.dtype("<u2"),
           "U32": np.dtype("<u4"), "U64": np.dtype("<u8"), "BOOL": np.dtype("?")}
_CODES = {v: k for k, v in _DTYPES.items()}
_FLOAT_CODES = ("F64", "F32", "F16", "BF16")


def _encode(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[bytes, list[np.ndarray]]:
    """(the 8-byte length and JSON header, the C-contiguous little-endian arrays to write after it)."""
    header: dict[str, Any] = {"__metadata__": metadata}
    arrays, offset = [], 0
    for name, value in tensors.items():
        arr = np.ascontiguousarray(value)
        code = _CODES.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if code is None:
            raise TypeError(f"tensor {name}: dtype {arr.dtype} cannot be stored in safetensors")
        arr = arr.astype(_DTYPES[code], copy=False)
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, arrays


def save_checkpoint(path: str | os.PathLike, cfg: Config, params: ParamDict,
                    extra: dict[str, Any] | None = None) -> None:
    """Write ``params`` (and optional ``extra``) to ``path`` as safetensors, atomically.

    ``extra`` may hold ``"tensors"`` (name -> numpy array, e.g. optimizer moments) and ``"meta"``
    (a JSON-serialisable dict, e.g. the step count); both come back from :func:`load_checkpoint`.
    """
    check_params(cfg, params)
    _write_with_extra(path, "rwkvx", cfg, {n: np.asarray(params[n], np.float32) for n in param_shapes(cfg)},
                      extra)


def _write_with_extra(path: str | os.PathLike, fmt: str, cfg: Config, tensors: dict[str, np.ndarray],
                      extra: Mapping[str, Any] | None, **metadata: str) -> None:
    """Write ``tensors`` plus ``extra`` (``"tensors"`` stored under ``extra.``, ``"meta"`` as JSON) with
    the metadata every rwkvx file has (``format``, ``format_version``, ``config``, ``extra_meta``) and
    ``metadata``, atomically."""
    extra = dict(extra or {})
    unknown = set(extra) - {"tensors", "meta"}
    if unknown:
        raise ValueError(f"extra accepts keys 'tensors' and 'meta', got {sorted(unknown)}")
    tensors = dict(tensors)
    for name, value in (extra.get("tensors") or {}).items():
        if not isinstance(value, np.ndarray):
            raise TypeError(f"extra tensor {name} must be a numpy array")
        tensors[_EXTRA_PREFIX + name] = value
    write_safetensors(path, tensors, {"format": fmt, "format_version": str(FORMAT_VERSION),
                                      "config": json.dumps(cfg.to_dict()),
                                      "extra_meta": json.dumps(extra.get("meta") or {}), **metadata})


def check_tensors(shapes: Mapping[str, tuple[int, ...]], tensors: Any, where: str, what: str
                  ) -> dict[str, np.ndarray]:
    """Copies of ``tensors`` (their dtype kept) in the order of ``shapes``; ``TypeError`` /
    ``ValueError`` naming ``where`` unless they are exactly the names and shapes of ``shapes``, finite
    float arrays. ``what`` says what the model expects (``"states (one per RWKV block, 2)"``)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{where} must be a dict of name -> numpy array, got {type(tensors).__name__}")
    missing = [n for n in shapes if n not in tensors]
    unexpected = sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        problems = ([f"missing {', '.join(missing[:3])}"] if missing else []) + (
            [f"unexpected {', '.join(unexpected[:3])}"] if unexpected else [])
        raise ValueError(f"{where}: not this model's {what}: " + "; ".join(problems))
    out = {}
    for name, shape in shapes.items():
        value = tensors[name]
        if not isinstance(value, np.ndarray) or value.dtype.kind != "f":
            raise TypeError(f"{where}: {name} must be a float numpy array")
        if value.shape != tuple(shape):
            raise ValueError(f"{where}: {name} has shape {value.shape}, but this model's {what} need "
                             f"{tuple(shape)} there")
        if not np.isfinite(value).all():
            raise ValueError(f"{where}: {name} is not finite")
        out[name] = value.copy()
    return out


def save_adapter(path: str | os.PathLike, fmt: str, cfg: Config, tensors: dict[str, np.ndarray],
                 extra: Mapping[str, Any] | None = None, info: Mapping[str, Any] | None = None) -> None:
    """Write an *adapter file* atomically: what a tuning run trains beside a frozen model (the tuned
    ``tensors``, stored as float32), the model's Config, the metadata ``format = fmt`` and, given
    ``info`` (JSON-able), ``adapter``: the adapter's own settings. ``extra`` as for
    :func:`save_checkpoint` (a trainer's optimizer moments and metadata)."""
    tensors = {n: np.asarray(t, np.float32) for n, t in tensors.items()}
    _write_with_extra(path, fmt, cfg, tensors, extra,
                      **({} if info is None else {"adapter": json.dumps(dict(info))}))


def file_format(path: str | os.PathLike) -> str | None:
    """The ``format`` an rwkvx safetensors file records (``"rwkvx"`` for a model, an adapter's format),
    read from the header alone; None for anything else, unreadable included (the reader of the
    intended format then reports the problem)."""
    try:
        return safetensors_metadata(path).get("format")
    except (OSError, ValueError):
        return None


def load_adapter(path: str | os.PathLike, fmt: str, what: str
                 ) -> tuple[Config, dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """``(Config, tensors, extra, info)`` of an adapter file of format ``fmt`` (see
    :func:`save_adapter`; ``extra`` as :func:`load_checkpoint` returns it, ``info`` the adapter's
    settings, ``{}`` when none). ``what`` names such a file in the ``ValueError`` for another file
    or corrupt metadata."""
    tensors, _, metadata = read_safetensors(path)
    if metadata.get("format") != fmt:
        raise ValueError(f"{path}: not a {what}")
    try:
        cfg = Config.from_dict(json.loads(metadata["config"]))
        meta = json.loads(metadata.get("extra_meta", "{}"))
        info = json.loads(metadata.get("adapter", "{}"))
    except (KeyError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: corrupt {what} metadata ({exc})") from None
    extra = {"tensors": {k[len(_EXTRA_PREFIX):]: v for k, v in tensors.items() if k.startswith(_EXTRA_PREFIX)},
             "meta": meta}
    return cfg, {k: v for k, v in tensors.items() if not k.startswith(_EXTRA_PREFIX)}, extra, info


def write_safetensors(path: str | os.PathLike, tensors: dict[str, np.ndarray],
                      metadata: dict[str, str]) -> None:
    """Write ``tensors`` (name -> numpy array) and string ``metadata`` as a safetensors file, atomically."""
    header, arrays = _encode(tensors, metadata)

    def write(f: Any) -> None:
        f.write(header)
        for arr in arrays:
            f.write(arr.tobytes())

    atomic_write(path, write)


def _read_header(f: Any, path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(the tensor entries, the metadata) of the safetensors file open as ``f``, read up to its data;
    ``ValueError`` on corruption."""
    size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise ValueError(f"{path}: truncated checkpoint (no header)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise ValueError(f"{path}: corrupt checkpoint (header length {n} exceeds file size {size})")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: corrupt checkpoint header ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt checkpoint header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise ValueError(f"{path}: corrupt checkpoint metadata")
    return header, metadata


def safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The metadata of a safetensors file, its header alone read; ``ValueError`` on corruption."""
    with open(path, "rb") as f:
        return _read_header(f, Path(path))[1]


def read_safetensors(path: str | os.PathLike
                     ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """``(tensors, dtype codes as stored, metadata)`` of a safetensors file; ``ValueError`` on corruption.

    bf16 tensors are widened to float32; every other dtype is returned as stored."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header, metadata = _read_header(f, path)
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint not found: {path}") from None
    tensors: dict[str, np.ndarray] = {}
    codes: dict[str, str] = {}
    for name, info in header.items():
        try:
            code, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt header entry for tensor {name}") from None
        if code not in _DTYPES and code != "BF16":
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {code}")
        itemsize = 2 if code == "BF16" else _DTYPES[code].itemsize
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= begin <= end <= len(data)) or end - begin != count * itemsize:
            raise ValueError(f"{path}: tensor {name} data is truncated or corrupt "
                             f"(offsets {begin}..{end}, {len(data)} data bytes, shape {list(shape)})")
        raw = np.frombuffer(data, dtype="<u2" if code == "BF16" else _DTYPES[code],
                            count=count, offset=begin)
        tensors[name] = (bf16_bits_to_f32(raw) if code == "BF16" else raw.copy()).reshape(shape)
        codes[name] = code
    return tensors, codes, metadata


# RWKV-LM's training code gives block 0 a value residual it never uses; rwkvx has none.
_BLOCK0_UNUSED = ("att.v0", "att.v1", "att.v2")
_RWKV_LM_ONLY = tuple(f"blocks.0.{name}" for name in _BLOCK0_UNUSED)


def _from_rwkv7_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """Map plain RWKV-7 state-dict names (no ``rwkv.`` prefix) to rwkvx names."""
    out = {}
    for name, value in tensors.items():
        if name in _RWKV_LM_ONLY:
            continue
        out[name if name.startswith(("rwkv.", "moba.", _EXTRA_PREFIX)) else "rwkv." + name] = value
    return out


def _to_rwkv7_names(cfg: Config, params: ParamDict) -> dict[str, np.ndarray]:
    """The RWKV-7 tensors of ``params`` under RWKV-LM's state-dict names, block 0's unused value
    residual included (as zeros) so that RWKV-LM's model loads the dict strictly."""
    out = {name[len("rwkv."):]: params[name] for name in param_shapes(cfg) if name.startswith("rwkv.")}
    for name, shape in rwkv_block_shapes(cfg, 1).items():
        if name in _BLOCK0_UNUSED:
            out[f"blocks.0.{name}"] = np.zeros(shape, np.float32)
    return out


def _dims(params: ParamDict, name: str, ndim: int) -> tuple[int, ...]:
    if name not in params:
        raise ValueError(f"cannot infer the model config: the checkpoint has no tensor {name}")
    shape = params[name].shape
    if len(shape) != ndim:
        raise ValueError(f"cannot infer the model config: tensor {name} has shape {shape}, "
                         f"expected a {ndim}-D tensor")
    return shape


def infer_config(params: ParamDict) -> Config:
    """The Config of an RWKV-7 parameter set (no attention blocks), read from tensor shapes: V and C
    from the embedding, H and N from ``r_k``, L from the block names, the FFN width and the LoRA
    ranks from block 0 (block 1 for ``dim_v``). ``ValueError`` when they do not fit together; the
    caller checks every other tensor against the Config's shapes."""
    V, C = _dims(params, "rwkv.emb.weight", 2)
    H, N = _dims(params, "rwkv.blocks.0.att.r_k", 2)
    if H * N != C:
        raise ValueError(f"inconsistent checkpoint: rwkv.blocks.0.att.r_k has shape {(H, N)} (H*N = "
                         f"{H * N}) but rwkv.emb.weight has width C = {C}")
    L = 1 + max(int(m.group(1)) for k in params if (m := re.match(r"rwkv\.blocks\.(\d+)\.", k)))
    fields = dict(vocab_size=V, n_embd=C, n_rwkv_layer=L, head_size=N,
                  ffn_dim=_dims(params, "rwkv.blocks.0.ffn.key.weight", 2)[0],
                  dim_w=_dims(params, "rwkv.blocks.0.att.w1", 2)[1],
                  dim_a=_dims(params, "rwkv.blocks.0.att.a1", 2)[1],
                  dim_v=_dims(params, "rwkv.blocks.1.att.v1", 2)[1] if L > 1 else None,
                  dim_g=_dims(params, "rwkv.blocks.0.att.g1", 2)[1],
                  ln0="rwkv.blocks.0.ln0.weight" in params)
    try:
        return Config(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot infer the model config from the checkpoint: {exc}") from None


def read_tensors(path: str | os.PathLike
                 ) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, str]]:
    """``(tensors, dtype codes, metadata)`` of a safetensors file or (by its zip signature or a
    ``.pth``/``.pt`` suffix) a PyTorch file, which has no metadata; ``ValueError`` on corruption."""
    if is_zip(path) or Path(path).suffix in (".pth", ".pt"):
        return (*read_pth(path), {})
    return read_safetensors(path)


def load_checkpoint(path: str | os.PathLike, cfg: Config | None = None
                    ) -> tuple[Config, ParamDict, dict[str, Any]]:
    """Read a checkpoint: ``(cfg, params, extra)``; every problem raises ``ValueError`` (a parameter
    holding NaN or Inf among them, named).

    Files written by :func:`save_checkpoint` carry their Config. Plain RWKV-7 state dicts
    (names without the ``rwkv.`` prefix, any float dtype incl. bf16), as safetensors or as PyTorch
    ``.pth`` files such as BlinkDL's releases, load too; their Config is inferred from the shapes
    (:func:`infer_config`) unless ``cfg`` is given.
    """
    tensors, codes, metadata = read_tensors(path)
    if "config" in metadata:
        try:
            saved = Config.from_dict(json.loads(metadata["config"]))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"{path}: corrupt config metadata ({exc})") from None
        if cfg is not None and cfg != saved:
            raise ValueError(f"{path}: checkpoint config {saved} differs from the requested {cfg}")
        cfg = saved
    renamed = _from_rwkv7_names(tensors)
    stored_codes = _from_rwkv7_names(codes)
    params = {k: v for k, v in renamed.items() if not k.startswith(_EXTRA_PREFIX)}
    for name in params:
        if stored_codes[name] not in _FLOAT_CODES:
            raise ValueError(f"{path}: tensor {name} has dtype {stored_codes[name]}, expected a float type")
    if cfg is None:
        cfg = infer_config(params)
    expected = param_shapes(cfg)
    for name, shape in expected.items():
        if name not in params:
            raise ValueError(f"{path}: checkpoint is missing tensor {name}")
        if params[name].shape != shape:
            raise ValueError(f"{path}: tensor {name} has shape {params[name].shape}, expected {shape}")
    unexpected = sorted(set(params) - set(expected))
    if unexpected:
        raise ValueError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:5])}")
    with np.errstate(over="ignore"):       # a float64 beyond float32's range becomes Inf, refused below
        params = {n: params[n].astype(np.float32, copy=False) for n in expected}
    for name, value in params.items():
        bad = ~np.isfinite(value)
        if bad.any():
            where = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), value.shape))
            raise ValueError(f"{path}: tensor {name} holds {int(bad.sum())} non-finite value(s) "
                             f"(NaN or Inf), the first {value[where]} at index {list(where)}")
    try:
        meta = json.loads(metadata.get("extra_meta", "{}"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: corrupt extra metadata ({exc})") from None
    extra = {"tensors": {k[len(_EXTRA_PREFIX):]: v for k, v in renamed.items()
                         if k.startswith(_EXTRA_PREFIX)},
             "meta": meta}
    return cfg, params, extra


def export_rwkv7_pth(path: str | os.PathLike, cfg: Config, params: ParamDict, dtype: str = "bf16",
                     drop_attention: bool = False) -> None:
    """Write the model as an RWKV-LM x070 state dict in PyTorch's ``.pth`` format, atomically.

    Names and shapes are RWKV-LM's (docs/SPEC.md §2.4 without the ``rwkv.`` prefix, plus block 0's unused
    ``att.v0/v1/v2`` as zeros), so RWKV-LM's code loads the file with ``torch.load`` and a strict
    ``load_state_dict``. ``dtype``: ``"bf16"`` (as BlinkDL's releases) or ``"fp32"``. RWKV-LM has no
    MoBA blocks: a model with attention blocks is refused unless ``drop_attention`` is true, which
    writes the RWKV-7 blocks alone (a different model, since the attention blocks' output is missing).
    """
    check_params(cfg, params)
    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WRITE_DTYPES)}, got {dtype!r}")
    if cfg.n_attn_layer and not drop_attention:
        raise ValueError(f"this model has {cfg.n_attn_layer} MoBA attention block(s), which RWKV-LM's "
                         "x070 model does not have; export the RWKV-7 blocks alone with "
                         "drop_attention (CLI: --drop-attention)")
    if not cfg.ln0:
        raise ValueError("this model has no ln0 (Config.ln0 is False), which RWKV-LM's x070 model "
                         "always has in block 0; it cannot be exported as an RWKV-LM state dict")
    write_pth(path, _to_rwkv7_names(cfg, params), dtype)
