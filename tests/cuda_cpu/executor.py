"""Runs rwkvx's CUDA kernels on the CPU: each kernel file (rwkvx/cu/<module>.cu, the source NVRTC compiles,
with the defines of its declaration) compiled by g++ against tests/cuda_cpu/include, whose headers stand in
for CUDA's (see tests/cuda_cpu/README.md), and op lists executed on host memory by :class:`CpuDevice`.

A :class:`CpuDevice` has what tests/gpu/harness.KernelCase needs of a device (``alloc``, ``upload``,
``download``, ``synchronize``, ``info``) and :meth:`CpuDevice.plan`, a plan of launches, GEMMs (cuBLASLt's
result in float64 from the stored operands, rounded once to D's type: tests/emulator.py's), memsets and
copies; its runs alternate between increasing thread order (runs 1, 3, ...) and decreasing (2, 4, ...),
so the harness's two bit-identical runs catch a missing barrier. Every buffer has canary bytes before
and after it, checked after every launch: an out-of-bounds write fails naming the buffer (by the launch
arguments that point into it). Launches are checked as the driver checks them (block and grid sizes,
dynamic shared memory). Compiled libraries are cached under rwkvx's cache folder (``cpuexec/``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import struct
import subprocess
import tempfile
import weakref
from pathlib import Path

import numpy as np

import rwkvx.cu  # noqa: F401  (declares every kernel)
from emulator import Memory, _gemm, run_memory_op
from rwkvx.runtime.cache import cache_root
from rwkvx.runtime.device import H200, DeviceInfo
from rwkvx.runtime.kernel import KernelFile
from rwkvx.runtime.nvrtc import CU_DIR
from rwkvx.runtime.ops import DevPtr, Gemm, Launch, as_ptr, flatten_ops

INCLUDE = Path(__file__).resolve().parent / "include"
CXX_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-fno-strict-aliasing", "-ffp-contract=off", "-w")
CANARY = 256                       # bytes before and after every buffer (keeps the 256-byte alignment)
CANARY_BYTE = 0xA5
MAX_BLOCK = (1024, 1024, 64)       # the driver's limits (sm_90)
MAX_BLOCK_THREADS = 1024
MAX_GRID = (2 ** 31 - 1, 65535, 65535)
ERROR_BYTES = 4096
# `extern __shared__ [__align__(n)] T name[];` -> a pointer to the launch's dynamic shared memory
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\s*\d+\s*\)\s+)?([\w:]+)\s+(\w+)\s*\[\s*\]\s*;")
# `__cluster_dims__(x, y, z) [__launch_bounds__(...)] name(`: a kernel's cluster shape, each dimension a number
# or a define
_CLUSTER_DIMS = re.compile(r"__cluster_dims__\(([^)]*)\)\s*(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(")
MAX_CLUSTER_BLOCKS = 8             # the portable cluster size


class KernelFault(RuntimeError):
    """A kernel failed on the CPU: a deadlock, a bad collective, a trap, an out-of-bounds write."""


def unavailable_reason() -> str | None:
    """None when kernels can run here, else why not (the runtime needs g++ and x86-64)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"CPU kernel execution needs x86-64 (fiber switching), this is {platform.machine()}"
    if shutil.which("g++") is None:
        return "CPU kernel execution needs g++, which is not on PATH"
    return None


def cpu_source(src: str) -> str:
    """CUDA source with its dynamic shared memory declarations (in a kernel or at namespace scope) made
    constant pointers to the CPU runtime's buffer."""
    return _EXTERN_SHARED.sub(r"\1* const \2 = reinterpret_cast<\1*>(cpuexec_smem);", src)


def cluster_shapes(src: str, defines: tuple[tuple[str, str], ...]) -> dict[str, tuple[int, int, int]]:
    """Kernel name -> its ``__cluster_dims__`` in ``src`` compiled with ``defines`` (kernels without one absent)."""
    values = dict(defines)
    shapes = {}
    for dims, name in _CLUSTER_DIMS.findall(src):
        shape = tuple(int(values.get(d.strip(), d.strip())) for d in dims.split(","))
        if len(shape) != 3:
            raise ValueError(f"__cluster_dims__ of {name}: three dimensions, got {dims!r}")
        shapes[name] = shape
    return shapes


