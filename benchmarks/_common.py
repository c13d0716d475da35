"""Helpers the step benchmarks share (benchmarks/ is no package: the benchmark files import this module
by name, as pytest puts their folder on the path)."""
from __future__ import annotations

import gc

import pytest

GIB = 2 ** 30


def free_memory(dev) -> int:
    """Bytes free on ``dev`` once the garbage is collected (a previous benchmark's model frees its arena)."""
    gc.collect()
    return dev.memory_info()["free"]


def skip_unless_fits(label: str, need: int, free: int, reserve: int = 0) -> None:
    """Skip the benchmark ``label`` names when an arena of ``need`` bytes and ``reserve`` more do not fit
    ``free`` bytes; the reason gives the arena's size and the free memory, GiB."""
    if need + reserve > free:
        pytest.skip(f"{label}: the arena takes {need / GIB:.1f} GiB, {free / GIB:.1f} GiB free")
