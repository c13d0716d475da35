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
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .validate import FieldError

if TYPE_CHECKING:  # annotations only: each command imports what it uses when it runs
    from .config import Config
    from .params import ParamDict
    from .tokenizer import Tokenizer
    from .training.loop import Outcome
    from .training.setup import Run, RunRequest

EXIT_USAGE = 2          # a bad argument, bad data or an output that cannot be written: nothing written
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)


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


class ModelFlag(NamedTuple):
    """A ``train`` flag that overrides one Config field of the preset."""
    field: str
    kind: Callable[[str], int]
    help: str


# model flag (argparse dest) -> what it sets; the "model" group of ``train`` has these flags in this order
MODEL_FLAGS = {
    "vocab_size": ModelFlag("vocab_size", _positive_int, "V (text data needs 256)"),
    "n_embd": ModelFlag("n_embd", _positive_int, "C, the model width"),
    "n_layer": ModelFlag("n_rwkv_layer", _positive_int, "L, RWKV-7 blocks"),
    "n_attn_layer": ModelFlag("n_attn_layer", _nonneg_int, "M, MoBA attention blocks (0 <= M <= L)"),
    "head_size": ModelFlag("head_size", _positive_int, "N, head size (must divide C)"),
    "ffn_dim": ModelFlag("ffn_dim", _positive_int, "channel-mix width (default 4*C)"),
    "chunk": ModelFlag("moba_chunk_size", _positive_int, "MoBA block length in tokens"),
    "top_k": ModelFlag("moba_top_k", _positive_int, "MoBA blocks per query, its own included"),
}
# TrainConfig fields set by a flag of the same name
TRAIN_FLAGS = ("batch_size", "seq_len", "steps", "lr", "lr_min", "warmup", "weight_decay", "grad_clip",
               "eval_every", "eval_batches", "ckpt_every", "val_fraction", "seed", "precision", "recompute",
               "cpu_dtype", "tune", "lora_rank", "lora_alpha", "lora_targets",
               "optimizer_memory")


def _flag(dest: str) -> str:
    """The command-line spelling of the argparse dest ``dest`` (``n_embd`` -> ``--n-embd``)."""
    return "--" + dest.replace("_", "-")


