"""The device: primary context of one GPU, one non-blocking stream, memory, kernels, cuBLASLt.

``Device.get()`` is a process-wide singleton, on GPU 0 unless ``Device.select(n)`` chose another
first (a data-parallel rank's GPU). Every driver call's status is checked (CudaError names the
call). ``upload``/``download``/``synchronize`` block the host: use them outside the step, never while a
graph is being captured.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from .errors import CudaError, check
from .ops import DevPtr, normalize_defines

NO_GPU_HELP = ("no CUDA GPU is available ({reason}). rwkvx's GPU runtime needs an NVIDIA GPU, its driver "
               "and the cu13 extra (pip install 'rwkvx[cu13]'); on a CPU use the reference implementation "
               "rwkvx.oracle.Oracle instead.")

# Driver entry points rwkvx._core calls through C function pointers, with the exported (versioned) symbol
# names of CUDA 13.0's cuda.h for the dlsym fallback.
PROC_SYMBOLS = {
    "cuLaunchKernel": "cuLaunchKernel",
    "cuMemsetD8Async": "cuMemsetD8Async",
    "cuMemcpyDtoDAsync": "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoDAsync": "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync": "cuMemcpyDtoHAsync_v2",
    "cuCtxGetCurrent": "cuCtxGetCurrent",
    "cuCtxSetCurrent": "cuCtxSetCurrent",
}
DRIVER_PROCS = tuple(PROC_SYMBOLS)
_PROC_ABI_VERSION = 13000          # function-pointer ABI the Cython typedefs follow
_DEFAULT_SMEM_LIMIT = 48 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    """The properties of a GPU that launch builders size their grids and shared memory from.

    :attr:`Device.info` reads them off the device; CPU tests of plans construct one explicitly for
    the device they assume."""
    name: str
    arch: str                  # "sm_90"
    sm_count: int              # multiprocessors
    smem_per_block: int        # bytes of shared memory a block may opt in to
    l2_bytes: int


# The GPU rwkvx is tuned and measured on (as its driver reports it), for building plans without a
# device: CPU tests of op lists, memory estimates.
H200 = DeviceInfo("NVIDIA H200", "sm_90", sm_count=132, smem_per_block=232448, l2_bytes=62914560)


def _driver():
    from cuda.bindings import driver
    return driver


class _Allocation:
    """``nbytes`` at address ``ptr`` (int) owned by a Device; freed by :meth:`close` or when garbage-collected."""

    __slots__ = ("ptr", "nbytes", "_dev", "__weakref__")

    def __init__(self, dev: "Device", ptr: int, nbytes: int):
        self.ptr = int(ptr)
        self.nbytes = int(nbytes)
        self._dev = dev

    def __int__(self) -> int:
        return self.ptr

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ptr=0x{self.ptr:x}, nbytes={self.nbytes})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _release(self, dev: "Device") -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Free the memory (idempotent)."""
        dev, self._dev = self._dev, None
        if self.ptr and dev is not None:
            self._release(dev)
        self.ptr = 0

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer (e.g. at interpreter exit)
            pass


class DeviceBuffer(_Allocation):
    """Device memory (cuMemAlloc)."""

    __slots__ = ()

    def __index__(self) -> int:
        return self.ptr

    def typed(self, elem: str) -> DevPtr:
        """The buffer's start as a pointer to ``elem`` elements (what kernel launches take)."""
        return DevPtr(self.ptr, elem)

    def _release(self, dev: "Device") -> None:
        dev._free(self.ptr, self.nbytes)


class _HostView:
    """Exposes pinned memory to numpy via __array_interface__ and keeps the PinnedBuffer alive."""

    def __init__(self, owner: "PinnedBuffer", shape: tuple, dtype: np.dtype):
        self.owner = owner
        self.__array_interface__ = {"data": (owner.ptr, False), "shape": shape,
                                    "typestr": dtype.str, "version": 3}


