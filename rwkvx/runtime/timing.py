"""Timing device work with CUDA events recorded on the device's stream: :class:`EventTimer`, and
:func:`warm_time_ms` for work timed after a warm-up run, repeated :func:`budget_repeats` times."""
from __future__ import annotations

from typing import Callable

from .errors import check


class EventTimer:
    """Milliseconds of device time for work enqueued between two events on ``dev.stream``."""

    def __init__(self, dev):
        from cuda.bindings import driver
        self._driver, self._dev = driver, dev
        self._start = check(driver.cuEventCreate(0), "cuEventCreate")
        self._stop = check(driver.cuEventCreate(0), "cuEventCreate")

    def time_ms(self, enqueue: Callable[[], None], repeats: int = 1) -> float:
        """Mean device milliseconds of one ``enqueue()`` (called ``repeats`` times between the events)."""
        drv, stream = self._driver, self._dev.stream
        check(drv.cuEventRecord(self._start, stream), "cuEventRecord")
        for _ in range(repeats):
            enqueue()
        check(drv.cuEventRecord(self._stop, stream), "cuEventRecord")
        check(drv.cuEventSynchronize(self._stop), "cuEventSynchronize")
        return float(check(drv.cuEventElapsedTime(self._start, self._stop), "cuEventElapsedTime")) / repeats

    def close(self) -> None:
        """Destroy both events."""
        for event in (self._start, self._stop):
            check(self._driver.cuEventDestroy(event), "cuEventDestroy")


BUDGET_MS = 50.0        # device time a timing fills by default


def budget_repeats(one_ms: float, budget_ms: float = BUDGET_MS) -> int:
    """Calls of ``one_ms`` device milliseconds each that fill about ``budget_ms`` (3 to 200): how often a
    timing repeats its work."""
    return max(3, min(200, int(budget_ms / max(one_ms, 1e-3))))


def warm_time_ms(dev, enqueue: Callable[[], None], repeats: int | None = None,
                 budget_ms: float = BUDGET_MS) -> float:
    """Mean device milliseconds of one ``enqueue()`` after a warm-up call (modules loaded, caches filled):
    ``repeats`` calls between the events, or, where None, as many as fill about ``budget_ms`` of device time
    (3 to 200, from one timed call)."""
    if repeats is not None and repeats < 1:
        raise ValueError(f"warm_time_ms: repeats must be >= 1, got {repeats}")
    enqueue()
    dev.synchronize()
    timer = EventTimer(dev)
    try:
        if repeats is None:
            repeats = budget_repeats(timer.time_ms(enqueue, 1), budget_ms)
        return timer.time_ms(enqueue, repeats)
    finally:
        timer.close()
