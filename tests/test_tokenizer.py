"""Tokenizers: the World tokenizer against an independent greedy reference, known ids, round trips,
chunked (streaming) encoding, decoding as text streams, and clear errors."""
import numpy as np
import pytest

from rwkvx._trie import ByteTrie
from rwkvx.tokenizer import (TOKENIZERS, TextStream, get_tokenizer, read_vocab, tokenizer_class,
                             world_vocab_path)

from seeding import seeded_rng

SAMPLES = ["", "a", "\n", "ROMEO: But, soft! what light through yonder window breaks?\n\n",
           "Today is a beautiful day. 今天是美好的一天。", "Ünïcödé — ✓ 🙂 Ελληνικά русский 日本語",
           "    indented\tcode();\r\n" + " " * 200 + "#" * 90, "\x00\x01 control \x7f"]


@pytest.fixture(scope="module")
def world():
    return get_tokenizer("world")


def greedy_reference(entries):
    """A greedy longest-match tokenizer written independently of the trie: at each position try the
    vocabulary's byte strings from the longest possible length down (a dict lookup per length)."""
    entries = dict(entries)
    longest = max(map(len, entries))

    def encode(data: bytes) -> list[int]:
        ids, pos = [], 0
        while pos < len(data):
            for n in range(min(longest, len(data) - pos), 0, -1):
                tid = entries.get(data[pos:pos + n])
                if tid is not None:
                    ids.append(tid)
                    pos += n
                    break
            else:
                raise ValueError(f"no entry at {pos}")
        return ids
    return encode


@pytest.fixture(scope="module")
def reference():
    return greedy_reference(read_vocab(world_vocab_path()))


def test_trie_matches_reference_on_random_vocabularies():
    rng = seeded_rng(2)
    for _ in range(20):
        alphabet = list(b"abc\x00\xff")
        words = {bytes([c]) for c in alphabet}
        words |= {bytes(rng.choice(alphabet, rng.integers(2, 9)).tolist())
                  for _ in range(rng.integers(1, 60))}
        entries = [(w, int(i)) for w, i in zip(words, rng.permutation(65536)[:len(words)])]
        trie, reference = ByteTrie(entries), greedy_reference(entries)
        for _ in range(20):
            data = bytes(rng.choice(alphabet, rng.integers(0, 200)).tolist())
            ids, used = trie.encode(data)
            assert used == len(data) and ids.tolist() == reference(data)


def test_world_vocabulary_file():
    raw = world_vocab_path().read_bytes()
    # lines of the file itself (CRLF-terminated in the rwkv package) and the ids they give
    for line in (b"11 '\\n' 1", b"196 b'\\xc3' 1", b"22590 ' the' 4", b"33520 'Today' 5",
                 b"37273 ' Romeo' 6"):
        assert b"\n" + line + b"\r\n" in raw, line
    entries = read_vocab(world_vocab_path())
    ids = sorted(tid for _, tid in entries)
    assert ids == list(range(1, 65530))                      # 65,529 entries, 0 is not one
    assert {b for b, _ in entries} >= {bytes([i]) for i in range(256)}
    assert tokenizer_class("world").vocab_size == 65536 and tokenizer_class("world").eod == 0


def test_known_ids(world):
    for text, tid in (("\n", 11), (" the", 22590), ("Today", 33520), (" Romeo", 37273)):
        assert world.encode(text).tolist() == [tid]
    assert world.encode_bytes(b"\xc3")[0].tolist() == [196]
    # the example in the README of the `rwkv-tokenizer` package (an independent Rust implementation)
    assert world.encode("Today is a beautiful day. 今天是美好的一天。").tolist() == [
        33520, 4600, 332, 59219, 21509, 47, 33, 10381, 11639, 13091, 15597, 11685, 14734, 10250,
        11639, 10080]


