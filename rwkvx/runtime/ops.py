"""The op records a :class:`rwkvx._core.Plan` executes: plain, validated, immutable data.

Building them needs no GPU, so step plans are constructed and checked on CPU CI. Pointers may be given
as ints or as any object with an integer ``ptr`` attribute (a DeviceBuffer / PinnedBuffer); they are
stored as ints. Kernel launches are normally built through their declarations
(:mod:`rwkvx.runtime.kernel`), which take :class:`DevPtr` (an address with its element type); GEMMs
check the element types of typed pointers against their :class:`GemmPrecision`.
Validation errors: wrong *type or kind* -> TypeError, wrong *value* -> ValueError.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields

from .dtypes import COMPUTE_TYPES, CUDA_TYPES, ELEM_BYTES, check_elem

ARG_KINDS = ("p", "i", "l", "f", "d")   # device pointer u64, int32, int64, float32, float64

_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
_U64_MAX = (1 << 64) - 1


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


class DevPtr(int):
    """A device address into a buffer of element type ``elem`` ("f32", "bf16", "f64", "i32").

    Arithmetic gives plain ints (untyped): move within the buffer with :meth:`offset`."""

    def __new__(cls, addr: int, elem: str):
        obj = super().__new__(cls, addr)
        obj.elem = check_elem(elem, "DevPtr.elem")
        return obj

    def offset(self, n: int) -> "DevPtr":
        """The address ``n`` elements further on, same element type."""
        return DevPtr(int(self) + int(n) * ELEM_BYTES[self.elem], self.elem)

    def __repr__(self) -> str:
        return f"DevPtr(0x{int(self):x}, {self.elem!r})"


def as_ptr(v, what: str = "pointer") -> int:
    """A device/host address as int: ints, DevPtrs, objects with an int ``ptr``; ``None`` is NULL (0)."""
    if v is None:
        return 0
    if not _is_int(v) and hasattr(v, "ptr"):
        v = v.ptr
    if not _is_int(v):
        raise TypeError(f"{what}: expected a pointer (int or buffer with .ptr), got {type(v).__name__}")
    v = int(v)
    if not 0 <= v <= _U64_MAX:
        raise ValueError(f"{what}: pointer {v} out of range")
    return v


def _as_count(v, what: str, minimum: int = 0) -> int:
    if not _is_int(v):
        raise TypeError(f"{what}: expected an int, got {type(v).__name__}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"{what}: must be >= {minimum}, got {v}")
    return v


def _as_dim3(v, what: str) -> tuple[int, int, int]:
    if _is_int(v):
        v = (v,)
    if not isinstance(v, (tuple, list)) or not 1 <= len(v) <= 3:
        raise TypeError(f"{what}: expected an int or a tuple of 1-3 ints, got {v!r}")
    out = [_as_count(x, what, 1) for x in v]
    for x in out:
        if x > 0x7FFFFFFF:
            raise ValueError(f"{what}: dimension {x} too large")
    return tuple(out + [1] * (3 - len(out)))  # type: ignore[return-value]


def normalize_defines(defines) -> tuple[tuple[str, str], ...]:
    """Defines as a sorted tuple of (name, str(value)); accepts a dict or (name, value) pairs."""
    if defines is None:
        return ()
    items = defines.items() if isinstance(defines, dict) else defines
    out = []
    for item in items:
        if isinstance(item, str):
            name, value = item, "1"
        else:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise TypeError(f"defines: expected (name, value) pairs, got {item!r}")
            name, value = item
        if not isinstance(name, str) or not name.isidentifier():
            raise TypeError(f"defines: bad macro name {name!r}")
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (str, numbers.Integral, float)):
            raise TypeError(f"defines: value of {name} must be str/int/float, got {type(value).__name__}")
        out.append((name, str(value)))
    return tuple(sorted(out))


def _normalize_args(args) -> tuple[tuple[str, int | float], ...]:
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args: expected a tuple of (kind, value) pairs, got {type(args).__name__}")
    out = []
    for i, a in enumerate(args):
        if not isinstance(a, (tuple, list)) or len(a) != 2:
            raise TypeError(f"args[{i}]: expected a (kind, value) pair, got {a!r}")
        kind, value = a
        if kind not in ARG_KINDS:
            raise TypeError(f"args[{i}]: unknown kind {kind!r} (use one of {', '.join(ARG_KINDS)})")
        if kind == "p":
            value = as_ptr(value, f"args[{i}]")
        elif kind in ("i", "l"):
            if not _is_int(value):
                raise TypeError(f"args[{i}]: kind {kind!r} needs an int, got {type(value).__name__}")
            value = int(value)
            lo, hi = _I32 if kind == "i" else _I64
            if not lo <= value <= hi:
                raise ValueError(f"args[{i}]: {value} does not fit kind {kind!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"args[{i}]: kind {kind!r} needs a float, got {type(value).__name__}")
            value = float(value)
        out.append((kind, value))
    return tuple(out)


@dataclass(frozen=True)
class Launch:
    """One kernel launch: ``name`` in rwkvx/cu/<module>.cu compiled with ``defines``."""
    module: str
    name: str
    grid: tuple = (1, 1, 1)
    block: tuple = (1, 1, 1)
    smem: int = 0
    args: tuple = ()
    defines: tuple = ()

    def __post_init__(self):
        if not isinstance(self.module, str) or not self.module:
            raise TypeError(f"Launch.module: expected a non-empty str, got {self.module!r}")
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"Launch.name: expected a non-empty str, got {self.name!r}")
        set_ = object.__setattr__
        set_(self, "grid", _as_dim3(self.grid, f"Launch {self.name}: grid"))
        set_(self, "block", _as_dim3(self.block, f"Launch {self.name}: block"))
        set_(self, "smem", _as_count(self.smem, f"Launch {self.name}: smem"))
        try:
            set_(self, "args", _normalize_args(self.args))
        except (TypeError, ValueError) as e:
            raise type(e)(f"Launch {self.name}: {e}") from None
        set_(self, "defines", normalize_defines(self.defines))


GEMM_ELEMS = ("f32", "bf16", "f64")        # operand / output element types of a GEMM


@dataclass(frozen=True)
class GemmPrecision:
    """Operand (``a``, ``b``), output (``c``) element types and compute type of one GEMM.

    ``compute`` "fp32": strict fp32 accumulation (CUBLAS_COMPUTE_32F; with bf16 operands, bf16
    products accumulated in fp32); "tf32": fp32 operands through TF32 tensor cores (FAST_TF32); "fp64":
    float64 operands, output and scalars (CUBLAS_COMPUTE_64F), and only those."""
    a: str = "f32"
    b: str = "f32"
    c: str = "f32"
    compute: str = "fp32"

    def __post_init__(self):
        for f in ("a", "b", "c"):
            if getattr(self, f) not in GEMM_ELEMS:
                raise ValueError(f"GemmPrecision.{f}: expected one of {GEMM_ELEMS}, got {getattr(self, f)!r}")
        if self.compute not in COMPUTE_TYPES:
            raise ValueError(f"GemmPrecision.compute: expected one of {sorted(COMPUTE_TYPES)}, "
                             f"got {self.compute!r}")
        if self.compute == "tf32" and (self.a, self.b) != ("f32", "f32"):
            raise ValueError("GemmPrecision: tf32 compute needs f32 operands")
        f64 = (self.a, self.b, self.c) == ("f64", "f64", "f64")
        if ("f64" in (self.a, self.b, self.c) or self.compute == "fp64") and not (f64 and self.compute == "fp64"):
            raise ValueError("GemmPrecision: f64 operands and output go with fp64 compute, and only they")

    def codes(self) -> tuple[int, int, int, int]:
        """(A type, B type, C type, compute type) as cuBLAS / CUDA enum values."""
        return CUDA_TYPES[self.a], CUDA_TYPES[self.b], CUDA_TYPES[self.c], COMPUTE_TYPES[self.compute]


def _as_trans(v, what: str) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.upper() in ("N", "T"):
        return v.upper() == "T"
    if _is_int(v) and int(v) in (0, 1):
        return bool(v)
    raise TypeError(f"{what}: expected 'N'/'T' or a bool, got {v!r}")


@dataclass(frozen=True)
class Gemm:
    """D = alpha * op(A) @ op(B) + beta * C in column-major cuBLAS conventions (run by cublasLtMatmul).

    op(A) is m x k, op(B) is k x n, C and D are m x n with the leading dimension ``ldc`` and C's element
    type; trans* = True/'T' means the stored matrix is transposed. ``D`` defaults to C (the product
    accumulated in place); another buffer leaves C as it is, e.g. a residual stream that is added to
    and kept. ``precision``: the element types of A, B, C and the compute type; typed pointers
    (:class:`DevPtr`) must match them.
    """
    transa: bool
    transb: bool
    m: int
    n: int
    k: int
    alpha: float
    A: int
    lda: int
    B: int
    ldb: int
    beta: float
    C: int
    ldc: int
    precision: GemmPrecision = field(default=GemmPrecision())
    D: int | None = None

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "transa", _as_trans(self.transa, "Gemm.transa"))
        set_(self, "transb", _as_trans(self.transb, "Gemm.transb"))
        for f in ("m", "n", "k", "lda", "ldb", "ldc"):
            set_(self, f, _as_count(getattr(self, f), f"Gemm.{f}", 1))
            if getattr(self, f) > 0x7FFFFFFF:
                raise ValueError(f"Gemm.{f}: {getattr(self, f)} does not fit int32")
        for f in ("alpha", "beta"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise TypeError(f"Gemm.{f}: expected a float, got {type(v).__name__}")
            set_(self, f, float(v))
        if not isinstance(self.precision, GemmPrecision):
            raise TypeError(f"Gemm.precision: expected a GemmPrecision, got {type(self.precision).__name__}")
        if self.D is None:
            set_(self, "D", self.C)
        for f in ("A", "B", "C", "D"):
            v = getattr(self, f)
            want = getattr(self.precision, "c" if f == "D" else f.lower())
            if isinstance(v, DevPtr) and v.elem != want:
                raise TypeError(f"Gemm.{f}: a {v.elem} buffer where the precision says {want}")
            set_(self, f, as_ptr(v, f"Gemm.{f}"))
        a_rows = self.k if self.transa else self.m
        b_rows = self.n if self.transb else self.k
        for ld, rows, f in ((self.lda, a_rows, "lda"), (self.ldb, b_rows, "ldb"), (self.ldc, self.m, "ldc")):
            if ld < max(1, rows):
                raise ValueError(f"Gemm.{f}={ld} < max(1, {rows}) (m={self.m}, n={self.n}, k={self.k}, "
                                 f"transa={self.transa}, transb={self.transb})")


class _MemoryOp:
    """Validation shared by the memory ops: every field an address (:func:`as_ptr`) but ``nbytes``, a
    byte count >= 0."""

    def __post_init__(self):
        for f in fields(self):
            value, what = getattr(self, f.name), f"{type(self).__name__}.{f.name}"
            object.__setattr__(self, f.name, _as_count(value, what) if f.name == "nbytes" else as_ptr(value, what))


@dataclass(frozen=True)
class Memset(_MemoryOp):
    """Zero ``nbytes`` at device ``ptr`` asynchronously on the stream."""
    ptr: int
    nbytes: int


@dataclass(frozen=True)
class Copy(_MemoryOp):
    """Asynchronous device-to-device copy of ``nbytes``."""
    dst: int
    src: int
    nbytes: int


@dataclass(frozen=True)
class CopyHtoD(_MemoryOp):
    """Asynchronous host-to-device copy from pinned host memory (read when the op executes)."""
    dst: int
    host_ptr: int
    nbytes: int


@dataclass(frozen=True)
class CopyDtoH(_MemoryOp):
    """Asynchronous device-to-host copy into pinned host memory."""
    host_ptr: int
    src: int
    nbytes: int


OP_TYPES = (Launch, Gemm, Memset, Copy, CopyHtoD, CopyDtoH)


def flatten_ops(ops) -> list:
    """Flatten nested lists/tuples of ops (builders return lists) and check every item is an op."""
    out: list = []

    def walk(x, path):
        if isinstance(x, OP_TYPES):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            for i, y in enumerate(x):
                walk(y, f"{path}[{i}]")
        else:
            raise TypeError(f"ops{path}: expected an op ({', '.join(t.__name__ for t in OP_TYPES)}), "
                            f"got {type(x).__name__}")

    walk(ops, "")
    return out
