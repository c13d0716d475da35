"""CPU tests of benchmarks/bench_wkv7.py's outside reference, RWKV-LM's clampw v3 kernel: where its sources
are looked up ($RWKV_LM_DIR; a visible skip without it, a clear error when a source is missing) and the
byte count its rows share with rwkvx's bf16 chunked rows."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rwkvx.cu import wkv7
from rwkvx.runtime.device import H200

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_wkv7.py"


@pytest.fixture(scope="module")
def bench():
    """benchmarks/bench_wkv7.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("bench_wkv7", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_skips_without_rwkv_lm_dir(bench, monkeypatch):
    monkeypatch.delenv(bench.RWKV_LM_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="RWKV_LM_DIR is not set"):
        bench.rwkv_lm_sources()
    monkeypatch.setenv(bench.RWKV_LM_ENV, "")
    with pytest.raises(pytest.skip.Exception, match="RWKV_LM_DIR is not set"):
        bench.rwkv_lm_sources()


def test_finds_the_clampw_v3_sources(bench, monkeypatch, tmp_path):
    monkeypatch.setenv(bench.RWKV_LM_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="rwkv7_clampw_v3_for_h100.cu, .*rwkv7_clampw_v3.cpp"):
        bench.rwkv_lm_sources()
    cuda = tmp_path / "RWKV-v7" / "train_temp" / "cuda"
    cuda.mkdir(parents=True)
    (cuda / "rwkv7_clampw_v3.cpp").write_text("")
    with pytest.raises(FileNotFoundError, match="no [^,]*rwkv7_clampw_v3_for_h100.cu$"):
        bench.rwkv_lm_sources()
    (cuda / "rwkv7_clampw_v3_for_h100.cu").write_text("")
    assert bench.rwkv_lm_sources() == [cuda / "rwkv7_clampw_v3_for_h100.cu", cuda / "rwkv7_clampw_v3.cpp"]


@pytest.mark.parametrize("shape", ["B8_T4096_H12", "B4_T4096_H32"])
def test_reference_saves_what_the_chunked_forward_saves(bench, shape):
    """The reference's rows count the bf16 chunked row's bytes from the tensors its own forward saves
    (sa [B, T, H, N] and the state every RWKV_LM_CHUNK tokens, f32): the same bytes."""
    B, T, H = bench.WKV7_SHAPES[shape]
    N = bench.N
    sizes = wkv7.scratch_elems(B, T, H, N, H200, method="chunked")
    assert T % bench.RWKV_LM_CHUNK == 0
    assert (sizes["sa"], sizes["ckpt"]) == (B * T * H * N, B * H * (T // bench.RWKV_LM_CHUNK) * N * N)
    n, saved = B * T * H * N, 4 * (sizes["sa"] + sizes["ckpt"])
    assert bench.floor_bytes("forward", "bf16", n, saved) == 16 * n + saved          # r, k, v, a, b, y bf16; w f32
    assert bench.floor_bytes("backward", "bf16", n, saved) == 38 * n + saved         # and dy, dr bf16; dw..db f32
