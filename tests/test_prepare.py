"""Tokenised text as RWKV-LM binidx: document layout (RWKV-LM's make_data.py: ids + end-of-document 0,
one sequence per document), streaming in chunks, the atomic writer, and bad input leaving nothing."""
import json
import struct

import numpy as np
import pytest

import rwkvx.data.text as text_mod
from rwkvx.data import BinidxWriter, load_tokens, write_binidx
from rwkvx.data.text import document_tokens, prepare_binidx, tokenize_text
from rwkvx.tokenizer import get_tokenizer

DOCS = ["To be, or not to be: that is the question.", "", "Ünïcödé ✓ 今天是美好的一天。\n\nSecond para.",
        "x" * 1000]


def read_binidx_by_hand(prefix):
    """(dtype code, sizes, pointers, doc_idx, tokens): the MMIDIDX layout parsed here, independently."""
    idx = open(f"{prefix}.idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, n, d = struct.unpack("<QBQQ", idx[9:34])
    assert version == 1
    sizes = np.frombuffer(idx, "<i4", n, 34)
    pointers = np.frombuffer(idx, "<i8", n, 34 + 4 * n)
    doc_idx = np.frombuffer(idx, "<i8", d, 34 + 12 * n)
    assert len(idx) == 34 + 12 * n + 8 * d
    tokens = np.fromfile(f"{prefix}.bin", "<u2")
    return code, sizes, pointers, doc_idx, tokens


def write_jsonl(path, docs, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "meta": 1}) + "\n")
        for line in extra_lines:
            f.write(line + "\n")


