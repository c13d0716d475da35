"""CUDA graphs: capture the work a function enqueues on the device stream, replay it with one call.

``Graph.capture(dev, fn)`` runs ``fn()`` between cuStreamBeginCapture (CU_STREAM_CAPTURE_MODE_GLOBAL) and
cuStreamEndCapture, then instantiates the graph and uploads it. Nothing executes during capture.
Run the same work once eagerly before capturing (loads modules, creates the cuBLAS handle, surfaces
errors with clear messages). Kernel arguments are baked in: feed new data by copying into the same
buffers (a captured CopyHtoD reads its pinned source when the graph runs).
"""
from __future__ import annotations

from .errors import CudaError, check


class Graph:
    """An instantiated, uploaded CUDA graph; :meth:`launch` replays it on ``dev.stream``."""

    def __init__(self, dev, graph, graph_exec, keep=None):
        self.dev = dev
        self._graph = graph
        self._exec = graph_exec
        self._keep = keep            # what the captured work refers to (e.g. the Plan), kept alive

    @classmethod
    def capture(cls, dev, fn) -> "Graph":
        driver = dev._driver
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
        check(driver.cuStreamBeginCapture(dev.stream, mode), "cuStreamBeginCapture")
        dev._capturing += 1
        try:
            try:
                fn()
            except BaseException:
                # end the capture (the stream must leave capture mode) and re-raise the original error
                try:
                    res = driver.cuStreamEndCapture(dev.stream)
                    if int(res[0]) == 0 and res[1] is not None and int(res[1]):
                        driver.cuGraphDestroy(res[1])
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    pass
                raise
            res = driver.cuStreamEndCapture(dev.stream)
        finally:
            dev._capturing -= 1
            if not dev._capturing:
                dev._flush_deferred_frees()
        if int(res[0]) != 0:
            from .errors import driver_error
            raise driver_error("cuStreamEndCapture", int(res[0]),
                               "the captured work used an operation that is illegal during stream capture "
                               "(synchronous copy/memset, allocation, synchronisation, module loading) "
                               "or another thread did")
        graph = res[1]
        try:
            graph_exec = check(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        except BaseException:
            driver.cuGraphDestroy(graph)
            raise
        try:
            check(driver.cuGraphUpload(graph_exec, dev.stream), "cuGraphUpload")
        except BaseException:
            driver.cuGraphExecDestroy(graph_exec)
            driver.cuGraphDestroy(graph)
            raise
        return cls(dev, graph, graph_exec, keep=getattr(fn, "__self__", fn))

    def launch(self) -> None:
        """Enqueue one replay on the device stream (no synchronisation)."""
        if self._exec is None:
            raise CudaError("Graph.launch on a closed graph", "cuGraphLaunch")
        check(self.dev._driver.cuGraphLaunch(self._exec, self.dev.stream), "cuGraphLaunch")

    def close(self) -> None:
        """Destroy the executable graph and the graph (idempotent)."""
        ex, self._exec = self._exec, None
        g, self._graph = self._graph, None
        driver = self.dev._driver
        if ex is not None:
            check(driver.cuGraphExecDestroy(ex), "cuGraphExecDestroy")
        if g is not None:
            check(driver.cuGraphDestroy(g), "cuGraphDestroy")
        self._keep = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