def test_world_matches_reference_and_round_trips(world, reference):
    rng = seeded_rng(0)
    corpus = (get_corpus_text()[:200_000]).encode("utf-8")
    cases = [s.encode("utf-8") for s in SAMPLES]
    cases += [corpus[s:s + rng.integers(1, 3000)] for s in rng.integers(0, len(corpus) - 3000, 30)]
    cases += [rng.integers(0, 256, rng.integers(1, 500)).astype(np.uint8).tobytes() for _ in range(30)]
    for data in cases:
        ids, used = world.encode_bytes(data)
        assert used == len(data) and ids.dtype == np.uint16
        assert ids.tolist() == reference(data)
        assert world.decode_bytes(ids) == data
    for text in SAMPLES:
        assert world.decode(world.encode(text)) == text


def get_corpus_text() -> str:
    from rwkvx.data import default_corpus_path
    return default_corpus_path().read_text(encoding="utf-8")


@pytest.mark.parametrize("name", TOKENIZERS)
def test_chunked_encoding_equals_whole(name):
    tok = get_tokenizer(name)
    rng = seeded_rng(1)
    data = (get_corpus_text()[:20_000] + "".join(SAMPLES) * 3).encode("utf-8")
    whole = tok.encode_bytes(data)[0].tolist()
    for _ in range(5):
        cuts = np.sort(rng.integers(0, len(data), 40))
        ids, carry, start = [], b"", 0
        for cut in [*cuts, len(data)]:
            buf = carry + data[start:cut]
            part, used = tok.encode_bytes(buf, final=cut == len(data))
            ids += part.tolist()
            carry, start = buf[used:], cut
        assert carry == b"" and ids == whole


def test_bytes_tokenizer():
    tok = get_tokenizer("bytes")
    assert (tok.vocab_size, tok.eod) == (256, None)
    text = "héllo ✓"
    assert tok.encode(text).tolist() == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text


def test_text_stream_holds_split_characters(world):
    by = TextStream(get_tokenizer("bytes"))
    assert [by.feed([b]) for b in "é✓".encode("utf-8")] == ["", "é", "", "", "✓"]
    assert by.close() == ""
    ws = TextStream(world)
    # "é" as its two single-byte World tokens (ids = byte + 1, lines "196 b'\xc3' 1", "170 b'\xa9' 1")
    assert ws.feed([196]) == "" and ws.feed([170]) == "é"
    assert ws.feed([196]) == "" and ws.close() == "\ufffd"       # an incomplete character at the end
    assert world.decode([0, 33520, 0]) == "Today"                 # end of document: nothing


def test_errors(world):
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'; known tokenizers: bytes, world"):
        get_tokenizer("gpt2")
    for tok in (world, get_tokenizer("bytes")):
        with pytest.raises(ValueError, match=f"token id {tok.vocab_size} is out of range"):
            tok.decode([1, tok.vocab_size])
        with pytest.raises(ValueError, match="out of range"):
            tok.decode([-1])
    with pytest.raises(ValueError, match="duplicate"):
        ByteTrie([(b"a", 1), (b"a", 2)])
    with pytest.raises(ValueError, match="non-empty bytes"):
        ByteTrie([(b"", 1)])
    with pytest.raises(ValueError, match="outside"):
        ByteTrie([(b"a", 65536)])
    trie = ByteTrie([(b"a", 1), (b"ab", 2)])
    assert trie.encode(b"aba")[0].tolist() == [2, 1]
    with pytest.raises(ValueError, match="byte 0x63 at offset 2 starts no vocabulary entry"):
        trie.encode(b"abc")


def test_read_vocab_rejects_malformed_files(tmp_path):
    for body, message in [("1 'a' 1\n2 'bc' 3\n", ":2: entry 'bc' is not 3 bytes"),
                          ("1 'a' 1\nnonsense\n", ":2: not an 'ID REPR LENGTH'"),
                          ("1 'a' 1\n1 'b' 1\n", ":2: duplicate id 1"),
                          ("1 'a 1\n", ":1: not an 'ID REPR LENGTH'")]:
        path = tmp_path / "v.txt"
        path.write_text(body, encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            read_vocab(path)
