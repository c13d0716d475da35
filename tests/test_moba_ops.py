"""CPU tests of the MoBA launch builders (rwkvx/ops/moba.py) and an NVRTC compile of rwkvx/cu/moba.cu.

No GPU needed; the compile test is skipped when NVRTC cannot be loaded here."""
import pytest

from rwkvx.ops import moba
from rwkvx.runtime import Launch

A = 1 << 20          # fake, 16-byte aligned device addresses


def scratch_for(B, T, H, N, chunk, top_k):
    return moba.carve(1 << 30, B, T, H, N, chunk, top_k)


def build(B, T, H, N, chunk, top_k):
    sc = scratch_for(B, T, H, N, chunk, top_k)
    fwd = moba.forward(A, 2 * A, 3 * A, 4 * A, sc, B, T, H, N, chunk, top_k)
    bwd = moba.backward(A, 2 * A, 3 * A, 4 * A, 5 * A, 6 * A, 7 * A, 8 * A, sc, B, T, H, N, chunk, top_k)
    return fwd, bwd


def test_emax_matches_brute_force():
    for T, chunk, top_k in [(1, 1, 1), (100, 7, 3), (4096, 512, 3), (300, 64, 2), (20, 1, 5), (50, 64, 3)]:
        want = sum(min(top_k - 1, t // chunk) for t in range(T))
        assert moba.emax(T, chunk, top_k) == want


def test_scratch_sizes_formula():
    B, T, H, N, chunk, top_k = 8, 4096, 12, 64, 512, 3
    s = moba.scratch_sizes(B, T, H, N, chunk, top_k)
    assert set(s) == set(moba.SCRATCH_NAMES)
    K1, nblk, E = 2, 8, moba.emax(T, chunk, top_k)
    assert s["part"] == 4 * B * H * T * K1 * N
    assert s["sel"] == 4 * B * H * T * K1
    assert s["qlist"] == 4 * B * H * E
    total = sum(s.values())
    assert total == 4 * (B * H * T * (K1 * N + 2 * K1 + 2) + B * H * nblk * (N + 1) + 3 * B * H * (nblk + 1)
                         + B * H * E)
    # top_k == 1: no selection buffers at all
    s1 = moba.scratch_sizes(1, 100, 2, 32, 16, 1)
    assert s1["sel"] == s1["part"] == s1["qlist"] == s1["kmean"] == 0 and s1["lse"] == 4 * 200
    # carve: aligned, non-overlapping
    sc = moba.carve(4096, B, T, H, N, chunk, top_k)
    spans = sorted((p, p + s[n]) for n, p in sc.items() if s[n])
    assert all(p % 256 == 0 for p, _ in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] <= 4096 + moba.scratch_bytes(B, T, H, N, chunk, top_k)


@pytest.mark.parametrize("B,T,H,N,chunk,top_k,fwd_names,bwd_names", [
    (2, 640, 2, 64, 64, 3,
     ["moba_kmean", "moba_select", "moba_scan", "moba_fill", "moba_fwd_past", "moba_fwd_own"],
     ["moba_bwd_delta", "moba_bwd_dq_past", "moba_bwd_dq_own", "moba_bwd_dkdv"]),
    (1, 100, 2, 32, 16, 1, ["moba_fwd_own"], ["moba_bwd_delta", "moba_bwd_dq_own", "moba_bwd_dkdv"]),
    (1, 50, 2, 32, 64, 3, ["moba_kmean", "moba_select", "moba_fwd_own"],
     ["moba_bwd_delta", "moba_bwd_dq_own", "moba_bwd_dkdv"]),
])
def test_builders(B, T, H, N, chunk, top_k, fwd_names, bwd_names):
    fwd, bwd = build(B, T, H, N, chunk, top_k)
    assert [op.name for op in fwd] == fwd_names
    assert [op.name for op in bwd] == bwd_names
    for op in fwd + bwd:
        assert isinstance(op, Launch) and op.module == "moba"
        assert dict(op.defines)["HEAD_SIZE"] == str(N)
        assert op.smem <= moba.MAX_SMEM
        assert op.block[0] * op.block[1] * op.block[2] <= 1024
        assert all(g <= 65535 for g in op.grid[1:])


def test_builders_validate():
    sc = scratch_for(1, 64, 2, 64, 16, 3)
    with pytest.raises(ValueError):
        moba.forward(A + 4, A, A, A, sc, 1, 64, 2, 64, 16, 3)      # misaligned q
    with pytest.raises(ValueError):
        moba.forward(A, A, A, A, {}, 1, 64, 2, 64, 16, 3)          # no scratch
    with pytest.raises(ValueError):
        moba.scratch_sizes(1, 64, 2, 6, 16, 3)
    with pytest.raises(ValueError):
        moba.scratch_sizes(1, 64, 2, 64, 16, 0)
    with pytest.raises(ValueError):
        moba.scratch_sizes(1, 64, 2, 512, 16, 2)      # N > 256
    with pytest.raises(ValueError):
        moba.scratch_sizes(1, 64, 2, 64, 0, 2)        # chunk < 1


@pytest.mark.parametrize("N", [4, 8, 16, 32, 48, 64, 128, 256])
def test_moba_cu_compiles(N, tmp_path, monkeypatch):
    from rwkvx.runtime import nvrtc
    ok, why = nvrtc.nvrtc_available()
    if not ok:
        pytest.skip(f"NVRTC not available: {why}")
    monkeypatch.setenv("RWKVX_CACHE_DIR", str(tmp_path))
    cubin = nvrtc.compile_cubin("moba", "sm_90", moba.defines(N))
    assert len(cubin) > 1000
    for name in ("moba_kmean", "moba_select", "moba_scan", "moba_fill", "moba_fwd_past", "moba_fwd_own",
                 "moba_bwd_delta", "moba_bwd_dq_past", "moba_bwd_dq_own", "moba_bwd_dkdv"):
        assert name.encode() in bytes(cubin)
