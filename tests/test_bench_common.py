"""CPU tests of benchmarks/_common.py, the fit check the step benchmarks share: a benchmark whose arena
(and any reserve) exceeds the free device memory is skipped with both sizes, one that fits runs."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

GIB = 2 ** 30


@pytest.fixture
def common(monkeypatch):
    """benchmarks/_common.py, imported by name as the benchmark files import it (benchmarks/ is no package)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    return importlib.import_module("_common")


class FakeDevice:
    """A device with ``free`` bytes free."""

    def __init__(self, free: int):
        self.free = free

    def memory_info(self) -> dict[str, int]:
        return {"free": self.free, "total": 2 * self.free}


def test_free_memory_reads_the_device(common):
    assert common.free_memory(FakeDevice(5 * GIB)) == 5 * GIB


def test_skips_with_both_sizes_when_the_arena_does_not_fit(common):
    with pytest.raises(pytest.skip.Exception, match=r"^pure_B8: the arena takes 3\.0 GiB, 2\.5 GiB free$"):
        common.skip_unless_fits("pure_B8", 3 * GIB, GIB * 5 // 2)
    # a reserve beside the arena: the arena alone fits, the two do not
    with pytest.raises(pytest.skip.Exception, match=r"takes 2\.0 GiB, 2\.5 GiB free"):
        common.skip_unless_fits("rwkv7-7.2b full at B = 1", 2 * GIB, GIB * 5 // 2, reserve=GIB)


def test_runs_when_the_arena_fits(common):
    common.skip_unless_fits("small", 2 * GIB, 2 * GIB)
    common.skip_unless_fits("small", GIB, 3 * GIB, reserve=2 * GIB)
