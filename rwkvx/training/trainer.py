"""The training loop's core: :class:`Trainer` over one of two backends with the same interface.

A backend owns the parameters and the optimizer state and does whole steps:

* :class:`CPUBackend` — :class:`rwkvx.oracle.Oracle` forward/backward + numpy :class:`rwkvx.optim.AdamW`
  (float32 or float64 arithmetic): the reference, and the fallback where no GPU is usable.
* :class:`GPUBackend` — the graph-replayed :class:`rwkvx.model.Model` step with the fused AdamW
  kernel (fp32 or tf32 GEMMs).

Steps are submitted (:meth:`Trainer.submit`) and their results read later (:class:`TrainStep`): on the
GPU backend a step is enqueued and the host goes on (staging the next batch into the other pinned slot,
see :mod:`rwkvx.model`) until the step's loss is read; :meth:`Trainer.step` submits and reads at once.
Both run the same graph, so their results are bit-identical. The CPU backend and data-parallel GPU
training finish each step inside ``submit``.

The Trainer, checkpoints and the training run (:mod:`rwkvx.training.loop`) are shared;
:func:`resolve_device` picks the backend for ``auto``. The GPU :class:`~rwkvx.model.Model` is built for one batch shape: :func:`pad_batch` and
:func:`forward_padded` fit smaller batches to it (for GPUBackend's ``evaluate``/``forward``).

Data parallel: given a :class:`rwkvx.dist.World`, each rank's Trainer steps on its shard of the
global batch and the gradients are averaged over the ranks before the (clipped) update — through
NCCL inside the step's CUDA graph on the GPU backend (:mod:`rwkvx.dist.step`), through the host
collectives of the world on the CPU backend. Losses are means over all ranks; every rank ends each
step with the same parameters. Without a world (the default) nothing of this runs.

State tuning (``TrainConfig.tune = "state"``, either backend; on the GPU without data parallel): the
backend trains the initial WKV states of the RWKV blocks (:mod:`rwkvx.state_tuning`) with the same
AdamW, the parameters stay as they were, and the checkpoint is a state file (the states, their moments
and the same metadata; no weights), which :meth:`Trainer.load` resumes given the model's parameters. LoRA
(``TrainConfig.tune = "lora"``, likewise either backend, on the GPU without data parallel) is the same with
the LoRA factors of :mod:`rwkvx.lora` in place of the states: they train, the parameters stay, the
checkpoint is a LoRA file.

Checkpoints (:meth:`Trainer.save`) are safetensors files (:mod:`rwkvx.checkpoint`) holding the
parameters, the AdamW moments (``extra.optim.m.<name>`` / ``extra.optim.v.<name>``, float32), and JSON
metadata: the step count, the optimizer state's scalars, the :class:`TrainConfig` (once, as
``meta["train"]``) and whatever the caller adds (a training run adds the data sampler's generator
state and its run options). Written
atomically. Resuming is exact on either backend: N steps straight == N/2 steps, save, load, N/2 steps,
bit for bit (with the same batches).
"""
from __future__ import annotations

import abc
import math
import os
from typing import Any, Mapping

import numpy as np

from ..checkpoint import file_format, load_checkpoint, save_checkpoint
from ..config import Config
from ..lora import LORA_FORMAT, FactorDict, check_factors, check_scale, init_factors, load_lora, save_lora
from ..optim import AdamW, Schedule
from ..params import ParamDict, check_params, param_shapes
from ..state_tuning import STATE_FORMAT, StateDict, check_states, load_states, save_states, zero_states
from ..validate import IGNORE_INDEX, check_targets, check_tokens
from .config import TrainConfig

