"""PyTorch ``.pth`` files (the zip format of ``torch.save``), read and written without PyTorch.

A ``torch.save`` file is a zip archive of uncompressed entries under one top-level folder:
``data.pkl`` (a protocol-2 pickle of the saved object), ``data/<key>`` (the raw little-endian bytes of
each tensor storage), ``byteorder`` and ``version``. In the pickle each tensor is a call
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`` whose
storage is a persistent id ``("storage", torch.<Type>Storage, key, location, numel)``.

Reading runs the pickle through an unpickler that knows only those globals, each implemented here
with numpy, plus plain containers. Any other global (a function, a class, code) is refused with a
``ValueError`` naming it: loading a checkpoint never runs code from the file. Writing emits the
same format for a flat dict of tensors, with the pickle written opcode by opcode, so that
``torch.load(path, weights_only=True)`` reads it.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .atomic_io import atomic_write
from .runtime.dtypes import bf16_bits_to_f32, f32_to_bf16_bits

# torch storage type -> (dtype code as in safetensors, numpy dtype of the stored bytes)
_STORAGES = {
    "FloatStorage": ("F32", "<f4"), "HalfStorage": ("F16", "<f2"), "BFloat16Storage": ("BF16", "<u2"),
    "DoubleStorage": ("F64", "<f8"), "LongStorage": ("I64", "<i8"), "IntStorage": ("I32", "<i4"),
    "ShortStorage": ("I16", "<i2"), "CharStorage": ("I8", "i1"), "ByteStorage": ("U8", "u1"),
    "BoolStorage": ("BOOL", "?"),
}
# the storage type written for each export dtype
WRITE_DTYPES = {"bf16": "BFloat16Storage", "fp32": "FloatStorage"}
_ARCHIVE = "archive"
_ALIGN = 64                      # torch aligns every entry's data to 64 bytes (its .storage_alignment)
_ZIP64_FROM = 1 << 30            # entries from this size on get a zip64 header (zipfile needs it at 2 GiB)
_KEY = re.compile(r"^[0-9A-Za-z_.-]+$")


class _Refused(ValueError):
    """A reason to refuse the file, raised from inside the unpickler and reported as is."""


class _Frozen:
    """Base of the objects the unpickler hands to the pickle: BUILD cannot change them."""

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle tries to set attribute {name!r} of {type(self).__name__}")


class _StorageType(_Frozen):
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)


class _Storage(_Frozen):
    __slots__ = ("key", "code", "array")

    def __init__(self, key: str, code: str, array: np.ndarray) -> None:
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "array", array)


class _Tensor(_Frozen):
    __slots__ = ("code", "array")

    def __init__(self, code: str, array: np.ndarray) -> None:
        object.__setattr__(self, "code", code)
        object.__setattr__(self, "array", array)


class _Function(_Frozen):
    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                    hooks: Any = None, metadata: Any = None) -> _Tensor:
    """``torch._utils._rebuild_tensor_v2``: the (possibly strided) view of ``storage``, copied."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor's storage is not a storage record")
    if not (_is_count(offset) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(map(_is_count, size + stride))
            and isinstance(requires_grad, bool)):
        raise pickle.UnpicklingError(f"malformed tensor view (offset {offset!r}, size {size!r}, "
                                     f"stride {stride!r})")
    if hooks:
        raise pickle.UnpicklingError("tensor backward hooks are not supported")
    if metadata:
        raise pickle.UnpicklingError(f"tensor metadata {metadata!r} is not supported")
    data = storage.array
    if 0 in size:
        return _Tensor(storage.code, np.empty(size, data.dtype))
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= data.size:
        raise pickle.UnpicklingError(
            f"tensor view (offset {offset}, size {list(size)}, stride {list(stride)}) reaches element "
            f"{last} of storage {storage.key}, which has {data.size}")
    view = np.lib.stride_tricks.as_strided(data[offset:], shape=size,
                                           strides=tuple(s * data.itemsize for s in stride))
    return _Tensor(storage.code, np.array(view))


def _rebuild_parameter(data: Any, requires_grad: Any, hooks: Any) -> _Tensor:
    """``torch._utils._rebuild_parameter``: an ``nn.Parameter`` is its tensor."""
    if not isinstance(data, _Tensor) or not isinstance(requires_grad, bool) or hooks:
        raise pickle.UnpicklingError("malformed parameter record")
    return data


