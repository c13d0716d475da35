"""Check that a source change to kernel files leaves their machine code as it was: every declared variant x
element type of each kernel file compiled by NVRTC from the tree at a git revision and from the working
tree, the CUBIN bytes compared. Moving inline PTX into shared headers (so that tests/cuda_cpu can replace
them) must pass this.

Usage (from the repository root; needs NVRTC, not a GPU)::

    python tests/cuda_cpu/cubin_identity.py REV [MODULE ...]

MODULE is ``<family>/<file>``; without any, every kernel file whose source or included headers differ from
REV. Prints one line per file and exits non-zero when any CUBIN differs.

NVRTC does not always give the same bytes for the same source (seen for the largest wkv7/chunked variant
on a loaded machine: a second compile of the unchanged source differs from the first). Where the first
CUBINs differ, both sides are compiled again, up to RETRIES times each; a variant is identical when one
CUBIN came from both, and the line counts those variants separately.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import rwkvx.cu  # noqa: F401  (declares every kernel)
from rwkvx.runtime import nvrtc
from rwkvx.runtime.kernel import KernelFile

ROOT = Path(__file__).resolve().parents[2]
RETRIES = 3


def _tree_at(rev: str, dest: Path) -> Path:
    """rwkvx/cu as of ``rev``, extracted under ``dest``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "rwkvx/cu"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "rwkvx" / "cu"


def _cubin(cu_dir: Path, module: str, defines) -> bytes:
    """NVRTC's CUBIN of ``cu_dir``/<module>.cu with the options of rwkvx.runtime.nvrtc, headers from ``cu_dir``."""
    options = [o if o != f"--include-path={nvrtc.CU_DIR}" else f"--include-path={cu_dir}"
               for o in nvrtc.build_options("sm_90", defines)]
    return nvrtc._compile(f"{module}.cu", (cu_dir / f"{module}.cu").read_text(), options, module)[0]


def changed_modules(old: Path) -> list[str]:
    """Kernel files whose source, or any header, differs between ``old`` and the working tree."""
    headers = {p.relative_to(old) for p in old.rglob("*.cuh")} | {p.relative_to(nvrtc.CU_DIR) for p in nvrtc.CU_DIR.rglob("*.cuh")}
    header_changed = any(not (old / h).exists() or not (nvrtc.CU_DIR / h).exists()
                         or (old / h).read_bytes() != (nvrtc.CU_DIR / h).read_bytes() for h in headers)
    return sorted(m for m in KernelFile.registry if (old / f"{m}.cu").exists() and (
        header_changed or (old / f"{m}.cu").read_bytes() != (nvrtc.CU_DIR / f"{m}.cu").read_bytes()))


def same_machine_code(old: Path, module: str, defines) -> str:
    """"first" when the CUBINs of the two trees are equal, "retried" when equal only after recompiling
    (see the module docstring), else "differ"."""
    seen_old, seen_new = {_cubin(old, module, defines)}, {_cubin(nvrtc.CU_DIR, module, defines)}
    if seen_old & seen_new:
        return "first"
    for _ in range(RETRIES):
        seen_old.add(_cubin(old, module, defines))
        seen_new.add(_cubin(nvrtc.CU_DIR, module, defines))
        if seen_old & seen_new:
            return "retried"
    return "differ"


def compare(rev: str, modules: list[str]) -> int:
    """Compare the CUBINs of ``modules`` (all changed ones when empty) at ``rev`` and now; the number differing."""
    with tempfile.TemporaryDirectory() as tmp:
        old = _tree_at(rev, Path(tmp))
        bad = 0
        for module in modules or changed_modules(old):
            cases = KernelFile.registry[module].compile_cases()
            results = [same_machine_code(old, module, d) for d in cases]
            diff = [dict(d) for d, r in zip(cases, results) if r == "differ"]
            bad += len(diff)
            print(f"{module}: {len(cases) - len(diff)} of {len(cases)} variants identical "
                  f"({results.count('retried')} after recompiling)" + (f"; differ: {diff}" if diff else ""))
        return bad


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(1 if compare(sys.argv[1], sys.argv[2:]) else 0)
