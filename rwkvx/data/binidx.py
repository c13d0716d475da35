"""RWKV-LM / Megatron binidx: reading the index, loading the token stream, writing (atomically).

A binidx dataset is ``PREFIX.bin`` + ``PREFIX.idx``. The ``.idx`` ("MMIDIDX" format) is, all little-endian::

    magic    9 bytes  b"MMIDIDX\\x00\\x00"
    version  uint64   1
    dtype    uint8    code of the token dtype (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                      6 float64, 7 float64, 8 uint16; RWKV-LM writes 8)
    count    uint64   number of sequences n
    docs     uint64   number of entries d of the document index
    sizes    int32[n]  tokens in each sequence
    pointers int64[n]  byte offset of each sequence in the .bin
    doc_idx  int64[d]  sequence index where each document starts (0 first, n last)

The ``.bin`` is the sequences' tokens back to back.
:class:`BinidxWriter` writes binidx (streaming, atomically); ``python -m rwkvx prepare`` uses it.
"""
from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from .stream import TokenData, file_size, scan_min

BINIDX_MAGIC = b"MMIDIDX\x00\x00"
BINIDX_VERSION = 1
_BINIDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, count, docs
BINIDX_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f8"), 8: np.dtype("<u2")}
_BINIDX_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype("<i2"): 3, np.dtype("<i4"): 4,
                 np.dtype("<i8"): 5, np.dtype("<u2"): 8}


def read_binidx_index(idx_path: str | os.PathLike) -> dict[str, Any]:
    """Parse a ``.idx`` file: ``{"dtype", "sizes", "pointers", "doc_idx"}``; ``ValueError`` if malformed."""
    idx_path = Path(idx_path)
    size = file_size(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_BINIDX_HEADER.size)
    if head[:len(BINIDX_MAGIC)] != BINIDX_MAGIC:
        raise ValueError(f"{idx_path}: not a binidx index (bad magic, expected {BINIDX_MAGIC!r})")
    if len(head) < _BINIDX_HEADER.size:
        raise ValueError(f"{idx_path}: truncated binidx header")
    _, version, code, count, docs = _BINIDX_HEADER.unpack(head)
    if version != BINIDX_VERSION:
        raise ValueError(f"{idx_path}: unsupported binidx version {version}")
    if code not in BINIDX_DTYPES:
        raise ValueError(f"{idx_path}: unknown binidx dtype code {code}")
    dtype = BINIDX_DTYPES[code]
    if dtype.kind == "f":
        raise ValueError(f"{idx_path}: float token dtype (code {code}) is not a token stream")
    start = _BINIDX_HEADER.size
    need = start + count * 4 + count * 8 + docs * 8
    if size < need:
        raise ValueError(f"{idx_path}: truncated binidx index ({size} bytes, header says {need})")
    mm = np.memmap(idx_path, dtype=np.uint8, mode="r")
    sizes = np.frombuffer(mm, dtype="<i4", count=count, offset=start)
    pointers = np.frombuffer(mm, dtype="<i8", count=count, offset=start + 4 * count)
    doc_idx = np.frombuffer(mm, dtype="<i8", count=docs, offset=start + 12 * count)
    return {"dtype": dtype, "sizes": sizes, "pointers": pointers, "doc_idx": doc_idx}


def load_binidx(prefix: Path) -> TokenData:
    """The token stream of ``PREFIX.bin`` (memory-mapped), checked against ``PREFIX.idx``."""
    idx_path, bin_path = Path(str(prefix) + ".idx"), Path(str(prefix) + ".bin")
    index = read_binidx_index(idx_path)
    bin_size = file_size(bin_path)
    dtype, sizes, pointers = index["dtype"], index["sizes"], index["pointers"]
    if sizes.shape[0] == 0:
        raise ValueError(f"{idx_path}: binidx index lists no sequences")
    if (sizes < 0).any():
        raise ValueError(f"{idx_path}: negative sequence sizes")
    expected = np.concatenate([[0], np.cumsum(sizes.astype(np.int64))[:-1]]) * dtype.itemsize
    if not np.array_equal(pointers, expected):
        raise ValueError(f"{idx_path}: sequence pointers are not contiguous from 0")
    total = int(sizes.astype(np.int64).sum())
    if bin_size % dtype.itemsize:
        raise ValueError(f"{bin_path}: size {bin_size} bytes is not a multiple of the token width "
                         f"{dtype.itemsize}")
    if total * dtype.itemsize > bin_size:
        raise ValueError(f"{bin_path}: holds {bin_size // dtype.itemsize} tokens, index says {total}")
    if total == 0:
        raise ValueError(f"data file is empty (no tokens): {bin_path}")
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(total,))
    if dtype.kind == "i" and scan_min(tokens) < 0:
        raise ValueError(f"{bin_path}: negative token ids")
    return TokenData(tokens, None, str(prefix), "binidx")


