"""``train --init-from`` (fine-tune a loaded model, or upgrade RWKV-7 to RWKV-X) and ``export`` (an
RWKV-LM .pth) on the CPU oracle, from a .pth fixture written by torch.save."""
import json
from pathlib import Path

import numpy as np
import pytest

from rwkvx import Config, load_checkpoint
from rwkvx.cli import main
from rwkvx.pth import read_pth

from seeding import seeded_rng

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PTH = FIXTURES / "rwkv7_tiny_bf16.pth"
# What scripts/make_pth_fixtures.py writes: V=16, C=8, N=4, L=2, FFN 24, LoRA ranks 4, 2, 6, 10.
FIXTURE_CFG = Config(vocab_size=16, n_embd=8, head_size=4, n_rwkv_layer=2, ffn_dim=24,
                     dim_w=4, dim_a=2, dim_v=6, dim_g=10)
RUN = ["--device", "cpu", "--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--no-progress"]


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, seeded_rng(0).integers(0, 16, 4000).astype(np.uint16))
    return str(path)


def _fixture_params():
    return {"rwkv." + k: v for k, v in read_pth(PTH)[0].items()
            if k not in ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2")}


def assert_bf16_nearest(x, y):
    """y is x rounded to the nearest bf16 value (bit patterns and bf16 spacing, no rounding routine)."""
    x, y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
    assert not (y.view(np.uint32) & 0xFFFF).any()
    _, exp = np.frexp(x)
    assert np.all(np.abs(x.astype(np.float64) - y) <= np.ldexp(1.0, exp - 9))


def test_pth_loads_trains_and_exports_back(tmp_path, tokens, capsys):
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(PTH), "--data", tokens, *RUN, "--steps", "3",
                 "--out", str(run)]) == 0
    assert f"initialised from {PTH}" in capsys.readouterr().out
    cfg, trained, _ = load_checkpoint(run / "checkpoint.safetensors")
    assert cfg == Config(**{**FIXTURE_CFG.to_dict(), "moba_chunk_size": 32, "moba_top_k": 2})  # tiny preset's
    start = _fixture_params()
    assert set(trained) == set(start)
    assert all(np.isfinite(v).all() for v in trained.values())
    assert any(not np.array_equal(trained[k], start[k]) for k in start)        # it trained
    assert json.loads((run / "run.json").read_text())["run"]["init_from"] == str(PTH)

    # resume the fine-tuning run: the source is remembered
    assert main(["train", "--resume", str(run), "--steps", "4", "--device", "cpu", "--no-progress"]) == 0
    assert json.loads((run / "run.json").read_text())["run"]["init_from"] == str(PTH)
    _, trained, _ = load_checkpoint(run / "checkpoint.safetensors")

    for dtype in ("fp32", "bf16"):
        out = tmp_path / f"model_{dtype}.pth"
        assert main(["export", "--ckpt", str(run), "--out", str(out), "--dtype", dtype]) == 0
        assert f"-> {out} ({dtype}" in capsys.readouterr().out
        assert {k: v.shape for k, v in read_pth(out)[0].items()} == \
            {k: v.shape for k, v in read_pth(PTH)[0].items()}                  # the source's layout
        cfg2, back, _ = load_checkpoint(out)
        assert cfg2 == FIXTURE_CFG and set(back) == set(trained)
        for k in trained:
            if dtype == "fp32":
                np.testing.assert_array_equal(back[k], trained[k], err_msg=k)
            else:
                assert_bf16_nearest(trained[k], back[k])


