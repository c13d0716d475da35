"""``python -m rwkvx prepare``, ``--tokenizer`` for train and sample, and their errors (nothing written)."""
import io
import json

import pytest
from seeding import seeded_rng
from test_cli import TINY, _fails

from rwkvx.checkpoint import load_checkpoint
from rwkvx.cli import TokenEcho, UsageError, encode_prompt, main
from rwkvx.data import default_corpus_path, load_tokens
from rwkvx.tokenizer import get_tokenizer

PROMPT = "ROMEO: Ünï"


def _corpus(chars):
    return default_corpus_path().read_text(encoding="utf-8")[:chars]


def _run_meta(run_dir):
    cfg, _, extra = load_checkpoint(run_dir / "checkpoint.safetensors")
    return cfg, extra["meta"]["user"]["run"]


def test_prepare_then_train_and_sample_world(tmp_path, capsys):
    text = _corpus(30_000)
    docs = [text[i:i + 3000] for i in range(0, len(text), 3000)]
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    prefix = tmp_path / "world"
    assert main(["prepare", "--data", str(tmp_path / "docs.jsonl"), "--out", str(prefix),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    world = get_tokenizer("world")
    n = sum(len(world.encode(d)) + 1 for d in docs)
    assert f"{n:,} tokens in {len(docs)} document(s)" in printed and "MB/s" in printed
    assert len(load_tokens(prefix)) == n

    run = tmp_path / "run"       # vocab_size comes from the tokenizer (the preset's is 256)
    assert main(["train", *TINY, "--data", str(prefix), "--tokenizer", "world", "--steps", "2",
                 "--out", str(run)]) == 0
    assert "[binidx, world tokenizer]" in capsys.readouterr().out
    cfg, info = _run_meta(run)
    assert cfg.vocab_size == 65536 and info["tokenizer"] == "world"

    assert main(["sample", "--ckpt", str(run), "--prompt", PROMPT, "--tokens", "8",
                 "--temperature", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROMPT) and out.endswith("\n") and "\ufffd" not in out[:len(PROMPT)]

    # text tokenised at the start of training: the same ids as prepare writes
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    assert main(["train", *TINY, "--data", str(tmp_path / "a.txt"), "--tokenizer", "world",
                 "--steps", "1", "--eval-every", "0", "--out", str(tmp_path / "run2")]) == 0
    printed = capsys.readouterr().out
    assert f"[text, world tokenizer], {len(world.encode(text)) + 1:,} tokens" in printed
    assert _run_meta(tmp_path / "run2")[1]["tokenizer"] == "world"


def test_tokenizer_errors_write_nothing(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(_corpus(5000), encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    data = ["--data", str(tmp_path / "a.txt")]
    for argv, message in [
        (["train", *TINY, "--tokenizer", "gpt2"], "invalid choice: 'gpt2' (choose from 'bytes', 'world')"),
        (["train", *TINY, *data, "--tokenizer", "world", "--vocab-size", "300"],
         "--tokenizer world has 65536 token ids: the model's vocab_size must be 65536, got 300"),
        (["train", *TINY, *data, "--vocab-size", "512"], "vocab_size must be 256, got 512"),
        (["train", *TINY, "--data", str(tmp_path / "bad.jsonl"), "--tokenizer", "world"],
         'bad.jsonl:2: not a JSON object with a "text" string'),
        (["sample", "--ckpt", str(tmp_path), "--tokenizer", "gpt2"], "invalid choice: 'gpt2'"),
    ]:
        _fails(capsys, tmp_path, argv, message)
    before = sorted(p.name for p in tmp_path.iterdir())
    for argv, message in [
        (["prepare", *data, "--out", str(tmp_path / "p"), "--tokenizer", "gpt2"],
         "invalid choice: 'gpt2' (choose from 'bytes', 'world')"),
        (["prepare", "--data", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "p")],
         "bad.jsonl:2: not a JSON object"),
        (["prepare", "--data", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "p")],
         "not found"),
        (["prepare", *data], "the following arguments are required: --out"),
    ]:
        _fails(capsys, tmp_path, argv, message)
        assert sorted(p.name for p in tmp_path.iterdir()) == before

    assert main(["prepare", *data, "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    capsys.readouterr()
    old = (tmp_path / "p.bin").read_bytes()
    _fails(capsys, tmp_path, ["prepare", *data, "--out", str(tmp_path / "p")], "p.bin already exists")
    assert (tmp_path / "p.bin").read_bytes() == old

    run = tmp_path / "r"
    assert main(["train", *TINY, *data, "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert _run_meta(run)[1]["tokenizer"] == "bytes"
    _fails(capsys, tmp_path, ["train", "--resume", str(run), "--tokenizer", "world", "--steps", "2",
                              "--device", "cpu"], "--tokenizer cannot change a resumed run")


def test_sample_prompt_errors_before_any_output(tmp_path, capsys):
    from rwkvx.data import write_binidx

    write_binidx(tmp_path / "toks", [seeded_rng(0).integers(0, 500, 400)])
    run = tmp_path / "r"
    assert main(["train", *TINY, "--data", str(tmp_path / "toks"), "--vocab-size", "512",
                 "--steps", "1", "--out", str(run)]) == 0
    capsys.readouterr()
    assert _run_meta(run)[1]["tokenizer"] is None                  # token ids of no named tokenizer
    for argv, message in [
        (["--prompt", "1 600"], "prompt token id 600 is out of range [0, 512)"),
        (["--prompt", "5, -3"], "prompt token id -3 is out of range [0, 512)"),
        (["--prompt", "hello"], "give --prompt as token ids"),
        (["--tokenizer", "bytes"], "the bytes tokenizer has 256 token ids but the model's vocab_size is 512"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["sample", "--ckpt", str(run), "--device", "cpu", *argv])
        captured = capsys.readouterr()
        assert exc.value.code == 2 and message in captured.err and captured.out == ""


def test_sample_checkpoints_without_a_tokenizer_record(tmp_path, capsys):
    """Weights-only checkpoints (older runs, converted models): bytes when V = 256, else ids, unless
    --tokenizer names one."""
    from rwkvx import Config, init_params, save_checkpoint

    for V in (256, 65536):
        cfg = Config(vocab_size=V, n_embd=32, n_rwkv_layer=1, head_size=16)
        save_checkpoint(tmp_path / f"v{V}.safetensors", cfg, init_params(cfg, 0))
    sample = ["sample", "--tokens", "3", "--device", "cpu", "--ckpt"]
    assert main([*sample, str(tmp_path / "v256.safetensors"), "--prompt", "hi ✓"]) == 0
    assert capsys.readouterr().out.startswith("hi ✓")
    assert main([*sample, str(tmp_path / "v65536.safetensors"), "--prompt", "7 8"]) == 0
    ids = capsys.readouterr().out.split()
    assert ids[:2] == ["7", "8"] and len(ids) == 5 and all(0 <= int(i) < 65536 for i in ids)
    assert main([*sample, str(tmp_path / "v65536.safetensors"), "--prompt", PROMPT,
                 "--tokenizer", "world"]) == 0
    assert capsys.readouterr().out.startswith(PROMPT)


def test_encode_prompt_and_echo():
    world = get_tokenizer("world")
    assert encode_prompt("Today", world, 65536) == [33520]
    assert encode_prompt("", world, 65536) == [11]                  # a newline
    assert encode_prompt("", get_tokenizer("bytes"), 256) == [10]
    assert encode_prompt("1, 2 3", None, 10) == [1, 2, 3] and encode_prompt("", None, 10) == [0]
    with pytest.raises(UsageError, match="prompt token id 33520 is out of range"):
        encode_prompt("Today", world, 1000)
    with pytest.raises(UsageError, match="--prompt is not valid text"):
        encode_prompt(b"caf\xe9".decode("utf-8", "surrogateescape"), world, 65536)  # argv of bad bytes

    out = io.StringIO()
    echo = TokenEcho(out, world)
    echo.prompt("Hi", [12, 13])
    echo.write([196])                                   # the first byte of "é" alone: held back
    assert out.getvalue() == "Hi"
    echo.write([170, 0, 33520])                         # its second byte, end of document, "Today"
    echo.close()
    assert out.getvalue() == "HiéToday\n"
    out = io.StringIO()
    echo = TokenEcho(out, None)
    echo.prompt("", [4, 5])
    echo.write([6])
    echo.close()
    assert out.getvalue() == "4 5 6\n"
