"""cuBLAS through a minimal function-pointer shim.

How it is bound, and why: the GPU machine has no nvmath-python and no internet, and cuda-bindings has
no cuBLAS module, so rwkvx binds the handful of entry points it needs itself. libcublas (and its
dependency libcublasLt) is located and loaded by ``cuda.pathfinder.load_nvidia_dynamic_lib("cublas")``
(the nvidia-cublas wheel, a conda env or the CUDA toolkit), then opened with ctypes:

* setup calls, run once per process, go through ctypes: ``cublasCreate_v2``, ``cublasSetStream_v2``,
  ``cublasSetWorkspace_v2``, ``cublasSetMathMode``, ``cublasDestroy_v2``, ``cublasGetVersion_v2``;
* the hot call, ``cublasGemmEx`` (exported without suffix), is handed to Cython as a raw address
  (:attr:`Cublas.gemm_ex_ptr`); :class:`rwkvx._core.Plan` calls it through a typed C function pointer
  without the GIL.

The handle is bound to the device's non-blocking stream, then given a preallocated workspace (32 MiB;
the order matters: setting the stream resets the workspace), so GEMMs never allocate and are safe under
CUDA-graph capture. Math mode is CUBLAS_DEFAULT_MATH; each GEMM carries its own operand, output and
compute types (:class:`rwkvx.runtime.ops.GemmPrecision`, mapped to cuBLAS's enums by CUDA_TYPES and
COMPUTE_TYPES below). Every status is checked.
"""
from __future__ import annotations

import ctypes

from .errors import check_cublas

WORKSPACE_BYTES = 32 << 20
CUBLAS_DEFAULT_MATH = 0
# cudaDataType_t of GEMM operands/outputs and cublasComputeType_t, by rwkvx's names (ops.GemmPrecision)
CUDA_TYPES = {"f32": 0, "bf16": 14}                 # CUDA_R_32F, CUDA_R_16BF
COMPUTE_TYPES = {"fp32": 68, "tf32": 77}            # CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32

_lib = None


def load_cublas() -> ctypes.CDLL:
    """libcublas as a ctypes library (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    errors = []
    lib = None
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        loaded = load_nvidia_dynamic_lib("cublas")
        path = getattr(loaded, "abs_path", None)
        handle = getattr(loaded, "_handle_uint", None)
        if path:
            lib = ctypes.CDLL(path)
        elif handle:
            lib = ctypes.CDLL("libcublas.so", handle=handle)
    except Exception as e:  # noqa: BLE001 - try the system loader next
        errors.append(f"cuda.pathfinder: {type(e).__name__}: {e}")
    if lib is None:
        for name in ("libcublas.so.13", "libcublas.so"):
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
    if lib is None:
        raise RuntimeError("cuBLAS not found (pip install 'nvidia-cublas>=13.0,<13.2'): " + "; ".join(errors))
    vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    sigs = {
        "cublasCreate_v2": [ctypes.POINTER(vp)],
        "cublasDestroy_v2": [vp],
        "cublasSetStream_v2": [vp, vp],
        "cublasSetWorkspace_v2": [vp, vp, sz],
        "cublasSetMathMode": [vp, i],
        "cublasGetVersion_v2": [vp, ctypes.POINTER(i)],
    }
    for name, argtypes in sigs.items():
        fn = getattr(lib, name)          # AttributeError names the missing symbol
        fn.argtypes = argtypes
        fn.restype = ctypes.c_int
    lib.cublasGemmEx.restype = ctypes.c_int
    _lib = lib
    return lib


class Cublas:
    """One cuBLAS handle bound to ``stream_handle`` with a fixed workspace (a device pointer)."""

    def __init__(self, stream_handle: int, workspace_ptr: int, workspace_bytes: int):
        lib = load_cublas()
        self._lib = lib
        handle = ctypes.c_void_p()
        check_cublas(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate_v2")
        self.handle: int = int(handle.value or 0)
        try:
            check_cublas(lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream_handle or None)),
                         "cublasSetStream_v2")
            # after SetStream: setting the stream resets the workspace to the default pool
            check_cublas(lib.cublasSetWorkspace_v2(handle, ctypes.c_void_p(workspace_ptr or None),
                                                   ctypes.c_size_t(workspace_bytes)),
                         "cublasSetWorkspace_v2")
            check_cublas(lib.cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH), "cublasSetMathMode")
            ver = ctypes.c_int()
            check_cublas(lib.cublasGetVersion_v2(handle, ctypes.byref(ver)), "cublasGetVersion_v2")
            self.version: int = ver.value
        except BaseException:
            lib.cublasDestroy_v2(handle)
            self.handle = 0
            raise
        self.gemm_ex_ptr: int = int(ctypes.cast(lib.cublasGemmEx, ctypes.c_void_p).value or 0)
        if not self.gemm_ex_ptr:
            raise RuntimeError("cuBLAS: cublasGemmEx not found")

    def close(self) -> None:
        if self.handle:
            h, self.handle = self.handle, 0
            check_cublas(self._lib.cublasDestroy_v2(ctypes.c_void_p(h)), "cublasDestroy_v2")