def _write_tree(dest: Path, module: str, text: str | None) -> None:
    """rwkvx/cu's kernel files and headers, as :func:`cpu_source` makes them, under ``dest`` (those
    tests/cuda_cpu/include replaces left out, so no include finds them), and the compiled file as
    ``<module>.cu`` (source ``text``, else rwkvx/cu's)."""
    replaced = {p.name for p in INCLUDE.iterdir()}
    for p in CU_DIR.rglob("*"):
        if p.suffix in (".cu", ".cuh") and not (p.parent == CU_DIR and p.name in replaced):
            (dest / p.relative_to(CU_DIR)).parent.mkdir(parents=True, exist_ok=True)
            (dest / p.relative_to(CU_DIR)).write_text(cpu_source(p.read_text()))
    if text is not None:
        (dest / f"{module}.cu").parent.mkdir(parents=True, exist_ok=True)
        (dest / f"{module}.cu").write_text(cpu_source(text))


def wrapper_source(kf: KernelFile) -> str:
    """The translation unit of one kernel file: the file itself and ``cpuexec_launch``, which calls kernel
    number ``k`` (declaration order) with its arguments from an array of 8-byte slots."""
    calls, names = [], []
    for i, k in enumerate(kf.kernels.values()):
        args = ", ".join(f"*({a.c_type()} const*)(a + {j})" for j, (_, a) in enumerate(k.params))
        calls.append(f"static void cpuexec_k{i}(const uint64_t* a) {{ {k.name}({args}); }}")
        names.append(f'"{k.name}"')
    fns = ", ".join(f"cpuexec_k{i}" for i in range(len(calls)))
    return "\n".join([
        f'#include "{kf.module}.cu"', *calls,
        'extern "C" int cpuexec_launch(int k, const uint64_t* args, const unsigned* grid, const unsigned* block,',
        "                              const unsigned* cluster, unsigned long long smem, int descending, char* err,",
        "                              int errlen) {",
        f"    static void (*const fns[])(const uint64_t*) = {{{fns}}};",
        f"    static const char* const names[] = {{{', '.join(names)}}};",
        "    return cpuexec_launch_impl(fns[k], names[k], args, grid, block, cluster, smem, descending, err, errlen);",
        "}", ""])


def _compiler_id() -> bytes:
    return subprocess.run(["g++", "--version"], capture_output=True, check=True).stdout


