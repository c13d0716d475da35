"""``python -m rwkvx``: ``train`` a model, ``sample`` text from a checkpoint, ``prepare`` text as binidx,
``export`` a model for RWKV-LM.

``python -m rwkvx train`` with no arguments trains the ``tiny`` preset on the embedded Shakespeare
corpus (GPU when usable, else the CPU oracle) and prints where the checkpoint, the loss log (CSV) and
the loss curve (PNG) are. Every argument and the data are checked before anything is written.

Data parallel: ``--gpus N`` starts N local ranks (:mod:`rwkvx.dist.launch`); a process started by
torchrun, mpirun or srun joins its job (:mod:`rwkvx.dist.env`). ``--batch-size`` is per rank; only
rank 0 prints, shows the progress bar and writes the run directory.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import math
import os
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

if TYPE_CHECKING:  # annotations only: each command imports what it uses when it runs
    from .config import Config
    from .data import BatchSampler, TokenData
    from .params import ParamDict
    from .tokenizer import Tokenizer
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
    """The ``python -m rwkvx`` parser: the ``train``, ``sample``, ``prepare`` and ``export`` subcommands."""
    from .dist.world import DEFAULT_TIMEOUT_S
    from .precision import PRECISION_NAMES as PRECISIONS
    from .presets import DEFAULT_PRESET, PRESETS
    from .pth import WRITE_DTYPES
    from .tokenizer import TOKENIZERS

    parser = argparse.ArgumentParser(
        prog="python -m rwkvx",
        description="Train RWKV-X language models (RWKV-7 + MoBA attention), sample from them, and "
                    "prepare tokenised data.")
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
    g.add_argument("--init-from", metavar="CKPT",
                   help="start from a trained model instead of a fresh one: an rwkvx checkpoint or run "
                        "directory, or an RWKV-LM x070 .pth / safetensors state dict. V, C, L, N, the FFN "
                        "width and LoRA ranks come from it (a contradicting flag is an error); "
                        "--n-attn-layer M on an RWKV-7 model upgrades it to RWKV-X (each attention "
                        "block copied from the RWKV block before it). Training starts at step 0")

    g = tr.add_argument_group("data")
    g.add_argument("--data", help="UTF-8 .txt or .jsonl text (see --tokenizer), .npy / raw .bin tokens, "
                                  "or a binidx prefix (PREFIX.bin + PREFIX.idx); default: embedded corpus")
    g.add_argument("--token-width", type=int, choices=(2, 4),
                   help="bytes per token of a raw .bin file: 2 = uint16, 4 = uint32")
    g.add_argument("--tokenizer", choices=TOKENIZERS, default=None,
                   help="text data: bytes (default, V=256) or world (RWKV World, V=65536, tokenised "
                        "at start); token data: the tokenizer its ids come from, so that sample "
                        "decodes them (default: none, sample reads and prints ids). Sets the model's "
                        "vocab_size, which must then equal the tokenizer's")
    g.add_argument("--val-fraction", type=_fraction, help="fraction of the data held out for validation")

    g = tr.add_argument_group("training")
    g.add_argument("--device", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: the GPU when usable, else the CPU oracle")
    g.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="GPU precision: fp32 (exact), tf32 (tensor-core GEMMs), bf16 (bf16 GEMMs and "
                        "activations, fp32 master weights; docs/SPEC.md §4); the CPU backend computes in --cpu-dtype")
    g.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=None,
                   help="GPU: recompute each block's forward in the backward (default; least memory), or "
                        "keep every block's transients (--no-recompute: faster, more memory)")
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
    g.add_argument("--gpus", type=_positive_int, default=1, metavar="N",
                   help="data-parallel training on N local GPUs, one process each (with --device cpu: N "
                        "oracle processes); --batch-size is per GPU. Under torchrun / mpirun / srun leave "
                        "it out: each launched process is one rank")
    g.add_argument("--dist-timeout", type=_positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="data parallel: how long a rank waits for the others before the job ends with an "
                        "error (default: %(default)g)")

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
                    help="text to continue, encoded with the model's tokenizer; token ids separated "
                         "by spaces or commas for a model trained without one (default: empty, i.e. "
                         "a newline, or token 0)")
    sp.add_argument("--tokenizer", choices=TOKENIZERS, default=None,
                    help="encode the prompt and decode the output with this tokenizer (default: the "
                         "one the checkpoint was trained with; a checkpoint that records none: bytes "
                         "when V=256, else token ids)")
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
                    help="GPU precision (default: the precision the checkpoint was trained "
                         "with, else fp32; the CPU oracle computes in float32)")

    ex = sub.add_parser(
        "export", help="write a model as an RWKV-LM x070 .pth state dict (no PyTorch needed)",
        description="Write a model's parameters as an RWKV-LM x070 state dict in PyTorch's .pth format "
                    "(RWKV-LM's names and shapes; block 0 gets the unused att.v0/v1/v2 as zeros), which "
                    "RWKV-LM's code loads with torch.load. The optimizer state is not exported.")
    ex.add_argument("--ckpt", required=True, help="checkpoint file or run directory (any format "
                                                  "load_checkpoint reads, .pth included)")
    ex.add_argument("--out", required=True, help="the .pth file to write (must not exist)")
    ex.add_argument("--dtype", choices=tuple(WRITE_DTYPES), default="bf16",
                    help="storage type (default: %(default)s, as BlinkDL's released models)")
    ex.add_argument("--drop-attention", action="store_true",
                    help="export an RWKV-X model's RWKV-7 blocks alone (RWKV-LM has no MoBA blocks; "
                         "without this flag such a model is refused). The result is a different model: "
                         "the attention blocks' contribution is missing")

    pp = sub.add_parser(
        "prepare", help="tokenise text into RWKV-LM's binidx format (PREFIX.bin + PREFIX.idx)",
        description="Tokenise a UTF-8 text file (one document) or .jsonl (one document per line, its "
                    '"text" field) into PREFIX.bin + PREFIX.idx, the binidx format of RWKV-LM: uint16 '
                    "ids, one sequence per document, each followed by the end-of-document id 0 "
                    "(world). Train on it with: train --data PREFIX --tokenizer world.")
    pp.add_argument("--data", required=True, help="input: .txt/.text/.md (UTF-8) or .jsonl")
    pp.add_argument("--tokenizer", choices=TOKENIZERS, default="world",
                    help="world (RWKV World, V=65536) or bytes (V=256) (default: %(default)s)")
    pp.add_argument("--out", required=True, metavar="PREFIX",
                    help="output prefix: writes PREFIX.bin and PREFIX.idx (never over existing files)")
    pp.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    from .atomic_io import atomic_write

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
    start_params: ParamDict | None  # --init-from's parameters (upgraded to cfg); None: fresh init
    init_from: str | None           # where they came from, for the header and the run options
    data: TokenData
    data_arg: str | None            # --data as given or resumed; None: the embedded corpus
    token_width: int | None
    tokenizer: str | None           # the ids' tokenizer (None: token data of none named)
    train_tokens: np.ndarray
    val_batches: list[tuple[np.ndarray, np.ndarray]]


def _train_tokenizer(args: argparse.Namespace, resume: Path | None, saved_run: dict[str, Any],
                     data_path: str) -> str | None:
    """The tokenizer of a run's ids: ``--tokenizer``, else a resumed run's, else ``bytes`` for text
    data and None (ids of no named tokenizer) for token data. A resumed run cannot change it."""
    from .data import TEXT_FORMATS, detect_format

    if resume is not None and "tokenizer" in saved_run:
        saved = saved_run["tokenizer"]
        if args.tokenizer is not None and args.tokenizer != saved:
            raise UsageError(f"--resume: the run's tokenizer is {saved or 'none (token ids)'}; "
                             "--tokenizer cannot change a resumed run")
        return saved
    if args.tokenizer is not None:
        return args.tokenizer
    try:
        fmt = detect_format(data_path)[0]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return "bytes" if fmt in TEXT_FORMATS else None


def _prepare_train(args: argparse.Namespace, rank: int = 0, ranks: int = 1,
                   kind: str | None = None) -> _Prepared:
    """Everything a run needs, validated; raises UsageError. Writes nothing.

    ``rank`` of ``ranks``: this process's place in a data-parallel job; ``kind``: the backend, when
    the caller has resolved it (the ``--gpus`` launcher, which must not open a GPU itself)."""
    from .config import Config
    from .data import TEXT_FORMATS, default_corpus_path, eval_batches, load_tokens, split_train_val
    from .presets import DEFAULT_PRESET, get_preset
    from .tokenizer import tokenizer_class
    from .train import CHECKPOINT_KIND

    note = None
    if kind is None:
        kind, note = _resolve_device(args.device, "training")

    if args.resume and args.init_from:
        raise UsageError("--init-from starts a new run from a model, --resume continues a run: give one")
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
    train["recompute"] = args.recompute if args.recompute is not None else saved_run.get("recompute", True)
    train["cpu_dtype"] = args.cpu_dtype or saved_run.get("cpu_dtype") or "float32"
    saved_ranks = int(saved_run.get("world_size") or 1)
    if resume_path is not None and saved_ranks != ranks and args.batch_size is None:
        # keep the global batch (and so the data stream) of the resumed run
        global_batch = train["batch_size"] * saved_ranks
        if global_batch % ranks:
            raise UsageError(f"--resume: the run's global batch of {global_batch} sequences "
                             f"({saved_ranks} ranks x {train['batch_size']}) does not split over {ranks} "
                             "ranks; pass --batch-size (sequences per rank)")
        train["batch_size"] = global_batch // ranks
    train["world_size"] = ranks
    B, T = train["batch_size"], train["seq_len"]
    if args.steps is not None:
        train["steps"] = args.steps
    elif args.tokens is not None:
        train["steps"] = max(1, math.ceil(args.tokens / (ranks * B * T)))
    if train["lr_min"] > train["lr"]:
        raise UsageError(f"--lr-min ({train['lr_min']}) must not exceed --lr ({train['lr']})")

    # data
    data_arg = args.data if args.data is not None else saved_run.get("data")
    token_width = args.token_width if args.token_width is not None else saved_run.get("token_width")
    data_path = data_arg if data_arg is not None else str(default_corpus_path())
    tokenizer = _train_tokenizer(args, resume_path, saved_run, data_path)
    try:
        data = load_tokens(data_path, token_width=token_width, tokenizer=tokenizer or "bytes",
                           progress=not args.no_progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except ImportError as exc:
        raise UsageError(f"--tokenizer {tokenizer}: {exc}") from None
    hi = None if data.format in TEXT_FORMATS else data.max_token()  # scanned once for both checks below
    tok_vocab = tokenizer_class(tokenizer).vocab_size if tokenizer is not None else None

    # model
    start_params, init_from = None, saved_run.get("init_from")
    if ckpt_cfg is not None:
        cfg = ckpt_cfg
    elif args.init_from:
        cfg, start_params, init_from = _init_model(args, preset["model"])
    else:
        model = dict(preset["model"])
        if tok_vocab is not None:
            model["vocab_size"] = tok_vocab
        model.update(_model_overrides(args))
        if hi is not None and args.vocab_size is None and hi >= model["vocab_size"]:
            raise UsageError(f"{data.source}: token id {hi} does not fit the preset's vocab_size "
                             f"{model['vocab_size']}; pass --vocab-size (at least {hi + 1}), or "
                             "--tokenizer world for World-tokenised data")
        try:
            cfg = Config(**model)
        except (ValueError, TypeError) as exc:
            raise UsageError(str(exc)) from None
    if tok_vocab is not None and cfg.vocab_size != tok_vocab:
        raise UsageError(f"--tokenizer {tokenizer} has {tok_vocab} token ids: the model's vocab_size "
                         f"must be {tok_vocab}, got {cfg.vocab_size}"
                         + (" (pass --tokenizer world for a World model)" if tokenizer == "bytes" else ""))
    if hi is not None and hi >= cfg.vocab_size:
        raise UsageError(f"{data.source}: token id {hi} is out of range for vocab_size "
                         f"{cfg.vocab_size}")
    try:
        train_tokens, val_tokens = split_train_val(data.tokens, T, train["val_fraction"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    val = (eval_batches(val_tokens, B, T, train["eval_batches"], rank, ranks)
           if val_tokens is not None else [])
    if resume_path is None and train["steps"] < 1:
        raise UsageError("--steps must be >= 1")
    return _Prepared(kind=kind, note=note, resume=resume_path, preset=preset_name, train=train,
                     cfg=cfg, start_params=start_params, init_from=init_from, data=data,
                     data_arg=data_arg, token_width=token_width, tokenizer=tokenizer,
                     train_tokens=train_tokens, val_batches=val)



def _init_model(args: argparse.Namespace, preset_model: dict[str, Any]
                ) -> tuple[Config, ParamDict, str]:
    """``--init-from``: the checkpoint's Config with the fields the flags may change (the MoBA block
    length and top-k; the number of attention blocks of an RWKV-7 model), its parameters (upgraded by
    :func:`rwkvx.rwkv7_to_rwkvx` when attention blocks are added) and what to call the source.
    A flag that contradicts a field fixed by the checkpoint's tensors is a UsageError."""
    from .checkpoint import load_checkpoint
    from .params import rwkv7_to_rwkvx

    path = _find_checkpoint(args.init_from)
    try:
        cfg, params, _ = load_checkpoint(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    changeable = {"moba_chunk_size", "moba_top_k"} | ({"n_attn_layer"} if cfg.n_attn_layer == 0 else set())
    overrides = _model_overrides(args)
    flags = {field: flag for flag, field in MODEL_FLAGS.items()}
    clash = [f"--{flags[field].replace('_', '-')} {value} (the checkpoint has {getattr(cfg, field)})"
             for field, value in overrides.items()
             if field not in changeable and value != getattr(cfg, field)]
    if clash:
        raise UsageError(f"--init-from {path}: {'; '.join(clash)}: these fields are fixed by the "
                         "checkpoint's tensors; drop the flag(s)")
    # An RWKV-7 checkpoint says nothing about MoBA: the preset's block length and top-k, then the flags.
    changes = {k: preset_model[k] for k in ("moba_chunk_size", "moba_top_k")} if cfg.n_attn_layer == 0 else {}
    changes.update({k: v for k, v in overrides.items() if k in changeable})
    try:
        new = replace(cfg, **changes)
        if new.n_attn_layer != cfg.n_attn_layer:
            params = rwkv7_to_rwkvx(new, params)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--init-from {path}: {exc}") from None
    return new, params, str(path)


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
    def main(self) -> bool:
        """This process prints and writes the run (rank 0, or the only process)."""
        return self.trainer.world is None or self.trainer.world.is_main

    @property
    def ckpt_path(self) -> Path:
        return self.out / CHECKPOINT_NAME

    @property
    def log_path(self) -> Path:
        return self.out / LOG_NAME

    @property
    def plot_path(self) -> Path:
        return self.out / PLOT_NAME


def _resolve_run(args: argparse.Namespace, world: Any = None) -> _Run:
    """The run ``train`` ``args`` ask for: a new or resumed Trainer, its data sampler, the run
    directory (checked) and the run options; raises UsageError. Writes nothing. ``world``: this
    rank's data-parallel job (None: one process; the run directory is then rank 0's alone)."""
    from .data import BatchSampler, unigram_entropy
    from .params import init_params
    from .train import Trainer

    rank, ranks = (0, 1) if world is None else (world.rank, world.world_size)
    main_rank = rank == 0
    prep = _prepare_train(args, rank, ranks)
    if world is not None:
        kinds = [k.decode() for k in world.allgather(prep.kind.encode())]
        if len(set(kinds)) > 1:
            raise UsageError("the ranks would not all train on the same backend ("
                             + ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
                             + "): pass --device gpu or --device cpu")
    tr, cfg = prep.train, prep.cfg
    B, T = tr["batch_size"], tr["seq_len"]
    trainer_kwargs = dict(batch_size=B, seq_len=T, lr=tr["lr"], lr_min=tr["lr_min"],
                          warmup=tr["warmup"], total_steps=tr["steps"], weight_decay=tr["weight_decay"],
                          grad_clip=tr["grad_clip"], precision=tr["precision"], seed=tr["seed"],
                          cpu_dtype=tr["cpu_dtype"], recompute=tr["recompute"])
    from .dist import DistributedError
    try:
        if prep.resume is not None:
            trainer = Trainer.load(prep.resume, backend=prep.kind, world=world, **trainer_kwargs)
        else:
            params = prep.start_params if prep.start_params is not None else init_params(cfg, tr["seed"])
            trainer = Trainer(cfg, params, backend=prep.kind, world=world, **trainer_kwargs)
    except DistributedError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    sampler = BatchSampler(prep.train_tokens, B, T, seed=tr["seed"], rank=rank, world_size=ranks)
    if prep.resume is not None and trainer.meta.get("sampler"):
        sampler.set_state(trainer.meta["sampler"])

    if args.out is not None:
        out = Path(args.out)
    elif prep.resume is not None:
        out = prep.resume.parent
    else:
        out = _default_out()
    if main_rank and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if main_rank and prep.resume is None and (out / CHECKPOINT_NAME).exists():
        raise UsageError(f"--out {out} already holds a run ({CHECKPOINT_NAME}); use --resume "
                         f"{out} to continue it or choose another --out")

    entropy = None
    if main_rank and len(prep.train_tokens) <= 50_000_000:
        entropy = unigram_entropy(prep.train_tokens, cfg.vocab_size)
    info = {"preset": prep.preset, "init_from": prep.init_from, "data": prep.data_arg,
            "token_width": prep.token_width, "tokenizer": prep.tokenizer,
            "steps": tr["steps"], **{k: tr[k] for k in TRAIN_KEYS}, "seed": tr["seed"],
            "precision": tr["precision"], "recompute": tr["recompute"], "cpu_dtype": tr["cpu_dtype"],
            "world_size": ranks}
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
          f"({sum(p.size for p in trainer.params.values()):,} parameters)"
          + (f", initialised from {prep.init_from}" if prep.init_from else ""))
    ranks = tr["world_size"]
    fmt = prep.data.format + (f", {prep.tokenizer} tokenizer" if prep.tokenizer else "")
    print(f"data: {prep.data.source} [{fmt}], {len(prep.data):,} tokens "
          f"({len(prep.train_tokens):,} train, {len(prep.val_batches) * ranks * B * T:,} validation tokens)"
          + (f", unigram entropy {run.entropy:.4f} nats" if run.entropy is not None else ""))
    if ranks > 1:
        print(f"data parallel: {ranks} ranks x B={B} = {ranks * B} sequences per step")
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
    steps; then write the final checkpoint, the log and the plot. Ctrl-C: see :func:`_ctrl_c_stops`.
    Data parallel: every rank trains and evaluates its shard; only rank 0 shows progress and writes."""
    from tqdm import tqdm

    prep, trainer, sampler, tr = run.prep, run.trainer, run.sampler, run.prep.train
    B, T, steps, start = tr["batch_size"], tr["seq_len"], tr["steps"], run.start
    step_tokens = tr["world_size"] * B * T
    resumed = prep.resume is not None
    rows = _read_log(prep.resume.parent / LOG_NAME, start) if resumed and run.main else []
    tokens_seen = int(trainer.meta.get("tokens_seen", start * step_tokens)) if resumed else 0
    elapsed0 = float(trainer.meta.get("elapsed_s", 0.0)) if resumed else 0.0

    def save(elapsed: float) -> None:
        if not run.main:
            return
        trainer.save(run.ckpt_path, meta={"run": run.info, "sampler": sampler.state(),
                                          "tokens_seen": tokens_seen, "elapsed_s": elapsed})
        _write_log(run.log_path, rows)

    train_time, ema, last_val = 0.0, None, None
    interrupted = False
    with tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, mininterval=0.5,
              disable=not (progress and run.main), file=sys.stderr) as bar, \
            _ctrl_c_stops(bar.write if run.main else lambda _: None) as stop:
        t0 = time.perf_counter()
        for step in range(start + 1, steps + 1):
            if stop.requested:
                trainer.request_stop()
            if trainer.stop_agreed:    # data parallel: every rank stops after the same step
                interrupted = True
                break
            x, y = sampler.next()
            ts = time.perf_counter()
            loss = trainer.step(x, y)
            train_time += time.perf_counter() - ts
            tokens_seen += step_tokens
            ema = loss if ema is None else 0.9 * ema + 0.1 * loss
            tps = (step - start) * step_tokens / max(train_time, 1e-9)
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
    ranks = "" if tr["world_size"] == 1 else f"{tr['world_size']} x "
    title = (f"rwkvx {prep.preset}: V={cfg.vocab_size} C={cfg.n_embd} L={cfg.n_rwkv_layer} "
             f"M={cfg.n_attn_layer}, B={ranks}{B} T={T}, {trainer.device}")
    if run.main:
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
    trained = (outcome.step - run.start) * tr["world_size"] * tr["batch_size"] * tr["seq_len"]
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


def _train(args: argparse.Namespace, world: Any) -> int:
    """Resolve the run, train it, report (rank 0 prints and writes); the exit status."""
    run = _resolve_run(args, world)
    if run.main:
        _print_run(run)
    steps = run.prep.train["steps"]
    if run.start >= steps:
        if run.main:
            print(f"checkpoint is at step {run.start} >= --steps {steps}: nothing to train "
                  "(pass a larger --steps to continue)")
        return 0
    if run.main:
        run.out.mkdir(parents=True, exist_ok=True)
        _write_bytes(run.out / RUN_NAME,
                     json.dumps({"config": run.prep.cfg.to_dict(), "run": run.info}, indent=2).encode())
    outcome = _train_loop(run, progress=not args.no_progress)
    if run.main:
        _print_outcome(run, outcome)
    return 130 if outcome.interrupted else 0


def _spawn(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``--gpus N``: check the arguments here (nothing is written, no GPU is opened), then run N ranks."""
    from .dist import env, launch

    n = args.gpus
    found = env.launched_by(os.environ)
    if found:
        raise UsageError(f"--gpus {n} starts its own {n} ranks, but this process was started by a launcher "
                         f"({found} set): leave --gpus out, each launched process is one rank")
    if args.device == "cpu":
        kind = "cpu"
    else:
        visible = launch.visible_gpus()
        if visible < n:
            raise UsageError(f"--gpus {n}: only {visible} GPU(s) visible here"
                             + ("; --device cpu runs the ranks on the CPU oracle" if not visible else ""))
        kind = "gpu"
    _prepare_train(args, 0, n, kind=kind)
    return launch.spawn(n, launch.train_command(argv))


