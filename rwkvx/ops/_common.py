"""Helpers shared by the launch builders in rwkvx/ops: pointer coercion and the Launch record.

Importing this needs no GPU (:mod:`rwkvx.runtime.ops` is plain data) and causes no import cycle
(rwkvx.runtime never imports rwkvx.ops).
"""
from __future__ import annotations

from rwkvx.runtime.ops import Launch, Memset

__all__ = ["Launch", "Memset", "ptr"]


def ptr(x) -> int:
    """A device pointer as int: ``None`` -> 0, objects with a ``.ptr`` (DeviceBuffer) -> that, else int(x)."""
    if x is None:
        return 0
    if hasattr(x, "ptr") and not isinstance(x, int):
        return int(x.ptr)
    return int(x)