class _Unpickler(pickle.Unpickler):
    """The unpickler of ``data.pkl``: tensors, storages, OrderedDict and built-in containers only."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        self._archive, self._prefix = archive, prefix
        self._storages: dict[str, _Storage] = {}
        self._globals = {
            ("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): _Function(_rebuild_tensor),
            ("torch._utils", "_rebuild_parameter"): _Function(_rebuild_parameter),
            **{("torch", name): _StorageType(name) for name in _STORAGES},
        }

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name.endswith("Storage"):
            raise _Refused(f"tensor storage type torch.{name} is not supported (supported: "
                           f"{', '.join(n[:-len('Storage')] for n in _STORAGES)})")
        raise _Refused(f"the pickle references {module}.{name}, which is not a tensor or a plain "
                       "container; refusing to load it (a checkpoint must not run code)")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and _KEY.match(pid[2])
                and isinstance(pid[3], str) and _is_count(pid[4])):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r}")
        _, kind, key, _location, numel = pid
        code, dtype = _STORAGES[kind.name]
        cached = self._storages.get(key)
        if cached is not None:
            if cached.code != code:
                raise pickle.UnpicklingError(f"storage {key} is used as two different types")
            return cached
        name = f"{self._prefix}data/{key}"
        try:
            size = self._archive.getinfo(name).file_size
        except KeyError:
            raise _Refused(f"storage entry {name} is missing (truncated or corrupt file)") from None
        expected = numel * np.dtype(dtype).itemsize
        if size != expected:  # checked before reading: a bad entry is refused without inflating it
            raise _Refused(f"storage {name} holds {size} bytes, expected {expected} "
                           f"({numel} x {kind.name}): truncated or corrupt file")
        storage = _Storage(key, code, np.frombuffer(self._archive.read(name), dtype=dtype))
        self._storages[key] = storage
        return storage


def is_zip(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts like a zip archive (the ``torch.save`` format)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def _archive_prefix(archive: zipfile.ZipFile) -> str:
    pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise _Refused(f"not a PyTorch checkpoint (expected one <folder>/data.pkl entry, "
                       f"found {len(pickles)})")
    return pickles[0][: -len("data.pkl")]


def read_pth(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``(tensors, dtype codes as stored)`` of a ``torch.save`` file holding a dict of tensors.

    bf16 tensors are widened to float32 (exactly); every other dtype is returned as stored, and views
    (offsets, strides) come back as contiguous arrays. Codes are safetensors' ("BF16", "F32", ...).
    Every problem — not a zip, truncated, a global other than tensors and OrderedDict, an entry that
    is not a tensor, an unsupported storage type — raises ``ValueError``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not is_zip(path):
        raise ValueError(f"{path}: not a zip archive, so not a PyTorch checkpoint of the current format "
                         "(the legacy pre-1.6 torch.save format is not supported: re-save it with "
                         "a recent PyTorch)")
    try:
        with zipfile.ZipFile(path) as archive:
            prefix = _archive_prefix(archive)
            names = set(archive.namelist())
            if f"{prefix}byteorder" in names:
                order = archive.read(f"{prefix}byteorder").decode("ascii", "replace").strip()
                if order != "little":
                    raise _Refused(f"byte order {order!r} is not supported (only little-endian)")
            obj = _Unpickler(archive.read(f"{prefix}data.pkl"), archive, prefix).load()
    except _Refused as exc:
        raise ValueError(f"{path}: {exc}") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, pickle.UnpicklingError,
            TypeError, AttributeError, IndexError, KeyError, ValueError, OverflowError,
            struct.error) as exc:
        raise ValueError(f"{path}: truncated or corrupt PyTorch checkpoint "
                         f"({type(exc).__name__}: {exc})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: the checkpoint holds a {type(obj).__name__}, expected a dict of "
                         "tensors (a state dict)")
    tensors: dict[str, np.ndarray] = {}
    codes: dict[str, str] = {}
    for name in list(obj):
        value = obj.pop(name)             # frees each stored-dtype copy once it is converted
        if not isinstance(name, str):
            raise ValueError(f"{path}: state-dict key {name!r} is not a string")
        if not isinstance(value, _Tensor):
            raise ValueError(f"{path}: entry {name!r} is of type {type(value).__name__}, not a tensor")
        array = value.array
        tensors[name] = bf16_bits_to_f32(array).reshape(array.shape) if value.code == "BF16" else array
        codes[name] = value.code
    return tensors, codes


# ---------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------

def _p_str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return b"X" + struct.pack("<I", len(raw)) + raw                      # BINUNICODE


def _p_int(value: int) -> bytes:
    if 0 <= value < 1 << 8:
        return b"K" + struct.pack("<B", value)                            # BININT1
    if 0 <= value < 1 << 16:
        return b"M" + struct.pack("<H", value)                            # BININT2
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)                            # BININT
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + struct.pack("<B", len(raw)) + raw                    # LONG1


def _p_tuple(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(map(_p_int, values)) + b"t" if values else b")"   # MARK ... TUPLE


def _p_global(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode("ascii")                         # GLOBAL


def _state_dict_pickle(entries: list[tuple[str, str, str, tuple[int, ...]]]) -> bytes:
    """A protocol-2 pickle of ``{name: tensor}`` in torch's form, for ``(name, storage type, key,
    shape)`` entries of contiguous tensors."""
    out = [b"\x80\x02}("]                                                 # PROTO 2, EMPTY_DICT, MARK
    for name, storage_type, key, shape in entries:
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        out += [_p_str(name), _p_global("torch._utils", "_rebuild_tensor_v2"), b"(",
                b"(", _p_str("storage"), _p_global("torch", storage_type), _p_str(key), _p_str("cpu"),
                _p_int(math.prod(shape)), b"tQ",                          # TUPLE, BINPERSID
                _p_int(0), _p_tuple(shape), _p_tuple(strides), b"\x89",   # offset, size, stride, False
                _p_global("collections", "OrderedDict"), b")R",           # empty backward hooks
                b"tR"]                                                    # TUPLE, REDUCE
    out.append(b"u.")                                                     # SETITEMS, STOP
    return b"".join(out)


def _add_entry(zf: zipfile.ZipFile, f: Any, name: str, data: bytes | memoryview) -> None:
    """Append one stored (uncompressed) entry whose data starts on a 64-byte boundary, as torch does."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    big = len(data) >= _ZIP64_FROM
    header = 30 + len(name.encode()) + 4 + (20 if big else 0)            # local header, padding field, zip64
    pad = -(f.tell() + header) % _ALIGN
    info.extra = struct.pack("<2sH", b"FB", pad) + b"Z" * pad
    with zf.open(info, "w", force_zip64=big) as w:
        w.write(data)


