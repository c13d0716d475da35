"""Exceptions and return-code checking for CUDA driver, NVRTC and cuBLAS calls."""
from __future__ import annotations


class CudaError(RuntimeError):
    """A CUDA driver, NVRTC or cuBLAS call failed. ``call`` names it; ``code`` is the status (int)."""

    def __init__(self, message: str, call: str = "", code: int | None = None):
        super().__init__(message)
        self.call = call
        self.code = code


class NvrtcCompileError(CudaError):
    """NVRTC rejected a source; the message holds the file name and the full compile log."""


def _driver_error_text(code: int) -> str:
    try:
        from cuda.bindings import driver
        err, name = driver.cuGetErrorName(driver.CUresult(code))
        name = name.decode() if err == driver.CUresult.CUDA_SUCCESS and name else f"CUresult {code}"
        err, desc = driver.cuGetErrorString(driver.CUresult(code))
        desc = desc.decode() if err == driver.CUresult.CUDA_SUCCESS and desc else ""
        return f"{name}: {desc}" if desc else name
    except Exception:  # noqa: BLE001 - best effort; the code itself is always shown
        return f"CUresult {code}"


def driver_error(call: str, code: int, what: str = "") -> CudaError:
    """A CudaError for a failed driver call (``what`` adds context, e.g. the kernel name)."""
    code = int(code)
    extra = f" ({what})" if what else ""
    return CudaError(f"{call}{extra} failed: {_driver_error_text(code)} [{code}]", call, code)


def check(result, call: str, what: str = ""):
    """Check a cuda.bindings.driver result tuple ``(CUresult, *values)``; return the values.

    Returns None for no values, the value for one, a tuple for more.
    """
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        raise driver_error(call, int(err), what)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


CUBLAS_STATUS = {
    0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED", 3: "CUBLAS_STATUS_ALLOC_FAILED",
    7: "CUBLAS_STATUS_INVALID_VALUE", 8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
    13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
    15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR",
}


def cublas_error(call: str, status: int, what: str = "") -> CudaError:
    """The :class:`CudaError` for cuBLAS ``status`` returned by ``call`` (``what``: the operation, in the
    message), naming the status."""
    extra = f" ({what})" if what else ""
    name = CUBLAS_STATUS.get(int(status), "unknown cuBLAS status")
    return CudaError(f"{call}{extra} failed: {name} [{int(status)}]", call, int(status))


def check_cublas(status: int, call: str, what: str = "") -> None:
    """Raise :func:`cublas_error` unless ``status`` is ``CUBLAS_STATUS_SUCCESS`` (0)."""
    if int(status) != 0:
        raise cublas_error(call, status, what)


def check_nvrtc(result, call: str, what: str = ""):
    """Check a cuda.bindings.nvrtc result tuple; return the values like :func:`check`."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if int(err) != 0:
        try:
            from cuda.bindings import nvrtc
            text = nvrtc.nvrtcGetErrorString(err)[1].decode()
        except Exception:  # noqa: BLE001
            text = f"nvrtcResult {int(err)}"
        extra = f" ({what})" if what else ""
        raise CudaError(f"{call}{extra} failed: {text} [{int(err)}]", call, int(err))
    if not values:
        return None
    return values[0] if len(values) == 1 else values