def test_init_from_upgrades_rwkv7_to_rwkvx(tmp_path, tokens, capsys):
    """--n-attn-layer 1 on the 2-block RWKV-7 fixture: attention block 0 follows RWKV blocks 0 and 1
    (docs/SPEC.md §2.2), so it starts as a copy of block 1's ln1/ln2, r/k/v/o and channel mix. A learning rate
    of 1e-9 leaves the trained values within 1e-6 of where they started."""
    run = tmp_path / "x"
    assert main(["train", "--init-from", str(PTH), "--n-attn-layer", "1", "--chunk", "4", "--top-k", "2",
                 "--data", tokens, *RUN, "--steps", "1", "--lr", "1e-9", "--lr-min", "0",
                 "--warmup", "0", "--out", str(run)]) == 0
    capsys.readouterr()
    cfg, params, _ = load_checkpoint(run / "checkpoint.safetensors")
    assert cfg == Config(**{**FIXTURE_CFG.to_dict(), "n_attn_layer": 1, "moba_chunk_size": 4,
                            "moba_top_k": 2})
    start = _fixture_params()
    for k, v in start.items():
        np.testing.assert_allclose(params[k], v, atol=1e-6, err_msg=k)
    copied = ["ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "att.receptance.weight", "att.key.weight",
              "att.value.weight", "att.output.weight", "ffn.x_k", "ffn.key.weight", "ffn.value.weight"]
    assert sorted(k for k in params if k.startswith("moba.")) == sorted("moba.0." + n for n in copied)
    for n in copied:
        np.testing.assert_allclose(params["moba.0." + n], start["rwkv.blocks.1." + n], atol=1e-6, err_msg=n)

    out = tmp_path / "m.pth"
    with pytest.raises(SystemExit) as exc:
        main(["export", "--ckpt", str(run), "--out", str(out)])
    assert exc.value.code == 2 and "--drop-attention" in capsys.readouterr().err
    assert not out.exists()
    assert main(["export", "--ckpt", str(run), "--out", str(out), "--drop-attention", "--dtype", "fp32"]) == 0
    assert "without its 1 attention block" in capsys.readouterr().out
    cfg2, back, _ = load_checkpoint(out)
    assert cfg2 == FIXTURE_CFG
    for k, v in back.items():
        np.testing.assert_array_equal(v, params[k], err_msg=k)


def _fails(capsys, tmp_path, argv, message):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not out.exists()


def test_init_from_errors_write_nothing(tmp_path, tokens, capsys):
    hybrid = tmp_path / "hybrid"
    assert main(["train", "--init-from", str(PTH), "--n-attn-layer", "1", "--chunk", "4", "--data", tokens,
                 *RUN, "--steps", "1", "--out", str(hybrid)]) == 0
    capsys.readouterr()
    base = ["train", "--init-from", str(PTH), "--data", tokens, *RUN, "--steps", "1"]
    for extra, message in [
        (["--n-embd", "16"], "--n-embd 16 (the checkpoint has 8)"),
        (["--vocab-size", "256"], "--vocab-size 256 (the checkpoint has 16)"),
        (["--n-layer", "3", "--ffn-dim", "32"], "--n-layer 3 (the checkpoint has 2); --ffn-dim 32 (the "
                                                "checkpoint has 24)"),
        (["--head-size", "8"], "--head-size 8 (the checkpoint has 4)"),
        (["--n-attn-layer", "3"], "--n-attn-layer 3 must be <= --n-layer 2"),
        (["--resume", str(hybrid)], "give one"),
    ]:
        _fails(capsys, tmp_path, [*base, *extra], message)
    for argv, message in [
        (["train", "--init-from", str(hybrid), "--n-attn-layer", "2", "--data", tokens, *RUN],
         "--n-attn-layer 2 (the checkpoint has 1)"),
        (["train", "--init-from", str(tmp_path / "nothere.pth"), *RUN], "checkpoint not found"),
        (["train", "--init-from", str(FIXTURES / "bad_global.pth"), "--data", tokens, *RUN],
         "a checkpoint must not run code"),
        (["train", "--init-from", str(PTH), *RUN], "the model's vocab_size must be 256, got 16"),   # the embedded corpus, V=16
    ]:
        _fails(capsys, tmp_path, argv, message)


def test_export_errors_write_nothing(tmp_path, capsys):
    existing = tmp_path / "exists.pth"
    existing.write_bytes(b"keep me")
    for argv, message in [
        (["export", "--ckpt", str(PTH), "--out", str(existing)], "exists"),
        (["export", "--ckpt", str(tmp_path / "none"), "--out", str(tmp_path / "o.pth")], "checkpoint not found"),
        (["export", "--ckpt", str(FIXTURES / "int_value.pth"), "--out", str(tmp_path / "o.pth")],
         "not a tensor"),
        (["export", "--ckpt", str(PTH), "--out", str(tmp_path / "o.pth"), "--dtype", "fp16"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err
    assert existing.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.pth"]