# (settings class, field) -> the flag that sets it
FLAGS = {**{("Config", m.field): _flag(flag) for flag, m in MODEL_FLAGS.items()},
         **{("TrainConfig", field): _flag(field) for field in TRAIN_FLAGS}}


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m rwkvx`` parser: the ``train``, ``sample``, ``prepare`` and ``export`` subcommands."""
    from .dist.world import DEFAULT_TIMEOUT_S
    from .precision import PRECISION_NAMES as PRECISIONS
    from .lora import DEFAULT_ALPHA, DEFAULT_RANK, DEFAULT_TARGETS, TARGETS
    from .presets import DEFAULT_PRESET, PRESETS, get_preset
    from .pth import WRITE_DTYPES
    from .tokenizer import TOKENIZERS
    from .training.config import CPU_DTYPES, OPTIMIZER_MEMORY, RECOMPUTE_AUTO, TUNES

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
            f"B={p['train'].batch_size} T={p['train'].seq_len} steps={p['train'].steps}"
            for name, p in ((name, get_preset(name)) for name in PRESETS)))
    g = tr.add_argument_group("model (preset, then overrides)")
    g.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help=f"model + training preset (default {DEFAULT_PRESET})")
    for flag, m in MODEL_FLAGS.items():
        g.add_argument(_flag(flag), type=m.kind, help=m.help)
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
    g.add_argument("--recompute", nargs="?", const=True, choices=(RECOMPUTE_AUTO,), default=None,
                   help="GPU: recompute each block's forward in the backward (least memory); --no-recompute "
                        "keeps every block's transients (faster, more memory); --recompute auto (the "
                        "default) keeps them when that arena fits in the GPU's free memory")
    g.add_argument("--no-recompute", dest="recompute", action="store_false", default=None,
                   help=argparse.SUPPRESS)
    g.add_argument("--cpu-dtype", choices=CPU_DTYPES, default=None,
                   help="arithmetic of the CPU oracle backend (default float32)")
    g.add_argument("--tune", choices=TUNES, default=None,
                   help="full (default): train every parameter; state: train only the initial WKV "
                        "state of every RWKV block, the model frozen (usually with --init-from; one GPU "
                        "or the CPU). The checkpoint is then a state file, state.safetensors; lora: "
                        "train only low-rank factors of the --lora-targets matrices, the model frozen "
                        "(one GPU or the CPU); the checkpoint is then a LoRA file, lora.safetensors")
    g.add_argument("--init-state", metavar="FILE",
                   help="--tune state: start from these states instead of zeros: a state file (a "
                        "state-tuning run's state.safetensors or its run directory) or RWKV-PEFT's "
                        ".pth state file (blocks.{i}.att.time_state)")
    g.add_argument("--lora-rank", type=_positive_int, metavar="R",
                   help=f"--tune lora: the factors' rank r (default {DEFAULT_RANK}); smaller than both "
                        "sides of every adapted matrix")
    g.add_argument("--lora-alpha", type=_positive_float, metavar="ALPHA",
                   help=f"--tune lora: the update is scaled by alpha / r (default {DEFAULT_ALPHA:g})")
    g.add_argument("--lora-targets", metavar="T1,T2",
                   help="--tune lora: the matrices to adapt, comma-separated, from " + ", ".join(TARGETS)
                        + f" (default {','.join(DEFAULT_TARGETS)}; the moba.* targets need MoBA blocks)")
    g.add_argument("--optimizer-memory", choices=tuple(OPTIMIZER_MEMORY), default=None,
                   help="standard (default): AdamW moments in float32; lean: in bf16, stochastically "
                        "rounded (4 bytes a parameter less; a standard run cannot resume lean)")
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
    g.add_argument("--stretch-schedule", action="store_true",
                   help="with --resume and a new --steps: stretch the learning rate's cosine to the new "
                        "end (default: keep its length; after it the rate stays at --lr-min)")
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
    sp.add_argument("--state", metavar="FILE",
                    help="start every RWKV block from the tuned initial WKV states of this state file "
                         "(a state-tuning run's state.safetensors or its run directory)")
    sp.add_argument("--lora", metavar="FILE",
                    help="adapt the model with this LoRA file (a LoRA run's lora.safetensors or its run "
                         "directory), merged into the weights on load: W + alpha/r * (A B)^T")
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
    sp.add_argument("--top-k", type=_nonneg_int, default=0,
                    help="sample among the k most likely tokens only; 0 = no limit (default: %(default)s)")
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
                    "RWKV-LM's code loads with torch.load. The optimizer state is not exported. With "
                    "--state instead of --ckpt: write tuned states as a .pth state file of RWKV-PEFT / "
                    "RWKV-Runner (float32 blocks.{i}.att.time_state).")
    ex.add_argument("--ckpt", help="checkpoint file or run directory (any format load_checkpoint reads, "
                                   ".pth included)")
    ex.add_argument("--state", metavar="FILE",
                    help="export this state file (a state-tuning run's state.safetensors or its run "
                         "directory) as a .pth state file instead of a model")
    ex.add_argument("--out", required=True, help="the .pth file to write (must not exist)")
    ex.add_argument("--dtype", choices=tuple(WRITE_DTYPES), default="bf16",
                    help="storage type (default: %(default)s, as BlinkDL's released models)")
    ex.add_argument("--lora", metavar="FILE",
                    help="merge this LoRA file (a LoRA run's lora.safetensors or its run directory) into "
                         "the weights before exporting: W + alpha/r * (A B)^T")
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

def _checkpoint(path: str, option: str = "--ckpt") -> Path:
    """The checkpoint file ``option`` names (a file or a run directory)."""
    from .training.setup import checkpoint_option

    with _usage_errors():
        return checkpoint_option(path, option)


def _check_writable(path: Path) -> None:
    """UsageError when ``--out`` ``path`` cannot be written."""
    from .training.setup import check_writable

    with _usage_errors():
        check_writable(path)


def flag_error(exc: FieldError) -> UsageError:
    """``exc`` (a bad Config or TrainConfig field) as the user typed it: each field named by its flag
    and value (``--head-size 16 must divide --n-embd 60``)."""
    def spell(name: str, value: Any) -> str:
        flag = FLAGS.get((exc.owner, name))
        if flag is None:      # a field no flag sets (e.g. one read from a checkpoint)
            return f"{exc.owner}.{name}={value!r}"
        return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"
    return UsageError(exc.render(spell))


@contextlib.contextmanager
def _usage_errors() -> Iterator[None]:
    """Library errors about the request as UsageErrors naming the flags."""
    from .training.setup import RunError

    try:
        yield
    except FieldError as exc:
        raise flag_error(exc) from None
    except RunError as exc:
        raise UsageError(str(exc)) from None


def _request(args: argparse.Namespace) -> RunRequest:
    """The run the ``train`` flags ask for."""
    from .training.setup import RunRequest

    return RunRequest(
        preset=args.preset, model={m.field: getattr(args, flag) for flag, m in MODEL_FLAGS.items()
                                   if getattr(args, flag) is not None},
        train={key: getattr(args, key) for key in TRAIN_FLAGS if getattr(args, key) is not None},
        tokens=args.tokens, stretch_schedule=args.stretch_schedule, init_from=args.init_from,
        init_state=args.init_state, data=args.data, token_width=args.token_width, tokenizer=args.tokenizer, device=args.device,
        resume=args.resume, out=args.out, progress=not args.no_progress)


def _schedule_note(run: Run) -> str | None:
    """What a resumed run does with the learning-rate schedule, when its length differs from ``steps``."""
    prep, tr = run.prep, run.train
    if prep.saved is None or prep.saved.steps == tr.steps:
        return None
    length = tr.schedule.total_steps
    if length == prep.saved.schedule.total_steps:
        if tr.steps <= length:
            return None
        return (f"the learning-rate schedule keeps its {length} steps: lr stays at {tr.lr_min:g} after "
                f"step {length} (--stretch-schedule stretches the cosine to {tr.steps} steps)")
    return (f"the cosine is stretched from {prep.saved.schedule.total_steps} to {length} steps: lr at step "
            f"{run.start + 1} is {tr.schedule.lr_at(run.start + 1):.3g} "
            f"(was {prep.saved.schedule.lr_at(run.start + 1):.3g})")


def _recompute_note(run: Run) -> str:
    """Whether the GPU backward recomputes each block's forward, and why when it was "auto"."""
    from .training.config import RECOMPUTE_AUTO

    resolved = run.info["recompute"]
    note = f"recompute {'on' if resolved else 'off'}"
    if run.train.recompute == RECOMPUTE_AUTO:
        note += f"; auto: the arena without recompute {'does not fit' if resolved else 'fits'} in the free GPU memory"
    return note


