"""Training settings: :class:`TrainConfig`, the one place every training default is written.

Presets (:mod:`rwkvx.presets`) override some fields, the CLI fills it from its flags, the
:class:`~rwkvx.training.trainer.Trainer` takes it and checkpoints store it once (``meta["train"]``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..config import Config
from ..lora import DEFAULT_ALPHA, DEFAULT_RANK, DEFAULT_TARGETS, LoraSettings, check_settings, lora_shapes
from ..model import DEFAULT_RECOMPUTE, RECOMPUTE_AUTO, check_recompute  # noqa: F401 (RECOMPUTE_AUTO: the CLI's)
from ..optim import Schedule
from ..precision import DEFAULT_PRECISION, resolve_precision
from ..validate import FieldError, require_int

CPU_DTYPES = ("float32", "float64")
TUNES = ("full", "state", "lora")   # what a run trains: every parameter, the initial WKV states, LoRA factors
# How the AdamW moments are stored, by TrainConfig.optimizer_memory: float32, or bf16 stochastically
# rounded (rwkvx.oracle.adamw, "lean moments": 4 bytes a parameter less)
OPTIMIZER_MEMORY = {"standard": "f32", "lean": "bf16"}


@dataclass(frozen=True)
class TrainConfig:
    """Every training setting and its default. Invalid values raise :class:`rwkvx.validate.FieldError`
    (a ``ValueError``) or ``TypeError`` naming the field.

    The learning rate warms up linearly to ``lr`` over ``warmup`` steps, then follows a cosine to
    ``lr_min`` at step ``schedule_steps`` (None: ``steps``, the end of the run) and stays there
    (:class:`rwkvx.optim.Schedule`). ``precision`` and ``recompute`` apply to the GPU backend, ``cpu_dtype``
    to the CPU oracle backend. ``batch_size`` is per rank when training data parallel. ``tune``:
    ``"full"`` trains every parameter; ``"state"`` trains only the initial WKV state of every RWKV
    block, the model frozen (:mod:`rwkvx.state_tuning`); ``"lora"`` trains only low-rank factors of
    the ``lora_targets`` matrices, rank ``lora_rank``, scale ``lora_alpha / lora_rank``, the model
    frozen (:mod:`rwkvx.lora`). State tuning and LoRA run on the GPU backend (one GPU) or the CPU.
    What depends on the model (a target it lacks, a rank too large for a matrix) :meth:`check_model` checks.
    ``optimizer_memory``: ``"standard"`` keeps the AdamW moments in float32; ``"lean"`` in bf16,
    stochastically rounded (:data:`OPTIMIZER_MEMORY`; a run with float32 moments cannot resume lean).
    """

    batch_size: int = 8
    seq_len: int = 128
    steps: int = 1000
    lr: float = 1e-3
    lr_min: float = 1e-4
    warmup: int = 50
    schedule_steps: int | None = None
    weight_decay: float = 0.0
    grad_clip: float = 1.0          # global gradient-norm clip; 0: off
    eval_every: int = 100           # 0: only at the end
    eval_batches: int = 4
    ckpt_every: int = 500           # 0: only at the end
    val_fraction: float = 0.05
    seed: int = 0
    precision: str = DEFAULT_PRECISION
    recompute: bool | str = DEFAULT_RECOMPUTE   # True, False or "auto" (rwkvx.model.Model)
    cpu_dtype: str = "float32"
    tune: str = "full"
    lora_rank: int = DEFAULT_RANK
    lora_alpha: float = DEFAULT_ALPHA
    lora_targets: tuple[str, ...] = DEFAULT_TARGETS
    optimizer_memory: str = "standard"

    def __post_init__(self) -> None:
        for name, minimum in (("batch_size", 1), ("seq_len", 1), ("steps", 1), ("warmup", 0),
                              ("eval_every", 0), ("eval_batches", 1), ("ckpt_every", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, np.integer):
                object.__setattr__(self, name, value := int(value))
            require_int("TrainConfig", name, value, minimum)
        if self.schedule_steps is not None:
            require_int("TrainConfig", "schedule_steps", self.schedule_steps, 1)
        for name, positive in (("lr", True), ("lr_min", False), ("weight_decay", False), ("grad_clip", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"TrainConfig.{name} must be a number, got {type(value).__name__}")
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                bound = ">" if positive else ">="
                raise FieldError("TrainConfig", f"{{{name}}} must be a finite number {bound} 0", **{name: value})
            object.__setattr__(self, name, float(value))
        if self.lr_min > self.lr:
            raise FieldError("TrainConfig", "{lr_min} must not exceed {lr}", lr_min=self.lr_min, lr=self.lr)
        if not isinstance(self.val_fraction, (int, float)) or not 0 <= self.val_fraction < 1:
            raise FieldError("TrainConfig", "{val_fraction} must be in [0, 1)", val_fraction=self.val_fraction)
        object.__setattr__(self, "precision", resolve_precision(self.precision).name)
        check_recompute(self.recompute, "TrainConfig.recompute")
        dtype = np.dtype(self.cpu_dtype).name if isinstance(self.cpu_dtype, (type, np.dtype)) else self.cpu_dtype
        if dtype not in CPU_DTYPES:
            raise FieldError("TrainConfig", f"{{cpu_dtype}} must be one of {', '.join(CPU_DTYPES)}",
                             cpu_dtype=self.cpu_dtype)
        object.__setattr__(self, "cpu_dtype", dtype)
        if self.tune not in TUNES:
            raise FieldError("TrainConfig", f"{{tune}} must be one of {', '.join(TUNES)}", tune=self.tune)
        if self.optimizer_memory not in OPTIMIZER_MEMORY:
            raise FieldError("TrainConfig", f"{{optimizer_memory}} must be one of {', '.join(OPTIMIZER_MEMORY)}",
                             optimizer_memory=self.optimizer_memory)
        lora = check_settings(self.lora_rank, self.lora_alpha, self.lora_targets)
        for name, value in zip(("lora_rank", "lora_alpha", "lora_targets"), lora):
            object.__setattr__(self, name, value)

    @property
    def lora(self) -> LoraSettings:
        """The LoRA settings (used when ``tune == "lora"``)."""
        return LoraSettings(self.lora_rank, self.lora_alpha, self.lora_targets)

    def check_model(self, cfg: Config) -> None:
        """FieldError when these settings cannot train ``cfg``: LoRA targets the model has no matrix
        for, or a rank not smaller than both sides of every adapted matrix."""
        if self.tune == "lora":
            lora_shapes(cfg, self.lora)

    @property
    def moments(self) -> str:
        """The AdamW moments' element type ("f32" or "bf16") for :attr:`optimizer_memory`."""
        return OPTIMIZER_MEMORY[self.optimizer_memory]

    @property
    def schedule(self) -> Schedule:
        """The learning-rate schedule these settings describe."""
        return Schedule(lr_max=self.lr, lr_min=self.lr_min, warmup=self.warmup,
                        total_steps=self.schedule_steps or self.steps)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with ``changes`` (field names; ``TypeError`` for an unknown one), validated."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown TrainConfig field(s): {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)

    def resumed(self, stretch_schedule: bool = False, **changes: Any) -> "TrainConfig":
        """The settings of a run resumed from these with ``changes``. A new ``steps`` only moves the
        end of the run: the cosine keeps its length (``schedule_steps`` pinned to it) and the learning
        rate stays at ``lr_min`` after it, unless ``stretch_schedule``, which stretches the cosine to the
        new ``steps`` (the learning rate then jumps to that cosine's value at the current step)."""
        if "schedule_steps" not in changes and changes.get("steps", self.steps) != self.steps:
            changes["schedule_steps"] = None if stretch_schedule else self.schedule.total_steps
        return self.replace(**changes)

    def to_dict(self) -> dict[str, Any]:
        """All fields, JSON-serialisable."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TrainConfig":
        """Inverse of :meth:`to_dict` (missing fields take their defaults); unknown keys raise ``TypeError``."""
        return cls().replace(**dict(data))
