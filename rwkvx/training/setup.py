"""Resolving a training run: a :class:`RunRequest` (what the user asked for) becomes a :class:`Run` (the
Trainer at its first step, the data, the sampler, the run directory and the run options), every
setting and the data checked before anything is written.

Settings come from the preset, then a resumed run's, then the request. Problems with the request or
the data raise :class:`RunError` naming the option at fault, or the :class:`rwkvx.validate.FieldError`
of ``Config`` / ``TrainConfig`` (a caller such as the CLI names the field's flag).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic_io import cannot_write
from ..config import Config
from ..data import TokenData
from ..params import ParamDict
from ..state_tuning import StateDict, load_states
from ..validate import FieldError
from . import trainer as _trainer
from .config import TrainConfig
from .rundir import CHECKPOINT_NAMES, LOG_NAME, PLOT_NAME, default_out, find_checkpoint
from .trainer import (ADAPTER_FORMATS, CHECKPOINT_KIND, TUNED, Trainer, read_checkpoint,
                      saved_train_config)

ENTROPY_MAX_TOKENS = 50_000_000   # the unigram entropy is computed for training data up to this size
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_targets")   # TrainConfig fields that only --tune lora uses
LORA_OPTIONS = "--lora-rank, --lora-alpha and --lora-targets"
RUN_TRAINS = {"full": "every parameter", **TUNED}   # by TrainConfig.tune


class RunError(ValueError):
    """A bad request or bad data, found before anything was written."""


@dataclass
class RunRequest:
    """What a training run is asked to be (the ``train`` command's options); None: not given."""

    preset: str | None = None
    model: dict[str, Any] = field(default_factory=dict)   # Config fields
    train: dict[str, Any] = field(default_factory=dict)   # TrainConfig fields
    tokens: int | None = None         # total training tokens, instead of train["steps"]
    stretch_schedule: bool = False    # resume: stretch the cosine to a new train["steps"]
    init_from: str | None = None
    init_state: str | None = None     # tune="state": the states to start from
    data: str | None = None
    token_width: int | None = None
    tokenizer: str | None = None
    device: str = "auto"
    resume: str | None = None
    out: str | None = None
    progress: bool = True


@dataclass
class Prepared:
    """A request's settings and data, validated (see :func:`prepare`)."""

    kind: str                       # "cpu" or "gpu"
    note: str | None                # why device "auto" fell back to the CPU
    resume: Path | None             # the checkpoint being resumed
    saved: TrainConfig | None       # the resumed run's settings
    preset: str
    train: TrainConfig
    world_size: int
    cfg: Config
    start_params: ParamDict | None  # init_from's parameters (upgraded to cfg); None: fresh init
    init_from: str | None           # where they came from
    start_states: StateDict | None  # init_state's states (None: zeros, or the resumed run's)
    data: TokenData
    data_arg: str | None            # the data as given or resumed; None: the embedded corpus
    token_width: int | None
    tokenizer: str | None           # the ids' tokenizer (None: token data of none named)
    train_tokens: np.ndarray
    val_tokens: np.ndarray | None   # the held-out tokens
    val_batches: list[tuple[np.ndarray, np.ndarray]]
    val_scored: int                 # held-out tokens an evaluation scores (distinct positions)


def check_device(device: str, task: str) -> tuple[str, str | None]:
    """``("cpu"|"gpu", note)`` for ``device`` (see :func:`rwkvx.training.trainer.resolve_device`); an
    explicit ``gpu`` that cannot be used is a RunError here, before anything is built or written."""
    try:
        kind, note = _trainer.resolve_device(device, task)
    except ValueError as exc:
        raise RunError(f"--device {device}: {exc}") from None
    if device == "gpu":
        reason = _trainer.gpu_unavailable_reason()   # looked up when called: tests stand in a GPU
        if reason is not None:
            raise RunError(f"--device gpu: the GPU backend cannot be used: {reason}. "
                           "Use --device cpu or --device auto.")
    return kind, note


def checkpoint_option(path: str, option: str) -> Path:
    """The checkpoint file that command-line ``option`` names (a file or a run directory); RunError
    naming the option when there is none."""
    try:
        return find_checkpoint(path)
    except ValueError as exc:
        raise RunError(f"{option}: {exc}") from None


def states_option(path: str, option: str, cfg: Config) -> StateDict:
    """The initial states of the state file that command-line ``option`` names (a file or a run
    directory; RWKV-PEFT's ``.pth`` too), for model ``cfg``; RunError naming the option."""
    try:
        return load_states(checkpoint_option(path, option), cfg)[1]
    except ValueError as exc:
        raise RunError(f"{option}: {exc}") from None


def check_writable(path: Path, shown: Path | None = None) -> None:
    """RunError naming ``--out`` (as ``shown``, default ``path``) when ``path`` cannot be written."""
    problem = cannot_write(path)
    if problem:
        raise RunError(f"--out {shown or path}: cannot write there ({problem})")


def _train_tokenizer(req: RunRequest, saved_run: dict[str, Any] | None, data_path: str) -> str | None:
    """The tokenizer of a run's ids: the request's, else a resumed run's, else ``bytes`` for text data
    and None (ids of no named tokenizer) for token data. A resumed run cannot change it."""
    from ..data import TEXT_FORMATS, detect_format

    if saved_run is not None and "tokenizer" in saved_run:
        saved = saved_run["tokenizer"]
        if req.tokenizer is not None and req.tokenizer != saved:
            raise RunError(f"--resume: the run's tokenizer is {saved or 'none (token ids)'}; "
                           "--tokenizer cannot change a resumed run")
        return saved
    if req.tokenizer is not None:
        return req.tokenizer
    try:
        fmt = detect_format(data_path)[0]
    except ValueError as exc:
        raise RunError(str(exc)) from None
    return "bytes" if fmt in TEXT_FORMATS else None


def _train_config(req: RunRequest, preset: TrainConfig, saved: TrainConfig | None, saved_ranks: int,
                  ranks: int) -> TrainConfig:
    """The run's TrainConfig: the preset's (or the resumed run's) with the request's fields."""
    changes = {k: v for k, v in req.train.items() if v is not None}
    base = saved or preset
    if saved is not None and saved_ranks != ranks and "batch_size" not in changes:
        # keep the global batch (and so the data stream) of the resumed run
        global_batch = saved.batch_size * saved_ranks
        if global_batch % ranks:
            raise RunError(f"--resume: the run's global batch of {global_batch} sequences "
                           f"({saved_ranks} ranks x {saved.batch_size}) does not split over {ranks} "
                           "ranks; pass --batch-size (sequences per rank)")
        changes["batch_size"] = global_batch // ranks
    if req.tokens is not None:
        per_step = ranks * changes.get("batch_size", base.batch_size) * changes.get("seq_len", base.seq_len)
        changes["steps"] = max(1, math.ceil(req.tokens / per_step))
    if saved is not None:
        return saved.resumed(req.stretch_schedule, **changes)
    return preset.replace(**changes)


def prepare(req: RunRequest, rank: int = 0, ranks: int = 1, kind: str | None = None) -> Prepared:
    """Everything a run needs, validated; raises RunError or FieldError. Writes nothing.

    ``rank`` of ``ranks``: this process's place in a data-parallel job; ``kind``: the backend, when the
    caller has resolved it (the ``--gpus`` launcher, which must not open a GPU itself)."""
    from ..checkpoint import file_format
    from ..data import TEXT_FORMATS, default_corpus_path, eval_batches, load_tokens, scored_tokens, split_train_val
    from ..presets import DEFAULT_PRESET, get_preset
    from ..tokenizer import tokenizer_class

    note = None
    if req.resume and req.init_from:
        raise RunError("--init-from starts a new run from a model, --resume continues a run: give one")
    resume_path = checkpoint_option(req.resume, "--resume") if req.resume else None
    tune = "full" if resume_path is None else ADAPTER_FORMATS.get(file_format(resume_path), "full")
    if req.train.get("tune") not in (None, tune) and resume_path is not None:
        raise RunError(f"--resume: the run trains {RUN_TRAINS[tune]}; --tune cannot change a resumed run")
    tune = req.train.get("tune") or tune
    lora_given = {f: req.train[f] for f in LORA_FIELDS if req.train.get(f) is not None}
    if req.init_state is not None and resume_path is not None:
        raise RunError("--init-state starts a new state-tuning run; a resumed run continues from its own states")
    if req.init_state is not None and tune != "state":
        raise RunError("--init-state gives the states a state-tuning run starts from: it needs --tune state")
    if lora_given and tune != "lora":
        raise RunError(f"{LORA_OPTIONS} are LoRA settings: they need --tune lora")
    if kind is None:
        kind, note = check_device(req.device, "training")
    if tune in TUNED and kind == "gpu" and ranks > 1:
        raise RunError(f"--tune {tune}: {_trainer.TUNING_DATA_PARALLEL}")
    saved_run, saved, ckpt_cfg = None, None, None
    if resume_path is not None:
        try:
            _, ckpt_cfg, _, extra = read_checkpoint(resume_path)
        except ValueError as exc:
            raise RunError(str(exc)) from None
        meta = extra.get("meta") or {}
        if meta.get("kind") != CHECKPOINT_KIND:
            raise RunError(f"{resume_path}: not a training checkpoint (no optimizer state)")
        try:
            saved = saved_train_config(meta)
        except ValueError as exc:
            raise RunError(f"{resume_path}: {exc}") from None
        saved_run = (meta.get("user") or {}).get("run") or {}
        clash = [f for f, v in req.model.items() if getattr(ckpt_cfg, f) != v]
        if clash:
            raise RunError(f"--resume: the checkpoint's model differs in {', '.join(clash)}; "
                           "model flags cannot change a resumed run")
        if req.preset and req.preset != saved_run.get("preset"):
            raise RunError("--resume: --preset cannot change a resumed run")
        if lora_given:
            try:
                same = saved.replace(**lora_given).lora == saved.lora
            except (ValueError, TypeError):   # a bad value differs from the run's too
                same = False
            if not same:
                r, alpha, targets = saved.lora
                raise RunError(f"--resume: the run's LoRA factors have rank {r}, alpha {alpha:g}, targets "
                               f"{','.join(targets)}; {LORA_OPTIONS} cannot change a resumed run")

    run_opts = saved_run or {}
    preset_name = run_opts.get("preset") or req.preset or DEFAULT_PRESET
    preset = get_preset(preset_name, device=kind)
    train = _train_config(req, preset["train"], saved, int(run_opts.get("world_size") or 1), ranks)

    # data
    data_arg = req.data if req.data is not None else run_opts.get("data")
    token_width = req.token_width if req.token_width is not None else run_opts.get("token_width")
    data_path = data_arg if data_arg is not None else str(default_corpus_path())
    tokenizer = _train_tokenizer(req, saved_run, data_path)
    try:
        data = load_tokens(data_path, token_width=token_width, tokenizer=tokenizer or "bytes",
                           progress=req.progress)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    except ImportError as exc:
        raise RunError(f"--tokenizer {tokenizer}: {exc}") from None
    hi = None if data.format in TEXT_FORMATS else data.max_token()  # scanned once for both checks below
    tok_vocab = tokenizer_class(tokenizer).vocab_size if tokenizer is not None else None

    # model
    start_params, init_from = None, run_opts.get("init_from")
    if ckpt_cfg is not None:
        cfg = ckpt_cfg
        if tune != "full" and init_from:   # the frozen model the states or LoRA factors were tuned on
            cfg, start_params, _ = _init_model(replace(req, init_from=init_from, model={
                k: getattr(ckpt_cfg, k) for k in ("moba_chunk_size", "moba_top_k", "n_attn_layer")}),
                preset["model"])
            if cfg != ckpt_cfg:
                raise RunError(f"--resume: the run's model {init_from} no longer fits its "
                               f"{CHECKPOINT_NAMES[tune]}")
    elif req.init_from:
        cfg, start_params, init_from = _init_model(req, preset["model"])
    else:
        model = dict(preset["model"])
        if tok_vocab is not None:
            model["vocab_size"] = tok_vocab
        model.update(req.model)
        if hi is not None and "vocab_size" not in req.model and hi >= model["vocab_size"]:
            raise RunError(f"{data.source}: token id {hi} does not fit the preset's vocab_size "
                           f"{model['vocab_size']}; pass --vocab-size (at least {hi + 1}), or "
                           "--tokenizer world for World-tokenised data")
        cfg = Config(**model)
    if tok_vocab is not None and cfg.vocab_size != tok_vocab:
        raise RunError(f"--tokenizer {tokenizer} has {tok_vocab} token ids: the model's vocab_size "
                       f"must be {tok_vocab}, got {cfg.vocab_size}"
                       + (" (pass --tokenizer world for a World model)" if tokenizer == "bytes" else ""))
    if hi is not None and hi >= cfg.vocab_size:
        raise RunError(f"{data.source}: token id {hi} is out of range for vocab_size {cfg.vocab_size}")
    train.check_model(cfg)
    start_states = None if req.init_state is None else states_option(req.init_state, "--init-state", cfg)
    B, T = train.batch_size, train.seq_len
    try:
        train_tokens, val_tokens = split_train_val(data.tokens, T, train.val_fraction)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    val, scored = [], 0
    if val_tokens is not None:
        val = eval_batches(val_tokens, B, T, train.eval_batches, rank, ranks)
        scored = scored_tokens(len(val_tokens), B * ranks, T, train.eval_batches)
    return Prepared(kind=kind, note=note, resume=resume_path, saved=saved, preset=preset_name, train=train,
                    world_size=ranks, cfg=cfg, start_params=start_params, init_from=init_from,
                    start_states=start_states, data=data,
                    data_arg=data_arg, token_width=token_width, tokenizer=tokenizer,
                    train_tokens=train_tokens, val_tokens=val_tokens, val_batches=val, val_scored=scored)


def _init_model(req: RunRequest, preset_model: dict[str, Any]) -> tuple[Config, ParamDict, str]:
    """``init_from``: the checkpoint's Config with the fields the request may change (the MoBA block
    length and top-k; the number of attention blocks of an RWKV-7 model), its parameters (upgraded by
    :func:`rwkvx.rwkv7_to_rwkvx` when attention blocks are added) and what to call the source.
    A model field that contradicts one fixed by the checkpoint's tensors is a RunError."""
    from ..checkpoint import load_checkpoint
    from ..params import rwkv7_to_rwkvx

    path = checkpoint_option(req.init_from, "--init-from")
    try:
        cfg, params, _ = load_checkpoint(path)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    changeable = {"moba_chunk_size", "moba_top_k"} | ({"n_attn_layer"} if cfg.n_attn_layer == 0 else set())
    clash = {name: value for name, value in req.model.items()
             if name not in changeable and value != getattr(cfg, name)}
    where = str(path).replace("{", "{{").replace("}", "}}")   # a FieldError template
    if clash:
        raise FieldError("Config", f"--init-from {where}: "
                         + "; ".join(f"{{{name}}} (the checkpoint has {getattr(cfg, name)})" for name in clash)
                         + ": these fields are fixed by the checkpoint's tensors; drop the flag(s)", **clash)
    # An RWKV-7 checkpoint says nothing about MoBA: the preset's block length and top-k, then the request.
    changes = {k: preset_model[k] for k in ("moba_chunk_size", "moba_top_k")} if cfg.n_attn_layer == 0 else {}
    changes.update({k: v for k, v in req.model.items() if k in changeable})
    try:
        new = replace(cfg, **changes)
        if new.n_attn_layer != cfg.n_attn_layer:
            params = rwkv7_to_rwkvx(new, params)
    except FieldError as exc:
        raise FieldError(exc.owner, f"--init-from {where}: {exc.template}", **exc.fields) from None
    except (ValueError, TypeError) as exc:
        raise RunError(f"--init-from {path}: {exc}") from None
    return new, params, str(path)


@dataclass
class Run:
    """A resolved training run: the trainer at its first step, the batch sampler, the run directory and
    the run options. Nothing is written yet."""

    prep: Prepared
    trainer: Trainer
    sampler: Any                    # rwkvx.data.BatchSampler
    start: int                      # steps already done (a resumed checkpoint's)
    out: Path
    entropy: float | None           # unigram entropy of the training tokens, when computed
    info: dict[str, Any]            # the run options besides the TrainConfig: run.json, checkpoints' meta["run"]
    progress: bool                  # show a progress bar (on stderr)

    @property
    def main(self) -> bool:
        """This process prints and writes the run (rank 0, or the only process)."""
        return self.trainer.world is None or self.trainer.world.is_main

    @property
    def train(self) -> TrainConfig:
        """The run's settings."""
        return self.trainer.config

    @property
    def ckpt_path(self) -> Path:
        """The run's checkpoint (a state-tuning run's: its state file; a LoRA run's: its LoRA file)."""
        return self.out / CHECKPOINT_NAMES[self.train.tune]

    @property
    def log_path(self) -> Path:
        """The run's loss log (CSV)."""
        return self.out / LOG_NAME

    @property
    def plot_path(self) -> Path:
        """The run's loss curve (PNG)."""
        return self.out / PLOT_NAME


def _check_out(out: Path, resuming: bool) -> None:
    """RunError unless ``out`` can become (or is) this run's directory: a directory (or nothing yet)
    where this process may write, holding no other run."""
    if out.exists() and not out.is_dir():
        raise RunError(f"--out {out} exists and is not a directory")
    for name in () if resuming else CHECKPOINT_NAMES.values():
        if (out / name).exists():
            raise RunError(f"--out {out} already holds a run ({name}); use --resume "
                           f"{out} to continue it or choose another --out")
    check_writable(out / LOG_NAME, shown=out)


def _fresh_params(cfg: Config, seed: int, kind: str, tune: str, show: bool) -> ParamDict:
    """A new run's initial parameters: drawn on the GPU when the run trains there (seconds, with a progress
    bar on stderr when ``show``), else on the host. A tuning run's fresh frozen model is always the host's,
    so that resuming the run on either backend rebuilds the same model (docs/SPEC.md §2.4)."""
    from ..params import init_params
    if kind != "gpu" or tune != "full":
        return init_params(cfg, seed)
    from tqdm import tqdm
    with tqdm(unit="param", unit_scale=True, desc="init", dynamic_ncols=True, leave=False, disable=not show,
              file=sys.stderr) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)
        return init_params(cfg, seed, device="gpu", progress=progress)


