"""NVRTC: compile rwkvx/cu/<module>.cu (or a source string) to CUBIN, with an on-disk cache.

Works without a GPU (CI compiles every kernel file for sm_90). All NVRTC options are set here, in
:func:`build_options`:

* ``--gpu-architecture=sm_XY`` (CUBIN, not PTX: the driver then needs no JIT and the binary matches the
  NVRTC that built it), ``-std=c++17``, ``-default-device``;
* no ``--use_fast_math`` (the kernels must match the float64 oracle closely); FMA contraction stays at
  NVRTC's default (on), which is deterministic;
* include paths: the CUDA runtime headers (``cuda_bf16.h`` ...) and, when present, CCCL, both located
  through ``cuda.pathfinder``, then rwkvx/cu itself for local ``#include "x.cuh"`` files;
* ``-DNAME=value`` for each entry of ``defines`` (sorted, so the order given does not matter): a
  file's constants, its element type and its variant, from its declaration (:mod:`rwkvx.runtime.kernel`).

Cache: directory ``$RWKVX_CACHE_DIR``, else ``$XDG_CACHE_HOME/rwkvx``, else ``~/.cache/rwkvx``
(subfolder ``cubin``). Key: sha256 of the source, every local file it ``#include``s from rwkvx/cu
(recursively), the options, the NVRTC version and the architecture. Writes are atomic (temporary file in
the same folder + ``os.replace``); an unwritable cache only costs recompilation (a warning is given).
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path

from .cache import cache_root
from .errors import CudaError, NvrtcCompileError, check_nvrtc
from .ops import normalize_defines

CU_DIR = Path(__file__).resolve().parent.parent / "cu"
BASE_OPTIONS = ("-std=c++17", "-default-device")
_CACHE_FORMAT = b"rwkvx-nvrtc-cache-v1"
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)

_lock = threading.Lock()
_stats = {"compiles": 0, "cache_hits": 0}
_include_dirs_cache: list[str] | None = None


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RuntimeError("NVRTC is not available: pip install 'rwkvx[cu13]' "
                           "(cuda-bindings and nvidia-cuda-nvrtc 13.0)") from e
    return nvrtc


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC; raises RuntimeError when NVRTC cannot be loaded."""
    nvrtc = _nvrtc()
    try:
        major, minor = check_nvrtc(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except CudaError:
        raise
    except Exception as e:  # library not found (cuda.pathfinder raises its own error types)
        raise RuntimeError(f"NVRTC library could not be loaded: {e}") from e
    return int(major), int(minor)


def nvrtc_available() -> tuple[bool, str]:
    """(True, "") when NVRTC can compile here, else (False, reason)."""
    try:
        nvrtc_version()
        include_dirs()
    except Exception as e:  # noqa: BLE001 - reported to the caller as the reason
        return False, f"{type(e).__name__}: {e}"
    return True, ""


def include_dirs() -> list[str]:
    """Header folders for NVRTC: CUDA runtime headers (required), CCCL (optional), rwkvx/cu."""
    return [*_system_include_dirs(), str(CU_DIR)]


def _system_include_dirs() -> list[str]:
    global _include_dirs_cache
    if _include_dirs_cache is not None:
        return list(_include_dirs_cache)
    dirs: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError as e:
        raise RuntimeError("cuda-pathfinder is needed to locate the CUDA headers for NVRTC") from e
    cudart = find_nvidia_header_directory("cudart")
    if not cudart:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            cudart = os.path.join(home, "include")
    if not cudart:
        raise RuntimeError("CUDA runtime headers (cuda_bf16.h ...) not found for NVRTC: "
                           "pip install 'nvidia-cuda-runtime==13.0.*'")
    dirs.append(str(cudart))
    try:
        cccl = find_nvidia_header_directory("cccl")
    except Exception:  # noqa: BLE001 - CCCL is optional (only <cuda/std/...> needs it)
        cccl = None
    if cccl and str(cccl) not in dirs:
        dirs.append(str(cccl))
    _include_dirs_cache = dirs
    return list(dirs)


def build_options(arch: str = "sm_90", defines=()) -> list[str]:
    """The complete NVRTC option list (the one place options are set)."""
    if not re.fullmatch(r"sm_\d+[a-z]?", arch):
        raise ValueError(f"arch must look like 'sm_90', got {arch!r}")
    opts = [f"--gpu-architecture={arch}", *BASE_OPTIONS]
    opts += [f"--include-path={d}" for d in include_dirs()]
    opts += [f"-D{name}={value}" for name, value in normalize_defines(defines)]
    return opts


def cache_dir() -> Path:
    """Folder of cached CUBINs (not created here)."""
    return cache_root() / "cubin"


def cache_stats() -> dict:
    """Counters since import: NVRTC compiles run and disk-cache hits."""
    with _lock:
        return dict(_stats)


def _local_includes(src: str, seen: dict[str, bytes], base_dirs: list[Path]) -> None:
    for inc in _INCLUDE_RE.findall(src):
        if inc in seen:
            continue
        for d in base_dirs:
            p = d / inc
            if p.is_file():
                data = p.read_bytes()
                seen[inc] = data
                _local_includes(data.decode("utf-8", "replace"), seen, [p.parent, *base_dirs])
                break


def cache_key(name: str, src: str, options: list[str], arch: str,
              extra_dirs: list[Path] | None = None) -> str:
    """The hex SHA-256 naming a compiled module in the cache: the cache format, the kernel ``name``, the
    target ``arch``, the NVRTC version, the compile ``options``, the source and the bytes of every local
    header it includes (searched in ``extra_dirs``, then ``rwkvx/cu``), so that a change to any of them
    compiles again."""
    h = hashlib.sha256()
    h.update(_CACHE_FORMAT + b"\0")
    h.update(name.encode() + b"\0" + arch.encode() + b"\0")
    h.update(repr(nvrtc_version()).encode() + b"\0")
    h.update("\0".join(options).encode() + b"\0\0")
    h.update(src.encode())
    incs: dict[str, bytes] = {}
    _local_includes(src, incs, [*(extra_dirs or []), CU_DIR])
    for inc in sorted(incs):
        h.update(b"\0include\0" + inc.encode() + b"\0" + hashlib.sha256(incs[inc]).digest())
    return h.hexdigest()


def _compile(name: str, src: str, options: list[str], origin: str) -> tuple[bytes, str]:
    nvrtc = _nvrtc()
    prog = check_nvrtc(nvrtc.nvrtcCreateProgram(src.encode(), name.encode(), 0, [], []),
                       "nvrtcCreateProgram", origin)
    try:
        opts = [o.encode() for o in options]
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log_size = check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize", origin)
        log = b""
        if log_size and log_size > 1:
            buf = b" " * log_size
            check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog", origin)
            log = buf.rstrip(b"\0 ")
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            text = log.decode("utf-8", "replace")
            raise NvrtcCompileError(
                f"NVRTC failed to compile {origin} (nvrtcResult {int(err)})\n"
                f"options: {' '.join(options)}\n--- compile log ---\n{text}",
                "nvrtcCompileProgram", int(err))
        size = check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize", origin)
        if not size:
            raise CudaError(f"nvrtcGetCUBINSize ({origin}) returned 0 bytes", "nvrtcGetCUBINSize")
        cubin = b" " * size
        check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN", origin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    with _lock:
        _stats["compiles"] += 1
    return bytes(cubin), log.decode("utf-8", "replace")


def _read_cache(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if data[:4] == b"\x7fELF" else None


def _write_cache(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as e:
        warnings.warn(f"rwkvx: could not write the NVRTC cache {path}: {e}", RuntimeWarning, stacklevel=3)


def compile_source(name: str, src: str, arch: str = "sm_90", defines=(), *, origin: str | None = None,
                   use_cache: bool = True) -> bytes:
    """Compile CUDA source text to CUBIN bytes for ``arch`` (disk-cached). ``name`` names the program
    (shown in the compile log) and the cache file; ``origin`` is the path shown in errors."""
    if not isinstance(src, str):
        raise TypeError("compile_source: src must be str")
    name = name if name.endswith((".cu", ".cuh")) else name + ".cu"
    options = build_options(arch, defines)
    origin = origin or name
    path = None
    if use_cache:
        key = cache_key(name, src, options, arch)
        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name.rsplit(".", 1)[0])
        path = cache_dir() / f"{stem}-{arch}-{key[:40]}.cubin"
        data = _read_cache(path)
        if data is not None:
            with _lock:
                _stats["cache_hits"] += 1
            return data
    data, _ = _compile(name, src, options, origin)
    if path is not None:
        _write_cache(path, data)
    return data


def module_path(module: str) -> Path:
    """rwkvx/cu/<family>/<file>.cu for the kernel module id ``"<family>/<file>"``."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)?", module):
        raise ValueError(f"bad kernel module name {module!r}")
    return CU_DIR / f"{module}.cu"


def compile_cubin(module: str, arch: str = "sm_90", defines=(), *, use_cache: bool = True) -> bytes:
    """Compile rwkvx/cu/<module>.cu to CUBIN bytes for ``arch``; needs NVRTC, not a GPU."""
    path = module_path(module)
    try:
        src = path.read_text()
    except OSError as e:
        raise FileNotFoundError(f"kernel module {module!r}: cannot read {path}: {e}") from e
    return compile_source(f"{module}.cu", src, arch, defines, origin=str(path), use_cache=use_cache)


_PTXAS_LINE = re.compile(r"Function properties for (\w+)|Compiling entry function '(\w+)'|"
                         r"Used (\d+) registers|(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads")


def resource_usage(module: str, arch: str = "sm_90", defines=()) -> dict[str, dict[str, int]]:
    """Per kernel of rwkvx/cu/<module>.cu: registers, stack frame and spill bytes from ptxas's report
    (compiled uncached with the same options plus ``--ptxas-options=-v``)."""
    path = module_path(module)
    _, log = _compile(f"{module}.cu", path.read_text(), build_options(arch, defines) + ["--ptxas-options=-v"],
                      str(path))
    usage: dict[str, dict[str, int]] = {}
    current = None
    for m in _PTXAS_LINE.finditer(log):
        if m.group(2):
            current = usage.setdefault(m.group(2), {})
        elif m.group(1):
            current = usage.setdefault(m.group(1), {})
        elif m.group(3) and current is not None:
            current["registers"] = int(m.group(3))
        elif m.group(4) and current is not None:
            current.update(stack=int(m.group(4)), spill_stores=int(m.group(5)), spill_loads=int(m.group(6)))
    return usage
