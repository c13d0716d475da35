"""Data files to token streams: :func:`load_tokens` (the format from :func:`rwkvx.data.detect.detect_format`).

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
  ``.idx`` (layout: :mod:`rwkvx.data.binidx`).

Bad data raises ``ValueError`` naming the file and the problem: empty, shorter than one training
window (``T + 1`` tokens), size not a multiple of the token width, unknown format, inconsistent
binidx header, token ids outside ``[0, vocab_size)``.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .binidx import load_binidx
from .detect import TEXT_FORMATS, Utf8Check, detect_format
from .stream import CHUNK, TokenData, file_size, scan_min
from .text import tokenize_text

DEFAULT_CORPUS = Path(__file__).resolve().parent / "shakespeare.txt"
DEFAULT_CORPUS_PROMPT = "ROMEO:"   # a prompt the embedded corpus's model continues (a speaker's cue)


def default_corpus_path() -> Path:
    """The embedded public-domain corpus (see rwkvx/data/README.md)."""
    return DEFAULT_CORPUS


def _load_text(path: Path) -> TokenData:
    file_size(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    check = Utf8Check(path)
    for start in range(0, raw.shape[0], CHUNK):
        check(raw[start:start + CHUNK].tobytes(), final=start + CHUNK >= raw.shape[0])
    return TokenData(raw, 256, str(path), "text")


def _load_npy(path: Path) -> TokenData:
    file_size(path)
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
    if arr.dtype.kind == "i" and scan_min(arr) < 0:
        raise ValueError(f"{path}: negative token ids")
    return TokenData(arr, None, str(path), "npy")


def _load_raw(path: Path, token_width: int | None) -> TokenData:
    size = file_size(path)
    if token_width is None:
        raise ValueError(f"{path}: a raw .bin token file needs --token-width 2 (uint16) or 4 (uint32) "
                         "(or a sibling .idx for binidx)")
    if token_width not in (2, 4):
        raise ValueError(f"token width must be 2 (uint16) or 4 (uint32), got {token_width}")
    if size % token_width:
        raise ValueError(f"{path}: size {size} bytes is not a multiple of the token width {token_width}")
    dtype = np.dtype("<u2") if token_width == 2 else np.dtype("<u4")
    return TokenData(np.memmap(path, dtype=dtype, mode="r"), None, str(path), "raw")


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
        data = TokenData(tokenize_text(p, tok, progress), tok.vocab_size, str(p), fmt)
    elif fmt == "npy":
        data = _load_npy(p)
    elif fmt == "raw":
        data = _load_raw(p, token_width)
    else:
        data = load_binidx(p)
    if vocab_size is not None:
        if tok is not None and vocab_size < tok.vocab_size:
            raise ValueError(f"{data.source}: text with the {tok.name} tokenizer needs vocab_size >= "
                             f"{tok.vocab_size} (vocab_size = {vocab_size})")
        hi = data.max_token()
        if hi >= vocab_size:
            raise ValueError(f"{data.source}: token id {hi} is out of range (vocab_size = {vocab_size})")
    return data
