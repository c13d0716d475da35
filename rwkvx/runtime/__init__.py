"""rwkvx GPU runtime: device + stream, NVRTC compile cache, cuBLAS shim, op records, graphs.

The plan executor that runs op lists is the compiled extension above this package, ``rwkvx._core``:

```python
from rwkvx._core import Plan
from rwkvx.runtime import Device, Launch, Gemm, Memset, Copy, CopyHtoD, CopyDtoH, Graph
dev = Device.get()
plan = Plan(dev, ops)                      # each Gemm carries its own precision
plan.run(); dev.synchronize()
graph = Graph.capture(dev, plan.run); graph.launch()
```

Importing this package needs neither a GPU nor the compiled extension: the op records (``ops``), the GEMM
helpers (``gemm``) and ``compile_cubin`` work on a CPU; ``Device.get()`` raises RuntimeError without a GPU.
"""
from .device import Device, DeviceBuffer, DeviceInfo, PinnedBuffer
from .errors import CudaError, NvrtcCompileError
from .event import Event
from .graph import Graph
from .nvrtc import cache_dir, compile_cubin, compile_source
from .timing import EventTimer, warm_time_ms
from .ops import (ARG_KINDS, Copy, CopyDtoH, CopyHtoD, DevPtr, Gemm, GemmPrecision, Launch, Memset,
                  flatten_ops)
from . import gemm

__all__ = ["Device", "DeviceBuffer", "DeviceInfo", "PinnedBuffer", "CudaError", "NvrtcCompileError",
           "Event", "Graph", "Launch", "Gemm", "GemmPrecision", "DevPtr", "Memset", "Copy", "CopyHtoD", "CopyDtoH",
           "EventTimer", "warm_time_ms", "compile_cubin", "compile_source", "cache_dir", "flatten_ops", "ARG_KINDS",
           "gemm"]

