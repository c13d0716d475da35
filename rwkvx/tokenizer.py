"""Tokenizers for text data: byte-level (``bytes``, V = 256) and RWKV World (``world``, V = 65536).

* ``bytes``: the UTF-8 bytes of the text are the tokens. No end-of-document token (every id is a byte).
* ``world``: the vocabulary RWKV-7 models are trained with, ``rwkv_vocab_v20230424.txt`` as the ``rwkv``
  package ships it (``pip install 'rwkvx[world]'``): 65,529 byte strings with ids 1..65529, the 256
  single bytes among them. The UTF-8 text is split left to right, each time into the longest
  vocabulary entry that starts there (the rule of RWKV's reference tokenizer), so decoding gives back
  the text exactly. Id 0 is no entry: it ends a document (RWKV-LM's ``make_data.py`` appends it to
  every document); V = 65536 leaves ids 65530..65535 unused. Ids without an entry decode to nothing.

:func:`get_tokenizer` builds one by name (once per process); :class:`TextStream` decodes generated
ids as they come, holding back a UTF-8 character split across tokens until it is complete.
"""
from __future__ import annotations

import ast
import codecs
import functools
import os
from pathlib import Path
from typing import Iterable

import numpy as np

WORLD_VOCAB_FILE = "rwkv_vocab_v20230424.txt"
WORLD_VOCAB_SIZE = 65536


class Tokenizer:
    """Text <-> token ids. ``eod`` is the id appended after each document (None: the tokenizer has none)."""

    name: str
    vocab_size: int
    eod: int | None

    def encode_bytes(self, data: bytes | memoryview, final: bool = True) -> tuple[np.ndarray, int]:
        """``(ids, consumed)``: uint16 ids of ``data[:consumed]`` (UTF-8 text). With ``final`` false the
        tokenizer may stop short of the end (a longer token could still start there): pass the rest
        in front of the next chunk. ``final`` true consumes everything."""
        raise NotImplementedError

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids``; ``ValueError`` for an id outside ``[0, vocab_size)``."""
        raise NotImplementedError

    def encode(self, text: str) -> np.ndarray:
        """The uint16 ids of ``text``."""
        return self.encode_bytes(text.encode("utf-8"))[0]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (invalid UTF-8, possible from sampled ids, becomes U+FFFD)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def _check_ids(self, ids: Iterable[int]) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {self.vocab_size}) of the "
                             f"{self.name} tokenizer")
        return ids


class ByteTokenizer(Tokenizer):
    """Byte-level: token = UTF-8 byte, V = 256."""

    name, vocab_size, eod = "bytes", 256, None

    def encode_bytes(self, data: bytes | memoryview, final: bool = True) -> tuple[np.ndarray, int]:
        """``(ids, len(data))``: each byte of ``data`` as its uint16 id; every byte is a whole token, so
        ``final`` changes nothing."""
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16), len(data)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes whose values are ``ids``; ``ValueError`` for an id outside ``[0, 256)``."""
        return bytes(self._check_ids(ids))


def read_vocab(path: str | os.PathLike) -> list[tuple[bytes, int]]:
    """``(bytes, id)`` entries of an RWKV vocabulary file: one ``ID REPR LENGTH`` line per entry, REPR a
    Python str (taken as UTF-8) or bytes literal of LENGTH bytes. ``ValueError`` on a malformed line."""
    entries, ids = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            first, last = line.find(" "), line.rfind(" ")
            try:
                tid, length = int(line[:first]), int(line[last + 1:])
                value = ast.literal_eval(line[first + 1:last])
            except (ValueError, SyntaxError):
                raise ValueError(f"{path}:{lineno}: not an 'ID REPR LENGTH' vocabulary line") from None
            data = value.encode("utf-8") if isinstance(value, str) else value
            if not isinstance(data, bytes) or len(data) != length or not data:
                raise ValueError(f"{path}:{lineno}: entry {value!r} is not {length} bytes")
            if tid in ids:
                raise ValueError(f"{path}:{lineno}: duplicate id {tid}")
            ids.add(tid)
            entries.append((data, tid))
    return entries


def world_vocab_path() -> Path:
    """The World vocabulary file of the installed ``rwkv`` package; ``ImportError`` when missing."""
    import importlib.resources

    try:
        path = Path(str(importlib.resources.files("rwkv") / WORLD_VOCAB_FILE))
    except ModuleNotFoundError:
        raise ImportError("the world tokenizer needs the vocabulary of the 'rwkv' package: "
                          "pip install 'rwkvx[world]'") from None
    if not path.is_file():
        raise ImportError(f"the installed 'rwkv' package has no {WORLD_VOCAB_FILE} ({path})")
    return path


class WorldTokenizer(Tokenizer):
    """RWKV World: greedy longest match over ``rwkv_vocab_v20230424.txt``, V = 65536, end of document 0."""

    name, vocab_size, eod = "world", WORLD_VOCAB_SIZE, 0

    def __init__(self, vocab_path: str | os.PathLike | None = None) -> None:
        from ._trie import ByteTrie

        path = vocab_path if vocab_path is not None else world_vocab_path()
        entries = read_vocab(path)
        high = max(tid for _, tid in entries)
        if high >= self.vocab_size or any(tid == self.eod for _, tid in entries):
            raise ValueError(f"{path}: ids must lie in [1, {self.vocab_size})")
        self._trie = ByteTrie(entries)
        self._pieces = [b""] * self.vocab_size
        for data, tid in entries:
            self._pieces[tid] = data

    def encode_bytes(self, data: bytes | memoryview, final: bool = True) -> tuple[np.ndarray, int]:
        """``(ids, consumed)`` by greedy longest match over the vocabulary (see :meth:`Tokenizer.encode_bytes`
        for ``final``)."""
        return self._trie.encode(data, final)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The vocabulary entries of ``ids``, joined; ``ValueError`` for an id outside ``[0, vocab_size)``."""
        return b"".join(self._pieces[i] for i in self._check_ids(ids))


_CLASSES: dict[str, type[Tokenizer]] = {"bytes": ByteTokenizer, "world": WorldTokenizer}
TOKENIZERS = tuple(_CLASSES)


def tokenizer_class(name: str) -> type[Tokenizer]:
    """The class of the tokenizer called ``name`` (its ``vocab_size`` and ``eod``, nothing loaded);
    ``ValueError`` listing the known names for any other."""
    if name not in _CLASSES:
        raise ValueError(f"unknown tokenizer {name!r}; known tokenizers: {', '.join(TOKENIZERS)}")
    return _CLASSES[name]


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str) -> Tokenizer:
    """The tokenizer called ``name`` (one of :data:`TOKENIZERS`), built once per process."""
    return tokenizer_class(name)()


class TextStream:
    """Decodes ids to text as they are generated; a character whose UTF-8 bytes span several tokens is
    returned once complete, invalid bytes as U+FFFD."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        """The text completed by ``ids``."""
        return self._utf8.decode(self.tokenizer.decode_bytes(ids))

    def close(self) -> str:
        """What is left at the end (an incomplete character, as U+FFFD)."""
        return self._utf8.decode(b"", final=True)
