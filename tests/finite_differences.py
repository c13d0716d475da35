"""The one finite-difference helper of the CPU tests: central differences of a scalar function with respect
to the entries of a float64 array, which it perturbs in place and restores."""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np


def central_difference(f: Callable[[], float], x: np.ndarray, index, h: float) -> float:
    """(f() at x[index] + h  -  f() at x[index] - h) / 2h; ``f`` reads ``x`` (or a view of it), which is
    perturbed in place and left as it was."""
    old = x[index]
    x[index] = old + h
    fp = f()
    x[index] = old - h
    fm = f()
    x[index] = old
    return (fp - fm) / (2 * h)


def numeric_gradient(f: Callable[[], float], x: np.ndarray, h: float = 1e-6,
                     indices: Iterable[int] | None = None) -> np.ndarray:
    """Central differences of ``f`` with respect to every entry of ``x`` (shaped like x), or, given
    ``indices`` into the flattened ``x``, those entries only (1-D, in their order). ``x`` must be
    C-contiguous, so that its flat view perturbs it."""
    if not x.flags.c_contiguous:
        raise ValueError("x must be C-contiguous")
    flat = x.reshape(-1)
    if indices is None:
        return np.array([central_difference(f, flat, i, h) for i in range(flat.size)]).reshape(x.shape)
    return np.array([central_difference(f, flat, i, h) for i in indices])
