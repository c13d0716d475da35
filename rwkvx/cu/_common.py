"""Helpers shared by the launch builders in rwkvx/cu: argument checks and grid sizes.

Importing this needs no GPU. Builders take typed device pointers (:class:`~rwkvx.runtime.ops.DevPtr`);
the activation element type of a launch is the element type of its activation buffers.
"""
from __future__ import annotations

import math

from rwkvx.runtime.device import DeviceInfo
from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.ops import DevPtr

__all__ = ["DevPtr", "DeviceInfo", "carve", "carved_bytes", "check_buffers", "check_rows", "grid_stride_blocks", "xtype_of"]

GRID_STRIDE_BLOCKS_PER_SM = 16     # grid-stride element-wise kernels: enough blocks in flight, no more


def check_rows(what: str, R: int, C: int, *ptrs) -> None:
    """Validate a row-wise [R, C] kernel: R, C > 0, C % 4 == 0, pointers aligned to 4 elements."""
    if R <= 0 or C <= 0:
        raise ValueError(f"{what}: rows={R} and C={C} must be positive")
    if C % 4:
        raise ValueError(f"{what}: C={C} must be a multiple of 4")
    for i, p in enumerate(ptrs):
        if isinstance(p, DevPtr) and int(p) % (4 * ELEM_BYTES[p.elem]):
            raise ValueError(f"{what}: pointer argument {i} (0x{int(p):x}) is not aligned to 4 {p.elem} "
                             "elements")


def check_buffers(what: str, **ptrs) -> None:
    """Every named buffer is given (not None) and 16-byte aligned (the kernels' vector accesses)."""
    for name, p in ptrs.items():
        if p is None:
            raise ValueError(f"{what}: {name} is required (NULL pointer)")
        if int(p) % 16:
            raise ValueError(f"{what}: {name} must be 16-byte aligned (got 0x{int(p):x})")


def grid_stride_blocks(n: int, dev: DeviceInfo, threads: int = 256) -> int:
    """Blocks of ``threads`` for a grid-stride loop over ``n`` items on ``dev``."""
    return max(1, min(math.ceil(n / threads), GRID_STRIDE_BLOCKS_PER_SM * dev.sm_count))


def xtype_of(what: str, *ptrs) -> str:
    """The common element type of a launch's activation buffers (TypeError if they differ)."""
    elems = {p.elem for p in ptrs if isinstance(p, DevPtr)}
    if len(elems) != 1:
        raise TypeError(f"{what}: activation buffers must share one element type, got {sorted(elems) or 'none'}")
    return elems.pop()


def carve(base: int, sizes: dict[str, tuple[int, str]], align: int = 256) -> dict[str, DevPtr | None]:
    """Typed pointers for buffers of ``sizes`` (name -> (elements, element type)) laid out one after
    another from address ``base``, each ``align``-byte aligned; empty buffers get None."""
    out: dict[str, DevPtr | None] = {}
    addr = int(base)
    for name, (count, elem) in sizes.items():
        out[name] = DevPtr(addr, elem) if count else None
        addr += -(-count * ELEM_BYTES[elem] // align) * align
    return out


def carved_bytes(sizes: dict[str, tuple[int, str]], align: int = 256) -> int:
    """Bytes :func:`carve` lays out for ``sizes``."""
    return sum(-(-count * ELEM_BYTES[elem] // align) * align for count, elem in sizes.values())