# what a fresh model's zero output matrices (att.output, ffn.value) mean for a tuning run, by tune
_FRESH_MODEL = {"state": "its states get no gradient",
                "lora": "only the factors of output matrices get a gradient until those have trained"}


def _print_run(run: Run) -> None:
    """The header: the fallback note, device, model, data and the training plan."""
    from .params import param_shapes
    prep, trainer, cfg, tr = run.prep, run.trainer, run.prep.cfg, run.train
    B, T, ranks = tr.batch_size, tr.seq_len, prep.world_size
    if prep.note:
        print(f"note: {prep.note}")
    note = _schedule_note(run)
    if note:
        print(f"note: {note}")
    print(f"device: {trainer.device}" + (f" ({tr.cpu_dtype} oracle)" if trainer.device == "cpu"
                                         else f" ({tr.precision}, {_recompute_note(run)})"))
    print(f"model: V={cfg.vocab_size} C={cfg.n_embd} L={cfg.n_rwkv_layer} M={cfg.n_attn_layer} "
          f"N={cfg.head_size} chunk={cfg.moba_chunk_size} top_k={cfg.moba_top_k}  "
          f"({sum(math.prod(s) for s in param_shapes(cfg).values()):,} parameters)"
          + (f", initialised from {prep.init_from}" if prep.init_from else ""))
    if trainer.states is not None:
        print(f"state tuning: {sum(s.size for s in trainer.states.values()):,} state values trained "
              f"({len(trainer.states)} RWKV blocks x [H, N, N]), the model frozen"
              + (f"; starting from {run.info['init_state']}" if run.info.get("init_state") else ""))
    if trainer.lora is not None:
        r, alpha, targets = tr.lora
        print(f"LoRA: {sum(f.size for f in trainer.lora.values()):,} factor values trained "
              f"({len(trainer.lora) // 2} matrices of {','.join(targets)}; rank {r}, alpha {alpha:g}, "
              f"scale {tr.lora.scale:g}), the model frozen")
    if tr.tune != "full" and prep.init_from is None:
        print(f"note: a fresh model's output matrices are zero, so {_FRESH_MODEL[tr.tune]}: tuning adapts "
              "a trained model (--init-from)")
    fmt = prep.data.format + (f", {prep.tokenizer} tokenizer" if prep.tokenizer else "")
    held = 0 if prep.val_tokens is None else len(prep.val_tokens)
    val = (f"{held:,} held out for validation, {prep.val_scored:,} of them scored" if held
           else "no validation split")
    print(f"data: {prep.data.source} [{fmt}], {len(prep.data):,} tokens "
          f"({len(prep.train_tokens):,} train, {val})"
          + (f", unigram entropy {run.entropy:.4f} nats" if run.entropy is not None else ""))
    if ranks > 1:
        print(f"data parallel: {ranks} ranks x B={B} = {ranks * B} sequences per step")
    print(f"training: steps {run.start + 1}..{tr.steps}, B={B} T={T}, lr {tr.lr:g} -> "
          f"{tr.lr_min:g}, warmup {tr.warmup}, wd {tr.weight_decay:g}, "
          f"clip {tr.grad_clip:g}; out {run.out}")


