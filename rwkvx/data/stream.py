"""Token streams: :class:`TokenData` (a flat 1-D stream of ids and where it came from), the chunked
scans over a (possibly memory-mapped) stream, and the check every data file passes first."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

CHUNK = 1 << 24  # tokens per chunk when scanning a memory-mapped stream


@dataclass
class TokenData:
    """A flat token stream plus where it came from."""

    tokens: np.ndarray   # 1-D integer array (often a read-only memmap)
    vocab_size: int | None  # known for text (256); None when the format does not say
    source: str
    format: str          # "text", "npy", "raw", "binidx"

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def max_token(self) -> int:
        """The largest token id in the stream (-1 when it is empty), scanned chunk by chunk."""
        return scan_max(self.tokens)


def _scan(tokens: np.ndarray, reduce: Callable[[np.ndarray], Any], combine: Callable[[int, int], int],
          value: int) -> int:
    for start in range(0, tokens.shape[0], CHUNK):
        value = combine(value, int(reduce(tokens[start:start + CHUNK])))
    return value


def scan_max(tokens: np.ndarray) -> int:
    """The largest id of ``tokens``, read chunk by chunk (a memory map is never loaded whole)."""
    return _scan(tokens, np.max, max, -1)


def scan_min(tokens: np.ndarray) -> int:
    """The smallest id of ``tokens`` (0 when none is negative), read chunk by chunk."""
    return _scan(tokens, np.min, min, 0)


def file_size(path: Path) -> int:
    """The size of the data file ``path``; ``ValueError`` when it is missing, not a file or empty."""
    if not path.exists():
        raise ValueError(f"data file not found: {path}")
    if not path.is_file():
        raise ValueError(f"data path is not a file: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"data file is empty: {path}")
    return size


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
    """Entropy (nats) of the token frequency distribution of ``tokens``."""
    n = tokens.shape[0]
    length = vocab_size or 0
    counts = np.zeros(max(length, 1), dtype=np.int64)
    for start in range(0, n, CHUNK):
        c = np.bincount(np.asarray(tokens[start:start + CHUNK], dtype=np.int64), minlength=length)
        if c.shape[0] > counts.shape[0]:
            c[:counts.shape[0]] += counts
            counts = c
        else:
            counts[:c.shape[0]] += c
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())
