"""``python -m rwkvx``: ``train`` a model and ``sample`` text from a checkpoint.

``python -m rwkvx train`` with no arguments trains the ``tiny`` preset on the embedded Shakespeare
corpus (GPU when usable, else the CPU oracle) and prints where the checkpoint, the loss log (CSV) and
the loss curve (PNG) are. Every argument and the data are checked before anything is written.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:  # annotations only: each command imports what it uses when it runs
    from .config import Config
    from .data import BatchSampler, TokenData
    from .params import ParamDict
    from .train import Trainer

CHECKPOINT_NAME = "checkpoint.safetensors"
LOG_NAME = "log.csv"
PLOT_NAME = "loss.png"
RUN_NAME = "run.json"
LOG_FIELDS = ["step", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "elapsed_s", "tokens_per_s"]

# model flag -> Config field
MODEL_FLAGS = {"vocab_size": "vocab_size", "n_embd": "n_embd", "n_layer": "n_rwkv_layer",
               "n_attn_layer": "n_attn_layer", "head_size": "head_size", "ffn_dim": "ffn_dim",
               "chunk": "moba_chunk_size", "top_k": "moba_top_k"}
# training options set by the preset, then a resumed run's options, then the flags
TRAIN_KEYS = ("batch_size", "seq_len", "lr", "lr_min", "warmup", "weight_decay", "grad_clip",
              "eval_every", "eval_batches", "ckpt_every", "val_fraction")


class UsageError(Exception):
    """A bad argument or bad data: reported as ``error: ...`` with exit status 2, nothing written."""


# ---------------------------------------------------------------------------------------------
# argument parsing
# ---------------------------------------------------------------------------------------------

def _number(kind: type, low: float, low_open: bool = False, high: float | None = None,
            what: str = "a number"):
    """An argparse type: ``kind`` (int or float), finite, >= low (> low when low_open), < high."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or (
                high is not None and value >= high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value
    return parse


_positive_int = _number(int, 1, what="a positive integer")
_nonneg_int = _number(int, 0, what="an integer >= 0")
_nonneg_float = _number(float, 0.0, what="a finite number >= 0")
_positive_float = _number(float, 0.0, low_open=True, what="a number > 0")
_fraction = _number(float, 0.0, high=1.0, what="a fraction in [0, 1)")


