"""A stand-in for rwkvx.runtime.Device on the CPU whose stream runs the enqueued work only when the host
waits for it (an event, a download, synchronize): a pinned buffer written before the step that reads it
has run is what that step sees, so host-side ordering mistakes show. Device and pinned memory are one
:class:`emulator.Memory` (device memory leaves it when its buffer is freed or garbage-collected); a plan
runs its copies and memsets, the cross-entropy launch (the per-token loss := float(target)) and AdamW's
step count, nothing else — each result names the batch and the step it came from. :func:`install` puts
it (or a subclass that runs more of a plan, tests/cuda_cpu/step_device.py), its plans, events and graphs
in place of the real ones."""
import types

import numpy as np

import rwkvx._core
import rwkvx.model
import rwkvx.runtime
from emulator import Memory, _args, run_memory_op
from rwkvx.cu import adamw
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import as_ptr, flatten_ops

REGION = 1 << 32                 # address space between two allocations of the stand-in device


IDLE_H200_BYTES = 140 << 30


class LazyDevice:
    """Device memory and pinned memory in one :class:`emulator.Memory`; a stream of closures run in
    order, each only once the host waits for it."""

    info = H200

    def __init__(self):
        self.mem, self.queue, self.ran, self.next_addr = Memory(), [], 0, 1 << 40
        self.cublas = types.SimpleNamespace(prepare=lambda gemms, scratch=None: [])

    def _region(self, nbytes):
        addr, self.next_addr = self.next_addr, self.next_addr + REGION
        self.mem.add(addr, nbytes)
        return addr

    def _release(self, addr):
        """Free the region at ``addr`` (a freed buffer's)."""
        self.mem.remove(addr)

    def execute(self, ops):
        """Run a plan's ``ops`` (when the host waits for them): :func:`execute`'s subset."""
        execute(self.mem, ops)

    def alloc(self, nbytes):
        return LazyBuffer(self, self._region(nbytes), nbytes)

    def memory_info(self) -> dict:
        """An idle H200's memory, all of it free (what recompute="auto" reads)."""
        return {"free": IDLE_H200_BYTES, "total": IDLE_H200_BYTES}

    def alloc_pinned(self, nbytes):
        return LazyPinned(self, self._region(nbytes), nbytes)

    def run_until(self, n):
        while self.ran < n:
            self.queue[self.ran]()
            self.ran += 1

    def synchronize(self):
        self.run_until(len(self.queue))

    def upload(self, ptr, array):
        self.synchronize()
        data = np.ascontiguousarray(array)
        self.mem.bytes(as_ptr(ptr, "upload"), data.nbytes)[:] = data.view(np.uint8).ravel()

    def download(self, ptr, shape, dtype=np.float32):
        self.synchronize()
        out = np.empty(shape, dtype)
        out.view(np.uint8).ravel()[:] = self.mem.bytes(as_ptr(ptr, "download"), out.nbytes)
        return out


class LazyBuffer:
    """Device memory of the stand-in: freed by :meth:`close` or when garbage-collected, as the real
    device's buffers are (its region leaves the memory: a later access raises IndexError)."""

    def __init__(self, dev, ptr, nbytes):
        self.dev, self.ptr, self.nbytes = dev, ptr, nbytes

    def close(self):
        ptr, self.ptr = self.ptr, 0
        self.dev._release(ptr)

    def __del__(self):
        self.close()


class LazyPinned:
    def __init__(self, dev, ptr, nbytes):
        self.dev, self.ptr, self.nbytes = dev, ptr, nbytes

    def array(self, dtype, shape):
        count = int(np.prod(shape))
        return self.dev.mem.bytes(self.ptr, self.nbytes).view(dtype)[:count].reshape(shape)


def execute(mem, ops):
    """The memory ops, the cross-entropy launch (loss := target) and AdamW's step count; nothing else."""
    for op in ops:
        if run_memory_op(mem, op):
            continue
        if getattr(op, "name", None) == "cross_entropy_loss":
            a = _args(op)
            mem.array(a["loss"], "f64", a["R"])[:] = mem.array(a["targets"], "i32", a["R"])
        elif getattr(op, "name", None) == "adamw_step_begin":
            mem.array(_args(op)["st"], "f64", adamw.STATE_DOUBLES)[adamw.ST_STEP] += 1


class LazyPlan:
    def __init__(self, dev, ops):
        self.dev, self.ops = dev, flatten_ops(ops)

    def run(self):
        self.dev.queue.append(lambda: self.dev.execute(self.ops))


class LazyEvent:
    def __init__(self, dev):
        self.dev, self.mark = dev, 0

    def record(self):
        self.mark = len(self.dev.queue)

    def query(self):
        return self.dev.ran >= self.mark

    def synchronize(self):
        self.dev.run_until(self.mark)


class LazyGraph:
    @classmethod
    def capture(cls, dev, fn):
        return types.SimpleNamespace(launch=fn)


def install(monkeypatch, device: LazyDevice | None = None) -> LazyDevice:
    """``device`` (default a fresh :class:`LazyDevice`) as the process's device, with its plans, events
    and graphs."""
    device = device if device is not None else LazyDevice()
    monkeypatch.setattr(rwkvx.runtime.Device, "get", classmethod(lambda cls: device))
    monkeypatch.setattr(rwkvx._core, "Plan", LazyPlan)
    monkeypatch.setattr(rwkvx.runtime, "Graph", LazyGraph)
    monkeypatch.setattr(rwkvx.model, "Event", LazyEvent)
    return device


def mean_target(targets) -> float:
    """The mean loss a step on ``targets`` reports on the stand-in device."""
    return float(np.sum(targets, dtype=np.float64)) * (1.0 / np.size(targets))
