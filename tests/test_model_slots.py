"""Model.launch_step's two pinned staging slots, on the CPU: a stand-in device whose stream runs the
enqueued work only when the host waits for it (an event, a download, synchronize), so a batch written
into a slot before the step that reads it has run would be the one that step sees. Its per-token
"loss" is the target itself (the cross-entropy launch writes float(target)) and AdamW's step counter
counts, so each result names the batch and the step it came from. What this checks is the host side
of the step (which slot each step stages into and reads back, when the host waits); the graph's
arithmetic is the GPU tests' (tests/gpu/test_train_async.py)."""
import types

import numpy as np
import pytest

import rwkvx._core
import rwkvx.model
import rwkvx.runtime
from emulator import Memory, _args, run_memory_op
from rwkvx import Config, init_params
from rwkvx.cu import adamw
from rwkvx.model import SLOTS, Model
from rwkvx.optim import Schedule
from rwkvx.runtime.device import H200
from rwkvx.runtime.ops import as_ptr, flatten_ops
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches

CFG = Config(vocab_size=97, n_embd=32, head_size=16, n_rwkv_layer=1, n_attn_layer=1,
             moba_chunk_size=8, moba_top_k=2)
B, T = 2, 16
REGION = 1 << 32                 # address space between two allocations of the stand-in device


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

    def alloc(self, nbytes):
        return types.SimpleNamespace(ptr=self._region(nbytes), nbytes=nbytes)

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
        self.dev.queue.append(lambda: execute(self.dev.mem, self.ops))


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


@pytest.fixture
def dev(monkeypatch):
    device = LazyDevice()
    monkeypatch.setattr(rwkvx.runtime.Device, "get", classmethod(lambda cls: device))
    monkeypatch.setattr(rwkvx._core, "Plan", LazyPlan)
    monkeypatch.setattr(rwkvx.runtime, "Graph", LazyGraph)
    monkeypatch.setattr(rwkvx.model, "Event", LazyEvent)
    return device


def model():
    m = Model(CFG, init_params(CFG, 0), B, T)
    m.configure_optimizer(Schedule(1e-3, 1e-4, 1, 10))
    return m


def mean_target(targets):
    return float(np.sum(targets, dtype=np.float64)) * (1.0 / targets.size)


@pytest.mark.parametrize("graph", [True, False])
def test_each_step_reads_its_own_batch_read_one_step_late(dev, graph):
    m, data = model(), seeded_batches(6, CFG.vocab_size, B, T, seed=0)
    got, pending = [], None
    for tokens, targets in data:
        launched = m.launch_step(tokens, targets, graph=graph)
        assert len(dev.queue) - dev.ran <= SLOTS          # never more than two steps ahead of the host
        if pending is not None:
            got.append(pending.result())
        pending = launched
    got.append(pending.result())
    assert [loss for loss, _ in got] == [mean_target(y) for _, y in data]
    assert [stats["step"] for _, stats in got] == [1, 2, 3, 4, 5, 6]


def test_a_slot_is_written_again_only_after_its_step_ran(dev):
    m, data = model(), seeded_batches(5, CFG.vocab_size, B, T, seed=1)
    pending = [m.launch_step(*data[0]), m.launch_step(*data[1])]
    assert not pending[0].done() and not pending[1].done()  # both enqueued, neither run yet
    pending.append(m.launch_step(*data[2]))                 # slot 0 again: the first step runs first
    assert pending[0].done() and not pending[1].done()
    pending += [m.launch_step(*d) for d in data[3:]]
    assert [p.loss() for p in reversed(pending)][::-1] == [mean_target(y) for _, y in data]


def test_results_of_dropped_steps_are_waited_for_not_lost(dev):
    m, data = model(), seeded_batches(5, CFG.vocab_size, B, T, seed=2)
    for tokens, targets in data[:-1]:
        m.launch_step(tokens, targets)                      # nobody keeps these
    last = m.launch_step(*data[-1])
    assert last.result() == (mean_target(data[-1][1]), last.stats()) and last.stats()["step"] == 5


def test_evaluation_between_steps_in_flight(dev):
    m, data = model(), seeded_batches(4, CFG.vocab_size, B, T, seed=3)
    probe = seeded_batches(1, CFG.vocab_size, B, T, seed=4)[0]
    first, second = m.launch_step(*data[0]), m.launch_step(*data[1])
    assert m.evaluate(*probe) == mean_target(probe[1])      # runs after both steps, in stream order
    third = m.launch_step(*data[2])
    assert [first.loss(), second.loss(), third.loss()] == [mean_target(y) for _, y in data[:3]]


def test_trainer_submit_on_the_gpu_backend_reads_late(dev):
    trainer = Trainer(CFG, init_params(CFG, 0), backend="gpu", batch_size=B, seq_len=T, steps=4, warmup=1)
    data = seeded_batches(4, CFG.vocab_size, B, T, seed=5)
    steps = [trainer.submit(*d) for d in data]
    assert trainer.step_count == 4 and [s.step for s in steps] == [1, 2, 3, 4]
    assert not steps[-1].done()
    assert [s.loss() for s in steps] == [mean_target(y) for _, y in data]
    assert trainer.step(*data[0]) == mean_target(data[0][1])
