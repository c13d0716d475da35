"""What a data argument is: :func:`detect_format` names its format from the path (and, for binidx, the
files beside it); :class:`Utf8Check` validates text as UTF-8 while it is read."""
from __future__ import annotations

import codecs
import os
from pathlib import Path

TEXT_SUFFIXES = (".txt", ".text", ".md")
TEXT_FORMATS = ("text", "jsonl")  # formats of text, which a tokenizer turns into ids


class Utf8Check:
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
