"""LoRA fine-tuning: low-rank updates of the model's projection matrices — their targets, names,
shapes, initialisation, file and merge.

A projection W [out, in] (PyTorch layout, y = x·Wᵀ; docs/SPEC.md §2.4) adapted with rank r gets two
factors, A [in, r] and B [r, out], and computes

    y = x·Wᵀ + s·(x·A)·B,        s = alpha / r.

A LoRA run (``TrainConfig.tune = "lora"``) trains the factors alone; every parameter of the model stays
frozen. B starts at zero, so the adapted model starts as the base model; A starts uniform in
[-1/sqrt(in), 1/sqrt(in)), drawn from the generator :func:`rwkvx.params.tensor_rng` gives the run's seed
and the factor's name (so a factor's values do not depend on the other targets).

Targets (``TrainConfig.lora_targets``) name matrices by their role: ``att.receptance``, ``att.key``,
``att.value``, ``att.output`` (the time mix of every RWKV block), ``ffn.key``, ``ffn.value`` (the channel
mix of every block, RWKV and MoBA) and ``moba.receptance`` (the query), ``moba.key``, ``moba.value``,
``moba.output`` (the attention of every MoBA block).

The *LoRA file* is a small safetensors file apart from the model's weights:

* tensors ``<W's name without .weight>.lora_A`` float32 [in, r] and ``.lora_B`` float32 [r, out]
  (e.g. ``rwkv.blocks.0.att.key.lora_A``), one pair per adapted matrix;
* metadata ``format = "rwkvx-lora"``, ``format_version``, ``config`` (the model's Config as JSON),
  ``adapter`` (JSON ``{"rank", "alpha", "targets"}``) and ``extra_meta`` (JSON; a trainer's step count,
  settings and run options);
* a trainer's optimizer moments as ``extra.optim.m.<factor>`` / ``extra.optim.v.<factor>`` (float32),
  which a resumed run reads back.

:func:`merge` folds the update into the weights, W' = W + s·(A·B)ᵀ: the merged model computes what
the adapted one does, up to rounding.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, NamedTuple

import numpy as np

from .checkpoint import check_tensors, load_adapter, save_adapter
from .config import Config
from .params import ParamDict, check_params, param_shapes, tensor_rng
from .validate import FieldError, require_int

LORA_FORMAT = "rwkvx-lora"
FactorDict = dict[str, np.ndarray]

# target -> (the parameter groups it adapts: RWKV blocks "rwkv.blocks.{i}.", MoBA blocks "moba.{j}.", and
# the matrix's name inside such a block)
TARGETS: dict[str, tuple[tuple[str, ...], str]] = {
    **{f"att.{n}": (("rwkv",), f"att.{n}.weight") for n in ("receptance", "key", "value", "output")},
    **{f"ffn.{n}": (("rwkv", "moba"), f"ffn.{n}.weight") for n in ("key", "value")},
    **{f"moba.{n}": (("moba",), f"att.{n}.weight") for n in ("receptance", "key", "value", "output")},
}
DEFAULT_TARGETS = ("att.receptance", "att.key", "att.value", "att.output", "ffn.key", "ffn.value")
DEFAULT_RANK = 8
DEFAULT_ALPHA = 8.0


class LoraSettings(NamedTuple):
    """The rank r, alpha and targets of an adapter (the ``lora_*`` fields of a TrainConfig)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        """s = alpha / r, the factor of the low-rank update."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values (the LoRA file's ``adapter`` metadata)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}


def check_settings(rank: Any, alpha: Any, targets: Any) -> LoraSettings:
    """The settings, normalised (``targets`` a tuple; a comma-separated string is split); TypeError or
    :class:`rwkvx.validate.FieldError` naming the TrainConfig field for a value no model can use."""
    if isinstance(rank, np.integer):
        rank = int(rank)
    require_int("TrainConfig", "lora_rank", rank, 1)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"TrainConfig.lora_alpha must be a number, got {type(alpha).__name__}")
    if not math.isfinite(alpha) or alpha <= 0:
        raise FieldError("TrainConfig", "{lora_alpha} must be a finite number > 0", lora_alpha=alpha)
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(","))
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise TypeError(f"TrainConfig.lora_targets must be a tuple of target names, got {targets!r}")
    targets = tuple(targets)
    shown = ",".join(targets)
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets or len(set(targets)) != len(targets):
        problem = (f"unknown target {unknown[0]!r}" if unknown else
                   "no target" if not targets else "a target named twice")
        raise FieldError("TrainConfig", f"{{lora_targets}}: {problem}; the targets are "
                         + ", ".join(TARGETS), lora_targets=shown)
    return LoraSettings(rank, float(alpha), targets)


def factor_names(weight: str) -> tuple[str, str]:
    """The names of the factors ``(A, B)`` of the matrix ``weight`` (a ``*.weight`` parameter)."""
    stem = weight.removesuffix(".weight")
    return f"{stem}.lora_A", f"{stem}.lora_B"


def _matrices(cfg: Config, target: str) -> set[str]:
    """The parameters ``target`` names in ``cfg`` (none for a MoBA target on an RWKV-7 model)."""
    groups, suffix = TARGETS[target]
    return {n for n in param_shapes(cfg) if n.split(".")[0] in groups and n.endswith("." + suffix)}


def adapted_weights(cfg: Config, targets: tuple[str, ...]) -> list[str]:
    """The parameters (matrices) ``targets`` adapt in ``cfg``, in parameter order; FieldError naming
    ``lora_targets`` for a target this model has no matrix for (a MoBA target on an RWKV-7 model)."""
    wanted = set()
    for target in targets:
        names = _matrices(cfg, target)
        if not names:
            raise FieldError("TrainConfig", f"{{lora_targets}}: this model has no MoBA attention blocks "
                             f"for {target} to adapt", lora_targets=",".join(targets))
        wanted |= names
    return [name for name in param_shapes(cfg) if name in wanted]


def _factor_shapes(cfg: Config, weights: list[str], rank: int) -> dict[str, tuple[int, int]]:
    """Names and shapes (A [in, r], B [r, out]) of the rank-``rank`` factors of ``weights``."""
    shapes, out = param_shapes(cfg), {}
    for weight in weights:
        rows, cols = shapes[weight]           # [out, in]
        a, b = factor_names(weight)
        out[a], out[b] = (cols, rank), (rank, rows)
    return out


def lora_shapes(cfg: Config, settings: LoraSettings) -> dict[str, tuple[int, int]]:
    """Names and shapes (A [in, r], B [r, out]) of the factors ``settings`` give ``cfg``, in parameter
    order; FieldError naming ``lora_rank`` unless r is smaller than both sides of every adapted matrix
    (or ``lora_targets``, see :func:`adapted_weights`)."""
    weights, shapes = adapted_weights(cfg, settings.targets), param_shapes(cfg)
    for weight in weights:
        if settings.rank >= min(shapes[weight]):
            raise FieldError("TrainConfig", "{lora_rank} must be smaller than both sides of every adapted "
                             f"matrix ({weight} is {list(shapes[weight])})", lora_rank=settings.rank)
    return _factor_shapes(cfg, weights, settings.rank)


def init_factors(cfg: Config, settings: LoraSettings, seed: int = 0) -> FactorDict:
    """The untrained factors, float32: every B zero, every A uniform in [-1/sqrt(in), 1/sqrt(in))
    from :func:`rwkvx.params.tensor_rng` (``seed``, the factor's name)."""
    factors = {}
    for name, shape in lora_shapes(cfg, settings).items():
        if name.endswith(".lora_A"):
            bound = 1.0 / math.sqrt(shape[0])
            factors[name] = tensor_rng(seed, name).uniform(-bound, bound, shape).astype(np.float32)
        else:
            factors[name] = np.zeros(shape, np.float32)
    return factors


def check_factors(cfg: Config, factors: Mapping[str, Any], settings: LoraSettings | None = None,
                  where: str = "LoRA factors") -> FactorDict:
    """Copies of ``factors`` (their dtype kept) in parameter order; TypeError / ValueError naming
    ``where`` unless they are finite float arrays forming (A, B) pairs of one rank for matrices of
    ``cfg`` — exactly the factors of ``settings`` when given."""
    if settings is not None:
        shapes = lora_shapes(cfg, settings)
    else:   # any adaptable matrices of the model, the rank read from the first A given
        adaptable = set().union(*(_matrices(cfg, t) for t in TARGETS))
        given = factors if isinstance(factors, Mapping) else {}
        weights = [w for w in param_shapes(cfg) if w in adaptable and any(n in given for n in factor_names(w))]
        first = given.get(factor_names(weights[0])[0]) if weights else None
        shapes = _factor_shapes(cfg, weights, int(np.shape(first)[1]) if np.ndim(first) == 2 else 0)
    return check_tensors(shapes, factors, where, "LoRA factors (A [in, r], B [r, out], one rank r)")


def settings_of(cfg: Config, factors: Mapping[str, Any], scale: float) -> LoraSettings:
    """The settings of ``factors`` (checked as :func:`check_factors` does) with update factor ``scale``:
    their rank, alpha = scale·r and the targets whose matrices they adapt; ValueError unless they adapt
    exactly the matrices of some targets."""
    factors, scale = check_factors(cfg, factors), check_scale(scale)
    adapted = {n.removesuffix(".lora_A") + ".weight" for n in factors if n.endswith(".lora_A")}
    targets = tuple(t for t in TARGETS if _matrices(cfg, t) and _matrices(cfg, t) <= adapted)
    if not adapted or set().union(*(_matrices(cfg, t) for t in targets)) != adapted:
        raise ValueError("LoRA factors must adapt every matrix of the targets they name (e.g. att.key in "
                         "every RWKV block), got factors for " + ", ".join(sorted(adapted)))
    rank = int(np.shape(factors[next(iter(factors))])[1])
    return LoraSettings(rank, scale * rank, targets)


def check_scale(scale: Any) -> float:
    """``scale`` as a float; ValueError unless it is a finite number."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"the LoRA scale must be a finite number, got {scale!r}")
    return float(scale)


def merge(cfg: Config, params: ParamDict, factors: Mapping[str, np.ndarray], scale: float) -> ParamDict:
    """``params`` with every adapted matrix W replaced by W + scale·(A·B)ᵀ (computed in float64, stored
    in W's dtype); the other parameters are the same arrays."""
    check_params(cfg, params)
    factors, scale = check_factors(cfg, factors), check_scale(scale)
    merged = dict(params)
    for weight in param_shapes(cfg):
        a, b = factor_names(weight)
        if a in factors:
            update = (factors[a].astype(np.float64) @ factors[b].astype(np.float64)).T
            merged[weight] = (params[weight].astype(np.float64) + scale * update).astype(params[weight].dtype)
    return merged


def save_lora(path: str | os.PathLike, cfg: Config, factors: Mapping[str, np.ndarray],
              settings: LoraSettings, extra: Mapping[str, Any] | None = None) -> None:
    """Write a LoRA file (see the module docstring) atomically. ``extra`` may hold ``"tensors"``
    (stored under ``extra.``) and ``"meta"`` (JSON-able), as :func:`rwkvx.checkpoint.save_checkpoint`."""
    save_adapter(path, LORA_FORMAT, cfg, check_factors(cfg, factors, settings), extra, settings.to_dict())


def load_lora(path: str | os.PathLike, cfg: Config | None = None
              ) -> tuple[Config, FactorDict, LoraSettings, dict[str, Any]]:
    """``(the Config it was tuned on, factors (float32), settings, extra)`` of a LoRA file; ``extra`` as
    :func:`rwkvx.checkpoint.load_checkpoint` returns it. Given ``cfg`` (the model the adapter is
    for), the factors must fit that model; any problem raises ``ValueError``."""
    saved, factors, extra, info = load_adapter(path, LORA_FORMAT, "LoRA file (a LoRA run's output)")
    where = f"LoRA file {path}"
    try:
        settings = check_settings(info.get("rank"), info.get("alpha"), info.get("targets"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: corrupt adapter metadata ({exc})") from None
    try:
        factors = check_factors(cfg or saved, factors, settings, where)
    except FieldError as exc:     # the settings ask for matrices or a rank the model does not have
        raise ValueError(f"{where}: does not fit this model ({exc})") from None
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return saved, {n: f.astype(np.float32, copy=False) for n, f in factors.items()}, settings, extra