def _token_count(text: str) -> int:
    """An integer with an optional k/M/G suffix (``--tokens 2M``)."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}
    t = text.strip().lower()
    mult = 1
    if t and t[-1] in scale:
        mult, t = scale[t[-1]], t[:-1]
    try:
        value = int(float(t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count like 500000 or 2M, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive token count, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m rwkvx`` parser: the ``train`` and ``sample`` subcommands."""
    from .train import PRECISIONS
    from .presets import DEFAULT_PRESET, PRESETS

    parser = argparse.ArgumentParser(
        prog="python -m rwkvx",
        description="Train RWKV-X language models (RWKV-7 + MoBA attention) and sample from them.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    tr = sub.add_parser(
        "train", help="train a model (no arguments: tiny model on the embedded Shakespeare corpus)",
        description="Train a model. With no arguments: the 'tiny' preset on the embedded public-domain "
                    "Shakespeare corpus, on the GPU when usable, else on the CPU (oracle). "
                    "Unset options come from the preset (or, with --resume, from the run).",
        epilog="presets: " + "; ".join(
            f"{name}: V={p['model']['vocab_size']} C={p['model']['n_embd']} "
            f"L={p['model']['n_rwkv_layer']} M={p['model']['n_attn_layer']}, "
            f"B={p['train']['batch_size']} T={p['train']['seq_len']} steps={p['train']['steps']}"
            for name, p in PRESETS.items()))
    g = tr.add_argument_group("model (preset, then overrides)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help=f"model + training preset (default {DEFAULT_PRESET})")
    g.add_argument("--vocab-size", type=_positive_int, help="V (text data needs 256)")
    g.add_argument("--n-embd", type=_positive_int, help="C, the model width")
    g.add_argument("--n-layer", type=_positive_int, help="L, RWKV-7 blocks")
    g.add_argument("--n-attn-layer", type=_nonneg_int, help="M, MoBA attention blocks (0 <= M <= L)")
    g.add_argument("--head-size", type=_positive_int, help="N, head size (must divide C)")
    g.add_argument("--ffn-dim", type=_positive_int, help="channel-mix width (default 4*C)")
    g.add_argument("--chunk", type=_positive_int, help="MoBA block length in tokens")
    g.add_argument("--top-k", type=_positive_int, help="MoBA blocks per query, its own included")

    g = tr.add_argument_group("data")
    g.add_argument("--data", help="UTF-8 .txt (byte tokens), .npy / raw .bin tokens, or a binidx "
                                  "prefix (PREFIX.bin + PREFIX.idx); default: embedded corpus")
    g.add_argument("--token-width", type=int, choices=(2, 4),
                   help="bytes per token of a raw .bin file: 2 = uint16, 4 = uint32")
    g.add_argument("--val-fraction", type=_fraction, help="fraction of the data held out for validation")

    g = tr.add_argument_group("training")
    g.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: the GPU when usable, else the CPU oracle")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="GPU GEMM precision (the CPU backend computes in --cpu-dtype)")
    g.add_argument("--cpu-dtype", choices=("float32", "float64"), default=None,
                   help="arithmetic of the CPU oracle backend (default float32)")
    g.add_argument("--batch-size", type=_positive_int, help="B, sequences per step")
    g.add_argument("--seq-len", type=_positive_int, help="T, tokens per sequence")
    n = g.add_mutually_exclusive_group()
    n.add_argument("--steps", type=_positive_int, help="total optimizer steps")
    n.add_argument("--tokens", type=_token_count, help="total training tokens (steps = tokens / (B*T))")
    g.add_argument("--lr", type=_positive_float, help="peak learning rate")
    g.add_argument("--lr-min", type=_nonneg_float, help="final learning rate of the cosine decay")
    g.add_argument("--warmup", type=_nonneg_int, help="linear warm-up steps")
    g.add_argument("--weight-decay", type=_nonneg_float, help="AdamW decay of 2-D *.weight matrices")
    g.add_argument("--grad-clip", type=_nonneg_float, help="global gradient-norm clip (0: off)")
    g.add_argument("--seed", type=_nonneg_int, help="parameter init and data sampling seed (default 0)")

    g = tr.add_argument_group("output")
    g.add_argument("--out", help="run directory (default runs/<date>-<time>; with --resume: the "
                                 "checkpoint's directory)")
    g.add_argument("--eval-every", type=_nonneg_int, help="validation every N steps (0: only at the end)")
    g.add_argument("--eval-batches", type=_positive_int, help="validation batches per evaluation")
    g.add_argument("--ckpt-every", type=_nonneg_int, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--resume", metavar="CKPT", help="continue a run from its checkpoint file or directory")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")

    # Defaults are written into the help texts: ArgumentDefaultsHelpFormatter would also print
    # "(default: None)" after the options whose default is worked out from the checkpoint.
    sp = sub.add_parser("sample", help="generate text from a checkpoint",
                        description="Continue a prompt: the prompt is processed once, then every new "
                                    "token is one stateful step (no context window).")
    sp.add_argument("--ckpt", required=True, help="checkpoint file (or run directory)")
    sp.add_argument("--prompt", default="",
                    help="text to continue (byte-level models); token ids separated by spaces or "
                         "commas for other vocabularies (default: empty, i.e. a newline for "
                         "byte-level models, else token 0)")
    sp.add_argument("--tokens", type=_positive_int, default=200,
                    help="tokens to generate (default: %(default)s)")
    sp.add_argument("--temperature", type=_nonneg_float, default=0.8,
                    help="0 = greedy (default: %(default)s)")
    sp.add_argument("--top-p", type=float, default=0.9,
                    help="nucleus sampling mass, in (0, 1] (default: %(default)s)")
    sp.add_argument("--seed", type=_nonneg_int, default=0, help="sampling seed (default: %(default)s)")
    sp.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                    help="auto: the GPU when usable, else the CPU oracle (default: %(default)s)")
    sp.add_argument("--precision", choices=PRECISIONS, default=None,
                    help="GPU GEMM precision (default: the precision the checkpoint was trained "
                         "with, else fp32; the CPU oracle computes in float32)")
    return parser


# ---------------------------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------------------------

