"""Data parallel on the CPU: sharded batches, the world-size-1 path, and whole jobs of oracle ranks
through the real launcher (``--gpus N --device cpu``): N ranks x B == 1 rank x N*B, resume on another
number of ranks, only rank 0 writing, a failing or hung rank ending the job with a clear error; state
tuning and LoRA on ranks of one process (threads) against one rank, step by step."""
import csv
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.checkpoint import load_checkpoint
from rwkvx.cli import main
from rwkvx.data import BatchSampler, eval_batches
from rwkvx.dist import World
from rwkvx.training.trainer import Trainer

from seeding import seeded_rng
from test_dist_store import on_all, start_world

REPO = Path(__file__).resolve().parents[1]
SMALL = ["--device", "cpu", "--cpu-dtype", "float64", "--n-embd", "32", "--n-layer", "1",
         "--n-attn-layer", "1", "--head-size", "16", "--chunk", "8", "--top-k", "2", "--seq-len", "32",
         "--no-progress", "--eval-every", "2", "--eval-batches", "2"]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli(*args, timeout=300, **kw):
    return subprocess.run([sys.executable, "-m", "rwkvx", "train", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)


def log(out):
    with open(Path(out) / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def params(out):
    return load_checkpoint(Path(out) / "checkpoint.safetensors")[1]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 7])
def test_ranks_together_see_the_one_process_batches(world_size, seed):
    tokens = np.arange(5000, dtype=np.uint16)
    B, T = 3, 16
    whole = BatchSampler(tokens, world_size * B, T, seed=seed)
    shards = [BatchSampler(tokens, B, T, seed=seed, rank=r, world_size=world_size) for r in range(world_size)]
    for _ in range(5):
        x, y = whole.next()
        parts = [s.next() for s in shards]
        assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), y)
        assert all(p[0].shape == (B, T) for p in parts)
    assert all(s.state() == whole.state() for s in shards)     # the data position is global
    val = eval_batches(tokens, world_size * B, T, 3)
    val_shards = [eval_batches(tokens, B, T, 3, r, world_size) for r in range(world_size)]
    for i, (x, y) in enumerate(val):
        assert np.array_equal(np.concatenate([v[i][0] for v in val_shards]), x)
        assert np.array_equal(np.concatenate([v[i][1] for v in val_shards]), y)
    with pytest.raises(ValueError, match="outside a world"):
        BatchSampler(tokens, B, T, rank=world_size, world_size=world_size)


def test_world_size_one_is_the_plain_step():
    cfg = Config(vocab_size=64, n_embd=32, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                 moba_chunk_size=8, moba_top_k=2)
    kw = dict(backend="cpu", batch_size=2, seq_len=24, lr=3e-3, warmup=2, steps=5, grad_clip=0.5)
    plain = Trainer(cfg, init_params(cfg, 1), **kw)
    single = Trainer(cfg, init_params(cfg, 1), world=World.single(), **kw)

    def shard(a, world):   # this rank's half of the global batch
        return a[2 * world.rank:2 * world.rank + 2]

    sampler = BatchSampler(seeded_rng(0).integers(0, 64, 4000), 2, 24, seed=3)
    for _ in range(4):
        x, y = sampler.next()
        assert plain.step(x, y) == single.step(x, y)
        assert plain.last_stats == single.last_stats
    assert plain.evaluate(x, y) == single.evaluate(x, y)
    a, b = plain.params, single.params
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not single.stop_agreed
    single.request_stop()
    single.step(x, y)
    assert single.stop_agreed and not plain.stop_agreed


def test_two_ranks_equal_one_rank_with_twice_the_batch(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    r1 = cli(*SMALL, "--batch-size", "4", "--steps", "4", "--out", str(one))
    r2 = cli(*SMALL, "--gpus", "2", "--batch-size", "2", "--steps", "4", "--out", str(two))
    assert r1.returncode == 0, r1.stderr
    assert r2.returncode == 0, r2.stderr
    assert r2.stdout.count("device:") == 1 and "data parallel: 2 ranks x B=2 = 4 sequences" in r2.stdout
    assert "error" not in r2.stderr.lower()
    rows1, rows2 = log(one), log(two)
    assert [r["tokens"] for r in rows2] == [r["tokens"] for r in rows1] == ["128", "256", "384", "512"]
    for a, b in zip(rows1, rows2):
        for key in ("train_loss", "val_loss", "grad_norm"):
            assert (a[key] == "") == (b[key] == "")
            if a[key]:
                assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-9), key
    p1, p2 = params(one), params(two)
    for n in p1:   # float64 oracle: the averages differ from the 2B sums by float64 rounding only
        np.testing.assert_allclose(p2[n], p1[n], rtol=0, atol=1e-6, err_msg=n)
    assert sorted(os.listdir(two)) == ["checkpoint.safetensors", "log.csv", "loss.png", "run.json"]