def write_pth(path: str | os.PathLike, tensors: Mapping[str, np.ndarray], dtype: str = "bf16") -> None:
    """Write ``tensors`` (name -> float array) as a ``torch.save``-format file, atomically.

    ``dtype`` is the storage type of every tensor: ``"bf16"`` (rounded to nearest even, as BlinkDL's
    released models are stored) or ``"fp32"``. ``torch.load(path, weights_only=True)`` returns a dict
    of contiguous CPU tensors with these names and shapes.
    """

    if dtype not in WRITE_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(WRITE_DTYPES)}, got {dtype!r}")
    for name, value in tensors.items():
        if not isinstance(name, str) or not isinstance(value, np.ndarray) or value.dtype.kind != "f":
            raise TypeError(f"tensor {name!r}: expected a float numpy array, got "
                            f"{getattr(value, 'dtype', type(value).__name__)}")
    storage_type = WRITE_DTYPES[dtype]
    entries = [(name, storage_type, str(i), tuple(int(n) for n in value.shape))
               for i, (name, value) in enumerate(tensors.items())]

    def storage_bytes(value: np.ndarray) -> memoryview:
        data = f32_to_bf16_bits(value) if dtype == "bf16" else np.ascontiguousarray(value, "<f4")
        return memoryview(data.reshape(-1).view(np.uint8))

    def write(f: Any) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            _add_entry(zf, f, f"{_ARCHIVE}/data.pkl", _state_dict_pickle(entries))
            _add_entry(zf, f, f"{_ARCHIVE}/.format_version", b"1")
            _add_entry(zf, f, f"{_ARCHIVE}/.storage_alignment", str(_ALIGN).encode())
            _add_entry(zf, f, f"{_ARCHIVE}/byteorder", b"little")
            for (_, _, key, _), value in zip(entries, tensors.values()):
                _add_entry(zf, f, f"{_ARCHIVE}/data/{key}", storage_bytes(value))
            _add_entry(zf, f, f"{_ARCHIVE}/version", b"3\n")

    atomic_write(path, write)
