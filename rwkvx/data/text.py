"""Text documents to token ids, and ``prepare``: tokenised text written as RWKV-LM binidx.

Inputs: a UTF-8 text file (``.txt``, ``.text``, ``.md``) is one document; a ``.jsonl`` file holds one
document per line, the line's ``"text"`` string (blank lines are skipped). Each document's ids are
followed by the tokenizer's end-of-document id when it has one (World: 0), and in binidx each
document is one sequence: the layout of RWKV-LM's ``make_data.py``, so the files train there too.
Text is read and tokenised in chunks (a text file never has to fit in memory), with a progress bar
over the input bytes.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..tokenizer import Tokenizer
from .binidx import BinidxWriter
from .detect import TEXT_FORMATS, Utf8Check, detect_format
from .stream import file_size

CHUNK_BYTES = 1 << 22  # text read and tokenised per step


def _end(tokenizer: Tokenizer) -> np.ndarray:
    return np.array([] if tokenizer.eod is None else [tokenizer.eod], dtype=np.uint16)


def _text_file(path: Path, tokenizer: Tokenizer, bar) -> Iterator[tuple[np.ndarray, bool]]:
    check = Utf8Check(path)
    carry = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK_BYTES)
            final = len(chunk) < CHUNK_BYTES
            check(chunk, final)
            buf = carry + chunk
            ids, used = tokenizer.encode_bytes(buf, final)
            carry = buf[used:]
            bar.update(len(chunk))
            if final:
                yield np.concatenate([ids, _end(tokenizer)]), True
                return
            yield ids, False


def _jsonl_file(path: Path, tokenizer: Tokenizer, bar) -> Iterator[tuple[np.ndarray, bool]]:
    end = _end(tokenizer)
    found = False
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            bar.update(len(line))
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise ValueError('not a JSON object with a "text" string')
                data = doc["text"].encode("utf-8")
            except ValueError as exc:  # JSON, UTF-8 and the check above
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            found = True
            yield np.concatenate([tokenizer.encode_bytes(data)[0], end]), True
    if not found:
        raise ValueError(f"{path}: no documents (every line is blank)")


def document_tokens(path: str | os.PathLike, tokenizer: Tokenizer, progress: bool = False
                    ) -> Iterator[tuple[np.ndarray, bool]]:
    """The ids of the documents of ``path`` (text or .jsonl) in order, as ``(ids, ends_document)``
    chunks (uint16); the chunk that ends a document carries its end-of-document id. ``ValueError``
    (naming the file, and the line of a .jsonl) for input that is not UTF-8 text or JSON documents:
    a missing, empty or non-text file at once, bad content when the iteration reaches it."""
    fmt, p = detect_format(path)
    if fmt not in TEXT_FORMATS:
        raise ValueError(f"{p}: expected UTF-8 text (.txt, .text, .md) or .jsonl documents, got "
                         f"{fmt} data")
    size = file_size(p)
    return _with_progress(_text_file if fmt == "text" else _jsonl_file, p, size, tokenizer, progress)


def _with_progress(read, path: Path, size: int, tokenizer: Tokenizer, progress: bool
                   ) -> Iterator[tuple[np.ndarray, bool]]:
    from tqdm import tqdm

    with tqdm(total=size, unit="B", unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
              mininterval=0.5, disable=not progress, file=sys.stderr, desc="tokenising") as bar:
        yield from read(path, tokenizer, bar)


def tokenize_text(path: str | os.PathLike, tokenizer: Tokenizer, progress: bool = False) -> np.ndarray:
    """All the ids of the documents of ``path`` as one uint16 stream (see :func:`document_tokens`)."""
    tokens = np.concatenate([ids for ids, _ in document_tokens(path, tokenizer, progress)])
    if tokens.shape[0] == 0:
        raise ValueError(f"data file is empty (no tokens): {path}")
    return tokens


@dataclass
class PrepareStats:
    """What :func:`prepare_binidx` wrote."""

    documents: int
    tokens: int
    text_bytes: int
    seconds: float


def prepare_binidx(path: str | os.PathLike, prefix: str | os.PathLike, tokenizer: Tokenizer,
                   progress: bool = False) -> PrepareStats:
    """Tokenise the documents of ``path`` into ``PREFIX.bin`` + ``PREFIX.idx`` (uint16, one sequence
    per document, each ending with the end-of-document id). Written atomically: on any error nothing
    is left behind."""
    if tokenizer.vocab_size > 1 << 16:
        raise ValueError(f"binidx stores uint16 tokens: the {tokenizer.name} tokenizer's "
                         f"{tokenizer.vocab_size} ids do not fit")
    start = time.perf_counter()
    chunks = document_tokens(path, tokenizer, progress)
    with BinidxWriter(prefix, np.uint16) as writer:
        for ids, ends in chunks:
            writer.add(ids)
            if ends:
                writer.end_document()
    return PrepareStats(documents=len(writer.sizes), tokens=writer.tokens,
                        text_bytes=Path(path).stat().st_size, seconds=time.perf_counter() - start)
