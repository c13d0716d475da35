"""Data formats (text, .npy, raw .bin, binidx), validation errors, splitting and the batch sampler."""
import hashlib
import json
import struct

import numpy as np
import pytest

from rwkvx.data import (BatchSampler, default_corpus_path, detect_format, eval_batches, load_tokens,
                        read_binidx_index, scored_tokens, split_train_val, unigram_entropy, write_binidx)

from seeding import seeded_rng


def write_binidx_by_hand(prefix, docs, code=8, dtype="<u2"):
    """An independent MMIDIDX writer (the test's own, straight from the header layout)."""
    docs = [np.asarray(d, dtype=dtype) for d in docs]
    sizes = np.array([len(d) for d in docs], "<i4")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(len(docs), "<i8")
    off = 0
    for i, d in enumerate(docs):
        pointers[i] = off
        off += len(d) * itemsize
    doc_idx = np.arange(len(docs) + 1, dtype="<i8")
    header = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + \
        struct.pack("<Q", len(docs)) + struct.pack("<Q", len(doc_idx))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(header + sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(d.tobytes())


# ------------------------------------------------------------------ formats round trip

def test_text_round_trip(tmp_path):
    text = "To be, or not to be: that is the question.\nÆsop — ünïcödé ✓\n"
    path = tmp_path / "a.txt"
    path.write_text(text, encoding="utf-8")
    data = load_tokens(path)
    assert data.format == "text" and data.vocab_size == 256
    assert bytes(np.asarray(data.tokens)) == text.encode("utf-8")


def test_npy_round_trip(tmp_path):
    for dtype in (np.uint16, np.uint32):
        arr = np.arange(1000, dtype=dtype) * 3
        path = tmp_path / f"t_{np.dtype(dtype).name}.npy"
        np.save(path, arr)
        data = load_tokens(path, vocab_size=3000)
        assert data.format == "npy" and isinstance(data.tokens, np.memmap)
        np.testing.assert_array_equal(data.tokens, arr)
        assert data.max_token() == 2997


def test_raw_bin_round_trip(tmp_path):
    for width, dtype in ((2, "<u2"), (4, "<u4")):
        arr = (np.arange(777) * 7919 % (60000 if width == 2 else 200000)).astype(dtype)
        path = tmp_path / f"w{width}.bin"
        arr.tofile(path)
        data = load_tokens(path, token_width=width)
        assert data.format == "raw" and isinstance(data.tokens, np.memmap)
        np.testing.assert_array_equal(data.tokens, arr)


@pytest.mark.parametrize("writer", ["by_hand", "module"])
def test_binidx_round_trip(tmp_path, writer):
    rng = seeded_rng(0)
    docs = [rng.integers(0, 65535, n) for n in (5, 17, 1, 300, 42)]
    prefix = tmp_path / "corpus_text_document"
    if writer == "by_hand":
        write_binidx_by_hand(prefix, docs)
    else:
        write_binidx(prefix, docs, dtype=np.uint16)
    flat = np.concatenate(docs)
    for arg in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
        data = load_tokens(arg)
        assert data.format == "binidx"
        np.testing.assert_array_equal(data.tokens, flat)
    index = read_binidx_index(f"{prefix}.idx")
    assert index["dtype"] == np.dtype("<u2")
    np.testing.assert_array_equal(index["sizes"], [5, 17, 1, 300, 42])
    np.testing.assert_array_equal(index["pointers"], np.array([0, 5, 22, 23, 323]) * 2)
    np.testing.assert_array_equal(index["doc_idx"], np.arange(6))


def test_binidx_other_dtypes(tmp_path):
    docs = [np.arange(10), np.arange(20) + 100]
    write_binidx_by_hand(tmp_path / "c", docs, code=4, dtype="<i4")
    np.testing.assert_array_equal(load_tokens(tmp_path / "c").tokens, np.concatenate(docs))
    write_binidx(tmp_path / "d", docs, dtype=np.uint8)
    np.testing.assert_array_equal(load_tokens(tmp_path / "d").tokens, np.concatenate(docs))


def test_detect_format(tmp_path):
    (tmp_path / "x.txt").write_text("hello")
    assert detect_format(tmp_path / "x.txt")[0] == "text"
    (tmp_path / "y.bin").write_bytes(b"\0\0")
    assert detect_format(tmp_path / "y.bin")[0] == "raw"


# ------------------------------------------------------------------ bad data

def test_empty_files(tmp_path):
    for name in ("e.txt", "e.bin", "e.npy"):
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(ValueError, match="empty"):
            load_tokens(tmp_path / name, token_width=2)
    np.save(tmp_path / "z.npy", np.zeros(0, np.uint16))
    with pytest.raises(ValueError, match="empty"):
        load_tokens(tmp_path / "z.npy")
    write_binidx_by_hand(tmp_path / "eb", [])
    with pytest.raises(ValueError):
        load_tokens(tmp_path / "eb")


def test_shorter_than_one_sequence(tmp_path):
    (tmp_path / "s.txt").write_text("abcdefgh")  # 8 tokens
    data = load_tokens(tmp_path / "s.txt")
    with pytest.raises(ValueError, match="shorter than one training sequence"):
        split_train_val(data.tokens, seq_len=8)          # needs 9
    with pytest.raises(ValueError, match="shorter than one training sequence"):
        BatchSampler(data.tokens, 2, 8)
    train, val = split_train_val(data.tokens, seq_len=7)  # exactly one window: no validation
    assert len(train) == 8 and val is None


def test_size_not_multiple_of_width(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="not a multiple of the token width 2"):
        load_tokens(tmp_path / "odd.bin", token_width=2)
    (tmp_path / "six.bin").write_bytes(b"\x01\x00\x02\x00\x03\x00")
    with pytest.raises(ValueError, match="not a multiple of the token width 4"):
        load_tokens(tmp_path / "six.bin", token_width=4)


def test_raw_bin_needs_width(tmp_path):
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02\x00")
    with pytest.raises(ValueError, match="token-width"):
        load_tokens(tmp_path / "t.bin")
    with pytest.raises(ValueError, match="token width must be 2"):
        load_tokens(tmp_path / "t.bin", token_width=3)


@pytest.mark.parametrize("name, content, match", [
    ("data.csv", b"1,2,3", "unknown data format"),
    ("nope.txt", None, "not found"),
    ("lonely.idx", b"MMIDIDX\x00\x00", "without its data file"),
    ("bad.txt", b"ok \xff\xfe bad", "UTF-8"),
    ("f.npy", np.ones(10, np.float32), "integer"),
    ("2d.npy", np.ones((2, 5), np.uint16), "1-D"),
    ("neg.npy", np.array([1, -2, 3], np.int32), "negative"),
    ("junk.npy", b"not numpy at all", ".npy"),
], ids=["unknown_format", "missing", "idx_without_bin", "bad_utf8", "float_npy", "2d_npy", "negative_npy",
        "junk_npy"])
def test_bad_file(tmp_path, name, content, match):
    """A file written as ``content`` (bytes, an array saved as .npy, or None: no file) is refused."""
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        np.save(path, content)
    with pytest.raises(ValueError, match=match):
        load_tokens(path)


def test_token_ids_out_of_vocab(tmp_path):
    np.save(tmp_path / "t.npy", np.array([1, 2, 300], np.uint16))
    with pytest.raises(ValueError, match="token id 300 is out of range"):
        load_tokens(tmp_path / "t.npy", vocab_size=256)
    load_tokens(tmp_path / "t.npy", vocab_size=301)
    (tmp_path / "a.txt").write_text("abc")
    with pytest.raises(ValueError, match="256"):
        load_tokens(tmp_path / "a.txt", vocab_size=100)


def test_corrupt_binidx(tmp_path):
    write_binidx_by_hand(tmp_path / "c", [np.arange(10), np.arange(5)])
    idx = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "m.idx").write_bytes(b"XXIDIDX\x00\x00" + idx[9:])
    (tmp_path / "m.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    with pytest.raises(ValueError, match="magic"):
        load_tokens(tmp_path / "m")
    (tmp_path / "v.idx").write_bytes(idx[:9] + struct.pack("<Q", 2) + idx[17:])
    (tmp_path / "v.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    with pytest.raises(ValueError, match="version"):
        load_tokens(tmp_path / "v")
    (tmp_path / "d.idx").write_bytes(idx[:17] + b"\x63" + idx[18:])
    (tmp_path / "d.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    with pytest.raises(ValueError, match="dtype code"):
        load_tokens(tmp_path / "d")
    (tmp_path / "t.idx").write_bytes(idx[:40])
    (tmp_path / "t.bin").write_bytes((tmp_path / "c.bin").read_bytes())
    with pytest.raises(ValueError, match="truncated"):
        load_tokens(tmp_path / "t")
    (tmp_path / "s.idx").write_bytes(idx)
    (tmp_path / "s.bin").write_bytes((tmp_path / "c.bin").read_bytes()[:20])
    with pytest.raises(ValueError, match="index says 15"):
        load_tokens(tmp_path / "s")


# ------------------------------------------------------------------ split and sampling

def test_split_and_eval_batches():
    tokens = np.arange(10_000, dtype=np.uint16)
    train, val = split_train_val(tokens, seq_len=64, val_fraction=0.1)
    assert len(train) == 9000 and len(val) == 1000
    np.testing.assert_array_equal(np.concatenate([train, val]), tokens)
    batches = eval_batches(val, batch_size=4, seq_len=64, max_batches=3)
    assert len(batches) == 3
    for x, y in batches:
        assert x.shape == y.shape == (4, 64) and x.dtype == np.int64
        np.testing.assert_array_equal(y, x + 1)     # consecutive ids: targets are the next tokens
        assert x.min() >= 9000
    again = eval_batches(val, 4, 64, 3)
    for (a, _), (b, _) in zip(batches, again):
        np.testing.assert_array_equal(a, b)
    # tiny validation region: still full batches (overlapping windows)
    small = eval_batches(np.arange(70), 4, 64, 2)
    assert len(small) == 1 and small[0][0].shape == (4, 64)
    _, none = split_train_val(tokens, seq_len=64, val_fraction=0.0)
    assert none is None


def test_sampler_windows_and_state():
    tokens = np.arange(5000, dtype=np.uint32)
    s = BatchSampler(tokens, batch_size=3, seq_len=16, seed=7)
    x, y = s.next()
    assert x.shape == y.shape == (3, 16) and x.dtype == np.int64
    np.testing.assert_array_equal(y, x + 1)
    np.testing.assert_array_equal(x[:, 1:], x[:, :-1] + 1)
    assert x.min() >= 0 and y.max() <= 4999
    state = json.loads(json.dumps(s.state()))   # JSON-able, survives a checkpoint's metadata
    want = [s.next() for _ in range(3)]
    s2 = BatchSampler(tokens, 3, 16, seed=123)
    s2.set_state(state)
    for (a, b), (c, d) in zip(want, (s2.next() for _ in range(3))):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    fresh = BatchSampler(tokens, 3, 16, seed=7)
    np.testing.assert_array_equal(fresh.next()[0], x)
    with pytest.raises(ValueError):
        s.set_state({"bit_generator": "MT19937"})


def test_sampler_covers_last_window():
    tokens = np.arange(20)
    s = BatchSampler(tokens, batch_size=256, seq_len=18, seed=0)  # starts in {0, 1}
    x, y = s.next()
    assert set(x[:, 0]) == {0, 1} and y.max() == 19


# ------------------------------------------------------------------ the embedded corpus

def test_embedded_corpus():
    path = default_corpus_path()
    raw = path.read_bytes()
    assert 100_000 < len(raw) <= 2 * 1024 * 1024
    raw.decode("utf-8")
    assert hashlib.sha256(raw).hexdigest() == \
        "5a9089baf9d140f6a221c1f010b2aa23ef569a36288296a35ec524ec9483bb44"   # as rwkvx/data/README.md
    assert (path.parent / "README.md").is_file()
    data = load_tokens(None)
    assert data.format == "text" and len(data) == len(raw)
    assert unigram_entropy(data.tokens, 256) == pytest.approx(3.3058, abs=1e-4)


@pytest.mark.parametrize("n, batch, T, batches",
                         [(33, 2, 32, 4), (279, 2, 32, 4), (5000, 8, 64, 4), (100, 1, 10, 3)])
def test_scored_tokens_counts_distinct_targets(n, batch, T, batches):
    tokens = np.arange(n)
    scored = set()
    for _, targets in eval_batches(tokens, batch, T, batches):
        scored.update(targets.ravel().tolist())
    assert scored_tokens(n, batch, T, batches) == len(scored)
