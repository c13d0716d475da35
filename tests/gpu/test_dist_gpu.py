"""Data parallel on GPUs through NCCL. One GPU: a world of one rank through NCCL is the plain step, bit
for bit (graph replay and eager). Two or more GPUs (skipped otherwise): 2 ranks x B == 1 rank x 2B
within fp32 reduction-order error, every rank holds the same parameters, two runs are bit-identical,
and a 300-step default-corpus run converges like the one-GPU run of the same global batch."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rwkvx.dist import World
from rwkvx.dist.launch import spawn, visible_gpus
from rwkvx.dist.nccl import NcclCommunicator, nccl_unavailable_reason
from rwkvx.dist.step import DistributedStep
from rwkvx.model import Model
from rwkvx.optim import Schedule
from rwkvx.oracle import rel_err
from rwkvx.training.trainer import Trainer

from test_train_gpu import CFG, B, T, batches   # the one-GPU training tests' model and batches

REPO = Path(__file__).resolve().parents[2]

needs_nccl = pytest.mark.skipif(nccl_unavailable_reason() is not None,
                                reason=f"no NCCL: {nccl_unavailable_reason()}")
needs_two_gpus = pytest.mark.skipif(visible_gpus() < 2 or nccl_unavailable_reason() is not None,
                                    reason=f"needs 2 GPUs and NCCL ({visible_gpus()} GPU(s) visible)")


@needs_nccl
def test_world_size_one_through_nccl_is_the_plain_step(dev, random_params):
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 21).items()}
    kw = dict(backend="gpu", batch_size=B, seq_len=T, lr=1e-3, lr_min=1e-4, warmup=2, steps=6,
              weight_decay=0.1, grad_clip=1.0)
    plain = Trainer(CFG, params, **kw)
    nccl = Trainer(CFG, params, world=World.single(), **kw)
    assert nccl.backend.dist_step is not None and plain.backend.dist_step is None
    for tokens, targets in batches(5, 3):
        assert nccl.step(tokens, targets) == plain.step(tokens, targets)
        assert nccl.last_stats == plain.last_stats
    a, b = nccl.params, plain.params
    assert all(np.array_equal(a[n], b[n]) for n in a)
    ga, gb = nccl.backend.model.grads(), plain.backend.model.grads()
    assert all(np.array_equal(ga[n], gb[n]) for n in ga)
    sa, sb = nccl.backend.optimizer_state()["tensors"], plain.backend.optimizer_state()["tensors"]
    assert all(np.array_equal(sa[n], sb[n]) for n in sa)
    x, y = batches(1, 9)[0]
    assert nccl.evaluate(x, y) == plain.evaluate(x, y)


@needs_nccl
def test_nccl_step_eager_equals_replay_and_agrees_on_stop(dev, random_params):
    params = {k: v.astype(np.float32) for k, v in random_params(CFG, 22).items()}
    steps = []
    for _ in range(2):
        model = Model(CFG, params, B, T)
        model.configure_optimizer(Schedule(lr_max=1e-3, lr_min=1e-4, warmup=1, total_steps=5), 0.1, 1.0)
        steps.append(DistributedStep(model, NcclCommunicator(World.single(), dev)))
    eager, replay = steps
    for i, (tokens, targets) in enumerate(batches(4, 4)):
        stop = i == 2
        assert replay.train_step(tokens, targets, stop=stop) == eager.train_step(tokens, targets, graph=False)
        assert replay.stop_agreed == stop and not eager.stop_agreed
    a, b = replay.model.params(), eager.model.params()
    assert all(np.array_equal(a[n], b[n]) for n in a)


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(out, ranks, batch, steps=6):
    cmd = [sys.executable, str(REPO / "scripts" / "dist_run.py"), str(out), "--preset", "tiny",
           "--batch-size", str(batch), "--seq-len", "64", "--steps", str(steps), "--warmup", "1"]
    if ranks == 1:
        subprocess.run(cmd, check=True, env=_env(), timeout=600)
    else:
        assert spawn(ranks, cmd, env=_env()) == 0
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(ranks)]


@needs_two_gpus
def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path):
    two = _run(tmp_path / "two", 2, 4)
    one = _run(tmp_path / "one", 1, 8)[0]
    names = [k for k in one if k.startswith("p.")]
    assert all(np.array_equal(two[0][n], two[1][n]) for n in names)     # every rank, same parameters
    np.testing.assert_allclose(two[0]["losses"], one["losses"], rtol=1e-5)
    for n in names:
        assert rel_err(two[0][n], one[n]) <= 1e-4, n
    again = _run(tmp_path / "again", 2, 4)                              # deterministic
    assert all(np.array_equal(again[0][n], two[0][n]) for n in names)
    assert np.array_equal(again[0]["losses"], two[0]["losses"])


def _val_losses(out):
    with open(out / "log.csv", newline="") as f:
        return [float(r["val_loss"]) for r in csv.DictReader(f) if r["val_loss"]]


@needs_two_gpus
def test_default_corpus_run_converges_like_one_gpu(tmp_path):
    common = ["--device", "gpu", "--steps", "300", "--no-progress", "--eval-every", "100"]
    two = subprocess.run([sys.executable, "-m", "rwkvx", "train", *common, "--gpus", "2", "--batch-size", "16",
                          "--out", str(tmp_path / "two")], env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert two.returncode == 0, two.stderr
    one = subprocess.run([sys.executable, "-m", "rwkvx", "train", *common, "--batch-size", "32",
                          "--out", str(tmp_path / "one")], env=_env(), capture_output=True, text=True,
                         timeout=900)
    assert one.returncode == 0, one.stderr
    v2, v1 = _val_losses(tmp_path / "two"), _val_losses(tmp_path / "one")
    assert len(v2) == len(v1) == 3
    assert v2[-1] < 2.5 and v2[-1] < v2[0]                  # learns (unigram entropy: 3.30 nats)
    assert abs(v2[-1] - v1[-1]) < 0.02, (v2, v1)            # like the one-GPU run of the same global batch
