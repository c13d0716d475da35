"""Declared kernel interfaces: each rwkvx/cu/<family>/<file>.cu is described once, in Python, by a :class:`KernelFile`.

A ``KernelFile`` holds the compile-time constants the file shares with its launchers (they reach the
kernel as NVRTC defines and are written nowhere else), the values of its per-launch variants (e.g.
``HEAD_SIZE``) and, for every ``extern "C" __global__`` kernel, the parameters in prototype order with
their types. Launch builders bind arguments by name through :meth:`Kernel.launch`: a missing, extra or
mistyped argument is an error when the op list is built. tests/test_kernel_declarations.py parses every
prototype in rwkvx/cu/<family>/*.cu and checks it against these declarations.

Parameter types (``Arg``): pointers to the activation element type ``floatX`` (``X_IN`` = ``const
floatX*``, ``X_OUT`` = ``floatX*``), to bf16 in every precision (``BF16_IN``/``BF16_OUT``), to fp32 (``F32_IN``/``F32_OUT``), fp64, int32, and the scalars
``INT`` (int), ``LONG`` (long long), ``FLOAT``, ``DOUBLE``. ``.opt()`` marks a pointer that may be NULL
(``None``). A pointer argument must be a :class:`~rwkvx.runtime.ops.DevPtr` of the declared element
type (``floatX`` resolves to the launch's ``xtype``).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Callable

from .dtypes import XTYPES
from .ops import DevPtr, Launch, normalize_defines

_SCALAR_KINDS = {"int": "i", "long": "l", "float": "f", "double": "d"}
# C spellings of each declared type, for messages and the prototype check
_C_ELEM = {"x": "floatX", "bf16": "__nv_bfloat16", "f32": "float", "f64": "double", "i32": "int"}
_C_SCALAR = {"int": "int", "long": "long long", "float": "float", "double": "double"}


@dataclass(frozen=True)
class Arg:
    """The declared type of one kernel parameter."""
    kind: str                 # "ptr" or a scalar kind: "int", "long", "float", "double"
    elem: str = ""            # pointers: "x" (floatX), "bf16" (always bf16), "f32", "f64", "i32"
    const: bool = True        # pointers: const (read-only) or not
    optional: bool = False    # pointers: NULL allowed

    def opt(self) -> "Arg":
        """The same pointer type, NULL allowed."""
        if self.kind != "ptr":
            raise TypeError("only pointer parameters can be optional")
        return replace(self, optional=True)

    def c_type(self) -> str:
        """The C spelling: ``const floatX*``, ``int`` ..."""
        if self.kind == "ptr":
            return ("const " if self.const else "") + _C_ELEM[self.elem] + "*"
        return _C_SCALAR[self.kind]


X_IN, X_OUT = Arg("ptr", "x"), Arg("ptr", "x", const=False)
BF16_IN, BF16_OUT = Arg("ptr", "bf16"), Arg("ptr", "bf16", const=False)
F32_IN, F32_OUT = Arg("ptr", "f32"), Arg("ptr", "f32", const=False)
F64_IN, F64_OUT = Arg("ptr", "f64"), Arg("ptr", "f64", const=False)
I32_IN, I32_OUT = Arg("ptr", "i32"), Arg("ptr", "i32", const=False)
INT, LONG, FLOAT, DOUBLE = Arg("int"), Arg("long"), Arg("float"), Arg("double")

XTYPE_DEFINE = "FLOATX_BF16"      # 0: floatX is float, 1: __nv_bfloat16 (rwkvx/cu/common.cuh)


def xtype_defines(xtype: str) -> tuple[tuple[str, int], ...]:
    """The define that selects ``floatX`` for activation element type ``xtype``."""
    if xtype not in XTYPES:
        raise ValueError(f"xtype must be one of {XTYPES}, got {xtype!r}")
    return ((XTYPE_DEFINE, int(xtype == "bf16")),)


class KernelFile:
    """The declared interface of rwkvx/cu/<module>.cu, ``module`` = ``"<family>/<file>"`` (see the module docstring).

    ``constants``: name -> value, passed to every compile of the file. ``variants``: define name ->
    the values launches of this file use (the CPU compile test builds every combination with every
    element type of :data:`~rwkvx.runtime.dtypes.XTYPES`); a launch must give one value of each.
    ``derived``: a function of a variant (dict) and the element type returning more defines that follow
    from them (tile sizes, shared-memory layouts), so that each value is computed in one place.
    """

    registry: dict[str, "KernelFile"] = {}

    def __init__(self, module: str, constants: dict | None = None, variants: dict | None = None,
                 derived: Callable[[dict, str], dict] | None = None):
        if module in KernelFile.registry:
            raise ValueError(f"kernel file {module!r} is declared twice")
        self.module = module
        self.constants = dict(constants or {})
        self.variants = {k: tuple(v) for k, v in (variants or {}).items()}
        self.derived = derived
        self.kernels: dict[str, Kernel] = {}
        KernelFile.registry[module] = self

    def kernel(self, name: str, **params: Arg) -> "Kernel":
        """Declare kernel ``name`` with its parameters in prototype order (keyword order)."""
        if name in self.kernels:
            raise ValueError(f"{self.module}.cu: kernel {name} declared twice")
        for pname, arg in params.items():
            if not isinstance(arg, Arg):
                raise TypeError(f"{name}: parameter {pname} must be declared with an Arg")
        k = Kernel(self, name, tuple(params.items()))
        self.kernels[name] = k
        return k

    def defines(self, xtype: str, variant: dict | None = None) -> tuple[tuple[str, str], ...]:
        """Every define of one compile: the constants, the element type and one value per variant."""
        variant = dict(variant or {})
        missing = set(self.variants) - set(variant)
        extra = set(variant) - set(self.variants)
        if missing or extra:
            raise ValueError(f"{self.module}.cu: variant defines {sorted(variant)} do not match the "
                             f"declared {sorted(self.variants)}")
        for name, value in variant.items():
            if value not in self.variants[name]:
                raise ValueError(f"{self.module}.cu: {name}={value!r} is not one of the supported "
                                 f"{self.variants[name]}")
        extra = self.derived(variant, xtype) if self.derived else {}
        return normalize_defines({**self.constants, **dict(xtype_defines(xtype)), **variant, **extra})

    def compile_cases(self) -> list[tuple[tuple[str, str], ...]]:
        """Every (element type x variant) define set this file is compiled with."""
        import itertools
        names = sorted(self.variants)
        combos = itertools.product(*(self.variants[n] for n in names)) if names else [()]
        return [self.defines(x, dict(zip(names, combo))) for combo in combos for x in XTYPES]


class Kernel:
    """One declared ``extern "C" __global__`` kernel; :meth:`launch` binds arguments by name."""

    def __init__(self, file: KernelFile, name: str, params: tuple[tuple[str, Arg], ...]):
        self.file, self.name, self.params = file, name, params

    def __repr__(self) -> str:
        sig = ", ".join(f"{a.c_type()} {n}" for n, a in self.params)
        return f"{self.name}({sig})"

    def launch(self, grid, block, *, xtype: str = "f32", variant: dict | None = None, smem: int = 0,
               **args) -> Launch:
        """A :class:`Launch` of this kernel with every declared parameter given by name."""
        given, declared = set(args), [n for n, _ in self.params]
        missing = [n for n in declared if n not in given]
        extra = sorted(given - set(declared))
        if missing or extra:
            raise TypeError(f"kernel {self.name}: "
                            + (f"missing argument(s) {', '.join(missing)}" if missing else "")
                            + ("; " if missing and extra else "")
                            + (f"unknown argument(s) {', '.join(extra)}" if extra else "")
                            + f" (declared: {self!r})")
        packed = tuple(self._bind(pname, arg, args[pname], xtype) for pname, arg in self.params)
        return Launch(self.file.module, self.name, grid=grid, block=block, smem=smem, args=packed,
                      defines=self.file.defines(xtype, variant))

    def _bind(self, pname: str, arg: Arg, value, xtype: str) -> tuple[str, int | float]:
        what = f"kernel {self.name}, argument {pname} ({arg.c_type()})"
        if arg.kind == "ptr":
            if value is None or (isinstance(value, int) and not isinstance(value, DevPtr) and value == 0):
                if not arg.optional:
                    raise ValueError(f"{what}: a buffer is required, got NULL")
                return ("p", 0)
            if not isinstance(value, DevPtr):
                raise TypeError(f"{what}: expected a typed device pointer (DevPtr), got "
                                f"{type(value).__name__}")
            want = xtype if arg.elem == "x" else arg.elem
            if value.elem != want:
                raise TypeError(f"{what}: expected a {want} buffer, got a {value.elem} one")
            return ("p", int(value))
        if arg.kind in ("int", "long"):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{what}: expected an int, got {type(value).__name__}")
        elif isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{what}: expected a number, got {type(value).__name__}")
        return (_SCALAR_KINDS[arg.kind], value)