class PinnedBuffer(_Allocation):
    """Page-locked host memory (cuMemHostAlloc) for async copies; :meth:`array` gives numpy views."""

    __slots__ = ()

    def array(self, dtype=np.uint8, shape=None) -> np.ndarray:
        """A writable numpy view of the buffer (``shape`` defaults to all of it, 1-D); the view keeps
        this buffer alive."""
        if not self.ptr:
            raise ValueError("PinnedBuffer is closed")
        dtype = np.dtype(dtype)
        if shape is None:
            shape = (self.nbytes // dtype.itemsize,)
        elif isinstance(shape, (int, np.integer)):
            shape = (int(shape),)
        shape = tuple(int(s) for s in shape)
        need = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if need > self.nbytes:
            raise ValueError(f"view of {need} bytes does not fit the {self.nbytes}-byte pinned buffer")
        return np.asarray(_HostView(self, shape, dtype))

    def _release(self, dev: "Device") -> None:
        dev._free_host(self.ptr, self.nbytes)


class Device:
    """Primary context of device 0 plus one non-blocking stream; see module docstring."""

    _instance: "Device | None" = None
    _ordinal = 0
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> "Device":
        """The process-wide device; RuntimeError (pointing to rwkvx.oracle.Oracle) without a GPU."""
        inst = cls._instance
        if inst is not None:
            return inst
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls._create(cls._ordinal)
            return cls._instance

    @classmethod
    def select(cls, ordinal: int) -> None:
        """Make :meth:`get` open GPU ``ordinal`` (a data-parallel rank's GPU); before the first ``get``."""
        with cls._lock:
            if cls._instance is not None and cls._instance.ordinal != ordinal:
                raise RuntimeError(f"Device.select({ordinal}): this process already uses GPU "
                                   f"{cls._instance.ordinal}")
            cls._ordinal = int(ordinal)

    @classmethod
    def _create(cls, ordinal: int) -> "Device":
        try:
            driver = _driver()
        except ImportError as e:
            raise RuntimeError(NO_GPU_HELP.format(reason=f"cuda-bindings is not installed: {e}")) from e
        try:
            res = driver.cuInit(0)
        except Exception as e:  # noqa: BLE001 - libcuda missing: cuda.pathfinder raises its own types
            raise RuntimeError(NO_GPU_HELP.format(reason=f"the CUDA driver could not be loaded: {e}")) from e
        if int(res[0]) != 0:
            raise RuntimeError(NO_GPU_HELP.format(reason=f"cuInit failed: {res[0]!r}"))
        count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
        if not count:
            raise RuntimeError(NO_GPU_HELP.format(reason="the driver reports 0 devices"))
        if ordinal >= count:
            raise RuntimeError(f"GPU {ordinal} was asked for, the driver reports {count} device(s)")
        return cls(ordinal)

    def __init__(self, ordinal: int = 0):
        """Use :meth:`get`; constructing a second Device retains the same primary context."""
        driver = _driver()
        self._driver = driver
        self.ordinal = ordinal
        self.cu_device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
        self.context = check(driver.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.context_handle = int(self.context)
        attr = driver.CUdevice_attribute
        major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                                                  self.cu_device), "cuDeviceGetAttribute")
        minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                                                  self.cu_device), "cuDeviceGetAttribute")
        self.compute_capability = (int(major), int(minor))
        self.arch = f"sm_{major}{minor}"
        self.smem_optin = int(check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, self.cu_device), "cuDeviceGetAttribute"))
        self.sm_count = int(check(driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.cu_device), "cuDeviceGetAttribute"))
        l2 = int(check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, self.cu_device),
                       "cuDeviceGetAttribute"))
        name = check(driver.cuDeviceGetName(256, self.cu_device), "cuDeviceGetName")
        self.name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        self.info = DeviceInfo(self.name, self.arch, self.sm_count, self.smem_optin, l2)
        self.driver_version = int(check(driver.cuDriverGetVersion(), "cuDriverGetVersion"))
        self.stream = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value),
                            "cuStreamCreate")
        self.stream_handle = int(self.stream)
        self.driver_procs = self._resolve_procs()

        self.allocated_bytes = 0
        self.peak_allocated_bytes = 0
        self.pinned_bytes = 0
        self._capturing = 0
        self._deferred_frees: list[tuple[int, int]] = []
        self._sources: dict[str, str] = {}
        self._modules: dict[tuple, object] = {}
        self._functions: dict[tuple, object] = {}
        self._smem_set: dict[int, int] = {}
        self._cublas = None
        self._cublas_workspace: DeviceBuffer | None = None
        self._mem_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Device({self.ordinal}: {self.name}, {self.arch})"

    # ---- driver entry points for rwkvx._core -------------------------------------------------------
    def _resolve_procs(self) -> dict[str, int]:
        driver = self._driver
        procs: dict[str, int] = {}
        version = min(_PROC_ABI_VERSION, self.driver_version)
        flag = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_LEGACY_STREAM
        problems = []
        for name in PROC_SYMBOLS:
            addr = 0
            try:
                res = driver.cuGetProcAddress(name.encode(), version, int(flag))
                if int(res[0]) == 0 and res[1]:
                    addr = int(res[1])
                else:
                    problems.append(f"cuGetProcAddress({name}) -> {res!r}")
            except Exception as e:  # noqa: BLE001 - fall back to dlsym below
                problems.append(f"cuGetProcAddress({name}): {e}")
            procs[name] = addr
        if not all(procs.values()):
            import ctypes
            try:
                lib = ctypes.CDLL("libcuda.so.1")
                for name, symbol in PROC_SYMBOLS.items():
                    if not procs[name]:
                        procs[name] = int(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value or 0)
            except (OSError, AttributeError) as e:
                problems.append(f"dlsym fallback: {e}")
        missing = [n for n, a in procs.items() if not a]
        if missing:
            raise CudaError(f"driver entry points not found: {missing} ({'; '.join(problems)})",
                            "cuGetProcAddress")
        return procs

    # ---- memory -------------------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> DeviceBuffer:
        """Device memory (uninitialised). Never call while a step is being captured."""
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"alloc: nbytes must be >= 0, got {nbytes}")
        if self._capturing:
            raise RuntimeError("Device.alloc during graph capture is not allowed")
        if nbytes == 0:
            return DeviceBuffer(self, 0, 0)
        ptr = check(self._driver.cuMemAlloc(nbytes), "cuMemAlloc", f"{nbytes} bytes")
        buf = DeviceBuffer(self, int(ptr), nbytes)
        with self._mem_lock:
            self.allocated_bytes += nbytes
            self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)
        return buf

    def _free(self, ptr: int, nbytes: int) -> None:
        if self._capturing:              # cuMemFree would invalidate the capture: free afterwards
            self._deferred_frees.append((ptr, nbytes))
            return
        with self._mem_lock:
            self.allocated_bytes -= nbytes
        check(self._driver.cuMemFree(ptr), "cuMemFree")

    def _flush_deferred_frees(self) -> None:
        pending, self._deferred_frees = self._deferred_frees, []
        for ptr, nbytes in pending:
            self._free(ptr, nbytes)

    def alloc_pinned(self, nbytes: int) -> PinnedBuffer:
        """Page-locked host memory (cuMemHostAlloc); ``.array(dtype, shape)`` gives a numpy view."""
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"alloc_pinned: nbytes must be > 0, got {nbytes}")
        if self._capturing:
            raise RuntimeError("Device.alloc_pinned during graph capture is not allowed")
        ptr = check(self._driver.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc", f"{nbytes} bytes")
        with self._mem_lock:
            self.pinned_bytes += nbytes
        return PinnedBuffer(self, int(ptr), nbytes)

    def _free_host(self, ptr: int, nbytes: int) -> None:
        with self._mem_lock:
            self.pinned_bytes -= nbytes
        check(self._driver.cuMemFreeHost(ptr), "cuMemFreeHost")

    def memory_info(self) -> dict:
        """free/total device memory (cuMemGetInfo) and rwkvx's own allocated / peak / pinned bytes."""
        free, total = check(self._driver.cuMemGetInfo(), "cuMemGetInfo")
        return {"free": int(free), "total": int(total), "allocated": self.allocated_bytes,
                "peak_allocated": self.peak_allocated_bytes, "pinned": self.pinned_bytes}

    def reset_peak(self) -> None:
        with self._mem_lock:
            self.peak_allocated_bytes = self.allocated_bytes

    # ---- synchronous helpers (outside steps) -------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for all work on the stream; asynchronous kernel faults surface here."""
        check(self._driver.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def upload(self, ptr, array) -> None:
        """Copy a numpy array to device memory at ``ptr`` (int or buffer) and wait for it."""
        from .ops import as_ptr
        ptr = as_ptr(ptr, "upload")
        arr = np.ascontiguousarray(array)
        if arr.nbytes == 0:
            return
        if ptr == 0:
            raise ValueError("upload: NULL device pointer")
        check(self._driver.cuMemcpyHtoDAsync(ptr, arr.ctypes.data, arr.nbytes, self.stream),
              "cuMemcpyHtoDAsync", "upload")
        self.synchronize()

    def download(self, ptr, shape, dtype=np.float32) -> np.ndarray:
        """Copy device memory at ``ptr`` into a new numpy array of ``shape``/``dtype`` (waits)."""
        from .ops import as_ptr
        ptr = as_ptr(ptr, "download")
        out = np.empty(shape, dtype=dtype)
        if out.nbytes == 0:
            return out
        if ptr == 0:
            raise ValueError("download: NULL device pointer")
        check(self._driver.cuMemcpyDtoHAsync(out.ctypes.data, ptr, out.nbytes, self.stream),
              "cuMemcpyDtoHAsync", "download")
        self.synchronize()
        return out

    def to_device(self, array) -> DeviceBuffer:
        """A new DeviceBuffer holding a copy of ``array``."""
        arr = np.ascontiguousarray(array)
        buf = self.alloc(arr.nbytes)
        self.upload(buf, arr)
        return buf

    def zeros(self, nbytes: int) -> DeviceBuffer:
        """A new zero-filled DeviceBuffer (waits)."""
        buf = self.alloc(nbytes)
        if buf.nbytes:
            check(self._driver.cuMemsetD8Async(buf.ptr, 0, buf.nbytes, self.stream), "cuMemsetD8Async", "zeros")
            self.synchronize()
        return buf

    # ---- kernels ------------------------------------------------------------------------------------
    def add_source(self, module: str, src: str) -> None:
        """Register CUDA source under ``module`` (instead of rwkvx/cu/<module>.cu), e.g. test kernels."""
        if not isinstance(src, str):
            raise TypeError("add_source: src must be str")
        old = self._sources.get(module)
        if old is not None and old != src:
            raise ValueError(f"module {module!r} is already registered with a different source")
        self._sources[module] = src

    def module(self, module: str, defines=()):
        """The loaded CUmodule of ``module`` compiled with ``defines`` (compiled and cached on first use)."""
        from . import nvrtc
        defs = normalize_defines(defines)
        key = (module, defs)
        mod = self._modules.get(key)
        if mod is not None:
            return mod
        if self._capturing:
            raise RuntimeError(f"kernel module {module!r} first used during graph capture: "
                               "run the plan once eagerly (or build it) before capturing")
        if module in self._sources:
            cubin = nvrtc.compile_source(module, self._sources[module], self.arch, defs,
                                         origin=f"<source {module}>")
        else:
            cubin = nvrtc.compile_cubin(module, self.arch, defs)
        mod = check(self._driver.cuModuleLoadData(cubin), "cuModuleLoadData", f"module {module} {dict(defs)}")
        self._modules[key] = mod
        return mod

    def kernel(self, module: str, name: str, defines=()):
        """CUfunction ``name`` of ``module`` with ``defines`` (cached per (module, defines, name))."""
        defs = normalize_defines(defines)
        key = (module, defs, name)
        fn = self._functions.get(key)
        if fn is None:
            mod = self.module(module, defs)
            fn = check(self._driver.cuModuleGetFunction(mod, name.encode()), "cuModuleGetFunction",
                       f"kernel {name!r} in module {module!r}")
            self._functions[key] = fn
        return fn

    def prepare_kernel(self, fn, smem: int, name: str = "") -> None:
        """Raise the kernel's dynamic shared-memory limit when a launch needs more than 48 KiB."""
        smem = int(smem)
        if smem <= _DEFAULT_SMEM_LIMIT:
            return
        if smem > self.smem_optin:
            raise ValueError(f"kernel {name}: {smem} bytes of dynamic shared memory exceed the device "
                             f"limit of {self.smem_optin}")
        key = int(fn)
        if self._smem_set.get(key, 0) >= smem:
            return
        attr = self._driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(self._driver.cuFuncSetAttribute(fn, attr, smem), "cuFuncSetAttribute", f"kernel {name}, smem={smem}")
        self._smem_set[key] = smem

    # ---- cuBLASLt -----------------------------------------------------------------------------------
    @property
    def cublas(self):
        """The cuBLASLt handle with its 32 MiB workspace, used on this stream (created on first use)."""
        if self._cublas is None:
            from .cublas import WORKSPACE_BYTES, CublasLt
            if self._capturing:
                raise RuntimeError("cuBLAS first used during graph capture: build the plan before capturing")
            ws = self.alloc(WORKSPACE_BYTES)
            self._cublas = CublasLt(self, ws.ptr, ws.nbytes)
            self._cublas_workspace = ws
        return self._cublas

