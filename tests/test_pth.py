"""PyTorch .pth files without torch: fixtures written by torch.save load with the values recorded
beside them, bad files are refused clearly, exports have RWKV-LM's layout, and (where torch is
installed) torch.load reads what we write. Fixtures: scripts/make_pth_fixtures.py."""
import pickletools
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest

import rwkvx.pth as pth
from rwkvx import Config, init_params, load_checkpoint
from rwkvx.checkpoint import export_rwkv7_pth
from rwkvx.pth import read_pth, write_pth

from seeding import seeded_rng

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The fixture model as scripts/make_pth_fixtures.py defines it (V, C, H x N, L, FFN width, LoRA ranks).
FIXTURE_CFG = Config(vocab_size=16, n_embd=8, head_size=4, n_rwkv_layer=2, ffn_dim=24,
                     dim_w=4, dim_a=2, dim_v=6, dim_g=10)
BLOCK0_UNUSED = ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2")
VARIANTS = {"rwkv7_tiny_bf16.pth": "BF16", "rwkv7_tiny_fp16.pth": "F16", "rwkv7_tiny_fp32_views.pth": "F32"}


@pytest.fixture(scope="module")
def ref():
    with np.load(FIXTURES / "rwkv7_tiny_ref.npz") as f:
        return {k: f[k] for k in f.files}


def data_offsets(path):
    """Where each entry's data starts: after its local header (30 bytes, name, extra field)."""
    raw = Path(path).read_bytes()
    with zipfile.ZipFile(path) as z:
        out = {}
        for info in z.infolist():
            name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
            out[info.filename] = info.header_offset + 30 + name_len + extra_len
        return out


def assert_bf16_nearest(x, y):
    """y is x rounded to a bf16 value, nearest: checked from the bit patterns and the bf16 spacing,
    without a rounding routine."""
    x, y = np.asarray(x, np.float32).ravel(), np.asarray(y, np.float32).ravel()
    assert not (y.view(np.uint32) & 0xFFFF).any()                  # y is representable in bf16
    _, exp = np.frexp(x)
    half_ulp = np.ldexp(1.0, exp - 9)                              # bf16 keeps 8 significant bits
    assert np.all(np.abs(x.astype(np.float64) - y) <= half_ulp)


@pytest.mark.parametrize("name", VARIANTS)
def test_torch_saved_fixtures_load_with_the_recorded_values(name, ref):
    tensors, codes = read_pth(FIXTURES / name)
    assert set(codes.values()) == {VARIANTS[name]}
    for k, v in tensors.items():
        assert v.dtype == (np.float16 if VARIANTS[name] == "F16" else np.float32)
        np.testing.assert_array_equal(v, ref[k], err_msg=k)
    expected_names = set(ref) - (set(BLOCK0_UNUSED) if "fp16" in name else set())
    assert set(tensors) == expected_names
    cfg, params, extra = load_checkpoint(FIXTURES / name)
    assert cfg == FIXTURE_CFG
    assert extra == {"tensors": {}, "meta": {}}
    assert set(params) == {"rwkv." + k for k in ref if k not in BLOCK0_UNUSED}
    for k, v in params.items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, ref[k[len("rwkv."):]], err_msg=k)


