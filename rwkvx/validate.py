"""Input checks shared by the CPU oracle and the GPU model (docs/SPEC.md §3).

Both run these before doing any work, so a bad token or target id is reported as a clear
``ValueError`` naming the first bad position, instead of an out-of-bounds read on the device.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

# Targets equal to this are ignored by the loss: the API's default, and the value the GPU model stores
# on the device for every ignored target whatever ignore_index the caller used.
IGNORE_INDEX = -100


class FieldError(ValueError):
    """A bad setting of a settings class (``Config``, ``TrainConfig``), naming the fields at fault.

    ``template`` refers to each field as ``{name}``; ``fields`` maps those names to their values.
    ``str()`` names them ``Owner.name=value``; :meth:`render` lets a caller name them its own way
    (the CLI names the flags the user typed)."""

    def __init__(self, owner: str, template: str, **fields: Any) -> None:
        self.owner, self.template, self.fields = owner, template, fields
        super().__init__(self.render(lambda name, value: f"{owner}.{name}={value!r}"))

    def render(self, spell: Callable[[str, Any], str]) -> str:
        """The message with each field spelt ``spell(name, value)``."""
        return self.template.format(**{name: spell(name, value) for name, value in self.fields.items()})


def require_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool); :class:`FieldError` when below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise FieldError(owner, f"{{{name}}} must be >= {minimum}", **{name: value})


def _as_int_array(value, name: str) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name} must be a numpy integer array, got {type(value).__name__}")
    if value.dtype.kind not in "iu":  # bool is kind "b": rejected too
        raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
    if value.ndim != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {value.shape}")
    if value.shape[0] == 0 or value.shape[1] == 0:
        raise ValueError(f"{name} must be non-empty, got shape {value.shape} (B and T must be >= 1)")
    return value


def _first_bad(bad: np.ndarray, value: np.ndarray) -> tuple[tuple[int, int], int]:
    b, t = np.argwhere(bad)[0]
    return (int(b), int(t)), int(value[b, t])


def _check_vocab(vocab_size) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    return int(vocab_size)


def check_tokens(tokens, vocab_size: int, name: str = "tokens") -> np.ndarray:
    """Validate token ids: an integer array [B, T], B, T >= 1, every id in [0, vocab_size).

    Returns a C-contiguous int64 copy/view. Raises ``TypeError`` for a non-array or a non-integer
    dtype, ``ValueError`` for a wrong shape, an empty batch or an id out of range.
    """
    V = _check_vocab(vocab_size)
    tokens = _as_int_array(tokens, name)
    bad = (tokens < 0) | (tokens >= V)
    if bad.any():
        pos, val = _first_bad(bad, tokens)
        raise ValueError(f"{name}[{pos[0]}, {pos[1]}] = {val} is out of range [0, {V}) "
                         f"({int(bad.sum())} bad id(s) in total)")
    return np.ascontiguousarray(tokens, dtype=np.int64)


def check_targets(targets, tokens_shape, vocab_size: int, ignore_index: int = IGNORE_INDEX) -> np.ndarray:
    """Validate target ids: same shape as the tokens, each in [0, vocab_size) or == ignore_index.

    Returns a C-contiguous int64 array. Raises ``TypeError``/``ValueError`` like :func:`check_tokens`.
    """
    V = _check_vocab(vocab_size)
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, (int, np.integer)):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    targets = _as_int_array(targets, "targets")
    if tuple(targets.shape) != tuple(tokens_shape):
        raise ValueError(f"targets shape {targets.shape} does not match tokens shape {tuple(tokens_shape)}")
    ignore = int(ignore_index)
    # Compare in int64 space so an ignore_index like -100 works with unsigned target arrays too.
    t64 = targets.astype(np.int64) if targets.dtype != np.uint64 else targets
    bad = ((t64 < 0) | (t64 >= V)) & (t64 != ignore)
    if bad.any():
        pos, val = _first_bad(bad, targets)
        raise ValueError(f"targets[{pos[0]}, {pos[1]}] = {val} is out of range [0, {V}) and is not "
                         f"ignore_index={ignore} ({int(bad.sum())} bad id(s) in total)")
    return np.ascontiguousarray(targets, dtype=np.int64)