def _print_outcome(run: Run, outcome: Outcome) -> None:
    """The summary: final losses, speed, where the outputs are, and how to resume or sample."""
    from .data import DEFAULT_CORPUS_PROMPT

    tr = run.train
    summary = f"step {outcome.step}/{tr.steps}"
    if outcome.ema is not None:
        summary += f": train loss {outcome.ema:.4f} (smoothed; last {outcome.final_train:.4f})"
    if outcome.final_val is not None:
        summary += f", validation loss {outcome.final_val:.4f}"
    if run.entropy is not None:
        summary += f" [unigram entropy {run.entropy:.4f}]"
    print(("interrupted at " if outcome.interrupted else "done: ") + summary)
    trained = (outcome.step - run.start) * run.prep.world_size * tr.batch_size * tr.seq_len
    print(f"time: {outcome.wall_time:.1f} s this run, "
          f"{trained / max(outcome.train_time, 1e-9):,.0f} tokens/s training")
    print(f"checkpoint: {run.ckpt_path}")
    print(f"log:        {run.log_path}")
    print(f"plot:       {run.plot_path}")
    if outcome.interrupted:
        print(f"resume:     python -m rwkvx train --resume {run.out}")
        return
    prompt = DEFAULT_CORPUS_PROMPT if run.prep.data_arg is None else ""
    if tr.tune != "full":
        if run.prep.init_from is None:    # a fresh model, which no file holds
            return
        source = (f"--ckpt {run.prep.init_from} --state {run.ckpt_path}" if tr.tune == "state"
                  else f"--ckpt {run.prep.init_from} --lora {run.ckpt_path}")
    else:
        source = f"--ckpt {run.ckpt_path}"
    print(f"sample:     python -m rwkvx sample {source}" + (f" --prompt {prompt!r}" if prompt else ""))


