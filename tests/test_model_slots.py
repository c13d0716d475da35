"""Model.launch_step's two pinned staging slots, on the CPU (tests/lazy_device.py: a stand-in device
whose stream runs only when the host waits, each step's loss the mean of its targets): which slot each
step stages into and reads back, and when the host waits. The graph's arithmetic is the GPU tests'
(tests/gpu/test_train_async.py)."""
import pytest

from lazy_device import install, mean_target
from rwkvx import Config, init_params
from rwkvx.model import SLOTS, Model
from rwkvx.optim import Schedule
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches

CFG = Config(vocab_size=97, n_embd=32, head_size=16, n_rwkv_layer=1, n_attn_layer=1,
             moba_chunk_size=8, moba_top_k=2)
B, T = 2, 16


@pytest.fixture
def dev(monkeypatch):
    return install(monkeypatch)


def model():
    m = Model(CFG, init_params(CFG, 0), B, T)
    m.configure_optimizer(Schedule(1e-3, 1e-4, 1, 10))
    return m


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