@pytest.mark.parametrize("tune", ["state", "lora"])
def test_tuning_on_two_ranks_equals_one_rank_with_twice_the_batch(tune, random_params):
    """State tuning and LoRA: 2 ranks x B=2 have the losses and the tuned tensors of 1 rank x B=4 after
    every step (float64 oracle: up to rounding), the ranks agree exactly and the model stays bit for bit.
    The model is random: a fresh one's zero output matrices would leave the states without a gradient."""
    cfg = Config(vocab_size=64, n_embd=32, head_size=16, n_rwkv_layer=1, n_attn_layer=1,
                 moba_chunk_size=8, moba_top_k=2)
    start = random_params(cfg, 5)
    frozen = {n: p.astype(np.float32) for n, p in start.items()}
    kw = dict(backend="cpu", cpu_dtype="float64", tune=tune, seq_len=16, lr=1e-2, lr_min=1e-3, warmup=1,
              steps=3, grad_clip=1.0, weight_decay=0.1, lora_rank=2, seed=3)
    tuned = {"state": lambda t: t.states, "lora": lambda t: t.lora}[tune]
    one = Trainer(cfg, start, batch_size=4, **kw)
    worlds = start_world(2)
    ranks = on_all(worlds, lambda w: Trainer(cfg, start, batch_size=2, world=w, **kw))
    first = tuned(one)

    def shard(a, world):   # this rank's half of the global batch
        return a[2 * world.rank:2 * world.rank + 2]

    sampler = BatchSampler(seeded_rng(0).integers(0, 64, 4000), 4, 16, seed=3)
    for _ in range(3):
        x, y = sampler.next()
        loss = one.step(x, y)
        losses = on_all(worlds, lambda w: ranks[w.rank].step(shard(x, w), shard(y, w)))
        assert losses[0] == losses[1] == pytest.approx(loss, rel=1e-9)
        for key, value in one.last_stats.items():   # the gradient norm: the ranks' gradients are averaged
            assert ranks[0].last_stats[key] == ranks[1].last_stats[key] == pytest.approx(value, rel=1e-9), key
        got = [tuned(t) for t in ranks]
        for n, want in tuned(one).items():
            assert np.array_equal(got[0][n], got[1][n]), n
            np.testing.assert_allclose(got[0][n], want, rtol=0, atol=1e-6, err_msg=n)
    evals = on_all(worlds, lambda w: ranks[w.rank].evaluate(shard(x, w), shard(y, w)))
    assert evals[0] == evals[1] == pytest.approx(one.evaluate(x, y), rel=1e-9)
    assert all(not np.array_equal(tuned(one)[n], first[n]) for n in first)    # every tuned tensor trained
    for trainer in (one, *ranks):
        assert all(np.array_equal(trainer.params[n], frozen[n]) for n in frozen)
    on_all(worlds, lambda w: w.close())


