"""Data-parallel throughput (report, don't assert; needs 2+ GPUs and NCCL): tokens/s on 1, 2, 4, 8 GPUs
of the ``small`` preset (B=8 per GPU, T=512), scaling efficiency = tokens/s(N) / (N * tokens/s(1)),
and the share of a step spent waiting on communication = 1 - t(1 GPU, same B) / t(N GPUs) (the
all-reduces that the backward does not hide, and the rank-to-rank synchronisation).

Each configuration runs ``scripts/dist_run.py`` (3 warm-up steps, then 30 timed steps, median)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rwkvx.dist.launch import spawn, visible_gpus
from rwkvx.dist.nccl import nccl_unavailable_reason

REPO = Path(__file__).resolve().parents[1]
GPUS = visible_gpus()
pytestmark = pytest.mark.skipif(GPUS < 2 or nccl_unavailable_reason() is not None,
                                reason=f"needs 2+ GPUs and NCCL ({GPUS} GPU(s) visible)")


def _median_step_s(out, ranks):
    cmd = [sys.executable, str(REPO / "scripts" / "dist_run.py"), str(out), "--preset", "small",
           "--steps", "30", "--warmup", "3"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if ranks == 1:
        subprocess.run(cmd, check=True, env=env, timeout=600)
    else:
        assert spawn(ranks, cmd, env=env) == 0
    # a step ends when the slowest rank's does: the per-step maximum over ranks
    seconds = np.max([np.load(out / f"rank{r}.npz")["seconds"] for r in range(ranks)], axis=0)
    run = np.load(out / "rank0.npz")
    return float(np.median(seconds)), int(run["batch_size"]) * int(run["seq_len"])


def test_scaling(tmp_path):
    t1, tokens = _median_step_s(tmp_path / "n1", 1)
    report = {"1": {"step_ms": round(1e3 * t1, 3), "tokens_per_s": round(tokens / t1)}}
    for n in (2, 4, 8):
        if n > GPUS:
            break
        tn, _ = _median_step_s(tmp_path / f"n{n}", n)
        report[str(n)] = {"step_ms": round(1e3 * tn, 3), "tokens_per_s": round(n * tokens / tn),
                          "scaling_efficiency": round(t1 / tn, 3), "comm_wait_share": round(1 - t1 / tn, 3)}
    print(json.dumps(report, indent=2))
    (tmp_path / "scaling.json").write_text(json.dumps(report))