def _headers_digest() -> bytes:
    h = hashlib.sha256()
    for d in (CU_DIR, INCLUDE):
        for p in sorted(d.rglob("*")):
            if p.suffix in (".cuh", ".h"):
                h.update(str(p.relative_to(d)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.digest()


def compile_file(kf: KernelFile, defines: tuple[tuple[str, str], ...], text: str | None = None,
                 smem_bytes: int = H200.smem_per_block) -> Path:
    """The shared library of declared kernel file ``kf`` (rwkvx/cu/<module>.cu, or the source ``text``)
    compiled with ``defines``, for launches of up to ``smem_bytes`` of dynamic shared memory (cached;
    built when missing)."""
    module = kf.module
    src = (CU_DIR / f"{module}.cu").read_text() if text is None else text
    flags = [*CXX_FLAGS, "-include", str(INCLUDE / "cuda_cpu.h"), f"-DCPUEXEC_DYNAMIC_SMEM_BYTES={smem_bytes}",
             *(f"-D{n}={v}" for n, v in defines)]
    wrapper = wrapper_source(kf)
    key = hashlib.sha256(b"\0".join([_compiler_id(), _headers_digest(), src.encode(), wrapper.encode(),
                                     "\0".join(flags).encode()])).hexdigest()
    folder = cache_root() / "cpuexec"
    lib = folder / f"{module.replace('/', '_')}-{key[:24]}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{lib.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory() as work:      # the sources g++ reads: this process's own copies
            _write_tree(Path(work) / "cu", module, text)
            (Path(work) / "launch.cpp").write_text(wrapper)
            res = subprocess.run(["g++", *flags, f"-I{INCLUDE}", f"-I{Path(work) / 'cu'}", str(Path(work) / "launch.cpp"),
                                  "-o", tmp], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ failed to compile {module}.cu for the CPU ({' '.join(f'-D{n}={v}' for n, v in defines)})"
                               f":\n{res.stderr[-6000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class CpuBuffer:
    """Host memory standing in for a device allocation: ``nbytes`` at ``ptr`` between two canaries."""

    def __init__(self, nbytes: int):
        self.nbytes = int(nbytes)
        self._raw = np.full(self.nbytes + 2 * CANARY + 256, CANARY_BYTE, np.uint8)
        start = -self._raw.ctypes.data % 256
        self._whole = self._raw[start:start + self.nbytes + 2 * CANARY]
        self.view = self._whole[CANARY:CANARY + self.nbytes]
        self.view[:] = 0xFF
        self.ptr = self.view.ctypes.data

    def __int__(self) -> int:
        return self.ptr

    def __index__(self) -> int:
        return self.ptr

    def typed(self, elem: str) -> DevPtr:
        """The buffer's start as a pointer to ``elem`` elements."""
        return DevPtr(self.ptr, elem)

    def canaries_intact(self) -> bool:
        """Whether the bytes before and after the buffer are as allocated."""
        return bool((self._whole[:CANARY] == CANARY_BYTE).all() and (self._whole[-CANARY:] == CANARY_BYTE).all())


class CpuPlan:
    """Ops executed in order on a :class:`CpuDevice`; odd runs in increasing thread order, even runs in
    decreasing."""

    def __init__(self, dev: "CpuDevice", ops):
        self.dev, self.ops, self.runs = dev, flatten_ops(ops), 0

    def run(self) -> None:
        """Execute the ops once."""
        descending = self.runs % 2 == 1
        self.runs += 1
        for op in self.ops:
            self.dev.execute(op, descending)


class CpuDevice:
    """Kernels run on the CPU over host memory (see the module docstring). ``info``: the GPU whose limits
    launches are checked against and whose properties launch builders size grids from. ``sources``: kernel
    files that are not in rwkvx/cu (e.g. a test's), each a declaration and its source text."""

    def __init__(self, info: DeviceInfo = H200, sources: list[tuple[KernelFile, str]] | None = None):
        self.info = info
        self.sources = {kf.module: (kf, text) for kf, text in sources or ()}
        self._buffers: weakref.WeakSet[CpuBuffer] = weakref.WeakSet()
        self._libs: dict[tuple, tuple[ctypes.CDLL, dict[str, tuple[int, int, int]]]] = {}

    def alloc(self, nbytes: int) -> CpuBuffer:
        """``nbytes`` of memory (filled with 0xFF bytes: NaN floats)."""
        buf = CpuBuffer(nbytes)
        self._buffers.add(buf)
        return buf

    def upload(self, ptr, array) -> None:
        """Copy a numpy array to memory at ``ptr``."""
        arr = np.ascontiguousarray(array)
        self._memory().bytes(as_ptr(ptr, "upload"), arr.nbytes)[:] = arr.reshape(-1).view(np.uint8)

    def download(self, ptr, shape, dtype=np.float32) -> np.ndarray:
        """A copy of the memory at ``ptr`` as an array of ``shape`` and ``dtype``."""
        out = np.empty(shape, dtype)
        out.reshape(-1).view(np.uint8)[:] = self._memory().bytes(as_ptr(ptr, "download"), out.nbytes)
        return out

    def synchronize(self) -> None:
        """Nothing to wait for: ops run when executed."""

    def plan(self, ops) -> CpuPlan:
        """A plan of ``ops`` (launches, memsets, copies) on this device."""
        return CpuPlan(self, ops)

    def _memory(self) -> Memory:
        mem = Memory()
        for buf in self._buffers:
            mem.add(buf.ptr, buf.nbytes, buf.view)
        return mem

    def execute(self, op, descending: bool = False) -> None:
        """Run one op: a launch (threads in decreasing order when ``descending``), a GEMM, a memset or a copy."""
        if isinstance(op, Launch):
            self._launch(op, descending)
        elif isinstance(op, Gemm):
            _gemm(self._memory(), op)
        elif not run_memory_op(self._memory(), op):
            raise TypeError(f"the CPU device runs kernels, GEMMs, memsets and copies, not {type(op).__name__}")

    def _library(self, op: Launch) -> tuple[ctypes.CDLL, dict[str, tuple[int, int, int]]]:
        """The compiled kernel file of ``op`` and its kernels' cluster shapes."""
        key = (op.module, op.defines)
        if key not in self._libs:
            kf, text = self.sources[op.module] if op.module in self.sources else (KernelFile.registry[op.module], None)
            lib = ctypes.CDLL(str(compile_file(kf, op.defines, text, self.info.smem_per_block)))
            lib.cpuexec_launch.restype = ctypes.c_int
            lib.cpuexec_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_int, ctypes.c_char_p,
                                           ctypes.c_int]
            src = (CU_DIR / f"{op.module}.cu").read_text() if text is None else text
            self._libs[key] = lib, cluster_shapes(src, op.defines)
        return self._libs[key]

    def _check_launch(self, op: Launch) -> None:
        what = f"launch of {op.name}"
        if any(b > m for b, m in zip(op.block, MAX_BLOCK)) or np.prod(op.block) > MAX_BLOCK_THREADS:
            raise ValueError(f"{what}: block {op.block} exceeds the limits {MAX_BLOCK}, {MAX_BLOCK_THREADS} threads")
        if any(g > m for g, m in zip(op.grid, MAX_GRID)):
            raise ValueError(f"{what}: grid {op.grid} exceeds the limits {MAX_GRID}")
        if op.smem > self.info.smem_per_block:
            raise ValueError(f"{what}: {op.smem} bytes of dynamic shared memory, more than the "
                             f"{self.info.smem_per_block} a block of {self.info.arch} may opt in to")

    def _owner(self, addr: int) -> CpuBuffer | None:
        return next((b for b in self._buffers if b.ptr <= addr < b.ptr + max(b.nbytes, 1)), None)

    def _launch(self, op: Launch, descending: bool) -> None:
        self._check_launch(op)
        kf = self.sources[op.module][0] if op.module in self.sources else KernelFile.registry[op.module]
        index = list(kf.kernels).index(op.name)
        params = kf.kernels[op.name].params
        slots = (ctypes.c_uint64 * max(1, len(op.args)))()
        pointers: dict[int, list[str]] = {}
        for i, ((pname, _), (kind, value)) in enumerate(zip(params, op.args)):
            if kind == "p" and value:
                owner = self._owner(value)
                if owner is None:
                    raise ValueError(f"launch of {op.name}: argument {pname} (0x{value:x}) points into no buffer")
                pointers.setdefault(id(owner), []).append(pname)
            fmt = {"p": "<Q", "i": "<i", "l": "<q", "f": "<f", "d": "<d"}[kind]
            slots[i] = int.from_bytes(struct.pack(fmt, value).ljust(8, b"\0"), "little")
        lib, clusters = self._library(op)
        cluster = clusters.get(op.name, (1, 1, 1))
        if np.prod(cluster) > MAX_CLUSTER_BLOCKS:
            raise ValueError(f"launch of {op.name}: cluster {cluster} of more than {MAX_CLUSTER_BLOCKS} blocks")
        err = ctypes.create_string_buffer(ERROR_BYTES)
        rc = lib.cpuexec_launch(index, slots, (ctypes.c_uint * 3)(*op.grid), (ctypes.c_uint * 3)(*op.block),
                                (ctypes.c_uint * 3)(*cluster), op.smem, int(descending), err, ERROR_BYTES)
        if rc:
            raise KernelFault(err.value.decode(errors="replace"))
        for buf in self._buffers:
            if not buf.canaries_intact():
                names = pointers.get(id(buf))
                named = f"the buffer of argument(s) {', '.join(names)}" if names else "a buffer none of its arguments points into"
                raise KernelFault(f"{op.name} wrote out of bounds of {named} ({buf.nbytes} bytes at 0x{buf.ptr:x})")