def test_prepare_jsonl_layout(tmp_path):
    world = get_tokenizer("world")
    write_jsonl(tmp_path / "docs.jsonl", DOCS, extra_lines=["", "   "])   # blank lines are skipped
    stats = prepare_binidx(tmp_path / "docs.jsonl", tmp_path / "out", world)
    code, sizes, pointers, doc_idx, tokens = read_binidx_by_hand(tmp_path / "out")
    expected = [world.encode(d).tolist() + [0] for d in DOCS]
    assert code == 8                                                    # uint16
    assert sizes.tolist() == [len(e) for e in expected]
    assert pointers.tolist() == (2 * np.concatenate([[0], np.cumsum(sizes)[:-1]])).tolist()
    assert doc_idx.tolist() == list(range(len(DOCS) + 1))
    assert tokens.tolist() == sum(expected, [])
    assert (stats.documents, stats.tokens) == (len(DOCS), len(tokens))
    for doc, begin, size in zip(DOCS, pointers // 2, sizes):
        assert world.decode(tokens[begin:begin + size - 1]) == doc and tokens[begin + size - 1] == 0
    # the reader, and text loaded directly for training, see the same stream
    np.testing.assert_array_equal(load_tokens(tmp_path / "out").tokens, tokens)
    direct = load_tokens(tmp_path / "docs.jsonl", tokenizer="world")
    assert direct.vocab_size == 65536 and direct.format == "jsonl"
    np.testing.assert_array_equal(direct.tokens, tokens)


@pytest.mark.parametrize("name", ["world", "bytes"])
def test_prepare_text_file_in_small_chunks(tmp_path, monkeypatch, name):
    """A text file is one document, tokenised chunk by chunk exactly as if whole."""
    tok = get_tokenizer(name)
    body = "\n\n".join(DOCS) * 5
    (tmp_path / "a.txt").write_text(body, encoding="utf-8")
    whole = tok.encode(body).tolist() + ([] if tok.eod is None else [tok.eod])
    monkeypatch.setattr(text_mod, "CHUNK_BYTES", 7)
    chunks = list(document_tokens(tmp_path / "a.txt", tok))
    assert len(chunks) > 100 and [end for _, end in chunks] == [False] * (len(chunks) - 1) + [True]
    prepare_binidx(tmp_path / "a.txt", tmp_path / "a", tok)
    _, sizes, _, _, tokens = read_binidx_by_hand(tmp_path / "a")
    assert sizes.tolist() == [len(whole)] and tokens.tolist() == whole
    if name == "bytes":
        assert bytes(tokens.astype(np.uint8)) == body.encode("utf-8")


def test_tokenize_text_and_load_tokens(tmp_path):
    (tmp_path / "a.txt").write_text("hello world", encoding="utf-8")
    world = get_tokenizer("world")
    np.testing.assert_array_equal(tokenize_text(tmp_path / "a.txt", world), [34550, 40213, 0])
    data = load_tokens(tmp_path / "a.txt", tokenizer="world")
    assert data.vocab_size == 65536 and data.format == "text"
    with pytest.raises(ValueError, match="needs vocab_size >= 65536"):
        load_tokens(tmp_path / "a.txt", tokenizer="world", vocab_size=65535)
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'; known tokenizers: bytes, world"):
        load_tokens(tmp_path / "a.txt", tokenizer="gpt2")


def _nothing_written(folder, before):
    assert sorted(p.name for p in folder.iterdir()) == before


@pytest.mark.parametrize("name,content,message", [
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "broken\n', r"bad.jsonl:2: Invalid control character"),
    ("nofield.jsonl", b'{"text": "ok"}\n{"body": "x"}\n', r'nofield.jsonl:2: not a JSON object with'),
    ("notstr.jsonl", b'{"text": 5}\n', r'notstr.jsonl:1: not a JSON object with a "text"'),
    ("array.jsonl", b'["text"]\n', r'array.jsonl:1: not a JSON object'),
    ("surrogate.jsonl", b'{"text": "\\ud800"}\n', r"surrogate.jsonl:1: .*surrogate"),
    ("latin1.jsonl", b'{"text": "caf\xe9"}\n', r"latin1.jsonl:1: "),
    ("blank.jsonl", b"\n  \n", "no documents"),
    ("empty.txt", b"", "empty"),
    ("bad.txt", b"fine text \xff\xfe then bad", "not valid UTF-8 text"),
    ("tokens.npy", np.arange(5, dtype=np.uint16).tobytes(), "expected UTF-8 text"),
    ("data.csv", b"a,b", "unknown data format"),
])
def test_bad_input_writes_nothing(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=message):
        prepare_binidx(tmp_path / name, tmp_path / "out", get_tokenizer("world"))
    _nothing_written(tmp_path, before)
    with pytest.raises(ValueError, match="not found"):
        prepare_binidx(tmp_path / "missing.txt", tmp_path / "out", get_tokenizer("world"))


def test_bad_text_late_in_a_large_file_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(text_mod, "CHUNK_BYTES", 64)
    (tmp_path / "late.txt").write_bytes(b"good text. " * 100 + b"\xc3(")
    with pytest.raises(ValueError, match="near byte 1100"):
        prepare_binidx(tmp_path / "late.txt", tmp_path / "out", get_tokenizer("world"))
    _nothing_written(tmp_path, ["late.txt"])


def test_writer_is_atomic_and_checks_ids(tmp_path):
    write_binidx(tmp_path / "keep", [np.arange(10)])
    old = [(tmp_path / f"keep.{s}").read_bytes() for s in ("bin", "idx")]
    with pytest.raises(RuntimeError, match="boom"):
        with BinidxWriter(tmp_path / "keep") as w:
            w.add(np.arange(50))
            raise RuntimeError("boom")
    for bad, message in [(np.array([1, 70000]), "outside the range of uint16"),
                         (np.array([-1]), "outside the range"), (np.ones((2, 2), int), "1-D"),
                         (np.array([0.5]), "integer")]:
        with pytest.raises(ValueError, match=message):
            with BinidxWriter(tmp_path / "keep") as w:
                w.add(bad)
    assert [(tmp_path / f"keep.{s}").read_bytes() for s in ("bin", "idx")] == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.bin", "keep.idx"]   # no temp files
    with BinidxWriter(tmp_path / "keep") as w:                 # replaced when the block succeeds
        w.add(np.array([7, 8], np.uint16))
        w.end_document()
        w.add(np.array([9], np.int64))                          # left open: ended at the close
    _, sizes, _, doc_idx, tokens = read_binidx_by_hand(tmp_path / "keep")
    assert sizes.tolist() == [2, 1] and doc_idx.tolist() == [0, 1, 2] and tokens.tolist() == [7, 8, 9]