BACKENDS = ("auto", "cpu", "gpu")
CHECKPOINT_KIND = "rwkvx-trainer"
STATS = ("lr", "grad_norm", "clip")      # the optimizer statistics of a step
# what a tuning run trains in place of the parameters (TrainConfig.tune -> its name in messages)
TUNED = {"state": "initial WKV states", "lora": "LoRA factors"}
ADAPTER_FORMATS = {STATE_FORMAT: "state", LORA_FORMAT: "lora"}   # an adapter file's format -> its tune
STATES_WITHOUT_TUNING = "initial states are trained only when state tuning (tune='state')"
LORA_WITHOUT_TUNING = "LoRA factors are trained only when LoRA tuning (tune='lora')"
TUNING_DATA_PARALLEL = ("state tuning and LoRA (tune='state', 'lora') on the GPU backend run on one GPU: "
                        "data-parallel tuning is not built; use one rank, or the CPU backend")


def check_loss(loss: float, step: int) -> float:
    """``loss`` when finite, else FloatingPointError naming the (1-based) ``step``."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at step {step}")
    return loss


class FinishedStep:
    """The results of a step that ran to its end inside ``submit_step`` (the handle of the backends
    that do not overlap steps with the host)."""

    def __init__(self, loss: float, stats: Mapping[str, float]) -> None:
        self._result = (loss, dict(stats))

    def done(self) -> bool:
        """Always True: the step has finished."""
        return True

    def result(self) -> tuple[float, dict[str, float]]:
        """``(mean loss, optimizer statistics)``."""
        return self._result


class Backend(abc.ABC):
    """What a Trainer needs from a backend. The GPU backend implements exactly this.

    * ``submit_step(tokens, targets)``: forward, loss, backward, clip + AdamW update with the
      learning rate ``schedule.lr_at(step_count + 1)``; increments ``step_count``; returns a handle
      whose ``result()`` is the mean loss (float, reduced in float64) and ``{"lr", "grad_norm",
      "clip"}`` (more keys allowed), waiting for the step when it has not finished, and whose
      ``done()`` says whether it has, without waiting. Inputs are validated int64 ``[B, T]`` arrays.
    * ``evaluate(tokens, targets)``: the mean loss, no update.
    * ``forward(tokens)``: logits ``[B, T, V]`` as a numpy array (for sampling).
    * ``get_params()``: host float32 copies of every parameter (docs/SPEC.md §2.4 names).
    * ``optimizer_state()`` / ``load_optimizer_state(state)``: the
      ``{"tensors": {"optim.m.<name>", "optim.v.<name>"}, "meta": {"optim_step": int, ...}}``
      dict of :meth:`rwkvx.optim.AdamW.state_dict` (host float32 moments).
    * ``step_count``: updates submitted.
    * data parallel (built with a world): ``submit_step(..., stop=True)`` tells the other ranks that
      this one wants to stop; ``stop_agreed`` is then True on every rank after that same step (both
      backends finish a data-parallel step inside ``submit_step``).
    """

    name = "abstract"
    step_count: int
    stop_agreed: bool = False

    @abc.abstractmethod
    def submit_step(self, tokens: np.ndarray, targets: np.ndarray, stop: bool = False) -> Any: ...

    @abc.abstractmethod
    def evaluate(self, tokens: np.ndarray, targets: np.ndarray) -> float: ...

    @abc.abstractmethod
    def forward(self, tokens: np.ndarray) -> np.ndarray: ...

    @abc.abstractmethod
    def get_params(self) -> ParamDict: ...

    @abc.abstractmethod
    def optimizer_state(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def load_optimizer_state(self, state: Mapping[str, Any]) -> None: ...


def cross_entropy_mean(logits: np.ndarray, targets: np.ndarray, ignore_index: int = IGNORE_INDEX) -> float:
    """Mean over targets != ignore_index of logsumexp(logits) - logits[target], in float64
    (0.0 when every target is ignored, as the oracle's loss)."""
    z = np.asarray(logits, dtype=np.float64).reshape(-1, logits.shape[-1])
    t = np.asarray(targets, dtype=np.int64).reshape(-1)
    keep = t != ignore_index
    if not keep.any():
        return 0.0
    z, t = z[keep], t[keep]
    zmax = z.max(axis=1)
    lse = zmax + np.log(np.exp(z - zmax[:, None]).sum(axis=1))
    return float(np.mean(lse - z[np.arange(z.shape[0]), t]))


class CPUBackend(Backend):
    """Oracle forward/backward (``dtype`` float32 or float64 math) + numpy AdamW on float32 params,
    or, with ``tune="state"``, on the float32 initial WKV ``states`` (None: zeros), or, with
    ``tune="lora"``, on the float32 ``lora`` factors (scaled by ``lora_scale``), the parameters
    frozen."""

    name = "cpu"

    def __init__(self, cfg: Config, params: ParamDict, schedule: Schedule, weight_decay: float,
                 grad_clip: float | None, dtype: Any = np.float32, world: Any = None, tune: str = "full",
                 states: StateDict | None = None, lora: FactorDict | None = None,
                 lora_scale: float = 1.0, moments: str = "f32") -> None:
        try:
            from ..oracle import Oracle
        except ImportError as exc:  # the Cython extension is not built
            raise RuntimeError(
                "the CPU backend needs the compiled oracle (rwkvx.oracle): build it with "
                "`pip install --no-build-isolation --no-deps -e .` or "
                f"`cythonize -3 -i oracle/*.pyx` ({exc})") from None
        self._Oracle = Oracle
        self.cfg = cfg
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"CPU backend dtype must be float32 or float64, got {self.dtype}")
        # in param_shapes' order: the flat layout the GPU arena uses (the lean moments' rounding reads it)
        self.params = {n: np.array(params[n], dtype=np.float32, copy=True) for n in param_shapes(cfg)}
        self.states = None
        if tune == "state":
            self.states = {n: s.astype(np.float32) for n, s in
                           check_states(cfg, zero_states(cfg) if states is None else states).items()}
        elif states is not None:
            raise ValueError(STATES_WITHOUT_TUNING)
        self.lora, self.lora_scale = None, check_scale(lora_scale)
        if tune == "lora":
            if lora is None:
                raise ValueError("LoRA tuning (tune='lora') needs the factors to train")
            self.lora = {n: f.astype(np.float32) for n, f in check_factors(cfg, lora).items()}
        elif lora is not None:
            raise ValueError(LORA_WITHOUT_TUNING)
        trainable = {"state": self.states, "lora": self.lora}.get(tune, self.params)
        self.opt = AdamW(trainable, schedule, weight_decay=weight_decay, grad_clip=grad_clip, moments=moments)
        self.world = world

    @property
    def step_count(self) -> int:  # type: ignore[override]
        return self.opt.step_count

    def oracle(self) -> Any:
        """An :class:`rwkvx.oracle.Oracle` of the parameters (and states or LoRA factors) as they are now."""
        # A fresh Oracle per call sees the parameters exactly as they are now (the optimizer
        # updates them in place); building one costs a dtype conversion of the weights, which is
        # small next to a forward/backward.
        return self._Oracle(self.cfg, self.params, dtype=self.dtype, states=self.states, lora=self.lora,
                            lora_scale=self.lora_scale)

    def submit_step(self, tokens: np.ndarray, targets: np.ndarray, stop: bool = False) -> FinishedStep:
        loss, grads = self.oracle().loss_and_grads(tokens, targets)
        loss, grads = float(loss), {n: grads[n] for n in self.opt.params}
        if self.world is not None:
            loss, grads = self._average(loss, grads, stop)
        check_loss(loss, self.step_count + 1)     # before the update: the parameters stay finite
        return FinishedStep(loss, self.opt.step(grads))

    def _average(self, loss: float, grads: ParamDict, stop: bool) -> tuple[float, ParamDict]:
        """Loss and gradients averaged over the world's ranks (in rank order, in the gradients' dtype);
        sets ``stop_agreed``."""
        names = list(grads)
        flat = self.world.mean(np.concatenate([np.ravel(grads[n]) for n in names]))
        loss, stops = self.world.mean(np.array([loss, float(stop)]))
        self.stop_agreed = bool(stops > 0)
        out, pos = {}, 0
        for n in names:
            size = np.size(grads[n])
            out[n] = flat[pos:pos + size].reshape(np.shape(grads[n]))
            pos += size
        return float(loss), out

    def evaluate(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        # Forward only (no backward), the cross-entropy in float64 as the oracle computes it.
        return cross_entropy_mean(self.forward(tokens), targets)

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self.oracle().forward(tokens))

    def get_params(self) -> ParamDict:
        return {n: p.copy() for n, p in self.params.items()}

    def optimizer_state(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        self.opt.load_state_dict(state)


def pad_batch(tokens: np.ndarray, batch_size: int, seq_len: int, targets: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """``tokens`` ``[B, T]`` (and ``targets``) padded at the end to ``[batch_size, seq_len]`` int64.

    The GPU model is built for one shape; padding a smaller batch changes nothing before the
    padding because the model is causal. Padded tokens are 0 and padded targets IGNORE_INDEX (ignored
    by the loss); without ``targets`` every target is IGNORE_INDEX. ValueError when ``B > batch_size`` or
    ``T > seq_len``.
    """
    B, T = tokens.shape
    if B > batch_size or T > seq_len:
        raise ValueError(f"batch {tokens.shape} is larger than the GPU model's "
                         f"(batch_size, seq_len) = {(batch_size, seq_len)}")
    tok = np.zeros((batch_size, seq_len), np.int64)
    tok[:B, :T] = tokens
    tgt = np.full((batch_size, seq_len), IGNORE_INDEX, np.int64)
    if targets is not None:
        tgt[:B, :T] = targets
    return tok, tgt


def forward_padded(model: Any, tokens: np.ndarray) -> np.ndarray:
    """Logits ``[B, T, V]`` of a :class:`rwkvx.model.Model` built for ``(model.B, model.T)`` on
    ``tokens`` ``[B <= model.B, T <= model.T]`` (see :func:`pad_batch`)."""
    B, T = tokens.shape
    return model.forward(pad_batch(tokens, model.B, model.T)[0])[:B, :T]


class GPUBackend(Backend):
    """The device-resident :class:`rwkvx.model.Model`; ``submit_step`` replays one CUDA graph holding
    forward, loss, backward and the fused AdamW update (step count and learning rate on the device)
    and returns before it ends (:class:`rwkvx.model.PendingStep`); data parallel, it waits for the step.

    Training batches are exactly ``[batch_size, seq_len]``; ``evaluate``/``forward`` take any
    ``[B, T]`` with B <= batch_size and T <= seq_len, padded by :func:`pad_batch`. With a ``world``
    the step is :class:`rwkvx.dist.step.DistributedStep` (NCCL all-reduces inside the graph).
    With ``tune="state"`` the model trains the float32 initial WKV ``states`` (None: zeros), with
    ``tune="lora"`` the float32 ``lora`` factors (scaled by ``lora_scale``); the parameters stay frozen
    (one GPU: no ``world``).
    """

    name = "gpu"

    def __init__(self, cfg: Config, params: ParamDict, schedule: Schedule, weight_decay: float,
                 grad_clip: float | None, batch_size: int, seq_len: int, precision: str,
                 recompute: bool, world: Any = None, tune: str = "full", states: StateDict | None = None,
                 lora: FactorDict | None = None, lora_scale: float = 1.0, moments: str = "f32") -> None:
        if tune in TUNED and world is not None:
            raise ValueError(TUNING_DATA_PARALLEL)
        if tune == "state":
            states = zero_states(cfg) if states is None else states
        elif states is not None:
            raise ValueError(STATES_WITHOUT_TUNING)
        if tune == "lora" and lora is None:
            raise ValueError("LoRA tuning (tune='lora') needs the factors to train")
        if tune != "lora" and lora is not None:
            raise ValueError(LORA_WITHOUT_TUNING)
        reason = gpu_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the GPU backend cannot be used: {reason}. Use the CPU backend "
                               "(the oracle) or 'auto'.")
        from ..model import Model
        self.model = Model(cfg, params, batch_size, seq_len, precision=precision, recompute=recompute,
                           moments=moments, states=states, lora=lora, lora_scale=lora_scale)
        self.model.configure_optimizer(schedule, weight_decay, grad_clip)
        self.dist_step = None
        if world is not None:
            from ..dist.nccl import NcclCommunicator
            from ..dist.step import DistributedStep
            self.dist_step = DistributedStep(self.model, NcclCommunicator(world, self.model.dev))
        self.step_count = 0

    def submit_step(self, tokens: np.ndarray, targets: np.ndarray, stop: bool = False) -> Any:
        if tokens.shape != (self.model.B, self.model.T):
            raise ValueError(f"training batches must be {(self.model.B, self.model.T)}, got {tokens.shape}")
        if self.dist_step is None:
            pending = self.model.launch_step(tokens, targets)
        else:
            loss = self.dist_step.train_step(tokens, targets, stop)
            self.stop_agreed = self.dist_step.stop_agreed
            pending = FinishedStep(loss, self.model.optimizer_stats())
        self.step_count += 1
        return pending

    def evaluate(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        return self.model.evaluate(*pad_batch(tokens, self.model.B, self.model.T, targets))

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        return forward_padded(self.model, tokens)

    @property
    def states(self) -> StateDict | None:
        """The initial WKV states being tuned, downloaded (None unless state tuning)."""
        return self.model.states()

    @property
    def lora(self) -> FactorDict | None:
        """The LoRA factors being tuned, downloaded (None unless LoRA tuning)."""
        return self.model.lora_factors()

    def get_params(self) -> ParamDict:
        return self.model.params()

    def optimizer_state(self) -> dict[str, Any]:
        return self.model.optimizer_state()

    def load_optimizer_state(self, state: Mapping[str, Any]) -> None:
        self.model.load_optimizer_state(dict(state))
        self.step_count = int(state["meta"]["optim_step"])


def gpu_unavailable_reason() -> str | None:
    """None when the GPU backend can be built here, else why not (runtime missing, no device...)."""
    try:
        from ..runtime import Device
        Device.get()
    except (ImportError, RuntimeError, OSError) as exc:
        return str(exc)
    return None


def resolve_device(device: str, task: str = "training") -> tuple[str, str | None]:
    """``("cpu"|"gpu", note)`` for ``device`` in auto/cpu/gpu; ``auto`` falls back to the CPU with a
    one-line note saying that ``task`` runs there (:func:`gpu_unavailable_reason` says why). ``gpu`` is
    not checked here: building the GPU model fails with the reason."""
    if device not in BACKENDS:
        raise ValueError(f"device must be one of {', '.join(BACKENDS)}, got {device!r}")
    if device == "cpu":
        return "cpu", None
    if device == "gpu":
        return "gpu", None
    reason = gpu_unavailable_reason()
    if reason is None:
        return "gpu", None
    return "cpu", f"no usable CUDA GPU here, so {task} runs on the CPU (the oracle)"


class TrainStep:
    """A step submitted by :meth:`Trainer.submit`. Its results are read when first asked for —
    :meth:`loss` / :meth:`stats` wait for this step only (on the GPU, its CUDA event; later steps may
    still be running) — and kept. :meth:`loss` raises FloatingPointError when the loss is not finite."""

    def __init__(self, trainer: "Trainer", step: int, handle: Any) -> None:
        self.step = step          # the trainer's step count after this step (1-based)
        self._trainer, self._handle = trainer, handle

    def done(self) -> bool:
        """Whether the step has finished (never waits)."""
        return self._handle.done()

    def _result(self) -> tuple[float, dict[str, float]]:
        loss, stats = self._handle.result()
        stats = {name: stats[name] for name in STATS}
        self._trainer._note_stats(self.step, stats)
        return loss, stats

    def loss(self) -> float:
        """The mean loss before this step's update (data parallel: the mean over every rank's shard)."""
        return check_loss(self._result()[0], self.step)

    def stats(self) -> dict[str, float]:
        """``{"lr", "grad_norm", "clip"}`` of this step's update."""
        return self._result()[1]


class Trainer:
    """Trains a model: ``step(tokens, targets) -> loss`` (or ``submit(tokens, targets)``, the loss read
    later); ``evaluate``; ``save``/``load`` with exact resume.

    ``config`` (:class:`TrainConfig`, default ``TrainConfig()``) holds the settings; ``settings`` are
    changes to single fields of it (``Trainer(cfg, params, lr=1e-3, steps=100)``). ``backend`` is "cpu"
    (oracle + numpy AdamW in ``config.cpu_dtype``), "gpu" (graph replay in ``config.precision``; needs
    rwkvx.model) or "auto" (GPU when usable, else CPU). ``world`` (a :class:`rwkvx.dist.World`):
    data-parallel training, ``config.batch_size`` rows per rank. State tuning (``config.tune ==
    "state"``) trains ``states`` (the initial WKV states, :mod:`rwkvx.state_tuning`; None: zeros) on
    either backend (the GPU's without a ``world``); LoRA (``config.tune == "lora"``) likewise trains
    ``lora`` (the factors of ``config.lora``, :mod:`rwkvx.lora`; None: :func:`rwkvx.lora.init_factors`
    of ``config.seed``).
    """

    def __init__(self, cfg: Config, params: ParamDict, config: TrainConfig | None = None,
                 backend: str = "auto", world: Any = None, states: StateDict | None = None,
                 lora: FactorDict | None = None, **settings: Any) -> None:
        if not isinstance(cfg, Config):
            raise TypeError("cfg must be an rwkvx.Config")
        if config is not None and not isinstance(config, TrainConfig):
            raise TypeError(f"config must be an rwkvx.TrainConfig, got {type(config).__name__}")
        check_params(cfg, params)
        self.cfg = cfg
        self.config = (config or TrainConfig()).replace(**settings)
        self.config.check_model(cfg)
        self.schedule = self.config.schedule
        self.world = world
        self._stop_requested = False
        self._stats_step, self._last_stats = 0, {name: float("nan") for name in STATS}
        kind, self.device_note = resolve_device(backend)
        c, clip = self.config, self.config.grad_clip or None
        if c.tune == "lora":
            lora = init_factors(cfg, c.lora, c.seed) if lora is None else check_factors(cfg, lora, c.lora)
        if kind == "gpu":
            self.backend: Backend = GPUBackend(cfg, params, self.schedule, c.weight_decay, clip, c.batch_size,
                                               c.seq_len, c.precision, c.recompute, world=world, tune=c.tune,
                                               states=states, lora=lora, lora_scale=c.lora.scale,
                                               moments=c.moments)
        else:
            self.backend = CPUBackend(cfg, params, self.schedule, c.weight_decay, clip,
                                      dtype=np.dtype(c.cpu_dtype), world=world, tune=c.tune, states=states,
                                      lora=lora, lora_scale=c.lora.scale, moments=c.moments)
        # what Trainer.load reads back of the caller's save(meta=..., tensors=...)
        self.meta: dict[str, Any] = {}
        self.extra_tensors: dict[str, np.ndarray] = {}

    # -- properties ---------------------------------------------------------------------------
    @property
    def device(self) -> str:
        """The backend in use: "cpu" or "gpu"."""
        return self.backend.name

    @property
    def step_count(self) -> int:
        """Optimizer steps done (kept across save/load)."""
        return self.backend.step_count

    @property
    def params(self) -> ParamDict:
        """Host float32 copies of the current parameters."""
        return self.backend.get_params()

    @property
    def states(self) -> StateDict | None:
        """Float32 copies of the initial WKV states being tuned (None unless state tuning)."""
        states = getattr(self.backend, "states", None)
        return None if states is None else {n: s.copy() for n, s in states.items()}

    @property
    def lora(self) -> FactorDict | None:
        """Float32 copies of the LoRA factors being tuned (None unless LoRA tuning)."""
        factors = getattr(self.backend, "lora", None)
        return None if factors is None else {n: f.copy() for n, f in factors.items()}

    @property
    def last_stats(self) -> dict[str, float]:
        """``{"lr", "grad_norm", "clip"}`` of the latest step whose results were read (:meth:`step`
        reads every step's; NaN before the first)."""
        return dict(self._last_stats)

    def _note_stats(self, step: int, stats: dict[str, float]) -> None:
        if step >= self._stats_step:
            self._stats_step, self._last_stats = step, stats

    def lr_at(self, step: int) -> float:
        """The scheduled learning rate of (1-based) step ``step``."""
        return self.schedule.lr_at(step)
    # -- steps --------------------------------------------------------------------------------
    def _inputs(self, tokens: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tokens = check_tokens(tokens, self.cfg.vocab_size)
        targets = check_targets(targets, tokens.shape, self.cfg.vocab_size)
        return tokens, targets

    def submit(self, tokens: np.ndarray, targets: np.ndarray) -> TrainStep:
        """Start one training step (forward, loss, backward, AdamW) and return without waiting for it
        (on the GPU backend, alone): its loss is read from the returned :class:`TrainStep`. Steps run
        in order; submitting the step after next reads this one's results first (at most two steps
        are in flight). The results are bit-identical to :meth:`step`'s."""
        tokens, targets = self._inputs(tokens, targets)
        handle = self.backend.submit_step(tokens, targets, stop=self._stop_requested)
        return TrainStep(self, self.step_count, handle)

    def step(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        """One training step (forward, loss, backward, AdamW); returns the mean loss before the update
        (data parallel: this rank's shard in, the mean over every rank's shard out)."""
        return self.submit(tokens, targets).loss()

    def request_stop(self) -> None:
        """Ask to stop training (e.g. on Ctrl-C). Alone, :attr:`stop_agreed` is True at once; data
        parallel, the request travels with the next step and every rank stops after that same step."""
        self._stop_requested = True

    @property
    def stop_agreed(self) -> bool:
        """Whether training should stop now (see :meth:`request_stop`); the same on every rank."""
        return self.backend.stop_agreed if self.world is not None else self._stop_requested

    def evaluate(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        """Mean loss on a batch, parameters unchanged (data parallel: the mean over the ranks' shards,
        a collective)."""
        tokens, targets = self._inputs(tokens, targets)
        loss = self.backend.evaluate(tokens, targets)
        if self.world is not None:
            loss = float(self.world.mean(np.array([loss]))[0])
        return loss

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        """Logits ``[B, T, V]`` for ``tokens`` ``[B, T]``, no update (on the GPU backend B and T are
        at most ``batch_size`` and ``seq_len``)."""
        return self.backend.forward(check_tokens(tokens, self.cfg.vocab_size))

    # -- checkpoints --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike, meta: Mapping[str, Any] | None = None,
             tensors: Mapping[str, np.ndarray] | None = None) -> None:
        """Write an atomic checkpoint: parameters, AdamW state, step, the TrainConfig, plus ``meta``
        (JSON-able) and ``tensors`` (extra arrays) of the caller. It holds every submitted step, read
        or not (reading the device state waits for them). State tuning: a state file (the states in
        place of the parameters); LoRA: a LoRA file (the factors)."""
        state = self.backend.optimizer_state()
        all_tensors = dict(state["tensors"])
        for name, value in (tensors or {}).items():
            if name.startswith("optim."):
                raise ValueError(f"extra tensor name {name!r} clashes with the optimizer state")
            all_tensors[name] = value
        full_meta = {"kind": CHECKPOINT_KIND, "step": self.step_count, "train": self.config.to_dict(),
                     "optim_state_meta": state["meta"], "user": dict(meta or {})}
        extra = {"tensors": all_tensors, "meta": full_meta}
        if self.config.tune == "state":
            save_states(path, self.cfg, self.backend.states, extra=extra)
        elif self.config.tune == "lora":
            save_lora(path, self.cfg, self.backend.lora, self.config.lora, extra=extra)
        else:
            save_checkpoint(path, self.cfg, self.backend.get_params(), extra=extra)

    @classmethod
    def load(cls, path: str | os.PathLike, backend: str = "auto", world: Any = None,
             config: TrainConfig | None = None, stretch_schedule: bool = False,
             params: ParamDict | None = None, **overrides: Any) -> "Trainer":
        """A Trainer restored from :meth:`save`: parameters, optimizer moments and step exactly.

        Settings are ``config`` when given, else the saved :class:`TrainConfig` with ``overrides`` (field
        names; None values are ignored) as :meth:`TrainConfig.resumed` makes them: a new ``steps``
        keeps the cosine's length unless ``stretch_schedule``. The caller's ``meta`` is ``trainer.meta``,
        its extra tensors ``trainer.extra_tensors``. ``world``: as for the constructor (the checkpoint
        may come from a job with another number of ranks). A state-tuning or LoRA checkpoint (a state
        or LoRA file) holds no weights: ``params`` are the frozen model's (required then, refused
        otherwise)."""
        tune, cfg, held, extra = read_checkpoint(path)
        if tune == "full":
            if params is not None:
                raise ValueError(f"{path}: holds the model's parameters; params=... is for state and "
                                 "LoRA files only")
            params = held
        elif params is None:
            raise ValueError(f"{path}: this checkpoint holds the tuned {TUNED[tune]}, not the model: "
                             "pass the model's parameters (params=...)")
        states, lora = (held if tune == "state" else None), (held if tune == "lora" else None)
        meta = extra.get("meta") or {}
        if meta.get("kind") != CHECKPOINT_KIND:
            raise ValueError(f"{path}: not a trainer checkpoint (no optimizer state); it holds weights "
                             "only — start a new run from it instead of resuming")
        if config is None:
            config = saved_train_config(meta).resumed(
                stretch_schedule, **{k: v for k, v in overrides.items() if v is not None})
        trainer = cls(cfg, params, config, backend=backend, world=world, states=states, lora=lora)
        tensors = extra.get("tensors") or {}
        trainer.backend.load_optimizer_state(
            {"tensors": {k: v for k, v in tensors.items() if k.startswith("optim.")},
             "meta": meta.get("optim_state_meta") or {}})
        if trainer.step_count != meta.get("step"):
            raise ValueError(f"{path}: inconsistent step count in checkpoint")
        trainer.meta = dict(meta.get("user") or {})
        trainer.extra_tensors = {k: v for k, v in tensors.items() if not k.startswith("optim.")}
        return trainer


def read_checkpoint(path: str | os.PathLike) -> tuple[str, Config, dict[str, np.ndarray], dict[str, Any]]:
    """``(tune, Config, the tensors it holds, extra)`` of a file :meth:`Trainer.save` writes: a model
    checkpoint (tune ``"full"``, the parameters), a state file (``"state"``, the states) or a LoRA file
    (``"lora"``, the factors); ``extra`` as :func:`rwkvx.checkpoint.load_checkpoint` returns it.
    Every problem raises ``ValueError``."""
    tune = ADAPTER_FORMATS.get(file_format(path), "full")
    if tune == "state":
        return (tune, *load_states(path))
    if tune == "lora":
        cfg, factors, _, extra = load_lora(path)
        return tune, cfg, factors, extra
    return (tune, *load_checkpoint(path))


def saved_train_config(meta: Mapping[str, Any]) -> TrainConfig:
    """The :class:`TrainConfig` a trainer checkpoint's metadata holds; ``ValueError`` when it holds none."""
    if not isinstance(meta.get("train"), Mapping):
        raise ValueError("not a trainer checkpoint of this version (no training settings)")
    return TrainConfig.from_dict(meta["train"])