def _train(args: argparse.Namespace, world: Any) -> int:
    """Resolve the run, train it, report (rank 0 prints and writes); the exit status."""
    from .training.loop import start_run, train_loop
    from .training.setup import resolve_run

    with _usage_errors():
        run = resolve_run(_request(args), world)
    if run.main:
        _print_run(run)
    if run.start >= run.train.steps:
        if run.main:
            print(f"checkpoint is at step {run.start} >= --steps {run.train.steps}: nothing to train "
                  "(pass a larger --steps to continue)")
        return 0
    start_run(run)
    outcome = train_loop(run)
    if run.main:
        _print_outcome(run, outcome)
    return EXIT_INTERRUPTED if outcome.interrupted else 0


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
    from .training.setup import prepare

    with _usage_errors():
        prepare(_request(args), 0, n, kind=kind)
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

def _generation_source(cfg: Config, params: ParamDict, device: str, precision: str,
                       states: dict | None = None) -> tuple[Any, str | None]:
    """What :func:`rwkvx.generation.stream` generates with on the chosen device, plus the fallback
    note: a GPU Model holding the weights (``precision``; its decoder has buffers of its own, so the
    model is built for one token), or the float32 CPU oracle; either starts from the initial WKV
    ``states`` when given."""
    from .training.setup import check_device

    with _usage_errors():
        kind, note = check_device(device, "sampling")
    if kind == "gpu":
        from .model import Model
        try:   # the weights' holder for the decoder; no backward: the least memory
            return Model(cfg, params, batch_size=1, seq_len=1, precision=precision, recompute=True,
                         states=states), note
        except (ValueError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
    try:
        from .oracle import Oracle
    except ImportError as exc:
        raise UsageError(f"sampling on the CPU needs the compiled oracle (rwkvx.oracle): {exc}") from None
    return Oracle(cfg, params, dtype=np.float32, states=states), note


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


# an adapter file given as a model -> (what it is, the option that takes it)
_ADAPTER_OPTIONS = {"state": ("a state file (tuned states, no model)", "--state"),
                    "lora": ("a LoRA file (tuned factors, no model)", "--lora")}


def _load_model(args: argparse.Namespace) -> tuple[Path, Config, ParamDict, dict[str, Any]]:
    """``(path, cfg, params, extra)`` of the model ``--ckpt`` names, with the ``--lora`` file merged
    into its weights when given (:func:`rwkvx.lora.merge`)."""
    from .checkpoint import file_format, load_checkpoint
    from .training.trainer import ADAPTER_FORMATS

    path = _checkpoint(args.ckpt)
    tune = ADAPTER_FORMATS.get(file_format(path))
    if tune is not None:
        what, option = _ADAPTER_OPTIONS[tune]
        use = f" and this file as {option}" if hasattr(args, option[2:]) else ""
        raise UsageError(f"--ckpt {path} is {what}: give the model as --ckpt{use}")
    try:
        cfg, params, extra = load_checkpoint(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.lora is not None:
        from .lora import load_lora, merge
        try:
            _, factors, settings, _ = load_lora(_checkpoint(args.lora, "--lora"), cfg)
        except ValueError as exc:
            raise UsageError(f"--lora: {exc}") from None
        params = merge(cfg, params, factors, settings.scale)
    return path, cfg, params, extra


def cmd_sample(args: argparse.Namespace) -> int:
    """``python -m rwkvx sample``: stream ``--tokens`` tokens after the prompt to stdout; returns 0."""
    from .precision import DEFAULT_PRECISION

    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    path, cfg, params, extra = _load_model(args)
    meta = extra.get("meta") or {}
    run = (meta.get("user") or {}).get("run") or {}
    tokenizer = _sample_tokenizer(args.tokenizer, run, cfg.vocab_size)
    prompt = encode_prompt(args.prompt, tokenizer, cfg.vocab_size)
    precision = args.precision or (meta.get("train") or {}).get("precision") or DEFAULT_PRECISION
    states = None
    if args.state is not None:
        from .training.setup import states_option
        with _usage_errors():
            states = states_option(args.state, "--state", cfg)
    source, note = _generation_source(cfg, params, args.device, precision, states)
    if note:
        print(f"note: {note}", file=sys.stderr)
    from .generation import stream
    try:
        new_tokens = stream(source, prompt, args.tokens, args.temperature, args.top_p, args.seed, args.top_k)
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
    _check_writable(Path(args.out))
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
    """``python -m rwkvx export``: the checkpoint's model as an RWKV-LM .pth, or a state file as a
    .pth state file (atomic); returns 0."""
    from .checkpoint import export_rwkv7_pth

    if (args.ckpt is None) == (args.state is None):
        raise UsageError("give --ckpt (a model to export) or --state (a state file to export), one of them")
    if args.state is not None and (args.lora or args.drop_attention):
        raise UsageError("--lora and --drop-attention apply to a model (--ckpt), not to --state")
    out = Path(args.out)
    if out.exists():
        raise UsageError(f"--out {out} exists; choose another path or remove it first")
    _check_writable(out)
    if args.state is not None:
        return _export_states(_checkpoint(args.state, "--state"), out)
    path, cfg, params, _ = _load_model(args)
    try:
        export_rwkv7_pth(out, cfg, params, dtype=args.dtype, drop_attention=args.drop_attention)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    notes = (f", without its {cfg.n_attn_layer} attention block(s)" if cfg.n_attn_layer else "")
    notes += f", the LoRA file {args.lora} merged" if args.lora else ""
    print(f"exported {path} -> {out} ({args.dtype}, RWKV-LM x070: V={cfg.vocab_size} C={cfg.n_embd} "
          f"L={cfg.n_rwkv_layer} N={cfg.head_size}{notes})")
    return 0


def _export_states(path: Path, out: Path) -> int:
    """``export --state``: the state file at ``path`` as a .pth state file ``out``."""
    from .state_tuning import export_states_pth, load_states

    try:
        cfg, states, _ = load_states(path)
    except ValueError as exc:
        raise UsageError(f"--state: {exc}") from None
    export_states_pth(out, cfg, states)
    print(f"exported {path} -> {out} (float32 states of {cfg.n_rwkv_layer} RWKV blocks, "
          f"[H={cfg.n_head}, N={cfg.head_size}, N] each, as blocks.{{i}}.att.time_state)")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit status. Bad arguments, bad
    data or an output that cannot be written exit with status 2 and an ``error:`` line, having written
    nothing; another I/O error with status 1, Ctrl-C with 130 (one line each, no traceback)."""
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
        parser.exit(EXIT_USAGE, f"{parser.prog} {args.command}: error: {exc}\n")
    except DistributedError as exc:
        parser.exit(1, f"{parser.prog} {args.command}: error: {exc}\n")
    except OSError as exc:   # e.g. the disk filled up; files are written atomically, none is left half-written
        where = f"{exc.filename}: " if exc.filename else ""
        parser.exit(1, f"{parser.prog} {args.command}: error: {where}{exc.strerror or exc}\n")
    except KeyboardInterrupt:
        parser.exit(EXIT_INTERRUPTED, f"{parser.prog} {args.command}: interrupted"
                    + (" (the run's last checkpoint stays)" if args.command == "train" else "") + "\n")
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
