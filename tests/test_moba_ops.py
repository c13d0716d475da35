"""CPU tests of the MoBA launch builders (rwkvx/cu/moba/ops.py): scratch sizes, shared-memory layouts,
launch lists, and the backward's launches as tests/emulator.py runs them. No GPU needed (plans assume an H200); compiling the kernel files is tests/test_nvrtc_compile.py's job."""
import numpy as np
import pytest

import emulator
from rwkvx import oracle as O
from rwkvx.cu import moba
from rwkvx.runtime import DevPtr, Launch
from rwkvx.runtime.device import H200
from seeding import seeded_rng

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
    assert s["olo"][0] == 0                       # f32 activations: the output is exact already
    bf16 = moba.scratch_sizes(B, T, H, N, chunk, top_k, "bf16")
    assert bf16 == {**s, "olo": (B * T * H * N, "bf16")}
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
        assert isinstance(op, Launch)
        assert op.module == ("moba/select" if op.name in moba.SELECT_CU.kernels else "moba/exact")
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


def build_mma(B, T, H, N, chunk, top_k, xtype="f32"):
    sc = moba.carve(1 << 30, B, T, H, N, chunk, top_k, xtype)
    p = [DevPtr(i * A, xtype) for i in range(1, 9)]
    fwd = moba.forward(*p[:4], sc, B, T, H, N, chunk, top_k, H200, method="mma")
    bwd = moba.backward(*p, sc, B, T, H, N, chunk, top_k, H200, method="mma")
    return fwd, bwd


