"""Training data: token streams from text, raw token files, .npy and RWKV-LM binidx; batch sampling.

Every source becomes one flat 1-D stream of token ids (memory-mapped where the format allows);
training windows of ``T + 1`` tokens are drawn from anywhere in it (document boundaries are ignored,
as RWKV-LM does for binidx).

Formats (:func:`load_tokens`):

* UTF-8 text (``.txt``, ``.text``, ``.md``, one document): byte tokens, vocabulary 256 (memory-mapped), or
  the ids of another tokenizer (``tokenizer="world"``, :mod:`rwkvx.tokenizer`). Must decode as UTF-8.
* ``.jsonl``: one document per line, its ``"text"`` string, tokenised like text; each document is
  followed by the tokenizer's end-of-document id (World: 0; see :mod:`rwkvx.data.text`).
* ``.npy``: a 1-D array of uint16 or uint32 (int16/int32/int64 are accepted when non-negative),
  memory-mapped.
* raw ``.bin`` without a sibling ``.idx``: little-endian uint16 or uint32 tokens, memory-mapped;
  the width is required (``token_width`` 2 or 4), there is no header to read it from.
* RWKV-LM / Megatron binidx: ``PREFIX.bin`` + ``PREFIX.idx``, given as the prefix, the ``.bin`` or the
  ``.idx``. The ``.idx`` ("MMIDIDX" format) is, all little-endian::

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

Bad data raises ``ValueError`` naming the file and the problem: empty, shorter than one training
window (``T + 1`` tokens), size not a multiple of the token width, unknown format, inconsistent
binidx header, token ids outside ``[0, vocab_size)``.
"""
from __future__ import annotations

import codecs
import contextlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

TEXT_SUFFIXES = (".txt", ".text", ".md")
TEXT_FORMATS = ("text", "jsonl")  # formats of text, which a tokenizer turns into ids
BINIDX_MAGIC = b"MMIDIDX\x00\x00"
BINIDX_VERSION = 1
_BINIDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, count, docs
BINIDX_DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
    5: np.dtype("<i8"), 6: np.dtype("<f8"), 7: np.dtype("<f8"), 8: np.dtype("<u2")}
_BINIDX_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype("<i2"): 3, np.dtype("<i4"): 4,
                 np.dtype("<i8"): 5, np.dtype("<u2"): 8}
_CHUNK = 1 << 24  # tokens per chunk when scanning a memory-mapped stream

DEFAULT_CORPUS = Path(__file__).resolve().parent / "shakespeare.txt"


def default_corpus_path() -> Path:
    """The embedded public-domain corpus (see rwkvx/data/README.md)."""
    return DEFAULT_CORPUS


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
        return _scan_max(self.tokens)


def _scan_max(tokens: np.ndarray) -> int:
    hi = -1
    for start in range(0, tokens.shape[0], _CHUNK):
        hi = max(hi, int(tokens[start:start + _CHUNK].max()))
    return hi


def _scan_min(tokens: np.ndarray) -> int:
    lo = 0
    for start in range(0, tokens.shape[0], _CHUNK):
        lo = min(lo, int(tokens[start:start + _CHUNK].min()))
    return lo


