"""State tuning: the trainable initial WKV states of the RWKV blocks, their names and their file.

Every RWKV block ``i`` starts its WKV recurrence from a state s0 [H, N, N] (float32; row = value
index, column = key index, docs/SPEC.md §2.3), shared by every sequence of a batch; untuned it is 0.
A state-tuning run trains these states alone (``TrainConfig.tune = "state"``) and saves them in a
*state file*, a small safetensors file apart from the model's weights:

* tensors ``blocks.{i}.att.state``, float32 [H, N, N], one per RWKV block (MoBA blocks have none);
* metadata ``format = "rwkvx-state"``, ``format_version``, ``config`` (the model's Config as JSON) and
  ``extra_meta`` (JSON; a trainer's step count, settings and run options);
* a trainer's optimizer moments as ``extra.optim.m.blocks.{i}.att.state`` /
  ``extra.optim.v.blocks.{i}.att.state`` (float32), which a resumed run reads back.

A state fits any model with the same number of RWKV blocks, heads and head size (the Config saved
with it says which model it was tuned on; :func:`load_states` checks the shapes only).

The state files of RWKV-PEFT and RWKV-Runner are PyTorch ``.pth`` files holding one tensor per RWKV-7
block, ``blocks.{i}.att.time_state`` [H, N, N] with the same orientation (row = value index) and no
Config: :func:`export_states_pth` writes one (float32), and :func:`load_states` reads one for a given
model.
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import numpy as np

from .checkpoint import check_tensors, load_adapter, save_adapter
from .config import Config
from .pth import is_zip, read_pth, write_pth

STATE_FORMAT = "rwkvx-state"
StateDict = dict[str, np.ndarray]


def state_name(layer: int) -> str:
    """The name of RWKV block ``layer``'s initial state (in files, gradients and the optimizer)."""
    return f"blocks.{layer}.att.state"


def state_shapes(cfg: Config) -> dict[str, tuple[int, int, int]]:
    """Names and shapes [H, N, N] of ``cfg``'s initial states, in block order; ``ValueError`` for a
    model without RWKV blocks (nothing to tune)."""
    if cfg.n_rwkv_layer < 1:
        raise ValueError("state tuning trains the initial WKV state of the RWKV blocks, and this model "
                         "has none")
    return {state_name(i): (cfg.n_head, cfg.head_size, cfg.head_size) for i in range(cfg.n_rwkv_layer)}


def zero_states(cfg: Config) -> StateDict:
    """The untuned states: zeros, float32."""
    return {name: np.zeros(shape, np.float32) for name, shape in state_shapes(cfg).items()}


def check_states(cfg: Config, states: Mapping[str, Any], where: str = "states") -> StateDict:
    """Copies of ``states`` (their dtype kept) in block order; ``TypeError`` / ``ValueError`` naming
    ``where`` unless they are exactly ``cfg``'s names and shapes, finite floats."""
    return check_tensors(state_shapes(cfg), states, where,
                         f"states (one per RWKV block, {cfg.n_rwkv_layer}; [H, N, N])")


def save_states(path: str | os.PathLike, cfg: Config, states: Mapping[str, np.ndarray],
                extra: Mapping[str, Any] | None = None) -> None:
    """Write a state file (see the module docstring) atomically. ``extra`` may hold ``"tensors"``
    (stored under ``extra.``) and ``"meta"`` (JSON-able), as :func:`rwkvx.checkpoint.save_checkpoint`."""
    save_adapter(path, STATE_FORMAT, cfg, check_states(cfg, states), extra)


def pth_state_name(layer: int) -> str:
    """The name of RWKV block ``layer``'s state in a ``.pth`` state file (RWKV-PEFT's)."""
    return f"blocks.{layer}.att.time_state"


def export_states_pth(path: str | os.PathLike, cfg: Config, states: Mapping[str, np.ndarray]) -> None:
    """Write ``states`` as a ``.pth`` state file of RWKV-PEFT / RWKV-Runner (float32
    ``blocks.{i}.att.time_state``; see the module docstring), atomically."""
    states = check_states(cfg, states)
    write_pth(path, {pth_state_name(i): np.asarray(states[state_name(i)], np.float32)
                     for i in range(cfg.n_rwkv_layer)}, dtype="fp32")


def _load_states_pth(path: str | os.PathLike, cfg: Config | None) -> StateDict:
    """The states of a ``.pth`` state file, renamed to :func:`state_name`'s names, for model ``cfg``."""
    if cfg is None:
        raise ValueError(f"{path}: a .pth state file records no model; load it for a given Config")
    ours = {pth_state_name(i): state_name(i) for i in range(cfg.n_rwkv_layer)}
    tensors = read_pth(path)[0]
    unexpected = sorted(set(tensors) - set(ours))
    if unexpected:
        raise ValueError(f"{path}: not this model's .pth state file: unexpected {', '.join(unexpected[:3])} "
                         f"(it holds {pth_state_name(0)} ... {pth_state_name(cfg.n_rwkv_layer - 1)})")
    return {ours[n]: value for n, value in tensors.items()}


def load_states(path: str | os.PathLike, cfg: Config | None = None
                ) -> tuple[Config, StateDict, dict[str, Any]]:
    """``(the Config it was tuned on, states, extra)`` of a state file; ``extra`` as
    :func:`rwkvx.checkpoint.load_checkpoint` returns it. Given ``cfg`` (the model the states are
    for), every state must have that model's shape; any problem raises ``ValueError``. A ``.pth``
    state file (RWKV-PEFT's) needs ``cfg``, which it returns as the Config, with an empty ``extra``."""
    if is_zip(path):
        saved, states, extra = cfg, _load_states_pth(path, cfg), {"tensors": {}, "meta": {}}
    else:
        saved, states, extra, _ = load_adapter(path, STATE_FORMAT, "state file (a state-tuning run's output)")
    try:
        states = {n: s.astype(np.float32, copy=False)
                  for n, s in check_states(cfg or saved, states, where=f"state file {path}").items()}
    except TypeError as exc:
        raise ValueError(str(exc)) from None
    return saved, states, extra