@pytest.mark.parametrize("N", moba.MMA_HEAD_SIZES)
@pytest.mark.parametrize("xtype", ["f32", "bf16"])
def test_mma_builders(N, xtype):
    B, T, H, chunk, top_k = 2, 1000, 3, 96, 4
    fwd, bwd = build_mma(B, T, H, N, chunk, top_k, xtype)
    exact_fwd, exact_bwd = build(B, T, H, N, chunk, top_k)
    attention = {"moba_fwd_past", "moba_fwd_own", "moba_bwd_dq_past", "moba_bwd_dq_own", "moba_bwd_dkdv"}
    # the same launch sequence; the attention kernels replaced by their tensor-core versions
    assert [op.name for op in fwd + bwd] == [n + "_mma" if n in attention else n
                                             for n in (op.name for op in exact_fwd + exact_bwd)]
    # the selection launches are untouched (same kernels, grids, arguments)
    for got, want in zip(fwd[:4], exact_fwd[:4]):
        assert (got.grid, got.block, got.smem) == (want.grid, want.block, want.smem)
    nblk, E, rows = moba.nblocks(T, chunk), moba.emax(T, chunk, top_k), moba.MMA_ROWS
    grids = {op.name: op.grid for op in fwd + bwd}
    assert grids["moba_fwd_past_mma"] == grids["moba_bwd_dq_past_mma"] == (-(-E // rows) + nblk, H, B)
    assert grids["moba_fwd_own_mma"] == grids["moba_bwd_dq_own_mma"] == (nblk * -(-chunk // rows), H, B)
    assert grids["moba_bwd_dkdv_mma"] == (-(-chunk // rows), nblk, B * H)
    for op in fwd + bwd:
        assert op.module == ("moba/mma" if op.name.endswith("_mma") else "moba/select")
        assert op.smem <= H200.smem_per_block
    smem = {op.name: op.smem for op in fwd + bwd}
    assert smem["moba_fwd_own_mma"] == moba.mma_smem_bytes(N, "MFWD", xtype)
    # bf16: the forward writes the output's residual and the backward's delta reads it (the last argument)
    olo = moba.carve(1 << 30, B, T, H, N, chunk, top_k, xtype)["olo"]
    last = {op.name: op.args[-1] for op in fwd + bwd}
    assert last["moba_fwd_own_mma"] == last["moba_bwd_delta"] == ("p", int(olo) if xtype == "bf16" else 0), last
    assert smem["moba_bwd_dkdv_mma"] == moba.mma_smem_bytes(N, "MKV", xtype)


def test_mma_smem_layouts_are_aligned_and_fit():
    for N in moba.MMA_HEAD_SIZES:
        for xtype in ("f32", "bf16"):
            esize = 2 if xtype == "bf16" else 4
            t = moba.mma_tiles(N, xtype)
            ld_bytes = t["MOBA_MMA_LD"] * esize
            # rows padded by 16 bytes (banks: tests/test_moba_mma_fragments.py)
            assert ld_bytes == N * esize + 16
            assert t["MOBA_MMA_Q"] == moba.tiles(N)["MOBA_FQ"]
            for group, (offsets, side_words, tile_elems) in moba.mma_smem_layouts(N, xtype).items():
                assert side_words % 4 == 0
                tiles = [v for name, v in offsets.items() if name.split("_")[-1] in ("Q", "K", "V", "DO")]
                assert tiles[0] == 0 and all((v * esize) % 16 == 0 for v in tiles)
                assert moba.mma_smem_bytes(N, group, xtype) <= H200.smem_per_block


def test_bf16_needs_the_output_residual():
    sc = moba.carve(1 << 30, 1, 64, 2, 64, 16, 3, "bf16")
    p = [DevPtr(i * A, "bf16") for i in range(1, 9)]
    del sc["olo"]
    with pytest.raises(ValueError, match="olo"):
        moba.forward(*p[:4], sc, 1, 64, 2, 64, 16, 3, H200)
    with pytest.raises(ValueError, match="olo"):
        moba.backward(*p, sc, 1, 64, 2, 64, 16, 3, H200, method="mma")


def test_mma_method_validates():
    sc = moba.carve(1 << 30, 1, 64, 2, 16, 16, 3)
    with pytest.raises(ValueError, match="head sizes"):
        moba.forward(x(1), x(2), x(3), x(4), sc, 1, 64, 2, 16, 16, 3, H200, method="mma")
    with pytest.raises(ValueError, match="method"):
        moba.backward(*(x(i) for i in range(1, 9)), sc, 1, 64, 2, 16, 16, 3, H200, method="tensor")


def test_mma_register_budget_matches_shared_memory():
    """The CTAs per SM the bf16 kernels' registers are budgeted for also fit in shared memory (an SM has
    the opt-in per-block size plus the 1 KiB the hardware reserves per CTA, 228 KiB in all)."""
    sm_bytes = H200.smem_per_block + 1024
    for N in moba.MMA_HEAD_SIZES:
        for group, blocks in moba.mma_min_blocks(N).items():
            assert blocks * (moba.mma_smem_bytes(N, group, "bf16") + 1024) <= sm_bytes, (N, group)


@pytest.mark.parametrize("N", moba.MMA_HEAD_SIZES)
@pytest.mark.parametrize("xtype", ["f32", "bf16"])
def test_mma_kernels_do_not_spill(xtype, N):
    """ptxas: the tensor-core kernels keep everything in registers (within their __launch_bounds__)."""
    from rwkvx.runtime import nvrtc
    ok, why = nvrtc.nvrtc_available()
    if not ok:
        pytest.skip(f"NVRTC is not installed/usable: {why}")
    usage = nvrtc.resource_usage("moba/mma", "sm_90", moba.MMA_CU.defines(xtype, {"HEAD_SIZE": N}))
    mma = {name: u for name, u in usage.items() if name.endswith("_mma")}
    assert len(mma) == 5
    assert all(u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0 for u in mma.values()), mma


@pytest.mark.parametrize("method", ["exact", "mma"])
def test_emulated_backward_runs_the_twin_once(monkeypatch, method):
    """tests/emulator.py's MoBA backward: the launch list of :func:`moba.backward` on the CPU gives the
    twin's dq, dk, dv with the twin run once (moba_bwd_dq_own's launch; moba_bwd_dkdv's writes what it
    left), and moba_bwd_dkdv without that launch before it raises."""
    B, T, H, N, chunk, top_k = 2, 40, 2, 32, 8, 3           # N 32: a head size of both methods
    shape = (B, T, H, N)
    mem = emulator.Memory()
    for i in range(1, 9):                          # q, k, v, o, do, dq, dk, dv
        mem.add(i * A, B * T * H * N * 4)
    sc = moba.carve(16 * A, B, T, H, N, chunk, top_k)
    mem.add(16 * A, moba.scratch_bytes(B, T, H, N, chunk, top_k))
    rng = seeded_rng()
    inputs = {i: rng.standard_normal(shape) for i in (1, 2, 3, 5)}
    for i, values in inputs.items():
        mem.write(x(i), values)
    calls = []
    twin = O.moba_attention_backward
    monkeypatch.setattr(emulator.O, "moba_attention_backward", lambda *args: calls.append(args) or twin(*args))
    fwd = moba.forward(x(1), x(2), x(3), x(4), sc, B, T, H, N, chunk, top_k, H200, method=method)
    bwd = moba.backward(x(1), x(2), x(3), x(4), x(5), x(6), x(7), x(8), sc, B, T, H, N, chunk, top_k, H200,
                        method=method)
    emulator.run(mem, fwd + bwd)
    assert len(calls) == 1 and not mem.pending
    want = twin(*(mem.read(x(i), B * T * H * N, shape) for i in (1, 2, 3, 5)), chunk, top_k, None)
    for i, w in zip((6, 7, 8), want):
        assert np.array_equal(mem.read(x(i), B * T * H * N, shape), w.astype(np.float32))
    with pytest.raises(RuntimeError, match="no moba_bwd_dq_own launch"):
        emulator.run(mem, [op for op in bwd if op.name.startswith("moba_bwd_dkdv")])