def _join(args: argparse.Namespace, info: Any) -> Any:
    """Join the data-parallel job ``info`` describes and pick this rank's GPU."""
    from .dist import env, init_world, launch
    from .runtime.device import Device

    world = init_world(info, args.dist_timeout)
    if args.device != "cpu":
        visible = launch.visible_gpus()
        if visible:
            try:
                Device.select(env.device_ordinal(world.local_rank, visible))
            except ValueError as exc:
                world.abort(str(exc))
                raise UsageError(f"rank {world.rank}: {exc}") from None
    return world


def cmd_train(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """``python -m rwkvx train``: resolve the run, train it, report. Returns the exit status: 0, or
    130 when Ctrl-C stopped the run (checkpointed, resumable). ``argv``: the train arguments as given
    (``--gpus N`` starts N processes of them); a process of a launched job trains as its rank."""
    from .dist import env

    try:
        info = env.launch_info(os.environ)
    except ValueError as exc:
        raise UsageError(f"data-parallel launch: {exc}") from None
    if args.gpus > 1:
        return _spawn(args, argv)
    if info is None:
        return _train(args, None)
    world = _join(args, info)
    try:
        status = _train(args, world)
    except BaseException as exc:
        world.abort("interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}")
        raise
    world.close()
    return status


# ---------------------------------------------------------------------------------------------
# sample
# ---------------------------------------------------------------------------------------------

def _generation_source(cfg: Config, params: ParamDict, device: str, prompt_len: int, precision: str
                       ) -> tuple[Any, str | None]:
    """What :func:`rwkvx.generation.stream` generates with on the chosen device, plus the fallback
    note: a GPU Model built for the prompt (``precision`` GEMMs), or the float32 CPU oracle."""
    kind, note = _resolve_device(device, "sampling")
    if kind == "gpu":
        from .decoder import PREFILL_METHODS
        from .model import Model
        try:   # with the kernels the decoder's prefill reads (else Decoder.from_model builds another Model)
            return Model(cfg, params, batch_size=1, seq_len=prompt_len, precision=precision,
                         methods=PREFILL_METHODS), note
        except (ValueError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
    try:
        from .oracle import Oracle
    except ImportError as exc:
        raise UsageError(f"sampling on the CPU needs the compiled oracle (rwkvx.oracle): {exc}") from None
    return Oracle(cfg, params, dtype=np.float32), note


def _sample_tokenizer(name: str | None, run: dict[str, Any], vocab_size: int) -> Tokenizer | None:
    """The tokenizer ``sample`` encodes and decodes with: ``name`` (``--tokenizer``), else the one the
    run recorded (None: the model was trained on token ids of no named tokenizer); a checkpoint that
    records none (older runs, converted models) is byte-level when V = 256, else token ids. Its
    vocabulary must be the model's."""
    from .tokenizer import get_tokenizer, tokenizer_class

    if name is None:
        name = run["tokenizer"] if "tokenizer" in run else ("bytes" if vocab_size == 256 else None)
    if name is None:
        return None
    try:
        cls = tokenizer_class(name)
        if cls.vocab_size != vocab_size:
            raise ValueError(f"the {name} tokenizer has {cls.vocab_size} token ids but the model's "
                             f"vocab_size is {vocab_size}")
        return get_tokenizer(name)
    except (ValueError, ImportError) as exc:
        raise UsageError(str(exc)) from None


def encode_prompt(prompt: str, tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """The prompt's ids: ``prompt`` encoded with ``tokenizer`` (empty: a newline), or, without one, read
    as ids separated by spaces or commas (empty: token 0). UsageError for text that cannot be encoded
    (undecodable bytes on the command line), an id outside ``[0, vocab_size)`` or an unreadable list."""
    if tokenizer is not None:
        try:
            ids = tokenizer.encode(prompt or "\n").tolist()
        except UnicodeEncodeError as exc:
            raise UsageError(f"--prompt is not valid text ({exc.reason} at character {exc.start})"
                             ) from None
    else:
        try:
            ids = [int(t) for t in prompt.replace(",", " ").split()] or [0]
        except ValueError:
            raise UsageError(f"this model was trained on token ids (vocab_size {vocab_size}, no "
                             "tokenizer): give --prompt as token ids separated by spaces or commas, "
                             "or name the ids' tokenizer with --tokenizer") from None
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is out of range [0, {vocab_size})")
    return ids


class TokenEcho:
    """Writes a sample as it is generated: text through the tokenizer (a character split across
    tokens appears once complete), or ids separated by spaces when there is no tokenizer."""

    def __init__(self, out: Any, tokenizer: Tokenizer | None) -> None:
        from .tokenizer import TextStream

        self.out = out
        self.text = TextStream(tokenizer) if tokenizer is not None else None

    def prompt(self, prompt: str, ids: Sequence[int]) -> None:
        """Echo the prompt: its text as given, or its ids."""
        self.out.write(prompt if self.text is not None else " ".join(map(str, ids)))
        self.out.flush()

    def write(self, ids: Sequence[int]) -> None:
        """Write generated ``ids``."""
        self.out.write(self.text.feed(ids) if self.text is not None else
                       "".join(f" {i}" for i in ids))
        self.out.flush()

    def close(self) -> None:
        """Write what is left and end the line."""
        self.out.write((self.text.close() if self.text is not None else "") + "\n")
        self.out.flush()


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
    meta = extra.get("meta") or {}
    run = (meta.get("user") or {}).get("run") or {}
    tokenizer = _sample_tokenizer(args.tokenizer, run, cfg.vocab_size)
    prompt = encode_prompt(args.prompt, tokenizer, cfg.vocab_size)
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
    echo = TokenEcho(sys.stdout, tokenizer)
    echo.prompt(args.prompt, prompt)
    for step in new_tokens:
        echo.write([int(step[0])])
    echo.close()
    return 0


# ---------------------------------------------------------------------------------------------
# prepare
# ---------------------------------------------------------------------------------------------

def cmd_prepare(args: argparse.Namespace) -> int:
    """``python -m rwkvx prepare``: tokenise ``--data`` into ``--out``.bin/.idx; returns 0."""
    from .data.text import prepare_binidx
    from .tokenizer import get_tokenizer

    out = [Path(f"{args.out}.bin"), Path(f"{args.out}.idx")]
    for path in out:
        if path.exists():
            raise UsageError(f"{path} already exists: remove it or choose another --out")
    try:
        tokenizer = get_tokenizer(args.tokenizer)
        stats = prepare_binidx(args.data, args.out, tokenizer, progress=not args.no_progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except ImportError as exc:
        raise UsageError(f"--tokenizer {args.tokenizer}: {exc}") from None
    mb = stats.text_bytes / 1e6
    print(f"wrote {out[0]} + {out[1]}: {stats.tokens:,} tokens in {stats.documents:,} document(s) "
          f"({args.tokenizer} tokenizer, V={tokenizer.vocab_size}, uint16)")
    print(f"text: {mb:,.1f} MB in {stats.seconds:.1f} s ({mb / max(stats.seconds, 1e-9):,.1f} MB/s)")
    print(f"train: python -m rwkvx train --data {args.out} --tokenizer {args.tokenizer}")
    return 0


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    """``python -m rwkvx export``: the checkpoint's model as an RWKV-LM .pth (atomic); returns 0."""
    from .checkpoint import export_rwkv7_pth, load_checkpoint

    path = _find_checkpoint(args.ckpt)
    out = Path(args.out)
    if out.exists():
        raise UsageError(f"--out {out} exists; choose another path or remove it first")
    try:
        cfg, params, _ = load_checkpoint(path)
        export_rwkv7_pth(out, cfg, params, dtype=args.dtype, drop_attention=args.drop_attention)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    dropped = (f", without its {cfg.n_attn_layer} attention block(s)" if cfg.n_attn_layer else "")
    print(f"exported {path} -> {out} ({args.dtype}, RWKV-LM x070: V={cfg.vocab_size} C={cfg.n_embd} "
          f"L={cfg.n_rwkv_layer} N={cfg.head_size}{dropped})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status. Bad arguments or
    data exit with status 2 and an ``error:`` line, having written nothing."""
    from .dist.store import DistributedError

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, argv[argv.index("train") + 1:])
        if args.command == "export":
            return cmd_export(args)
        if args.command == "prepare":
            return cmd_prepare(args)
        return cmd_sample(args)
    except UsageError as exc:
        parser.exit(2, f"{parser.prog} {args.command}: error: {exc}\n")
    except DistributedError as exc:
        parser.exit(1, f"{parser.prog} {args.command}: error: {exc}\n")
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
