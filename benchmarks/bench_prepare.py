"""``prepare`` throughput: MB of UTF-8 text per second tokenised with the World tokenizer and written
as binidx (read, UTF-8 check, tokenise, write, fsync), for one large text file and for .jsonl documents.

Input: the embedded corpus repeated to 8 MB, plus a mixed-script line so multi-byte characters are
timed too. ``benchmark.extra_info["MB/s"]`` holds the throughput of the mean run.
"""
import json

import pytest

from rwkvx.data import default_corpus_path
from rwkvx.data.text import prepare_binidx
from rwkvx.tokenizer import get_tokenizer

TARGET_BYTES = 8 * 10**6


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepare")
    base = default_corpus_path().read_text(encoding="utf-8") + "Ünïcödé ✓ 今天是美好的一天。 Ελληνικά\n"
    text = base * (TARGET_BYTES // len(base.encode("utf-8")) + 1)
    (folder / "corpus.txt").write_text(text, encoding="utf-8")
    docs = [text[i:i + 4000] for i in range(0, len(text), 4000)]       # ~4 KB documents
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs)
    get_tokenizer("world")                                             # built once, not timed
    return folder


@pytest.mark.parametrize("name", ["corpus.txt", "corpus.jsonl"])
def test_prepare_throughput(benchmark, inputs, name):
    src = inputs / name
    stats = benchmark.pedantic(prepare_binidx, args=(src, inputs / "out", get_tokenizer("world")),
                               rounds=3, iterations=1)
    assert stats.tokens > src.stat().st_size // 8
    benchmark.extra_info["MB/s"] = round(src.stat().st_size / 1e6 / benchmark.stats.stats.mean, 1)
    benchmark.extra_info["tokens"] = stats.tokens
