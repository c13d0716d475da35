"""CPU tests of the MoBA launch builders (rwkvx/ops/moba.py): scratch sizes, shared-memory layouts,
launch lists. No GPU needed (plans assume an H200); compiling moba.cu is tests/test_nvrtc_compile.py's job."""
import pytest

from rwkvx.ops import moba
from rwkvx.runtime import DevPtr, Launch
from rwkvx.runtime.device import H200

A = 1 << 20          # fake, 16-byte aligned device addresses


def x(i):
    return DevPtr(i * A, "f32")


def build(B, T, H, N, chunk, top_k):
    sc = moba.carve(1 << 30, B, T, H, N, chunk, top_k)
    fwd = moba.forward(x(1), x(2), x(3), x(4), sc, B, T, H, N, chunk, top_k, H200)
    bwd = moba.backward(x(1), x(2), x(3), x(4), x(5), x(6), x(7), x(8), sc, B, T, H, N, chunk, top_k, H200)
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
    assert s["part"] == (B * H * T * K1 * N, "f32")
    assert s["sel"] == (B * H * T * K1, "i32")
    assert s["qlist"] == (B * H * E, "i32")
    total = sum(n for n, _ in s.values())
    assert total == (B * H * T * (K1 * N + 2 * K1 + 2) + B * H * nblk * (N + 1) + 3 * B * H * (nblk + 1)
                     + B * H * E)
    # top_k == 1: no selection buffers at all
    s1 = moba.scratch_sizes(1, 100, 2, 32, 16, 1)
    assert s1["sel"][0] == s1["part"][0] == s1["qlist"][0] == s1["kmean"][0] == 0 and s1["lse"][0] == 200
    # carve: typed, aligned, non-overlapping
    sc = moba.carve(4096, B, T, H, N, chunk, top_k)
    assert all(sc[n].elem == s[n][1] for n in sc if sc[n] is not None)
    spans = sorted((int(p), int(p) + 4 * s[n][0]) for n, p in sc.items() if p is not None)
    assert all(p % 256 == 0 for p, _ in spans)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] <= 4096 + moba.scratch_bytes(B, T, H, N, chunk, top_k)


@pytest.mark.parametrize("N", moba.HEAD_SIZES)
def test_smem_layouts_are_contiguous_and_fit(N):
    for group, (offsets, words) in moba.smem_layouts(N).items():
        values = list(offsets.values())
        assert values[0] == 0 and values == sorted(values) and values[-1] <= words
    assert 4 * max(w for _, w in moba.smem_layouts(N).values()) <= H200.smem_per_block


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
        assert op.smem <= H200.smem_per_block
        assert op.block[0] * op.block[1] * op.block[2] <= 1024
        assert all(g <= 65535 for g in op.grid[1:])


def test_builders_validate():
    sc = moba.carve(1 << 30, 1, 64, 2, 64, 16, 3)
    with pytest.raises(ValueError):
        moba.forward(DevPtr(A + 4, "f32"), x(1), x(1), x(1), sc, 1, 64, 2, 64, 16, 3, H200)   # misaligned q
    with pytest.raises(ValueError):
        moba.forward(x(1), x(1), x(1), x(1), {}, 1, 64, 2, 64, 16, 3, H200)                   # no scratch
    with pytest.raises(TypeError):
        moba.forward(x(1), DevPtr(A, "bf16"), x(1), x(1), sc, 1, 64, 2, 64, 16, 3, H200)      # mixed types
    for bad in [(1, 64, 2, 6, 16, 3), (1, 64, 2, 64, 16, 0), (1, 64, 2, 512, 16, 2), (1, 64, 2, 64, 0, 2)]:
        with pytest.raises(ValueError):
            moba.check_shape(*bad, H200)
