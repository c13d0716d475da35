"""Every rwkvx/cu/<family>/<file>.cu compiles with NVRTC for sm_90 (no GPU needed) with every define set its
declaration (rwkvx/cu) launches it with: each variant (head size ...) x each element type (float, bf16).
Also: the CUBIN disk cache works.
"""

import pytest

import rwkvx.cu  # noqa: F401  (declares every kernel file)
from rwkvx.runtime import nvrtc
from rwkvx.runtime.kernel import KernelFile

OK, WHY = nvrtc.nvrtc_available()
pytestmark = pytest.mark.skipif(not OK, reason=f"NVRTC is not installed/usable: {WHY}")

ARCH = "sm_90"


def _cases():
    out = []
    for module, kf in sorted(KernelFile.registry.items()):
        for defs in kf.compile_cases():
            d = dict(defs)
            label = ",".join(f"{k}={d[k]}" for k in [*sorted(kf.variants), "FLOATX_BF16"])
            out.append(pytest.param(module, defs, id=f"{module}[{label}]"))
    return out


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RWKVX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "cubin"


@pytest.mark.parametrize("module,defines", _cases())
def test_cu_file_compiles(module: str, defines, tmp_cache):
    cubin = nvrtc.compile_cubin(module, ARCH, defines)
    assert cubin[:4] == b"\x7fELF", "NVRTC output for sm_90 should be a CUBIN (ELF)"


SRC = r'''
extern "C" __global__ void rwkvx_test_scale(float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= a * SCALE;
}
'''


def test_cache_hit_on_second_compile(tmp_cache):
    before = nvrtc.cache_stats()
    a = nvrtc.compile_source("cache_probe", SRC, ARCH, {"SCALE": 2})
    mid = nvrtc.cache_stats()
    assert mid["compiles"] == before["compiles"] + 1
    files = list(tmp_cache.glob("cache_probe-sm_90-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == a
    assert not list(tmp_cache.glob("*.tmp")), "atomic write must not leave temporary files"
    b = nvrtc.compile_source("cache_probe", SRC, ARCH, {"SCALE": 2})
    after = nvrtc.cache_stats()
    assert a == b
    assert after["compiles"] == mid["compiles"] and after["cache_hits"] == mid["cache_hits"] + 1
    # other defines -> other key -> compile again
    nvrtc.compile_source("cache_probe", SRC, ARCH, {"SCALE": 3})
    assert nvrtc.cache_stats()["compiles"] == after["compiles"] + 1
    assert len(list(tmp_cache.glob("cache_probe-sm_90-*.cubin"))) == 2


def test_corrupt_cache_entry_is_recompiled(tmp_cache):
    a = nvrtc.compile_source("cache_probe2", SRC, ARCH, {"SCALE": 1})
    (f,) = tmp_cache.glob("cache_probe2-*.cubin")
    f.write_bytes(b"garbage")
    n = nvrtc.cache_stats()["compiles"]
    assert nvrtc.compile_source("cache_probe2", SRC, ARCH, {"SCALE": 1}) == a
    assert nvrtc.cache_stats()["compiles"] == n + 1


def test_cache_key_covers_local_includes(tmp_path, tmp_cache, monkeypatch):
    cu = tmp_path / "cu"
    cu.mkdir()
    monkeypatch.setattr(nvrtc, "CU_DIR", cu)
    (cu / "probe_inc.cuh").write_text("#define PROBE_FACTOR 2.0f\n")
    (cu / "probe.cu").write_text('#include "probe_inc.cuh"\n'
                                 'extern "C" __global__ void rwkvx_probe(float* x) { x[0] = PROBE_FACTOR; }\n')
    a = nvrtc.compile_cubin("probe", ARCH)
    n = nvrtc.cache_stats()["compiles"]
    nvrtc.compile_cubin("probe", ARCH)
    assert nvrtc.cache_stats()["compiles"] == n              # hit
    (cu / "probe_inc.cuh").write_text("#define PROBE_FACTOR 3.0f\n")
    b = nvrtc.compile_cubin("probe", ARCH)
    assert nvrtc.cache_stats()["compiles"] == n + 1          # include changed -> miss
    assert a != b


def test_compile_error_shows_log_and_file(tmp_cache):
    bad = 'extern "C" __global__ void k(float* x) { x[0] = undefined_symbol; }\n'
    with pytest.raises(nvrtc.NvrtcCompileError) as ei:
        nvrtc.compile_source("broken", bad, ARCH, origin="/some/where/broken.cu")
    msg = str(ei.value)
    assert "/some/where/broken.cu" in msg and "undefined_symbol" in msg and "compile log" in msg
    assert isinstance(ei.value, RuntimeError)


def test_options_in_one_place():
    opts = nvrtc.build_options("sm_90", {"HEAD_SIZE": 64, "A": "x"})
    assert opts[0] == "--gpu-architecture=sm_90"
    assert "-std=c++17" in opts and "-default-device" in opts
    assert not any("fast_math" in o or "fast-math" in o for o in opts)
    assert opts[-2:] == ["-DA=x", "-DHEAD_SIZE=64"]
    assert any(o.startswith("--include-path=") for o in opts)
    with pytest.raises(ValueError):
        nvrtc.build_options("90")


def test_default_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("RWKVX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert nvrtc.cache_dir() == tmp_path / "rwkvx" / "cubin"
    monkeypatch.setenv("RWKVX_CACHE_DIR", str(tmp_path / "x"))
    assert nvrtc.cache_dir() == tmp_path / "x" / "cubin"
