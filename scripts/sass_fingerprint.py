"""Hash every kernel's machine code: for each declared kernel file, each (element type x variant) it is
compiled with, and each kernel in it, the sha256 of the kernel's SASS (the CUBIN's ``.text.<kernel>``
section) with the sizes of its parameter block and static shared memory.

Two trees whose fingerprints are equal run the same machine code, so a reorganisation of the CUDA
sources (files split, helpers moved to shared headers, comments) is shown to leave every result
bit-identical without a GPU: NVRTC compiles here. Keys name the kernel, not its file, so a kernel may
move between files.

    python scripts/sass_fingerprint.py before.json            # on one tree
    python scripts/sass_fingerprint.py after.json --compare before.json
    python scripts/sass_fingerprint.py after.json --compare before.json --only moba/ embedding   # some files only

``--only`` builds just the kernel files whose module path contains one of the given texts (a quick check
of an edit to those files); the comparison then covers only the kernels it built.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
from collections.abc import Sequence

import rwkvx.cu  # noqa: F401  (declares every kernel file)
from rwkvx.runtime import nvrtc
from rwkvx.runtime.kernel import KernelFile


def elf_sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF image (NOBITS sections as zeros)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = headers[shstrndx][4]
    out = {}
    for name, kind, _flags, _addr, offset, size in headers:
        label = elf[names_at + name:elf.index(b"\0", names_at + name)].decode()
        out[label] = b"\0" * size if kind == 8 else elf[offset:offset + size]
    return out


def kernel_files(only: Sequence[str] = ("",)) -> list[tuple[str, KernelFile]]:
    """The declared kernel files whose module path contains one of ``only`` (all of them by default)."""
    return [(module, kf) for module, kf in sorted(KernelFile.registry.items())
            if any(text in module for text in only)]


def fingerprint(arch: str = "sm_90", only: Sequence[str] = ("",)) -> dict[str, str]:
    """``kernel|FLOATX_BF16=x|variant`` -> hash of its SASS, parameter-block and shared-memory sizes, for
    the kernel files ``kernel_files(only)``."""
    result = {}
    for module, kf in kernel_files(only):
        for defines in kf.compile_cases():
            d = dict(defines)
            case = ",".join(f"{k}={d[k]}" for k in sorted(kf.variants))
            sections = elf_sections(nvrtc.compile_cubin(module, arch, defines, use_cache=False))
            for kernel in kf.kernels:
                text = sections.get(f".text.{kernel}")
                if text is None:         # not instantiated for this variant
                    continue
                result[f"{kernel}|FLOATX_BF16={d['FLOATX_BF16']}|{case}"] = (
                    f"{hashlib.sha256(text).hexdigest()[:20]} params={len(sections.get(f'.nv.constant0.{kernel}', b''))}"
                    f" shared={len(sections.get(f'.nv.shared.{kernel}', b''))}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--compare", help="an earlier fingerprint: list the kernels whose code differs")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--only", nargs="+", default=[""], metavar="TEXT",
                    help="build only the kernel files whose module path contains a TEXT; compare only their kernels")
    args = ap.parse_args()
    fp = fingerprint(args.arch, args.only)
    with open(args.out, "w") as f:
        json.dump(fp, f, indent=0, sort_keys=True)
    print(f"{len(fp)} kernel builds fingerprinted")
    if args.compare:
        with open(args.compare) as f:
            old = json.load(f)
        if args.only != [""]:            # only the kernels of the files built
            kernels = {kernel for _, kf in kernel_files(args.only) for kernel in kf.kernels}
            old = {k: h for k, h in old.items() if k.split("|")[0] in kernels}
        changed = sorted(k for k in old.keys() | fp.keys() if old.get(k) != fp.get(k))
        for k in changed:
            print(f"differs: {k}: {old.get(k, 'absent')} -> {fp.get(k, 'absent')}")
        print(f"{len(changed)} of {len(old)} differ")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