def resolve_run(req: RunRequest, world: Any = None) -> Run:
    """The run ``req`` asks for: a new or resumed Trainer, its data sampler, the run directory
    (checked) and the run options; raises RunError or FieldError. Writes nothing. ``world``: this
    rank's data-parallel job (None: one process; the run directory is then rank 0's alone)."""
    from ..data import BatchSampler, unigram_entropy
    from ..dist import DistributedError

    rank, ranks = (0, 1) if world is None else (world.rank, world.world_size)
    prep = prepare(req, rank, ranks)
    if world is not None:
        kinds = [k.decode() for k in world.allgather(prep.kind.encode())]
        if len(set(kinds)) > 1:
            raise RunError("the ranks would not all train on the same backend ("
                           + ", ".join(f"rank {r}: {k}" for r, k in enumerate(kinds))
                           + "): pass --device gpu or --device cpu")
    tr, cfg = prep.train, prep.cfg
    try:
        if prep.resume is not None and tr.tune == "full":
            trainer = Trainer.load(prep.resume, backend=prep.kind, world=world, config=tr)
        else:   # a new run, or a tuning run's frozen model (a fresh one: the run's first seed)
            seed = (prep.saved or tr).seed
            params = (prep.start_params if prep.start_params is not None else
                      _fresh_params(cfg, seed, prep.kind, tr.tune, req.progress and rank == 0))
            trainer = (Trainer(cfg, params, tr, backend=prep.kind, world=world, states=prep.start_states)
                       if prep.resume is None else
                       Trainer.load(prep.resume, backend=prep.kind, world=world, config=tr, params=params))
    except DistributedError:
        raise
    except (ValueError, RuntimeError) as exc:
        raise RunError(str(exc)) from None
    sampler = BatchSampler(prep.train_tokens, tr.batch_size, tr.seq_len, seed=tr.seed, rank=rank,
                           world_size=ranks)
    if prep.resume is not None and trainer.meta.get("sampler"):
        sampler.set_state(trainer.meta["sampler"])

    if req.out is not None:
        out = Path(req.out)
    elif prep.resume is not None:
        out = prep.resume.parent
    else:
        out = default_out()
    if rank == 0:
        _check_out(out, prep.resume is not None)
    entropy = None
    if rank == 0 and len(prep.train_tokens) <= ENTROPY_MAX_TOKENS:
        entropy = unigram_entropy(prep.train_tokens, cfg.vocab_size)
    # the GPU model's resolved recompute (a TrainConfig's "auto" decided by the free memory); None on the CPU
    recompute = trainer.backend.model.recompute if trainer.device == "gpu" else None
    info = {"preset": prep.preset, "init_from": prep.init_from, "init_state": req.init_state,
            "data": prep.data_arg,
            "token_width": prep.token_width, "tokenizer": prep.tokenizer, "world_size": ranks,
            "recompute": recompute}
    return Run(prep=prep, trainer=trainer, sampler=sampler, start=trainer.step_count, out=out,
               entropy=entropy, info=info, progress=req.progress)
