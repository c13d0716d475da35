# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Plan executor: a step's ops packed once into C arrays and enqueued in a nogil loop.

`Plan(dev, ops)` resolves every kernel (``dev.kernel``), packs launch arguments into one
contiguous host buffer with a ``void**`` kernelParams array pointing into it, and GEMM/memset/copy
parameters into a C struct array. `run()` enqueues everything on ``dev.stream`` through typed C function
pointers to the driver entry points (cuLaunchKernel, cuMemsetD8Async, cuMemcpy*Async) and to
``cublasLtMatmul``, without the GIL and without any host synchronisation, checking every status; the first
failure stops the loop and is raised after it, naming the op (kernel name, or "cublasLtMatmul op #i").

Why function pointers and not ``cimport cuda.bindings.cydriver``: cydriver.pxd of cuda-bindings 13.N
declares every type of CUDA 13.N's cuda.h, so it only compiles against headers at least that new (13.5's
fails against the 13.0 headers of nvidia-cuda-runtime 13.0.x; the GPU machine pairs bindings 13.3.1 with
13.0 headers). The driver's own ``cuGetProcAddress`` (ABI pinned to CUDA 13.0) gives the same entry
points the bindings call, so this module needs no CUDA header at build time and no particular
cuda-bindings version.

The ``dev`` object needs: ``stream_handle`` (int CUstream), ``context_handle`` (int CUcontext, 0 = do
not touch the current context), ``driver_procs`` (dict name -> int address of the entry points in
DRIVER_PROCS), ``kernel(module, name, defines)`` (a CUfunction or int address),
``prepare_kernel(fn, smem, name)`` (optional; raises the dynamic shared-memory limit when needed) and,
only when the ops contain a Gemm, ``cublas`` with ``handle``, ``matmul_ptr``, ``workspace_ptr`` and
``workspace_bytes`` (ints) and ``prepare(gemms)`` (each GEMM's descriptor, A / B / C layouts and algorithm
address: :meth:`rwkvx.runtime.cublas.CublasLt.prepare`).
"""
from libc.stdint cimport uint64_t, int32_t, int64_t, uintptr_t
from libc.stdlib cimport calloc, free
from libc.string cimport memcpy


import numpy as np

from rwkvx.runtime.device import DRIVER_PROCS
from rwkvx.runtime.ops import Launch, Gemm, Memset, Copy, CopyHtoD, CopyDtoH, flatten_ops
from rwkvx.runtime.errors import driver_error, cublas_error

# cublasStatus_t cublasLtMatmul(cublasLtHandle_t, cublasLtMatmulDesc_t, const void* alpha,
#   const void* A, cublasLtMatrixLayout_t Adesc, const void* B, cublasLtMatrixLayout_t Bdesc,
#   const void* beta, const void* C, cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
#   const cublasLtMatmulAlgo_t* algo, void* workspace, size_t workspaceSizeInBytes, cudaStream_t)
ctypedef int (*lt_matmul_t)(void* handle, void* desc, const void* alpha, const void* A, void* Adesc,
                            const void* B, void* Bdesc, const void* beta, const void* C, void* Cdesc,
                            void* D, void* Ddesc, const void* algo, void* workspace, size_t ws_bytes,
                            void* stream) noexcept nogil

# Driver entry points (cuda.h, CUDA 13.0 ABI): CUresult is a C int enum, CUdeviceptr is unsigned long long,
# CUfunction / CUstream / CUcontext are opaque pointers.
ctypedef int (*launch_t)(void* f, unsigned int gx, unsigned int gy, unsigned int gz,
                         unsigned int bx, unsigned int by, unsigned int bz, unsigned int smem,
                         void* stream, void** params, void** extra) noexcept nogil
ctypedef int (*memset_d8_t)(unsigned long long dst, unsigned char uc, size_t n, void* stream) noexcept nogil
ctypedef int (*copy_dtod_t)(unsigned long long dst, unsigned long long src, size_t n,
                            void* stream) noexcept nogil
ctypedef int (*copy_htod_t)(unsigned long long dst, const void* src, size_t n, void* stream) noexcept nogil
ctypedef int (*copy_dtoh_t)(void* dst, unsigned long long src, size_t n, void* stream) noexcept nogil
ctypedef int (*ctx_get_t)(void** ctx) noexcept nogil
ctypedef int (*ctx_set_t)(void* ctx) noexcept nogil

cdef enum OpKind:
    OP_LAUNCH = 0
    OP_GEMM = 1
    OP_MEMSET = 2
    OP_COPY = 3
    OP_HTOD = 4
    OP_DTOH = 5

# The memory ops: their record kind, the driver call that runs them (named in errors), and the fields
# holding their destination and source addresses (a memset has no source).
MEMORY_OPS = {
    Memset: (OP_MEMSET, "cuMemsetD8Async", "ptr", None),
    Copy: (OP_COPY, "cuMemcpyDtoDAsync", "dst", "src"),
    CopyHtoD: (OP_HTOD, "cuMemcpyHtoDAsync", "dst", "host_ptr"),
    CopyDtoH: (OP_DTOH, "cuMemcpyDtoHAsync", "host_ptr", "src"),
}

cdef struct OpRec:
    int kind
    # launch
    void* func
    unsigned int gx, gy, gz, bx, by, bz, smem
    void** params
    # gemm (D = alpha A B + beta C; D and C share the layout lc)
    void* desc
    void* la
    void* lb
    void* lc
    void* algo
    float alpha, beta
    double alpha64, beta64    # the scalars of an fp64 GEMM (cuBLASLt reads doubles there)
    int scale64
    uint64_t a, b, c, d
    # memset / copies
    uint64_t dst, src
    size_t nbytes

cdef enum:
    ARG_SLOT = 8          # every kernel argument gets an 8-byte, 8-aligned slot

cdef union ArgSlot:       # one argument's slot, by kind (ops.ARG_KINDS)
    uint64_t p
    int32_t i
    int64_t l
    float f
    double d


cdef class Plan:
    """Packed ops, executed by :meth:`run` on ``dev.stream``; see the module docstring."""
    cdef OpRec* recs
    cdef int n
    cdef unsigned char* argbuf
    cdef void** argptrs
    cdef size_t nargs
    cdef void* stream
    cdef void* ctx
    cdef launch_t p_launch
    cdef memset_d8_t p_memset
    cdef copy_dtod_t p_dtod
    cdef copy_htod_t p_htod
    cdef copy_dtoh_t p_dtoh
    cdef ctx_get_t p_ctx_get
    cdef ctx_set_t p_ctx_set
    cdef void* cublas_handle
    cdef lt_matmul_t lt_matmul
    cdef void* workspace
    cdef size_t workspace_bytes
    cdef list _prepared
    cdef readonly object dev
    cdef readonly list ops
    cdef list _names
    cdef list _arg_offsets
    cdef list _missing_procs

    def __cinit__(self):
        self.recs = NULL
        self.argbuf = NULL
        self.argptrs = NULL
        self.n = 0
        self.nargs = 0
        self.cublas_handle = NULL
        self.lt_matmul = NULL
        self.workspace = NULL
        self.workspace_bytes = 0

    def __init__(self, dev, ops):
        ops = flatten_ops(ops)
        if len(ops) > 0x7FFFFFFF:
            raise ValueError("Plan: too many ops")
        self.dev = dev
        self.ops = ops
        self.stream = <void*><uintptr_t>int(dev.stream_handle)
        self.ctx = <void*><uintptr_t>int(getattr(dev, "context_handle", 0) or 0)
        procs = dev.driver_procs
        missing = [p for p in DRIVER_PROCS if not int(procs.get(p, 0) or 0)]
        self._missing_procs = missing
        self.p_launch = <launch_t><uintptr_t>int(procs.get("cuLaunchKernel", 0) or 0)
        self.p_memset = <memset_d8_t><uintptr_t>int(procs.get("cuMemsetD8Async", 0) or 0)
        self.p_dtod = <copy_dtod_t><uintptr_t>int(procs.get("cuMemcpyDtoDAsync", 0) or 0)
        self.p_htod = <copy_htod_t><uintptr_t>int(procs.get("cuMemcpyHtoDAsync", 0) or 0)
        self.p_dtoh = <copy_dtoh_t><uintptr_t>int(procs.get("cuMemcpyDtoHAsync", 0) or 0)
        self.p_ctx_get = <ctx_get_t><uintptr_t>int(procs.get("cuCtxGetCurrent", 0) or 0)
        self.p_ctx_set = <ctx_set_t><uintptr_t>int(procs.get("cuCtxSetCurrent", 0) or 0)
        gemms = [op for op in ops if isinstance(op, Gemm)]
        self._prepared = []       # the descriptors and algorithms the records point at, kept alive
        if gemms:
            cub = dev.cublas
            self.cublas_handle = <void*><uintptr_t>int(cub.handle)
            self.lt_matmul = <lt_matmul_t><uintptr_t>int(cub.matmul_ptr)
            self.workspace = <void*><uintptr_t>int(cub.workspace_ptr)
            self.workspace_bytes = int(cub.workspace_bytes)
            if self.cublas_handle == NULL or self.lt_matmul == NULL:
                raise RuntimeError("Plan: dev.cublas has a NULL handle or cublasLtMatmul pointer")
            self._prepared = list(cub.prepare(gemms))
        prepared = iter(self._prepared)

        cdef size_t total_args = 0
        for op in ops:
            if isinstance(op, Launch):
                total_args += len(op.args)
        self.recs = <OpRec*>calloc(max(len(ops), 1), sizeof(OpRec))
        self.argbuf = <unsigned char*>calloc(max(total_args, 1), ARG_SLOT)
        self.argptrs = <void**>calloc(max(total_args, 1), sizeof(void*))
        if self.recs == NULL or self.argbuf == NULL or self.argptrs == NULL:
            raise MemoryError("Plan: out of host memory")
        self.nargs = total_args
        self._names = []
        self._arg_offsets = []

        cdef size_t slot = 0
        cdef OpRec* r
        cdef ArgSlot arg
        cdef unsigned char* dst
        cdef int i
        for i, op in enumerate(ops):
            r = &self.recs[i]
            if isinstance(op, Launch):
                fn = dev.kernel(op.module, op.name, op.defines)
                prep = getattr(dev, "prepare_kernel", None)
                if prep is not None:
                    prep(fn, op.smem, op.name)
                r.kind = OP_LAUNCH
                r.func = <void*><uintptr_t>int(fn)
                if r.func == NULL:
                    raise RuntimeError(f"Plan: kernel {op.module}.{op.name} resolved to NULL")
                r.gx, r.gy, r.gz = op.grid
                r.bx, r.by, r.bz = op.block
                r.smem = op.smem
                r.params = &self.argptrs[slot] if len(op.args) else NULL
                self._arg_offsets.append((slot, len(op.args)))
                for kind, value in op.args:
                    dst = self.argbuf + slot * ARG_SLOT
                    arg.p = 0       # a 4-byte argument leaves the rest of its slot zero
                    if kind == "p":
                        arg.p = value
                    elif kind == "i":
                        arg.i = value
                    elif kind == "l":
                        arg.l = value
                    elif kind == "f":
                        arg.f = value
                    elif kind == "d":
                        arg.d = value
                    else:  # ops.Launch validated the kinds already
                        raise TypeError(f"Plan: bad argument kind {kind!r} in {op.name}")
                    memcpy(dst, &arg, ARG_SLOT)
                    self.argptrs[slot] = <void*>dst
                    slot += 1
                self._names.append(op.name)
            elif isinstance(op, Gemm):
                p = next(prepared)
                r.kind = OP_GEMM
                r.desc = <void*><uintptr_t>int(p.desc)
                r.la = <void*><uintptr_t>int(p.layouts[0])
                r.lb = <void*><uintptr_t>int(p.layouts[1])
                r.lc = <void*><uintptr_t>int(p.layouts[2])
                r.algo = <void*><uintptr_t>int(p.algo_ptr)
                r.alpha, r.beta = op.alpha, op.beta
                r.alpha64, r.beta64 = op.alpha, op.beta
                r.scale64 = op.precision.compute == "fp64"
                r.a, r.b, r.c, r.d = op.A, op.B, op.C, op.D
                self._arg_offsets.append(None)
                self._names.append(f"cublasLtMatmul op #{i}")
            elif type(op) in MEMORY_OPS:
                r.kind, call, dst_field, src_field = MEMORY_OPS[type(op)]
                r.dst, r.nbytes = getattr(op, dst_field), op.nbytes
                r.src = getattr(op, src_field) if src_field else 0
                self._arg_offsets.append(None)
                self._names.append(f"{call} op #{i}")
            else:  # flatten_ops rejects anything else
                raise TypeError(f"Plan: unsupported op {type(op).__name__}")
        self.n = len(ops)

    def __dealloc__(self):
        free(self.recs)
        free(self.argbuf)
        free(self.argptrs)
        self.recs = NULL
        self.argbuf = NULL
        self.argptrs = NULL

    def __len__(self):
        return self.n

    @property
    def names(self):
        """Per-op name used in error messages (kernel name, or "<call> op #i")."""
        return list(self._names)

    def packed_args(self, int i):
        """The packed argument slots of op ``i`` (a Launch) as bytes, ARG_SLOT=8 bytes per argument."""
        if not 0 <= i < self.n:
            raise IndexError(i)
        cdef size_t start, count, j
        info = self._arg_offsets[i]
        if info is None:
            raise TypeError(f"op #{i} is not a Launch")
        start, count = info
        for j in range(count):   # each kernelParams entry must point at its slot
            if <uintptr_t>self.argptrs[start + j] != <uintptr_t>(self.argbuf + (start + j) * ARG_SLOT):
                raise AssertionError("kernelParams does not point into the argument buffer")
        return bytes((<char*>self.argbuf)[start * ARG_SLOT:(start + count) * ARG_SLOT])

    def run(self):
        """Enqueue every op on the stream (no synchronisation); raise CudaError on the first failure."""
        cdef int i
        cdef int failed = -1
        cdef int res = 0
        cdef int status = 0
        cdef void* cur = NULL
        cdef OpRec* r
        if self._missing_procs:
            raise RuntimeError(f"Plan.run: driver entry points not available: {self._missing_procs}")
        if self.ctx != NULL:
            res = self.p_ctx_get(&cur)
            if res != 0:
                raise driver_error("cuCtxGetCurrent", res)
            if cur != self.ctx:
                res = self.p_ctx_set(self.ctx)
                if res != 0:
                    raise driver_error("cuCtxSetCurrent", res)
        with nogil:
            for i in range(self.n):
                r = &self.recs[i]
                if r.kind == OP_LAUNCH:
                    res = self.p_launch(r.func, r.gx, r.gy, r.gz, r.bx, r.by, r.bz,
                                        r.smem, self.stream, r.params, NULL)
                elif r.kind == OP_GEMM:
                    status = self.lt_matmul(self.cublas_handle, r.desc,
                                            <const void*>&r.alpha64 if r.scale64 else <const void*>&r.alpha,
                                            <const void*><uintptr_t>r.a, r.la, <const void*><uintptr_t>r.b, r.lb,
                                            <const void*>&r.beta64 if r.scale64 else <const void*>&r.beta,
                                            <const void*><uintptr_t>r.c, r.lc,
                                            <void*><uintptr_t>r.d, r.lc, r.algo,
                                            self.workspace, self.workspace_bytes, self.stream)
                elif r.nbytes == 0:   # empty memset/copy: nothing to enqueue
                    pass
                elif r.kind == OP_MEMSET:
                    res = self.p_memset(r.dst, 0, r.nbytes, self.stream)
                elif r.kind == OP_COPY:
                    res = self.p_dtod(r.dst, r.src, r.nbytes, self.stream)
                elif r.kind == OP_HTOD:
                    res = self.p_htod(r.dst, <const void*><uintptr_t>r.src, r.nbytes, self.stream)
                else:
                    res = self.p_dtoh(<void*><uintptr_t>r.dst, r.src, r.nbytes, self.stream)
                if res != 0 or status != 0:
                    failed = i
                    break
        if failed >= 0:
            self._raise(failed, res, status)

    cdef _raise(self, int i, int res, int status):
        op = self.ops[i]
        if isinstance(op, Gemm):
            raise cublas_error("cublasLtMatmul", status,
                               f"op #{i}: transa={op.transa} transb={op.transb} m={op.m} n={op.n} k={op.k} "
                               f"lda={op.lda} ldb={op.ldb} ldc={op.ldc} {op.precision}")
        if isinstance(op, Launch):
            raise driver_error("cuLaunchKernel", res,
                               f"kernel {op.name} in {op.module} (op #{i}), grid={op.grid}, "
                               f"block={op.block}, smem={op.smem}")
        call = self._names[i].split(" ")[0]
        raise driver_error(call, res, f"op #{i}: {op}")


def sum_float64(x) -> float:
    """Sequential float64 sum of a 1-D (or any contiguous) array, e.g. the pinned per-token losses."""
    arr = np.asarray(x)
    if arr.dtype != np.float64:
        raise TypeError(f"sum_float64: expected float64 data, got {arr.dtype}")
    arr = np.ascontiguousarray(arr).reshape(-1)
    cdef const double[::1] v = arr
    cdef double s = 0.0
    cdef Py_ssize_t i, n = v.shape[0]
    with nogil:
        for i in range(n):
            s += v[i]
    return s
