"""A training run's directory: the names of its files, finding a checkpoint, the loss log (CSV) and the
loss plot (PNG). Every file is written atomically (:mod:`rwkvx.atomic_io`): a reader sees the old file
or the new one, never half of one."""
from __future__ import annotations

import csv
import io
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic_io import atomic_write

CHECKPOINT_NAME = "checkpoint.safetensors"
STATE_NAME = "state.safetensors"          # a state-tuning run's checkpoint: the tuned state file
LORA_NAME = "lora.safetensors"            # a LoRA run's checkpoint: the LoRA file
CHECKPOINT_NAMES = {"full": CHECKPOINT_NAME, "state": STATE_NAME, "lora": LORA_NAME}   # by TrainConfig.tune
LOG_NAME = "log.csv"
PLOT_NAME = "loss.png"
RUN_NAME = "run.json"
LOG_FIELDS = ["step", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "elapsed_s", "tokens_per_s"]


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint file ``path`` names: the file itself, or a run directory's checkpoint (a
    state-tuning run's state file, a LoRA run's LoRA file); ``ValueError`` when there is none."""
    p = Path(path)
    if p.is_dir():
        p = next((p / n for n in CHECKPOINT_NAMES.values() if (p / n).is_file()), p / CHECKPOINT_NAME)
    if not p.is_file():
        raise ValueError(f"checkpoint not found: {p}")
    return p


def default_out() -> Path:
    """A new run directory's default path: ``runs/<date>-<time>`` (with a suffix if that exists)."""
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = Path(f"{base}-{i}"), i + 1
    return out


def write_bytes(path: Path, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""
    atomic_write(path, lambda f: f.write(data))


def write_json(path: Path, value: Any) -> None:
    """Atomically write ``value`` as indented JSON to ``path``."""
    write_bytes(path, json.dumps(value, indent=2).encode())


def read_log(path: Path, upto_step: int) -> list[dict[str, Any]]:
    """The rows of the loss log ``path`` up to step ``upto_step`` (none when there is no log)."""
    if not path.is_file():
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            try:
                if int(row["step"]) <= upto_step:
                    rows.append(row)
            except (KeyError, ValueError):
                continue
    return rows


def write_log(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write the loss log: a header of :data:`LOG_FIELDS`, then ``rows``."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in LOG_FIELDS})
    write_bytes(path, buf.getvalue().encode())


def fmt(value: float | None, digits: int = 6) -> str:
    """A log cell: ``value`` to ``digits`` significant digits; empty for None or a non-finite value."""
    return "" if value is None or not math.isfinite(value) else f"{value:.{digits}g}"


def write_plot(path: Path, rows: list[dict[str, Any]], title: str, entropy: float | None) -> None:
    """The loss curve: training loss (raw and smoothed) and validation loss against the step."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps = np.array([int(r["step"]) for r in rows if r.get("train_loss") not in ("", None)])
    train = np.array([float(r["train_loss"]) for r in rows if r.get("train_loss") not in ("", None)])
    val = [(int(r["step"]), float(r["val_loss"])) for r in rows if r.get("val_loss") not in ("", None)]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    if len(train):
        ax.plot(steps, train, color="tab:blue", alpha=0.3, linewidth=0.8, label="train (per step)")
        ema, out = train[0], []
        for x in train:
            ema = 0.9 * ema + 0.1 * x
            out.append(ema)
        ax.plot(steps, out, color="tab:blue", linewidth=1.8, label="train (smoothed)")
    if val:
        vs, vl = zip(*val)
        ax.plot(vs, vl, "o-", color="tab:orange", linewidth=1.5, markersize=4, label="validation")
    if entropy is not None:
        ax.axhline(entropy, color="gray", linestyle="--", linewidth=1,
                   label=f"unigram entropy {entropy:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_bytes(path, buf.getvalue())
