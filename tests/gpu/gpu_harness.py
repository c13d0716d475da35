"""Shared GPU test harness for tests/gpu/test_{adamw,channelmix,embedding,layernorm,loss}.py.

``Gpu`` allocates/uploads buffers (kept alive until it is dropped), downloads results and runs op lists
as fp32 Plans; ``rel`` is the norm-wise relative error (denominator 1 when the reference is zero). The
module-scoped ``gpu`` fixture (a fresh Gpu per test module) lives in tests/gpu/conftest.py; test modules
import ``rel`` with ``from gpu_harness import rel`` (tests/gpu is on sys.path: it has no __init__.py and
pytest uses its default prepend import mode).
"""
from __future__ import annotations

import numpy as np


class Gpu:
    def __init__(self):
        from rwkvx.runtime import Device
        self.dev = Device.get()
        self.keep = []

    def buf(self, arr):
        arr = np.ascontiguousarray(arr)
        b = self.dev.alloc(max(arr.nbytes, 256))
        self.keep.append(b)
        self.dev.upload(b.ptr, arr)
        return b.ptr

    def set(self, ptr, arr):
        self.dev.upload(ptr, np.ascontiguousarray(arr))

    def get(self, ptr, shape, dtype=np.float32):
        self.dev.synchronize()
        return np.array(self.dev.download(ptr, shape, dtype))

    def run(self, ops):
        from rwkvx.runtime import Plan
        plan = Plan(self.dev, ops, precision="fp32")
        plan.run()
        self.dev.synchronize()
        return plan


def rel(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    n = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (n if n > 0 else 1.0))