def _nonempty(path: Path) -> int:
    if not path.exists():
        raise ValueError(f"data file not found: {path}")
    if not path.is_file():
        raise ValueError(f"data path is not a file: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"data file is empty: {path}")
    return size


class _Utf8Check:
    """Validates a file's bytes as UTF-8, chunk by chunk: ``ValueError`` naming the file and offset."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def __call__(self, chunk: bytes, final: bool) -> None:
        try:
            self._decoder.decode(chunk, final=final)
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.path}: not valid UTF-8 text (near byte {self.offset + exc.start}: "
                             f"{exc.reason})") from None
        self.offset += len(chunk)


def _load_text(path: Path) -> TokenData:
    _nonempty(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    check = _Utf8Check(path)
    for start in range(0, raw.shape[0], _CHUNK):
        check(raw[start:start + _CHUNK].tobytes(), final=start + _CHUNK >= raw.shape[0])
    return TokenData(raw, 256, str(path), "text")


def _load_npy(path: Path) -> TokenData:
    _nonempty(path)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npy file ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{path}: expected a 1-D token array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{path}: expected integer tokens (uint16/uint32), got dtype {arr.dtype}")
    if arr.shape[0] == 0:
        raise ValueError(f"data file is empty (no tokens): {path}")
    if arr.dtype.kind == "i" and _scan_min(arr) < 0:
        raise ValueError(f"{path}: negative token ids")
    return TokenData(arr, None, str(path), "npy")


def _load_raw(path: Path, token_width: int | None) -> TokenData:
    size = _nonempty(path)
    if token_width is None:
        raise ValueError(f"{path}: a raw .bin token file needs --token-width 2 (uint16) or 4 (uint32) "
                         "(or a sibling .idx for binidx)")
    if token_width not in (2, 4):
        raise ValueError(f"token width must be 2 (uint16) or 4 (uint32), got {token_width}")
    if size % token_width:
        raise ValueError(f"{path}: size {size} bytes is not a multiple of the token width {token_width}")
    dtype = np.dtype("<u2") if token_width == 2 else np.dtype("<u4")
    return TokenData(np.memmap(path, dtype=dtype, mode="r"), None, str(path), "raw")


def read_binidx_index(idx_path: str | os.PathLike) -> dict[str, Any]:
    """Parse a ``.idx`` file: ``{"dtype", "sizes", "pointers", "doc_idx"}``; ``ValueError`` if malformed."""
    idx_path = Path(idx_path)
    size = _nonempty(idx_path)
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


def _load_binidx(prefix: Path) -> TokenData:
    idx_path, bin_path = Path(str(prefix) + ".idx"), Path(str(prefix) + ".bin")
    index = read_binidx_index(idx_path)
    bin_size = _nonempty(bin_path)
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
    if dtype.kind == "i" and _scan_min(tokens) < 0:
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


def detect_format(path: str | os.PathLike) -> tuple[str, Path]:
    """``(format, path)`` for a data argument: "text", "jsonl", "npy", "raw" or "binidx" (path = prefix)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in (".bin", ".idx"):
        prefix = p.with_suffix("")
        if Path(str(prefix) + ".idx").exists() and Path(str(prefix) + ".bin").exists():
            return "binidx", prefix
        if suffix == ".idx":
            raise ValueError(f"{p}: binidx index without its data file {prefix}.bin")
        return "raw", p
    if not p.exists() and Path(str(p) + ".idx").exists():
        if not Path(str(p) + ".bin").exists():
            raise ValueError(f"{p}.idx: binidx index without its data file {p}.bin")
        return "binidx", p
    if suffix in TEXT_SUFFIXES:
        return "text", p
    if suffix == ".jsonl":
        return "jsonl", p
    if suffix == ".npy":
        return "npy", p
    if not p.exists():
        raise ValueError(f"data file not found: {p}")
    raise ValueError(f"{p}: unknown data format '{suffix or '(no extension)'}' — use a UTF-8 .txt file, "
                     ".jsonl documents, .npy or raw .bin tokens (with --token-width), or a binidx "
                     "prefix/.bin/.idx")


def load_tokens(path: str | os.PathLike | None = None, token_width: int | None = None,
                vocab_size: int | None = None, tokenizer: str = "bytes", progress: bool = False
                ) -> TokenData:
    """Open a token stream (the embedded corpus when ``path`` is None); validates the ids.

    Text (``.txt``/``.text``/``.md``, ``.jsonl``) is tokenised with ``tokenizer`` (a name of
    :data:`rwkvx.tokenizer.TOKENIZERS`; byte-level text files are memory-mapped, everything else is
    tokenised into memory, with a progress bar when ``progress``). ``vocab_size``, when given, must
    exceed every token id (text needs at least the tokenizer's vocabulary size)."""
    from ..tokenizer import get_tokenizer

    if path is None:
        path = DEFAULT_CORPUS
    fmt, p = detect_format(path)
    tok = get_tokenizer(tokenizer) if fmt in TEXT_FORMATS else None
    if token_width is not None and fmt != "raw":
        if token_width not in (2, 4):
            raise ValueError(f"token width must be 2 (uint16) or 4 (uint32), got {token_width}")
    if fmt == "text" and tok.name == "bytes":
        data = _load_text(p)
    elif tok is not None:
        from .text import tokenize_text
        data = TokenData(tokenize_text(p, tok, progress), tok.vocab_size, str(p), fmt)
    elif fmt == "npy":
        data = _load_npy(p)
    elif fmt == "raw":
        data = _load_raw(p, token_width)
    else:
        data = _load_binidx(p)
    if vocab_size is not None:
        if tok is not None and vocab_size < tok.vocab_size:
            raise ValueError(f"{data.source}: text with the {tok.name} tokenizer needs vocab_size >= "
                             f"{tok.vocab_size} (vocab_size = {vocab_size})")
        hi = data.max_token()
        if hi >= vocab_size:
            raise ValueError(f"{data.source}: token id {hi} is out of range (vocab_size = {vocab_size})")
    return data


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
    """Entropy (nats) of the token frequency distribution of ``tokens``."""
    n = tokens.shape[0]
    length = vocab_size or 0
    counts = np.zeros(max(length, 1), dtype=np.int64)
    for start in range(0, n, _CHUNK):
        c = np.bincount(np.asarray(tokens[start:start + _CHUNK], dtype=np.int64), minlength=length)
        if c.shape[0] > counts.shape[0]:
            c[:counts.shape[0]] += counts
            counts = c
        else:
            counts[:c.shape[0]] += c
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------
# Splitting and sampling
# ---------------------------------------------------------------------------------------------

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
        if not isinstance(state, Mapping) or state.get("bit_generator") != "PCG64":
            raise ValueError("sampler state must be a PCG64 bit_generator state")
        self.rng.bit_generator.state = dict(state)


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
    n, T = int(tokens.shape[0]), seq_len
    if n < T + 1:
        return []
    count = batch_size * max(1, min(max_batches, ((n - 1) // T) // batch_size))
    starts = np.linspace(0, n - T - 1, count).astype(np.int64)
    windows = np.stack([np.asarray(tokens[s:s + T + 1], dtype=np.int64) for s in starts])
    out = []
    for i in range(0, count, batch_size):
        w = windows[i:i + batch_size]
        out.append((w[:, :-1].copy(), w[:, 1:].copy()))
    return out
