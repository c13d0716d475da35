"""cuBLASLt through a minimal ctypes shim: each GEMM of a plan as one ``cublasLtMatmul`` with the
algorithm measured fastest for its shape.

How it is bound, and why: the GPU machine has no nvmath-python and no internet, and cuda-bindings has
no cuBLAS module, so rwkvx binds the handful of entry points it needs itself. libcublasLt is located
by ``cuda.pathfinder.load_nvidia_dynamic_lib("cublasLt")`` (the nvidia-cublas wheel, a conda env or the
CUDA toolkit), else by the system loader, and opened with ctypes:

* setup calls run through ctypes: the handle, one matmul descriptor and three matrix layouts per GEMM
  shape (:class:`GemmShape`), the heuristic's candidate algorithms;
* the hot call, ``cublasLtMatmul``, is handed to Cython as a raw address (:attr:`CublasLt.matmul_ptr`);
  :class:`rwkvx._core.Plan` calls it through a typed C function pointer without the GIL, with the
  descriptors and algorithm :meth:`CublasLt.prepare` returns for each of its GEMMs.

Why cuBLASLt rather than ``cublasGemmEx``: GemmEx runs the heuristic's first algorithm, and for many of
the step's shapes another candidate is faster (H200, the 0.22B bf16 step's GEMMs: 61.6 ms with GemmEx,
57.6 ms with the fastest candidate of each shape). :mod:`rwkvx.runtime.gemm_algos` times the candidates
of each new shape once per machine and keeps the choice.

Every GEMM runs on the device's stream with one preallocated workspace (32 MiB), so GEMMs never
allocate and are safe under CUDA-graph capture. Each shape runs one fixed algorithm; cuBLASLt's split-K
reductions run in a fixed order (the in-place scheme serialises through counters, the others reduce in a
separate pass), so a plan is bit-reproducible. Every status is checked.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .dtypes import COMPUTE_TYPES, CUDA_TYPES
from .errors import check_cublas
from .gemm_algos import choose
from .gemm_shape import Algo, GemmShape

WORKSPACE_BYTES = 32 << 20
# alpha and beta: float for the fp32 and tf32 compute types, double for fp64 (cublasLt's scale type must
# match the compute type's precision)
_SCALE = {COMPUTE_TYPES["fp64"]: (CUDA_TYPES["f64"], ctypes.c_double)}
_SCALE_F32 = (CUDA_TYPES["f32"], ctypes.c_float)
# cublasLt.h (CUDA 13) attribute enums
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT = (5, 6, 7, 8)                  # A, B, C, D (bytes)

_lib = None


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """libcublasLt as a ctypes library (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    lib = None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
    except Exception as e:  # noqa: BLE001 - try the system loader next
        errors.append(f"cuda.pathfinder: {type(e).__name__}: {e}")
    if lib is None:
        for name in ("libcublasLt.so.13", "libcublasLt.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
    if lib is None:
        raise RuntimeError("cuBLASLt not found (pip install 'nvidia-cublas>=13.0,<13.2'): " + "; ".join(errors))
    vp, sz, u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64
    sigs = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtDestroy": [vp],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, sz],
        "cublasLtMatmulDescDestroy": [vp],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, ctypes.c_int64],
        "cublasLtMatrixLayoutDestroy": [vp],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, sz],
        "cublasLtMatmulPreferenceDestroy": [vp],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                           ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(Algo), vp, sz, vp],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)          # AttributeError names the missing symbol
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.cublasLtGetVersion.argtypes = []
    lib.cublasLtGetVersion.restype = sz
    _lib = lib
    return lib


@dataclass(frozen=True)
class Prepared:
    """The cuBLASLt objects of one GEMM shape: descriptor, layouts of A, B and C (= D), the algorithm."""
    desc: int
    layouts: tuple
    algo: Algo

    @property
    def algo_ptr(self) -> int:
        return ctypes.addressof(self.algo)


