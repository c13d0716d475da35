"""Timing device work with CUDA events recorded on the device's stream."""
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