class BinidxWriter:
    """Streams documents into ``PREFIX.bin`` + ``PREFIX.idx`` (one sequence per document), atomically.

    Use as a context manager: :meth:`add` appends tokens to the current document, :meth:`end_document`
    closes it (a document still open at the end is closed then). Both files are written to temporary
    files and renamed into place only when the block ends without an error (the old ``.idx`` is
    removed first, so no moment pairs a new ``.bin`` with an old ``.idx``); on an error nothing
    changes."""

    def __init__(self, prefix: str | os.PathLike, dtype: Any = np.uint16) -> None:
        dtype = np.dtype(dtype)
        self.dtype = dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
        self.code = _BINIDX_CODES.get(self.dtype)
        if self.code is None:
            raise ValueError(f"binidx cannot store dtype {dtype}")
        self._range = np.iinfo(self.dtype)
        self.prefix = str(prefix)
        self.sizes: list[int] = []
        self.tokens = 0                       # tokens written so far
        self._open = 0                        # tokens of the open document

    def __enter__(self) -> "BinidxWriter":
        self._session = self._write()
        return self._session.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        return bool(self._session.__exit__(exc_type, exc, tb))

    @contextlib.contextmanager
    def _write(self) -> Iterator["BinidxWriter"]:
        from ..atomic_io import atomic_files

        idx_path = Path(self.prefix + ".idx")
        with atomic_files(self.prefix + ".bin", idx_path) as (self._bin, idx):
            yield self
            if self._open:
                self.end_document()
            n = len(self.sizes)
            sizes = np.array(self.sizes, dtype="<i4")
            offsets = np.zeros(n, dtype="<i8")
            np.cumsum(sizes[:-1], dtype=np.int64, out=offsets[1:])
            idx.write(_BINIDX_HEADER.pack(BINIDX_MAGIC, BINIDX_VERSION, self.code, n, n + 1))
            idx.write(sizes.tobytes())
            idx.write((offsets * self.dtype.itemsize).tobytes())
            idx.write(np.arange(n + 1, dtype="<i8").tobytes())
            idx_path.unlink(missing_ok=True)

    def add(self, tokens: np.ndarray) -> None:
        """Append ``tokens`` (1-D integers within the dtype's range) to the open document."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise ValueError(f"a document's tokens must be a 1-D integer array, got {tokens.dtype} "
                             f"{tokens.shape}")
        if not np.can_cast(tokens.dtype, self.dtype) and tokens.size and (
                tokens.min() < self._range.min or tokens.max() > self._range.max):
            raise ValueError(f"token ids outside the range of {self.dtype} "
                             f"[{self._range.min}, {self._range.max}]")
        if self._open + tokens.size > np.iinfo(np.int32).max:
            raise ValueError(f"document {len(self.sizes)} has more than 2**31 - 1 tokens (binidx stores "
                             "sizes as int32): split it")
        self._bin.write(tokens.astype(self.dtype, copy=False).tobytes())
        self._open += tokens.size
        self.tokens += tokens.size

    def end_document(self) -> None:
        """Close the open document (it may be empty)."""
        self.sizes.append(self._open)
        self._open = 0


def write_binidx(prefix: str | os.PathLike, docs: Iterable[np.ndarray], dtype: Any = np.uint16) -> None:
    """Write documents (1-D integer arrays) as ``PREFIX.bin`` + ``PREFIX.idx`` (one sequence per doc)."""
    with BinidxWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add(doc)
            writer.end_document()