def test_refuses_code_and_non_tensors(capfd):
    for name, message in [
        ("bad_global.pth", "system, which is not a tensor"),
        ("numpy_value.pth", "multiarray._reconstruct, which is not a tensor"),
        ("int_value.pth", "entry 'step' is of type int, not a tensor"),
        ("complex.pth", "torch.ComplexFloatStorage is not supported"),
        ("legacy.pth", "legacy pre-1.6 torch.save format is not supported"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_checkpoint(FIXTURES / name)
    assert "ran a command" not in "".join(capfd.readouterr())   # the pickled os.system never ran


def test_truncated_or_corrupt_zip(tmp_path):
    data = (FIXTURES / "rwkv7_tiny_bf16.pth").read_bytes()
    path = tmp_path / "t.pth"
    for cut in (len(data) - 10, len(data) // 2, 100, 4):
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated or corrupt"):
            load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="not a zip archive"):
        load_checkpoint(path)
    # one flipped byte inside a storage: the zip's CRC catches it
    offset = data_offsets(FIXTURES / "rwkv7_tiny_bf16.pth")["rwkv7_tiny_bf16/data/0"]
    flipped = bytearray(data)
    flipped[offset] ^= 0xFF
    path.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="corrupt"):
        load_checkpoint(path)
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as z:
        z.writestr("readme.txt", "not a checkpoint")
    with pytest.raises(ValueError, match="expected one <folder>/data.pkl"):
        load_checkpoint(tmp_path / "other.zip")


def _rewrite(src, dst, change):
    """Copy the zip ``src`` to ``dst`` with ``change(name, data) -> data`` applied to each entry."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            zout.writestr(name, change(name, zin.read(name)))


def test_storage_and_view_bounds(tmp_path):
    good = tmp_path / "good.pth"
    write_pth(good, {"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, "fp32")
    short = tmp_path / "short.pth"
    _rewrite(good, short, lambda n, d: d[:-4] if n.endswith("data/0") else d)
    with pytest.raises(ValueError, match="holds 20 bytes, expected 24"):
        read_pth(short)
    # the tensor's offset moved to 1: its last element would be past the storage's end
    shifted = tmp_path / "shifted.pth"
    _rewrite(good, shifted, lambda n, d: d.replace(b"tQK\x00", b"tQK\x01") if n.endswith("data.pkl") else d)
    with pytest.raises(ValueError, match="reaches element 6 of storage 0, which has 6"):
        read_pth(shifted)
    # a storage entry that is not there
    missing = tmp_path / "missing.pth"
    _rewrite(good, missing, lambda n, d: d.replace(b"X\x01\x00\x00\x000", b"X\x01\x00\x00\x009")
             if n.endswith("data.pkl") else d)
    with pytest.raises(ValueError, match="storage entry archive/data/9 is missing"):
        read_pth(missing)


def test_wrong_shapes_are_clear_errors(tmp_path, ref):
    path = tmp_path / "s.pth"
    for name, value, message in [
        ("blocks.1.att.w1", np.zeros((8, 5), np.float32), r"rwkv.blocks.1.att.w1 has shape \(8, 5\), expected \(8, 4\)"),
        ("blocks.1.ffn.key.weight", np.zeros((20, 8), np.float32), "rwkv.blocks.1.ffn.key.weight has shape"),
        ("head.weight", np.zeros((17, 8), np.float32), "rwkv.head.weight has shape"),
        ("blocks.0.att.r_k", np.zeros((2, 3), np.float32), "r_k has shape \\(2, 3\\) \\(H\\*N = 6\\)"),
        ("emb.weight", np.zeros(128, np.float32), "rwkv.emb.weight has shape \\(128,\\), expected a 2-D"),
        ("blocks.0.att.x_r", np.zeros(8, np.float32), r"x_r has shape \(8,\), expected \(1, 1, 8\)"),
    ]:
        write_pth(path, {**ref, name: value}, "fp32")
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path)
    for name, message in [("blocks.1.att.output.weight", "missing tensor rwkv.blocks.1.att.output.weight"),
                          ("blocks.0.att.r_k", "has no tensor rwkv.blocks.0.att.r_k")]:
        write_pth(path, {k: v for k, v in ref.items() if k != name}, "fp32")
        with pytest.raises(ValueError, match=message):
            load_checkpoint(path)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_non_finite_weights_are_refused_by_name(tmp_path, ref, dtype):
    tensors = dict(ref)
    tensors["blocks.1.ffn.key.weight"] = tensors["blocks.1.ffn.key.weight"].copy()
    tensors["blocks.1.ffn.key.weight"][2, 1] = np.nan
    tensors["blocks.1.ffn.key.weight"][4, 0] = np.inf
    path = tmp_path / "nan.pth"
    write_pth(path, tensors, dtype)
    with pytest.raises(ValueError, match=r"tensor rwkv.blocks.1.ffn.key.weight holds 2 non-finite.*\[2, 1\]"):
        load_checkpoint(path, FIXTURE_CFG)


def test_write_read_round_trip(tmp_path):
    rng = seeded_rng(5)
    tensors = {"w": rng.standard_normal((5, 7)).astype(np.float32) * 100,
               "v": rng.standard_normal((1, 1, 9)).astype(np.float32),
               "scalar": np.array(-3.25, np.float32), "empty": np.zeros((0, 4), np.float32),
               "f64": rng.standard_normal(6)}
    for dtype, code in (("fp32", "F32"), ("bf16", "BF16")):
        path = tmp_path / f"{dtype}.pth"
        write_pth(path, tensors, dtype)
        back, codes = read_pth(path)
        assert list(back) == list(tensors) and set(codes.values()) == {code}
        for k, v in tensors.items():
            assert back[k].shape == v.shape and back[k].dtype == np.float32
            if dtype == "fp32":
                np.testing.assert_array_equal(back[k], v.astype(np.float32))
            else:
                assert_bf16_nearest(v.astype(np.float32), back[k])
        assert all(off % 64 == 0 for off in data_offsets(path).values())
        with zipfile.ZipFile(path) as z:
            assert z.read("archive/byteorder") == b"little" and z.read("archive/version") == b"3\n"
            globals_ = {arg for op, arg, _ in pickletools.genops(z.read("archive/data.pkl"))
                        if op.name == "GLOBAL"}
        assert globals_ == {"torch._utils _rebuild_tensor_v2", "collections OrderedDict",
                            f"torch {pth.WRITE_DTYPES[dtype]}"}
    with pytest.raises(ValueError, match="dtype must be one of"):
        write_pth(tmp_path / "x.pth", tensors, "fp16")
    with pytest.raises(TypeError, match="expected a float numpy array"):
        write_pth(tmp_path / "x.pth", {"i": np.arange(3)}, "fp32")
    assert not (tmp_path / "x.pth").exists()


def test_zip64_entries_stay_aligned(tmp_path, monkeypatch):
    """Entries of 1 GiB and more get a zip64 header; the data must still start on 64 bytes."""
    monkeypatch.setattr(pth, "_ZIP64_FROM", 0)
    path = tmp_path / "z.pth"
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    write_pth(path, {"a": a}, "fp32")
    assert all(off % 64 == 0 for off in data_offsets(path).values())
    np.testing.assert_array_equal(read_pth(path)[0]["a"], a)


def test_export_has_rwkv_lm_layout(tmp_path, ref):
    cfg, params, _ = load_checkpoint(FIXTURES / "rwkv7_tiny_fp32_views.pth")
    shapes = {k: v.shape for k, v in read_pth(FIXTURES / "rwkv7_tiny_bf16.pth")[0].items()}
    for dtype, code in (("fp32", "F32"), ("bf16", "BF16")):
        out = tmp_path / f"{dtype}.pth"
        export_rwkv7_pth(out, cfg, params, dtype=dtype)
        tensors, codes = read_pth(out)
        assert {k: v.shape for k, v in tensors.items()} == shapes    # RWKV-LM's names and shapes
        assert set(codes.values()) == {code}
        for k, v in tensors.items():
            expected = np.zeros_like(ref[k]) if k in BLOCK0_UNUSED else ref[k]  # values are bf16-exact
            np.testing.assert_array_equal(v, expected, err_msg=k)
        assert load_checkpoint(out)[0] == cfg


def test_export_refusals_write_nothing(tmp_path):
    hybrid = Config(vocab_size=16, n_embd=8, head_size=4, n_rwkv_layer=2, n_attn_layer=1,
                    moba_chunk_size=4, moba_top_k=2)
    params = init_params(hybrid, 0)
    out = tmp_path / "x.pth"
    with pytest.raises(ValueError, match="1 MoBA attention block"):
        export_rwkv7_pth(out, hybrid, params)
    no_ln0 = Config(vocab_size=16, n_embd=8, head_size=4, n_rwkv_layer=2, ln0=False)
    with pytest.raises(ValueError, match="no ln0"):
        export_rwkv7_pth(out, no_ln0, init_params(no_ln0, 0))
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_rwkv7_pth(out, hybrid, params, dtype="fp16", drop_attention=True)
    assert not list(tmp_path.iterdir())
    export_rwkv7_pth(out, hybrid, params, drop_attention=True)
    assert load_checkpoint(out)[0] == Config(vocab_size=16, n_embd=8, head_size=4, n_rwkv_layer=2)


# ---- with PyTorch installed: torch reads what we write, we read what torch writes ----------------

def _torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed (only the fixture script and "
                                               "these cross-checks use it)")


def test_torch_loads_our_files(tmp_path):
    torch = _torch()
    rng = seeded_rng(9)
    tensors = {"w": rng.standard_normal((6, 5)).astype(np.float32), "s": np.array(0.1, np.float32),
               "big": rng.standard_normal((70, 1000)).astype(np.float32)}
    for dtype, tdtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        path = tmp_path / f"{dtype}.pth"
        write_pth(path, tensors, dtype)
        for mmap in (False, True):
            loaded = torch.load(path, weights_only=True, mmap=mmap)
            assert list(loaded) == list(tensors)
            for k, v in tensors.items():
                assert loaded[k].dtype == tdtype and tuple(loaded[k].shape) == v.shape
                assert torch.equal(loaded[k], torch.from_numpy(v).to(tdtype))   # torch's own rounding


def test_torch_loads_the_export_as_rwkv_lm_state_dict(tmp_path):
    torch = _torch()
    cfg, params, _ = load_checkpoint(FIXTURES / "rwkv7_tiny_bf16.pth")
    export_rwkv7_pth(tmp_path / "m.pth", cfg, params)
    ours = torch.load(tmp_path / "m.pth", weights_only=True)
    theirs = torch.load(FIXTURES / "rwkv7_tiny_bf16.pth", weights_only=True)
    assert set(ours) == set(theirs)
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
        if k not in BLOCK0_UNUSED:
            assert torch.equal(ours[k], theirs[k]), k
    # a module with the state dict's parameters loads it strictly, as RWKV-LM's model does
    module = torch.nn.Module()
    for k, v in theirs.items():
        module.register_parameter(k.replace(".", "_"), torch.nn.Parameter(torch.empty_like(v)))
    module.load_state_dict({k.replace(".", "_"): v for k, v in ours.items()}, strict=True)


def test_we_read_fresh_torch_files_with_views(tmp_path):
    torch = _torch()
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4, 5, 6, generator=g)
    lin = torch.nn.Linear(6, 3).to(torch.float16)
    state = lin.state_dict()                                  # an OrderedDict with _metadata
    state.update({
        "permuted": base.permute(2, 0, 1), "narrow": base[1:3, ::2, 4:], "expanded": base[0, 0, :1].expand(3, 4),
        "bf16_t": base[0].to(torch.bfloat16).t(), "f64": base[2, 1].double(),
        "param": torch.nn.Parameter(torch.ones(2)), "scalar": base[3, 4, 5],
    })
    torch.save(state, tmp_path / "v.pth")
    tensors, codes = read_pth(tmp_path / "v.pth")
    assert list(tensors) == list(state)
    for k, v in state.items():
        np.testing.assert_array_equal(tensors[k], v.detach().float().numpy() if v.dtype == torch.bfloat16
                                      else v.detach().numpy(), err_msg=k)
    assert codes["weight"] == "F16" and codes["bf16_t"] == "BF16" and codes["f64"] == "F64"
