"""Checkpoints: exact round trip, RWKV-7 names, and clear errors on bad files."""
import json
import struct

import numpy as np
import pytest

from rwkvx import Config, init_params, load_checkpoint, save_checkpoint
from rwkvx.checkpoint import _encode

from seeding import seeded_rng

CFG = Config(vocab_size=50, n_embd=32, head_size=8, n_rwkv_layer=3, n_attn_layer=1,
             moba_chunk_size=4, moba_top_k=2)


def write_raw(path, tensors, metadata=None):
    header, arrays = _encode(tensors, metadata or {})
    with open(path, "wb") as f:
        f.write(header)
        for a in arrays:
            f.write(a.tobytes())


def test_round_trip_exact(tmp_path):
    rng = seeded_rng(0)
    params = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in init_params(CFG, 1).items()}
    extra = {"tensors": {"adam.m.rwkv.emb.weight": rng.standard_normal((50, 32))},
             "meta": {"step": 12, "lr": 3e-4}}
    path = tmp_path / "ck.safetensors"
    save_checkpoint(path, CFG, params, extra)
    cfg, loaded, loaded_extra = load_checkpoint(path)
    assert cfg == CFG
    assert all(np.array_equal(params[k], loaded[k]) for k in params)
    assert loaded_extra["meta"] == extra["meta"]
    np.testing.assert_array_equal(loaded_extra["tensors"]["adam.m.rwkv.emb.weight"],
                                  extra["tensors"]["adam.m.rwkv.emb.weight"])
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_rwkv7_state_dict_names_load(tmp_path):
    cfg = Config(vocab_size=50, n_embd=32, head_size=8, n_rwkv_layer=2)
    params = init_params(cfg, 2)
    plain = {k[len("rwkv."):]: v for k, v in params.items()}
    plain["blocks.0.att.v0"] = np.zeros((1, 1, 32), np.float32)
    plain["blocks.0.att.v1"] = np.zeros((32, 32), np.float32)
    plain["blocks.0.att.v2"] = np.zeros((32, 32), np.float32)
    # bf16 as real RWKV checkpoints store it: the top half of the float32 bits
    bf16 = {k: v.view(np.uint32) >> 16 for k, v in plain.items()}
    path = tmp_path / "rwkv7.safetensors"
    header, _ = _encode({k: v.astype(np.uint16) for k, v in bf16.items()}, {})
    hdr = json.loads(header[8:])
    for k in bf16:
        hdr[k]["dtype"] = "BF16"
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for k in bf16:
            f.write(bf16[k].astype("<u2").tobytes())
    loaded_cfg, loaded, _ = load_checkpoint(path)
    assert loaded_cfg == cfg
    for k, v in params.items():
        np.testing.assert_allclose(loaded[k], v, rtol=1e-2, atol=1e-30)


def test_truncated(tmp_path):
    path = tmp_path / "t.safetensors"
    save_checkpoint(path, CFG, init_params(CFG, 0))
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="truncated|corrupt"):
        load_checkpoint(path)
    path.write_bytes(data[:5])
    with pytest.raises(ValueError, match="truncated"):
        load_checkpoint(path)


def test_corrupt_header(tmp_path):
    path = tmp_path / "c.safetensors"
    path.write_bytes(struct.pack("<Q", 10) + b"{not json!" + b"\0" * 16)
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header length"):
        load_checkpoint(path)


@pytest.mark.parametrize("name, value, match", [
    ("moba.0.att.key.weight", None, "moba.0.att.key.weight"),
    ("rwkv.blocks.1.att.w1", np.zeros((32, 7), np.float32), "rwkv.blocks.1.att.w1.*shape"),
    ("rwkv.ln_out.bias", np.zeros(32, np.int32), "rwkv.ln_out.bias.*dtype"),
], ids=["missing", "wrong_shape", "wrong_dtype"])
def test_bad_tensor(tmp_path, name, value, match):
    """A tensor missing (value None), of the wrong shape or of the wrong dtype is an error naming it."""
    params = init_params(CFG, 0)
    if value is None:
        del params[name]
    else:
        params[name] = value
    path = tmp_path / "m.safetensors"
    write_raw(path, params, {"config": json.dumps(CFG.to_dict())})
    with pytest.raises(ValueError, match=match):
        load_checkpoint(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e39], ids=["nan", "inf", "-inf", "beyond_f32"])
def test_non_finite_weights_are_refused_by_name(tmp_path, bad):
    """A weight holding NaN or Inf (or a float64 beyond float32's range) is refused at load, named with
    where it is, instead of sampling garbage later."""
    params = {k: v.astype(np.float64) for k, v in init_params(CFG, 0).items()}
    params["rwkv.blocks.1.att.w1"][3, 5] = bad
    path = tmp_path / "m.safetensors"
    write_raw(path, params, {"config": json.dumps(CFG.to_dict())})
    with pytest.raises(ValueError, match=r"tensor rwkv.blocks.1.att.w1 holds 1 non-finite value.*index \[3, 5\]"):
        load_checkpoint(path)


def test_save_rejects_bad_params(tmp_path):
    params = init_params(CFG, 0)
    params["rwkv.head.weight"] = params["rwkv.head.weight"][:3]
    with pytest.raises(ValueError, match="rwkv.head.weight"):
        save_checkpoint(tmp_path / "x.safetensors", CFG, params)
    assert not list(tmp_path.iterdir())