class CublasLt:
    """One cuBLASLt handle with a fixed workspace (a device pointer), the descriptors of every GEMM shape
    it has seen and the algorithm each shape runs (chosen by :mod:`rwkvx.runtime.gemm_algos`)."""

    def __init__(self, dev, workspace_ptr: int, workspace_bytes: int):
        lib = load_cublaslt()
        self._lib = lib
        self.dev = dev
        handle = ctypes.c_void_p()
        check_cublas(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        self.handle: int = int(handle.value or 0)
        self.version: int = int(lib.cublasLtGetVersion())
        self.workspace_ptr, self.workspace_bytes = int(workspace_ptr), int(workspace_bytes)
        self.matmul_ptr: int = int(ctypes.cast(lib.cublasLtMatmul, ctypes.c_void_p).value or 0)
        if not self.matmul_ptr:
            raise RuntimeError("cuBLASLt: cublasLtMatmul not found")
        self._descs: dict[GemmShape, tuple[int, tuple]] = {}
        self._prepared: dict[GemmShape, Prepared] = {}

    # -- descriptors and candidates ----------------------------------------------------------------
    def descriptors(self, shape: GemmShape) -> tuple[int, tuple]:
        """(matmul descriptor, (layout A, layout B, layout C)) of ``shape``, created once."""
        if shape in self._descs:
            return self._descs[shape]
        lib, s = self._lib, shape
        ta, tb, tc, compute = s.types
        desc = ctypes.c_void_p()
        scale_type = _SCALE.get(compute, _SCALE_F32)[0]
        check_cublas(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), compute, scale_type), "cublasLtMatmulDescCreate")
        for attr, trans in ((_DESC_TRANSA, s.transa), (_DESC_TRANSB, s.transb)):
            v = ctypes.c_int32(int(trans))
            check_cublas(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                         "cublasLtMatmulDescSetAttribute")
        layouts = []
        # column-major stored matrices: A is (k x m if transa else m x k), B (n x k if transb else k x n), C m x n
        for typ, rows, cols, ld in ((ta, s.k if s.transa else s.m, s.m if s.transa else s.k, s.lda),
                                    (tb, s.n if s.transb else s.k, s.k if s.transb else s.n, s.ldb),
                                    (tc, s.m, s.n, s.ldc)):
            lay = ctypes.c_void_p()
            check_cublas(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), typ, rows, cols, ld),
                         "cublasLtMatrixLayoutCreate")
            layouts.append(int(lay.value))
        self._descs[shape] = (int(desc.value), tuple(layouts))
        return self._descs[shape]

    def candidates(self, shape: GemmShape, count: int) -> list[Algo]:
        """Up to ``count`` algorithms the heuristic offers for ``shape`` (best guess first), within the
        workspace and the operands' alignment."""
        lib = self._lib
        desc, (la, lb, lc) = self.descriptors(shape)
        pref = ctypes.c_void_p()
        check_cublas(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(self.workspace_bytes)
            check_cublas(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                                  ctypes.sizeof(ws)), "cublasLtMatmulPreferenceSetAttribute")
            a, b, c = shape.align
            for attr, al in zip(_PREF_MIN_ALIGNMENT, (a, b, c, c)):
                v = ctypes.c_uint32(al)
                check_cublas(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(v), ctypes.sizeof(v)),
                             "cublasLtMatmulPreferenceSetAttribute")
            results = (_HeuristicResult * count)()
            found = ctypes.c_int(0)
            check_cublas(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, la, lb, lc, lc, pref, count, results,
                                                            ctypes.byref(found)),
                         "cublasLtMatmulAlgoGetHeuristic", shape.key())
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        algos = [Algo.from_buffer_copy(results[i].algo) for i in range(found.value) if results[i].state == 0]
        if not algos:
            raise RuntimeError(f"cuBLASLt offers no algorithm for the GEMM {shape.key()}")
        return algos

    def matmul(self, shape: GemmShape, algo: Algo, op, c: int | None = None) -> None:
        """Enqueue ``op`` (an ops.Gemm of this shape) with ``algo`` on the device stream through ctypes;
        with ``c`` given, the GEMM reads C (when beta != 0) and writes D there instead of op.C / op.D."""
        desc, (la, lb, lc) = self.descriptors(shape)
        scalar = _SCALE.get(shape.types[3], _SCALE_F32)[1]
        alpha, beta = scalar(op.alpha), scalar(op.beta)
        src, out = (op.C, op.D) if c is None else (c, c)
        src, out = ctypes.c_void_p(src), ctypes.c_void_p(out)
        check_cublas(self._lib.cublasLtMatmul(self.handle, desc, ctypes.byref(alpha), op.A, la, op.B, lb,
                                              ctypes.byref(beta), src, lc, out, lc, ctypes.byref(algo),
                                              self.workspace_ptr, self.workspace_bytes, self.dev.stream_handle),
                     "cublasLtMatmul", shape.key())

    # -- plans -------------------------------------------------------------------------------------
    def prepare(self, ops: list, scratch: tuple[int, int] | None = None, tune: bool = True) -> list[Prepared]:
        """The descriptors and algorithm of each ops.Gemm in ``ops``; the algorithms of new shapes are
        chosen now, timed with their outputs written to ``scratch`` (device address, bytes) when given,
        else to a buffer allocated for the timing; without ``tune``, the heuristic's first candidate
        (for GEMMs that run a few times only, e.g. the device initialisation's)."""
        shapes = [GemmShape.of(op) for op in ops]
        new = {s: op for s, op in zip(shapes, ops) if s not in self._prepared}
        for shape, algo in choose(self, new, scratch, tune).items():
            desc, layouts = self.descriptors(shape)
            self._prepared[shape] = Prepared(desc, layouts, algo)
        return [self._prepared[s] for s in shapes]

    def close(self) -> None:
        """Destroy the descriptors, layouts and the handle (idempotent)."""
        lib = self._lib
        for desc, layouts in self._descs.values():
            for lay in layouts:
                lib.cublasLtMatrixLayoutDestroy(ctypes.c_void_p(lay))
            lib.cublasLtMatmulDescDestroy(ctypes.c_void_p(desc))
        self._descs.clear()
        self._prepared.clear()
        if self.handle:
            h, self.handle = self.handle, 0
            check_cublas(lib.cublasLtDestroy(ctypes.c_void_p(h)), "cublasLtDestroy")
