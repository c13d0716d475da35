"""Training steps that do not wait (Model.launch_step, Trainer.submit) against the waiting path
(Model.train_step, Trainer.step): the same losses, optimizer statistics and parameters bit for bit,
with the next batch staged while a step runs, with evaluations and forwards between steps in flight,
and with results read late."""
import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.data import BatchSampler
from rwkvx.model import SLOTS, Model
from rwkvx.optim import Schedule
from rwkvx.presets import get_preset
from rwkvx.training.trainer import Trainer

from seeding import seeded_batches, seeded_rng

CFG = Config(vocab_size=97, n_embd=64, head_size=16, n_rwkv_layer=3, n_attn_layer=1,
             moba_chunk_size=16, moba_top_k=3)
B, T = 2, 48
SCHEDULE = Schedule(lr_max=1e-3, lr_min=1e-4, warmup=2, total_steps=8)
STEPS = 8


def batches(n, seed):
    return seeded_batches(n, CFG.vocab_size, B, T, seed)


def models(precision, n=2):
    params = init_params(CFG, 5)
    out = [Model(CFG, params, B, T, precision=precision) for _ in range(n)]
    for m in out:
        m.configure_optimizer(SCHEDULE, weight_decay=0.1, grad_clip=1.0)
    return out


def assert_same_state(a, b):
    pa, pb = a.params(), b.params()
    assert all(np.array_equal(pa[n], pb[n]) for n in pa)
    sa, sb = a.optimizer_state()["tensors"], b.optimizer_state()["tensors"]
    assert all(np.array_equal(sa[n], sb[n]) for n in sa)
    assert a.optimizer_stats() == b.optimizer_stats()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_launch_step_is_bit_identical_to_train_step(dev, precision):
    """Each loss read after the next step is launched, evaluations and forwards between them: the
    same losses, statistics, evaluations, logits and final state as waiting for every step."""
    waiting, pipelined = models(precision)
    data, probe = batches(STEPS, 1), batches(1, 2)[0]
    losses, stats, evals, logits = [], [], [], []
    for i, (tokens, targets) in enumerate(data):
        losses.append(waiting.train_step(tokens, targets))
        stats.append(waiting.optimizer_stats())
        if i % 3 == 2:
            evals.append(waiting.evaluate(*probe))
            logits.append(waiting.forward(probe[0]))
    got_losses, got_stats, got_evals, got_logits, pending = [], [], [], [], None
    for i, (tokens, targets) in enumerate(data):
        launched = pipelined.launch_step(tokens, targets)
        if pending is not None:
            got_losses.append(pending.loss())
            got_stats.append(pending.stats())
        pending = launched
        if i % 3 == 2:      # with step i in flight
            got_evals.append(pipelined.evaluate(*probe))
            got_logits.append(pipelined.forward(probe[0]))
    got_losses.append(pending.loss())
    got_stats.append(pending.stats())
    assert got_losses == losses and got_stats == stats and got_evals == evals
    assert all(np.array_equal(a, b) for a, b in zip(got_logits, logits))
    assert_same_state(waiting, pipelined)


def test_results_read_late_are_kept(dev):
    """Launching more steps than there are slots before reading any: every result is still the step's."""
    waiting, pipelined = models("fp32")
    data = batches(STEPS, 3)
    losses = [waiting.train_step(*d) for d in data]
    allocated = dev.allocated_bytes
    pending = [pipelined.launch_step(*d) for d in data]
    assert dev.allocated_bytes == allocated                   # nothing allocated per step
    assert all(p.done() for p in pending[:-SLOTS])            # read when their slot was taken again
    assert [p.loss() for p in reversed(pending)][::-1] == losses
    assert [p.stats()["step"] for p in pending] == list(range(1, STEPS + 1))
    assert_same_state(waiting, pipelined)


def test_trainer_submit_matches_step_on_the_small_preset(dev):
    """The small preset's model and batch: Trainer.submit read one step late == Trainer.step, bit for
    bit, with the batches drawn while the previous step runs."""
    preset = get_preset("small", device="gpu")
    cfg = Config(**preset["model"])
    config = preset["train"].replace(steps=STEPS, warmup=2)
    tokens = seeded_rng(4).integers(0, cfg.vocab_size, 200_000)
    params = init_params(cfg, 0)
    waiting, submitting = (Trainer(cfg, params, config, backend="gpu") for _ in range(2))
    sampler = BatchSampler(tokens, config.batch_size, config.seq_len, seed=7)
    losses = [waiting.step(*sampler.next()) for _ in range(STEPS)]
    sampler = BatchSampler(tokens, config.batch_size, config.seq_len, seed=7)
    got, pending = [], None
    for _ in range(STEPS):
        submitted = submitting.submit(*sampler.next())
        if pending is not None:
            got.append(pending.loss())
        pending = submitted
    got.append(pending.loss())
    assert got == losses
    assert submitting.last_stats == waiting.last_stats and submitting.step_count == STEPS
    a, b = waiting.params, submitting.params
    assert all(np.array_equal(a[n], b[n]) for n in a)