def _find_checkpoint(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT_NAME
    if not p.is_file():
        raise UsageError(f"checkpoint not found: {p}")
    return p


def _default_out() -> Path:
    base = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    out, i = base, 1
    while out.exists():
        out, i = Path(f"{base}-{i}"), i + 1
    return out


def _write_bytes(path: Path, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""
    from .checkpoint import atomic_write

    atomic_write(path, lambda f: f.write(data))


def _read_log(path: Path, upto_step: int) -> list[dict[str, Any]]:
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


def _write_log(path: Path, rows: list[dict[str, Any]]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=LOG_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in LOG_FIELDS})
    _write_bytes(path, buf.getvalue().encode())


def _fmt(value: float | None, digits: int = 6) -> str:
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
    _write_bytes(path, buf.getvalue())


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {cfg_name: getattr(args, flag) for flag, cfg_name in MODEL_FLAGS.items()
            if getattr(args, flag) is not None}


def _resolve_device(device: str, task: str) -> tuple[str, str | None]:
    """``("cpu"|"gpu", note)`` for ``--device``; an explicit ``gpu`` that cannot be used is a
    UsageError here, before anything is built or written."""
    from .train import gpu_unavailable_reason, resolve_device

    kind, note = resolve_device(device, task)
    if device == "gpu":
        reason = gpu_unavailable_reason()
        if reason is not None:
            raise UsageError(f"--device gpu: the GPU backend cannot be used: {reason}. "
                             "Use --device cpu or --device auto.")
    return kind, note


@dataclass
class _Prepared:
    """A ``train`` invocation's settings, validated: the arguments over a resumed run over the preset."""

    kind: str                       # "cpu" or "gpu"
    note: str | None                # why --device auto fell back to the CPU
    resume: Path | None             # the checkpoint being resumed
    preset: str
    train: dict[str, Any]           # TRAIN_KEYS, steps, seed, precision, cpu_dtype
    cfg: Config
    data: TokenData
    data_arg: str | None            # --data as given or resumed; None: the embedded corpus
    token_width: int | None
    train_tokens: np.ndarray
    val_batches: list[tuple[np.ndarray, np.ndarray]]


def _prepare_train(args: argparse.Namespace) -> _Prepared:
    """Everything a run needs, validated; raises UsageError. Writes nothing."""
    from .config import Config
    from .data import default_corpus_path, eval_batches, load_tokens, split_train_val
    from .presets import DEFAULT_PRESET, get_preset
    from .train import CHECKPOINT_KIND

    kind, note = _resolve_device(args.device, "training")

    resume_path = _find_checkpoint(args.resume) if args.resume else None
    saved_run: dict[str, Any] = {}
    ckpt_cfg = None
    if resume_path is not None:
        from .checkpoint import load_checkpoint
        try:
            ckpt_cfg, _, extra = load_checkpoint(resume_path)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        meta = extra.get("meta") or {}
        if meta.get("kind") != CHECKPOINT_KIND:
            raise UsageError(f"{resume_path}: not a training checkpoint (no optimizer state)")
        saved_run = ((meta.get("user") or {}).get("run")) or {}
        overrides = _model_overrides(args)
        clash = [f for f, v in overrides.items() if getattr(ckpt_cfg, f) != v]
        if clash:
            raise UsageError(f"--resume: the checkpoint's model differs in {', '.join(clash)}; "
                             "model flags cannot change a resumed run")
        if args.preset and args.preset != saved_run.get("preset"):
            raise UsageError("--resume: --preset cannot change a resumed run")

    preset_name = saved_run.get("preset") or args.preset or DEFAULT_PRESET
    preset = get_preset(preset_name, device=kind)
    train = dict(preset["train"])
    for key in TRAIN_KEYS + ("steps",):
        if key in saved_run and saved_run[key] is not None:
            train[key] = saved_run[key]
    for key in TRAIN_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            train[key] = value
    train["seed"] = args.seed if args.seed is not None else saved_run.get("seed", 0)
    train["precision"] = args.precision or saved_run.get("precision") or "fp32"
    train["cpu_dtype"] = args.cpu_dtype or saved_run.get("cpu_dtype") or "float32"
    B, T = train["batch_size"], train["seq_len"]
    if args.steps is not None:
        train["steps"] = args.steps
    elif args.tokens is not None:
        train["steps"] = max(1, math.ceil(args.tokens / (B * T)))
    if train["lr_min"] > train["lr"]:
        raise UsageError(f"--lr-min ({train['lr_min']}) must not exceed --lr ({train['lr']})")

    # data
    data_arg = args.data if args.data is not None else saved_run.get("data")
    token_width = args.token_width if args.token_width is not None else saved_run.get("token_width")
    data_path = data_arg if data_arg is not None else str(default_corpus_path())
    try:
        data = load_tokens(data_path, token_width=token_width)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    hi = data.max_token() if data.format != "text" else None  # scanned once for both checks below

    # model
    if ckpt_cfg is not None:
        cfg = ckpt_cfg
    else:
        model = dict(preset["model"])
        model.update(_model_overrides(args))
        if hi is not None and args.vocab_size is None and hi >= model["vocab_size"]:
            raise UsageError(f"{data.source}: token id {hi} does not fit the preset's vocab_size "
                             f"{model['vocab_size']}; pass --vocab-size (at least {hi + 1})")
        try:
            cfg = Config(**model)
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None
    if data.format == "text" and cfg.vocab_size < 256:
        raise UsageError(f"{data.source}: byte-level text needs --vocab-size >= 256, got {cfg.vocab_size}")
    if hi is not None and hi >= cfg.vocab_size:
        raise UsageError(f"{data.source}: token id {hi} is out of range for vocab_size "
                         f"{cfg.vocab_size}")
    try:
        train_tokens, val_tokens = split_train_val(data.tokens, T, train["val_fraction"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    val = eval_batches(val_tokens, B, T, train["eval_batches"]) if val_tokens is not None else []
    if resume_path is None and train["steps"] < 1:
        raise UsageError("--steps must be >= 1")
    return _Prepared(kind=kind, note=note, resume=resume_path, preset=preset_name, train=train,
                     cfg=cfg, data=data, data_arg=data_arg, token_width=token_width,
                     train_tokens=train_tokens, val_batches=val)


@dataclass
class _Run:
    """A resolved ``train`` invocation: the trainer at its first step, the batch sampler, the run
    directory and the run options. Nothing is written yet."""

    prep: _Prepared
    trainer: Trainer
    sampler: BatchSampler
    start: int                      # steps already done (a resumed checkpoint's)
    out: Path
    entropy: float | None           # unigram entropy of the training tokens, when computed
    info: dict[str, Any]            # the run options: run.json and every checkpoint's meta["run"]

    @property
    def ckpt_path(self) -> Path:
        return self.out / CHECKPOINT_NAME

    @property
    def log_path(self) -> Path:
        return self.out / LOG_NAME

    @property
    def plot_path(self) -> Path:
        return self.out / PLOT_NAME


def _resolve_run(args: argparse.Namespace) -> _Run:
    """The run ``train`` ``args`` ask for: a new or resumed Trainer, its data sampler, the run
    directory (checked) and the run options; raises UsageError. Writes nothing."""
    from .data import BatchSampler, unigram_entropy
    from .params import init_params
    from .train import Trainer

    prep = _prepare_train(args)
    tr, cfg = prep.train, prep.cfg
    B, T = tr["batch_size"], tr["seq_len"]
    trainer_kwargs = dict(batch_size=B, seq_len=T, lr=tr["lr"], lr_min=tr["lr_min"],
                          warmup=tr["warmup"], total_steps=tr["steps"], weight_decay=tr["weight_decay"],
                          grad_clip=tr["grad_clip"], precision=tr["precision"], seed=tr["seed"],
                          cpu_dtype=tr["cpu_dtype"])
    try:
        if prep.resume is not None:
            trainer = Trainer.load(prep.resume, backend=prep.kind, **trainer_kwargs)
        else:
            trainer = Trainer(cfg, init_params(cfg, tr["seed"]), backend=prep.kind, **trainer_kwargs)
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    sampler = BatchSampler(prep.train_tokens, B, T, seed=tr["seed"])
    if prep.resume is not None and trainer.meta.get("sampler"):
        sampler.set_state(trainer.meta["sampler"])

    if args.out is not None:
        out = Path(args.out)
    elif prep.resume is not None:
        out = prep.resume.parent
    else:
        out = _default_out()
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if prep.resume is None and (out / CHECKPOINT_NAME).exists():
        raise UsageError(f"--out {out} already holds a run ({CHECKPOINT_NAME}); use --resume "
                         f"{out} to continue it or choose another --out")

    entropy = None
    if len(prep.train_tokens) <= 50_000_000:
        entropy = unigram_entropy(prep.train_tokens, cfg.vocab_size)
    info = {"preset": prep.preset, "data": prep.data_arg, "token_width": prep.token_width,
            "steps": tr["steps"], **{k: tr[k] for k in TRAIN_KEYS}, "seed": tr["seed"],
            "precision": tr["precision"], "cpu_dtype": tr["cpu_dtype"]}
    return _Run(prep=prep, trainer=trainer, sampler=sampler, start=trainer.step_count, out=out,
                entropy=entropy, info=info)


def _print_run(run: _Run) -> None:
    """The header: the fallback note, device, model, data and the training plan."""
    prep, trainer, cfg, tr = run.prep, run.trainer, run.prep.cfg, run.prep.train
    B, T = tr["batch_size"], tr["seq_len"]
    if prep.note:
        print(f"note: {prep.note}")
    print(f"device: {trainer.device}" + (f" ({tr['cpu_dtype']} oracle)" if trainer.device == "cpu"
                                         else f" ({tr['precision']})"))
    print(f"model: V={cfg.vocab_size} C={cfg.n_embd} L={cfg.n_rwkv_layer} M={cfg.n_attn_layer} "
          f"N={cfg.head_size} chunk={cfg.moba_chunk_size} top_k={cfg.moba_top_k}  "
          f"({sum(p.size for p in trainer.params.values()):,} parameters)")
    print(f"data: {prep.data.source} [{prep.data.format}], {len(prep.data):,} tokens "
          f"({len(prep.train_tokens):,} train, {len(prep.val_batches) * B * T:,} validation tokens)"
          + (f", unigram entropy {run.entropy:.4f} nats" if run.entropy is not None else ""))
    print(f"training: steps {run.start + 1}..{tr['steps']}, B={B} T={T}, lr {tr['lr']:g} -> "
          f"{tr['lr_min']:g}, warmup {tr['warmup']}, wd {tr['weight_decay']:g}, "
          f"clip {tr['grad_clip']:g}; out {run.out}")


@contextlib.contextmanager
def _ctrl_c_stops(announce: Callable[[str], None]) -> Iterator[types.SimpleNamespace]:
    """Within the block the first Ctrl-C only sets ``flag.requested`` (and ``announce``s it): the
    loop reads the flag between steps, so a run never stops inside an update and is checkpointed as
    usual. A second Ctrl-C raises KeyboardInterrupt at once: the run aborts and the last periodic
    checkpoint stays. Only the main thread can set signal handlers; elsewhere Ctrl-C keeps its
    default behaviour."""
    flag = types.SimpleNamespace(requested=False)

    def on_sigint(signum: int, frame: Any) -> None:
        if flag.requested:
            raise KeyboardInterrupt
        flag.requested = True
        announce("stopping after this step (Ctrl-C again to abort without saving)...")

    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class _Outcome:
    """How a training loop ended."""

    step: int                       # the trainer's step count at the end
    interrupted: bool               # stopped by Ctrl-C before the last step
    ema: float | None               # smoothed training loss (None: no step ran)
    final_train: float | None       # the log's last training loss
    final_val: float | None         # the log's last validation loss
    train_time: float               # seconds inside trainer.step, this run
    wall_time: float                # seconds of the whole loop and the final writes, this run


def _mean_val_loss(trainer: Trainer, batches: list[tuple[np.ndarray, np.ndarray]]) -> float | None:
    """The mean loss over the validation batches; None without validation data."""
    if not batches:
        return None
    return float(np.mean([trainer.evaluate(x, y) for x, y in batches]))


def _train_loop(run: _Run, progress: bool) -> _Outcome:
    """Train ``run`` to its last step with a progress bar (on stderr, unless ``progress`` is false),
    validation every ``eval_every`` steps and at the end, and a checkpoint every ``ckpt_every``
    steps; then write the final checkpoint, the log and the plot. Ctrl-C: see :func:`_ctrl_c_stops`."""
    from tqdm import tqdm

    prep, trainer, sampler, tr = run.prep, run.trainer, run.sampler, run.prep.train
    B, T, steps, start = tr["batch_size"], tr["seq_len"], tr["steps"], run.start
    resumed = prep.resume is not None
    rows = _read_log(prep.resume.parent / LOG_NAME, start) if resumed else []
    tokens_seen = int(trainer.meta.get("tokens_seen", start * B * T)) if resumed else 0
    elapsed0 = float(trainer.meta.get("elapsed_s", 0.0)) if resumed else 0.0

    def save(elapsed: float) -> None:
        trainer.save(run.ckpt_path, meta={"run": run.info, "sampler": sampler.state(),
                                          "tokens_seen": tokens_seen, "elapsed_s": elapsed})
        _write_log(run.log_path, rows)

    train_time, ema, last_val = 0.0, None, None
    interrupted = False
    with tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, mininterval=0.5,
              disable=not progress, file=sys.stderr) as bar, _ctrl_c_stops(bar.write) as stop:
        t0 = time.perf_counter()
        for step in range(start + 1, steps + 1):
            if stop.requested:
                interrupted = True
                break
            x, y = sampler.next()
            ts = time.perf_counter()
            loss = trainer.step(x, y)
            train_time += time.perf_counter() - ts
            tokens_seen += B * T
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            tps = (step - start) * B * T / max(train_time, 1e-9)
            row = {"step": step, "tokens": tokens_seen, "lr": _fmt(trainer.last_stats.get("lr")),
                   "train_loss": _fmt(loss), "grad_norm": _fmt(trainer.last_stats.get("grad_norm")),
                   "tokens_per_s": _fmt(tps, 5)}
            if (tr["eval_every"] and step % tr["eval_every"] == 0) or step == steps:
                last_val = _mean_val_loss(trainer, prep.val_batches)
                row["val_loss"] = _fmt(last_val)
            row["elapsed_s"] = _fmt(elapsed0 + time.perf_counter() - t0, 5)
            rows.append(row)
            postfix = {"loss": f"{ema:.3f}", "tok/s": f"{tps:,.0f}"}
            if last_val is not None:
                postfix["val"] = f"{last_val:.3f}"
            bar.set_postfix(postfix, refresh=False)
            bar.update(1)
            if tr["ckpt_every"] and step % tr["ckpt_every"] == 0 and step != steps:
                save(elapsed0 + time.perf_counter() - t0)
    save(elapsed0 + time.perf_counter() - t0)
    cfg = prep.cfg
    title = (f"rwkvx {prep.preset}: V={cfg.vocab_size} C={cfg.n_embd} L={cfg.n_rwkv_layer} "
             f"M={cfg.n_attn_layer}, B={B} T={T}, {trainer.device}")
    write_plot(run.plot_path, rows, title, run.entropy)
    return _Outcome(
        step=trainer.step_count, interrupted=interrupted, ema=ema,
        final_train=next((float(r["train_loss"]) for r in reversed(rows) if r.get("train_loss")), None),
        final_val=next((float(r["val_loss"]) for r in reversed(rows) if r.get("val_loss")), None),
        train_time=train_time, wall_time=time.perf_counter() - t0)


def _print_outcome(run: _Run, outcome: _Outcome) -> None:
    """The summary: final losses, speed, where the outputs are, and how to resume or sample."""
    tr = run.prep.train
    summary = f"step {outcome.step}/{tr['steps']}"
    if outcome.ema is not None:
        summary += f": train loss {outcome.ema:.4f} (smoothed; last {outcome.final_train:.4f})"
    if outcome.final_val is not None:
        summary += f", validation loss {outcome.final_val:.4f}"
    if run.entropy is not None:
        summary += f" [unigram entropy {run.entropy:.4f}]"
    print(("interrupted at " if outcome.interrupted else "done: ") + summary)
    trained = (outcome.step - run.start) * tr["batch_size"] * tr["seq_len"]
    print(f"time: {outcome.wall_time:.1f} s this run, "
          f"{trained / max(outcome.train_time, 1e-9):,.0f} tokens/s training")
    print(f"checkpoint: {run.ckpt_path}")
    print(f"log:        {run.log_path}")
    print(f"plot:       {run.plot_path}")
    if outcome.interrupted:
        print(f"resume:     python -m rwkvx train --resume {run.out}")
        return
    prompt = "ROMEO:" if run.prep.data_arg is None else ""
    print(f"sample:     python -m rwkvx sample --ckpt {run.ckpt_path}"
          + (f" --prompt {prompt!r}" if prompt else ""))


def cmd_train(args: argparse.Namespace) -> int:
    """``python -m rwkvx train``: resolve the run, train it, report. Returns the exit status: 0, or
    130 when Ctrl-C stopped the run (checkpointed, resumable)."""
    run = _resolve_run(args)
    _print_run(run)
    steps = run.prep.train["steps"]
    if run.start >= steps:
        print(f"checkpoint is at step {run.start} >= --steps {steps}: nothing to train "
              "(pass a larger --steps to continue)")
        return 0
    run.out.mkdir(parents=True, exist_ok=True)
    _write_bytes(run.out / RUN_NAME,
                 json.dumps({"config": run.prep.cfg.to_dict(), "run": run.info}, indent=2).encode())
    outcome = _train_loop(run, progress=not args.no_progress)
    _print_outcome(run, outcome)
    return 130 if outcome.interrupted else 0


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------

def _generation_source(cfg: Config, params: ParamDict, device: str, prompt_len: int, precision: str
                       ) -> tuple[Any, str | None]:
    """What :func:`rwkvx.generation.stream` generates with on the chosen device, plus the fallback
    note: a GPU Model built for the prompt (``precision`` GEMMs), or the float32 CPU oracle."""
    kind, note = _resolve_device(device, "sampling")
    if kind == "gpu":
        from .model import Model
        try:
            return Model(cfg, params, batch_size=1, seq_len=prompt_len, precision=precision), note
        except (ValueError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
    try:
        from .oracle import Oracle
    except ImportError as exc:
        raise UsageError(f"sampling on the CPU needs the compiled oracle (rwkvx.oracle): {exc}") from None
    return Oracle(cfg, params, dtype=np.float32), note


def cmd_sample(args: argparse.Namespace) -> int:
    """``python -m rwkvx sample``: stream ``--tokens`` tokens after the prompt to stdout; returns 0."""
    from .checkpoint import load_checkpoint

    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    path = _find_checkpoint(args.ckpt)
    try:
        cfg, params, extra = load_checkpoint(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    byte_level = cfg.vocab_size == 256
    if byte_level:
        prompt = list(args.prompt.encode("utf-8")) or [10]
    else:
        try:
            prompt = [int(t) for t in args.prompt.replace(",", " ").split()]
        except ValueError:
            raise UsageError(f"this model has vocab_size {cfg.vocab_size}, not byte-level: give --prompt "
                             "as token ids separated by spaces or commas") from None
        if not prompt:
            prompt = [0]
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is out of range [0, {cfg.vocab_size})")
    meta = extra.get("meta") or {}
    run = (meta.get("user") or {}).get("run") or {}
    precision = (args.precision or run.get("precision")
                 or (meta.get("trainer") or {}).get("precision") or "fp32")
    source, note = _generation_source(cfg, params, args.device, len(prompt), precision)
    if note:
        print(f"note: {note}", file=sys.stderr)
    from .generation import stream
    try:
        new_tokens = stream(source, prompt, args.tokens, args.temperature, args.top_p, args.seed)
    except ValueError as exc:          # e.g. a model too large for the decoder's buffers
        raise UsageError(str(exc)) from None
    out = sys.stdout
    if byte_level:
        out.write(args.prompt)
        out.flush()
        pending = b""
    else:
        out.write(" ".join(map(str, prompt)))
    for step in new_tokens:
        nxt = int(step[0])
        if byte_level:
            pending += bytes([nxt])
            try:
                text = pending.decode("utf-8")
                pending = b""
            except UnicodeDecodeError as exc:
                if exc.reason == "unexpected end of data" and len(pending) < 4:
                    continue
                text, pending = pending.decode("utf-8", errors="replace"), b""
            out.write(text)
        else:
            out.write(f" {nxt}")
        out.flush()
    if byte_level and pending:
        out.write(pending.decode("utf-8", errors="replace"))
    out.write("\n")
    out.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status. Bad arguments or
    data exit with status 2 and an ``error:`` line, having written nothing."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args)
        return cmd_sample(args)
    except UsageError as exc:
        parser.exit(2, f"{parser.prog} {args.command}: error: {exc}\n")
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
