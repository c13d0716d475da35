"""A CUDA event for ordering the host after one piece of device work: :class:`Event` records a point on
the device stream; :meth:`Event.synchronize` waits for that point only (not for work enqueued after it),
:meth:`Event.query` asks without waiting."""
from __future__ import annotations

from .errors import check, driver_error


class Event:
    """A CUDA event without timing (CU_EVENT_DISABLE_TIMING: the cheapest to record and wait on)."""

    def __init__(self, dev):
        self._driver, self._dev = dev._driver, dev
        flags = self._driver.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self._event = check(self._driver.cuEventCreate(flags), "cuEventCreate")

    def record(self) -> None:
        """Mark the current end of the device stream's work."""
        check(self._driver.cuEventRecord(self._event, self._dev.stream), "cuEventRecord")

    def query(self) -> bool:
        """Whether the work before the last :meth:`record` has finished (True when never recorded)."""
        res = self._driver.cuEventQuery(self._event)
        code = int(res[0] if isinstance(res, tuple) else res)
        if code == int(self._driver.CUresult.CUDA_ERROR_NOT_READY):   # recorded work still running
            return False
        if code != 0:
            raise driver_error("cuEventQuery", code)
        return True

    def synchronize(self) -> None:
        """Wait for the work before the last :meth:`record`; asynchronous kernel faults surface here."""
        check(self._driver.cuEventSynchronize(self._event), "cuEventSynchronize")

    def close(self) -> None:
        """Destroy the event (idempotent)."""
        event, self._event = self._event, None
        if event is not None:
            check(self._driver.cuEventDestroy(event), "cuEventDestroy")

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - the driver may be gone at interpreter exit
            pass
