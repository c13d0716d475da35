"""Training and validation batches: the held-out split, the seeded random sampler and the fixed
evaluation batches."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


def split_train_val(tokens: np.ndarray, seq_len: int, val_fraction: float = 0.05
                    ) -> tuple[np.ndarray, np.ndarray | None]:
    """Hold out the last ``val_fraction`` of the stream (at least one window of ``seq_len + 1``).

    Raises ``ValueError`` when the stream is shorter than one window. When it is too short for both
    a training and a validation window (or ``val_fraction`` is 0) there is no validation split (None).
    """
    n, window = int(tokens.shape[0]), seq_len + 1
    if n < window:
        raise ValueError(f"data has {n} tokens, shorter than one training sequence "
                         f"(seq_len + 1 = {window} tokens); use a smaller --seq-len or more data")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if val_fraction == 0 or n < 2 * window:
        return tokens, None
    n_val = max(window, int(n * val_fraction))
    n_val = min(n_val, n - window)
    return tokens[:n - n_val], tokens[n - n_val:]


class BatchSampler:
    """Random ``[B, T+1]`` windows from a token stream, from a seeded, checkpointable generator.

    ``next()`` returns ``(tokens, targets)``, both int64 ``[B, T]``: window start s is uniform in
    ``[0, n - T - 1]``; tokens = stream[s : s+T], targets = stream[s+1 : s+T+1].

    Data parallel: with ``world_size`` N, every rank draws the starts of the whole global batch of
    N*B windows (the same generator calls as one process with batch N*B) and reads only its rows
    ``[rank*B, (rank+1)*B)``: the ranks together see exactly the batches of one process with N times
    the batch, and the generator state (the data position) is the same on every rank.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of size {world_size}")
        n = int(tokens.shape[0])
        if n < seq_len + 1:
            raise ValueError(f"data has {n} tokens, shorter than one training sequence "
                             f"(seq_len + 1 = {seq_len + 1} tokens)")
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.rank, self.world_size = rank, world_size
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """The next batch, ``(tokens, targets)``, both int64 ``[B, T]`` (this rank's rows of the global
        batch; see the class docstring); advances the generator."""
        T, B = self.seq_len, self.batch_size
        starts = self.rng.integers(0, self.tokens.shape[0] - T, size=B * self.world_size)
        mine = starts[self.rank * B:(self.rank + 1) * B]
        windows = np.stack([np.asarray(self.tokens[s:s + T + 1], dtype=np.int64) for s in mine])
        return windows[:, :-1].copy(), windows[:, 1:].copy()

    __next__ = next

    def __iter__(self) -> "BatchSampler":
        return self

    def state(self) -> dict[str, Any]:
        """JSON-able generator state."""
        return self.rng.bit_generator.state

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a generator state from :meth:`state` (a checkpoint's data position); ``ValueError`` when
        ``state`` is not a PCG64 bit-generator state."""
        if not isinstance(state, Mapping) or state.get("bit_generator") != "PCG64":
            raise ValueError("sampler state must be a PCG64 bit_generator state")
        self.rng.bit_generator.state = dict(state)


def _eval_starts(n: int, batch_size: int, seq_len: int, max_batches: int) -> np.ndarray:
    """The window starts of :func:`eval_batches` over ``n`` tokens, ascending (none when n <= seq_len)."""
    T = seq_len
    if n < T + 1:
        return np.zeros(0, np.int64)
    count = batch_size * max(1, min(max_batches, ((n - 1) // T) // batch_size))
    return np.linspace(0, n - T - 1, count).astype(np.int64)


def scored_tokens(n: int, batch_size: int, seq_len: int, max_batches: int = 4) -> int:
    """How many distinct target positions of an ``n``-token region :func:`eval_batches` scores (windows
    may overlap, or leave gaps between them). ``batch_size``: the global batch (all ranks' rows)."""
    starts = _eval_starts(n, batch_size, seq_len, max_batches)
    if not starts.shape[0]:
        return 0
    return int(np.minimum(np.diff(starts), seq_len).sum()) + seq_len


def eval_batches(tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int = 4,
                 rank: int = 0, world_size: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed validation batches of exactly ``batch_size`` evenly spaced windows each.

    As many batches (at most ``max_batches``) as non-overlapping windows fill; at least one, whose
    windows overlap when the region is shorter than ``batch_size`` windows. Deterministic (no
    randomness), so every evaluation of a run scores the same text. With ``world_size`` N the
    batches are those of one process with batch N*B, and this rank gets rows ``[rank*B, (rank+1)*B)``
    of each (as :class:`BatchSampler`)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    if world_size > 1:
        B = batch_size
        return [(x[rank * B:(rank + 1) * B], y[rank * B:(rank + 1) * B])
                for x, y in eval_batches(tokens, B * world_size, seq_len, max_batches)]
    starts = _eval_starts(int(tokens.shape[0]), batch_size, seq_len, max_batches)
    T, count = seq_len, starts.shape[0]
    if not count:
        return []
    windows = np.stack([np.asarray(tokens[s:s + T + 1], dtype=np.int64) for s in starts])
    out = []
    for i in range(0, count, batch_size):
        w = windows[i:i + batch_size]
        out.append((w[:, :-1].copy(), w[:, 1:].copy()))
    return out