def test_resume_on_another_number_of_ranks(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert cli(*SMALL, "--batch-size", "4", "--steps", "6", "--out", str(straight)).returncode == 0
    first = cli(*SMALL, "--gpus", "2", "--batch-size", "2", "--steps", "3", "--out", str(split))
    assert first.returncode == 0, first.stderr
    # one rank resumes the two-rank run: it keeps the global batch of 4 sequences (B = 4)
    second = cli("--resume", str(split), "--steps", "6", "--device", "cpu", "--no-progress")
    assert second.returncode == 0, second.stderr
    assert "steps 4..6, B=4" in second.stdout
    assert [r["step"] for r in log(split)] == [str(s) for s in range(1, 7)]
    a, b = log(straight), log(split)
    for ra, rb in zip(a, b):
        assert float(rb["train_loss"]) == pytest.approx(float(ra["train_loss"]), rel=1e-9)
    p1, p2 = params(straight), params(split)
    for n in p1:
        np.testing.assert_allclose(p2[n], p1[n], rtol=0, atol=1e-6, err_msg=n)
    # and back to four ranks of one sequence
    third = cli("--resume", str(split), "--steps", "7", "--gpus", "4", "--device", "cpu", "--no-progress")
    assert third.returncode == 0, third.stderr
    assert "steps 7..7, B=1" in third.stdout and "4 ranks x B=1" in third.stdout
    odd = cli("--resume", str(split), "--steps", "8", "--gpus", "3", "--device", "cpu", "--no-progress")
    assert odd.returncode == 2 and "global batch of 4 sequences" in odd.stderr
    assert [r["step"] for r in log(split)] == [str(s) for s in range(1, 8)]


def test_launch_errors_are_clear_and_write_nothing(tmp_path):
    out = tmp_path / "run"
    env = {**_env(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}
    res = subprocess.run([sys.executable, "-m", "rwkvx", "train", *SMALL, "--gpus", "2", "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "--gpus 2 starts its own 2 ranks" in res.stderr
    env.pop("WORLD_SIZE")
    res = subprocess.run([sys.executable, "-m", "rwkvx", "train", *SMALL, "--out", str(out)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "RANK is set but WORLD_SIZE is not" in res.stderr
    res = cli(*SMALL, "--gpus", "2", "--seq-len", "0", "--out", str(out))
    assert res.returncode == 2 and "--seq-len" in res.stderr
    assert not out.exists()


def test_no_gpus_is_a_clear_error(tmp_path, capsys, monkeypatch):
    from rwkvx.dist import launch
    monkeypatch.setattr(launch, "visible_gpus", lambda: 0)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--gpus", "2", "--device", "gpu", "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    assert "--gpus 2: only 0 GPU(s) visible here; --device cpu runs the ranks" in capsys.readouterr().err


WORKER = textwrap.dedent("""
    import os, sys, time
    from rwkvx.dist import DistributedError, init_world, launch_info
    world = init_world(launch_info(os.environ), timeout=float(sys.argv[2]))
    if sys.argv[1] == "sleep":
        open(sys.argv[3] + str(world.rank), "w").write(str(os.getpid()))
        time.sleep(60)
    if world.rank == 1:
        if sys.argv[1] == "crash":
            os._exit(3)
        time.sleep(60)                       # "hang"
    try:
        world.barrier()
    except DistributedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
""")


@pytest.mark.parametrize("mode, status, message", [
    ("crash", 3, "rank 0: stopping because rank 1 exited without finishing"),
    ("hang", 1, "rank 0: timed out after 2 s in collective #2"),
])
def test_a_dead_or_hung_rank_ends_the_job(tmp_path, mode, status, message):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    code = (f"import sys\nfrom rwkvx.dist.launch import spawn\n"
            f"sys.exit(spawn(2, [sys.executable, {str(script)!r}, {mode!r}, '2'], grace_s=2))\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert time.monotonic() - t0 < 30
    assert res.returncode == status, res.stderr
    assert message in res.stderr
    first = "rank 1 exited with status 3" if mode == "crash" else "rank 0 exited with status 1"
    assert f"rwkvx: {first}; stopping ranks" in res.stderr


def test_ctrl_c_stops_every_rank_after_the_same_step(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rwkvx", "train", *SMALL, "--gpus", "2",
                             "--batch-size", "2", "--steps", "100000", "--eval-every", "0",
                             "--ckpt-every", "5", "--out", str(out)],
                            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint.safetensors").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "interrupted at step" in stdout and "resume:" in stdout
    step = Trainer.load(out / "checkpoint.safetensors", backend="cpu").step_count
    assert 5 <= step < 100000 and [int(r["step"]) for r in log(out)][-1] == step


def test_stopping_the_launcher_stops_every_rank(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    pidfile = str(tmp_path / "pid")
    code = (f"import sys\nfrom rwkvx.dist.launch import spawn\n"
            f"sys.exit(spawn(2, [sys.executable, {str(script)!r}, 'sleep', '30', {pidfile!r}]))\n")
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=_env())
    deadline = time.monotonic() + 60
    while not all(Path(pidfile + r).exists() for r in "01") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    pids = [int(Path(pidfile + r).read_text()) for r in "01"]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
