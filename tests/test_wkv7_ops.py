"""CPU tests of the WKV7 launch builders (rwkvx/cu/wkv7/ops.py): argument checks, launch lists, scratch
sizes. No GPU needed (plans assume an H200); the kernel itself is tested in tests/gpu/test_wkv7.py."""
import pytest

from rwkvx.cu.wkv7 import ops as W
from rwkvx.runtime import DevPtr
from rwkvx.runtime.device import H200
from rwkvx.runtime.kernel import KernelFile


def test_wkv7_builders_validate():
    """Bad arguments raise before any GPU work; launch shapes and scratch sizes."""
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 48, H200)                                  # unsupported N
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 64, H200, sa=p(), ckpt=DevPtr(8, "f32"))  # misaligned ckpt
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 64, H200, ckpt=p())                       # ckpt without sa
    with pytest.raises(ValueError):
        W.backward(*[p()] * 15, 1, 10, 1, 128, H200, split=1)                      # N=128 needs P >= 2
    with pytest.raises(ValueError):
        W.backward(*[p()] * 15, 1, 10, 1, 64, H200, split=2)                       # P > 1 needs partials
    ops = W.backward(*[p()] * 15, 1, 10, 1, 64, H200, partials=p(2), split=4)
    assert [o.name for o in ops] == ["wkv7_backward", "wkv7_backward_reduce"]
    assert ops[0].block == (64, 1, 1) and ops[0].grid == (4, 1, 1)
    assert W.scratch_elems(8, 4096, 12, 64, H200) == {"sa": 8 * 4096 * 12 * 64,
                                                       "ckpt": 8 * 12 * 512 * 64 * 64, "partials": 0}


def test_wkv7_chunked_builders():
    """method="chunked": validation, the launch lists, the work buffer and the state passes' shared memory."""
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 64, H200, method="tiled")                 # unknown method
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 128, H200, method="chunked", partials=p())  # N not supported
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 64, H200, method="chunked")               # no work buffer
    with pytest.raises(ValueError):
        W.backward(*[p()] * 15, 1, 10, 1, 64, H200, method="chunked", partials=p(), split=16)
    ops = W.forward(*[p()] * 7, 2, 33, 3, 64, H200, sa=p(), ckpt=p(), method="chunked", partials=p())
    assert [o.name for o in ops] == ["wkv7c_intra", "wkv7c_forward_state"]
    assert ops[0].grid == (3, 3, 2) and ops[1].grid == (4, 3, 2) and ops[1].block == (128, 1, 1)
    ops = W.backward(*[p()] * 15, 8, 4096, 12, 64, H200, method="chunked", partials=p())
    assert [o.name for o in ops] == ["wkv7c_intra", "wkv7c_backward_state", "wkv7c_backward_grads"]
    assert ops[1].grid == (4, 12, 8) and ops[1].block == (128, 1, 1) and ops[2].grid == (256, 12, 8)
    for op in ops:
        assert op.smem <= H200.smem_per_block
    sizes = W.scratch_elems(8, 4096, 12, 64, H200, method="chunked")
    nc = 8 * 12 * 256
    assert sizes["ckpt"] == nc * 64 * 64 and sizes["sa"] == 8 * 4096 * 12 * 64
    assert sizes["partials"] == nc * W._record_floats(64, W.BWD_RECORD) + nc * 64 * 64 + 8 * 4096 * 12 * 64


def test_wkv7_chunked_exact_builders():
    """method="chunked_exact": the chunked kernels' 3xTF32 variant, f32 inputs only."""
    p = lambda i=1, elem="f32": DevPtr(16 * i, elem)      # noqa: E731
    with pytest.raises(ValueError, match="f32 inputs"):
        W.forward(*[p(1, "bf16")] * 7, 1, 10, 1, 64, H200, method="chunked_exact", partials=p())
    with pytest.raises(ValueError, match="f32 inputs"):
        W.backward(*[p(1, "bf16")] * 15, 1, 10, 1, 64, H200, method="chunked_exact", partials=p())
    for method, exact in (("chunked", "0"), ("chunked_exact", "1")):
        ops = W.forward(*[p()] * 7, 2, 33, 3, 64, H200, sa=p(), ckpt=p(), method=method, partials=p())
        ops += W.backward(*[p()] * 15, 2, 33, 3, 64, H200, method=method, partials=p())
        assert len(ops) == 5 and all(dict(op.defines)["WKV_EXACT"] == exact for op in ops)
    assert W.scratch_elems(8, 4096, 12, 64, H200, method="chunked_exact") == \
        W.scratch_elems(8, 4096, 12, 64, H200, method="chunked")


def test_wkv7_chunked_split_fills_the_device():
    """The state rows split over as many blocks as one wave holds (two groups of 8 rows or more each),
    the keys of each group over two warps while the pass has at most STATE_WARPS_PER_SM warps per SM."""
    assert W.chunked_split(8, 12, 64, H200) == 4 and W.chunked_split(8, 64, 64, H200) == 1
    assert W.chunked_split(1, 12, 64, H200) == 4
    assert W.chunked_split(1, 1, 32, H200) == 2
    assert W.chunked_key_warps(1, 12, 64, H200) == W.chunked_key_warps(8, 12, 64, H200) == 2
    assert W.chunked_key_warps(16, 12, 64, H200) == W.chunked_key_warps(8, 64, 64, H200) == 1


def test_wkv7_chunked_kept_records():
    """A forward given ``records`` computes the backward's chunk records in its own intra launch (mode 2), the
    backward given them runs no intra launch; records need the chunked method and a saving forward."""
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    saved = dict(sa=p(3), ckpt=p(4))
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 64, H200, method="chunked", partials=p(), records=p(5))  # no sa, ckpt
    with pytest.raises(ValueError):
        W.forward(*[p()] * 7, 1, 10, 1, 64, H200, **saved, records=p(5))                      # sequential
    with pytest.raises(ValueError):
        W.backward(*[p()] * 15, 1, 10, 1, 64, H200, records=p(5))                              # sequential
    with pytest.raises(ValueError):
        W.scratch_elems(1, 10, 1, 64, H200, kept_records=True)
    fwd = W.forward(*[p()] * 7, 1, 10, 1, 64, H200, **saved, method="chunked", partials=p(6), records=p(5))
    assert fwd[0].name == "wkv7c_intra" and fwd[0].args[-1][1] == W.INTRA_BOTH
    bwd = W.backward(*[p()] * 15, 1, 10, 1, 64, H200, method="chunked", partials=p(6), records=p(5))
    assert [o.name for o in bwd] == ["wkv7c_backward_state", "wkv7c_backward_grads"]
    plain, kept = (W.scratch_elems(8, 4096, 12, 64, H200, method="chunked", kept_records=k) for k in (False, True))
    assert kept["records"] + kept["partials"] == plain["partials"]         # N = 64: no more memory


def launch_args(op) -> dict:
    """A launch's argument values by parameter name (pointers as ints)."""
    names = [n for n, _ in KernelFile.registry[op.module].kernels[op.name].params]
    return {n: value for n, (_, value) in zip(names, op.args)}


@pytest.mark.parametrize("method", W.METHODS)
def test_wkv7_initial_state_builders(method):
    """s0 reaches the forward's state kernel (and the sequential backward); ds0 adds the ordered batch sum
    when B > 1 (none for B = 1: the backward writes ds0 itself); its scratch is [B, H, N, N]."""
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    work = {"method": method, "partials": p()}
    ops = W.forward(*[p()] * 7, 2, 33, 3, 64, H200, sa=p(), ckpt=p(), s0=p(5), **work)
    assert launch_args(ops[-1])["s_init"] == 16 * 5
    assert launch_args(W.forward(*[p()] * 7, 2, 33, 3, 64, H200, sa=p(), ckpt=p(), **work)[-1])["s_init"] == 0
    with pytest.raises(ValueError, match="aligned"):
        W.forward(*[p()] * 7, 2, 33, 3, 64, H200, s0=DevPtr(8, "f32"), **work)
    with pytest.raises(ValueError, match="ds0"):
        W.backward(*[p()] * 15, 2, 33, 3, 64, H200, ds0_partials=p(), **work)
    with pytest.raises(ValueError, match="ds0_partials"):
        W.backward(*[p()] * 15, 2, 33, 3, 64, H200, s0=p(), ds0=p(), **work)           # B > 1 needs scratch
    plain = [o.name for o in W.backward(*[p()] * 15, 2, 33, 3, 64, H200, **work)]
    ops = W.backward(*[p()] * 15, 2, 33, 3, 64, H200, s0=p(), ds0=p(6), ds0_partials=p(7), **work)
    assert [o.name for o in ops] == plain + ["wkv7_state_reduce"]
    assert {k: launch_args(ops[-1])[k] for k in ("part", "ds0", "n", "B")} == {"part": 16 * 7, "ds0": 16 * 6,
                                                                              "n": 3 * 64 * 64, "B": 2}
    assert [launch_args(o)["ds_part"] for o in ops if "ds_part" in launch_args(o)] == [16 * 7]
    ops = W.backward(*[p()] * 15, 1, 33, 3, 64, H200, s0=p(), ds0=p(6), **work)
    assert [o.name for o in ops] == plain
    assert [launch_args(o)["ds_part"] for o in ops if "ds_part" in launch_args(o)] == [16 * 6]
    sizes = W.scratch_elems(2, 33, 3, 64, H200, method=method, ds0=True)
    assert sizes == {**W.scratch_elems(2, 33, 3, 64, H200, method=method), "ds0_partials": 2 * 3 * 64 * 64}
    assert W.scratch_elems(1, 33, 3, 64, H200, method=method, ds0=True)["ds0_partials"] == 0


def test_wkv7_segment_layout():
    """m = ceil(n_c / S) chunks per segment, ceil(n_c / m) segments (never more than asked); bad counts raise."""
    assert W.segment_layout(16384, 8) == (128, 8)
    assert W.segment_layout(1000, 3) == (21, 3)          # 63 chunks
    assert W.segment_layout(100, 5) == (2, 4)            # 7 chunks: 2 + 2 + 2 + 1
    assert W.segment_layout(33, 1) == (3, 1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError):
            W.segment_layout(100, bad)


def test_wkv7_chunked_segments_choice():
    """Segments where B*H leaves the device idle (B1 T16384 H12: 48 state-pass blocks on 132 SMs; B1 T4096
    H32, state tuning's shape), none where it fills a wave (the shapes benchmarked before segments: their
    launches stay as they were), none for a sequence of few chunks."""
    assert W.chunked_segments(1, 16384, 12, 64, H200) == 8
    assert W.chunked_segments(1, 4096, 32, 64, H200) > 1 and W.chunked_segments(1, 4096, 1, 64, H200) > 1
    for B, T, H in ((8, 4096, 12), (16, 512, 12), (8, 4096, 64), (2, 33, 3), (1, 16, 1), (2, 16384, 32)):
        assert W.chunked_segments(B, T, H, 64, H200) == 1, (B, T, H)
    for B, T, H, N in ((1, 16384, 12, 64), (1, 4096, 32, 64), (1, 1000, 1, 32)):
        S = W.chunked_segments(B, T, H, N, H200)
        assert W._scan_steps(B, T, H, N, S, H200) <= W.SEGMENT_GAIN * W._scan_steps(B, T, H, N, 1, H200)
        assert 1 < S <= W.MAX_SEGMENTS and W.segment_layout(T, S)[1] == S


@pytest.mark.parametrize("S", [2, 5])
def test_wkv7_chunked_segmented_launches(S):
    """segments = S > 1: each state pass is the summary walk (2P blocks per segment, outputs NULL, seg),
    the carry over the segments (none for S = 2) and the walk of every segment writing the outputs; seg
    leads the work buffer (the records, dS and dX follow it); S = 1 is the one walk (seg NULL, m = n_c)."""
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    B, T, H, N = 2, 1000, 3, 64
    m, S = W.segment_layout(T, S)
    seg = B * H * S * 2 * N * N
    P = W.chunked_split(B, H, N, H200)
    work = dict(method="chunked", partials=p(100), segments=S)
    fwd = W.forward(*[p()] * 6, p(7), B, T, H, N, H200, sa=p(8), ckpt=p(9), s0=p(10), **work)
    bwd = W.backward(*[p()] * 6, p(7), p(8), p(9), *[p(11)] * 6, B, T, H, N, H200, s0=p(10), ds0=p(12),
                     ds0_partials=p(13), **work)
    carry = ["wkv7c_segment_carry"] if S > 2 else []
    assert [o.name for o in fwd] == ["wkv7c_intra", "wkv7c_forward_state", *carry, "wkv7c_forward_state"]
    assert [o.name for o in bwd] == ["wkv7c_intra", "wkv7c_backward_state", *carry, "wkv7c_backward_state",
                                     "wkv7c_backward_grads", "wkv7_state_reduce"]
    assert launch_args(fwd[0])["rec"] == launch_args(bwd[0])["rec"] == 16 * 100 + 4 * seg
    for ops, outputs, reverse in ((fwd, ("y", "sa_out", "s0"), 0), (bwd, ("dv", "dx", "ds", "ds_part"), 1)):
        summary, *mid, walk = ops[1:3 + len(carry)]
        assert summary.grid == (2 * P, H, B * S) and walk.grid == (P, H, B * S) and summary.block == walk.block
        a, b = launch_args(summary), launch_args(walk)
        assert (a["summary"], b["summary"], a["m"], b["m"], a["seg"], b["seg"]) == (1, 0, m, m, 1600, 1600)
        assert all(a[n] == 0 for n in outputs) and all(b[n] != 0 for n in outputs)
        for op in mid:
            assert op.grid == (N // 8, H, B) and launch_args(op) == {"seg": 1600, "S": S, "reverse": reverse}
    assert launch_args(fwd[1])["s_init"] == launch_args(fwd[-1])["s_init"] == 160
    sizes = W.scratch_elems(B, T, H, N, H200, method="chunked", segments=S)
    assert sizes["partials"] == seg + W.scratch_elems(B, T, H, N, H200, method="chunked", segments=1)["partials"]
    one = W.forward(*[p()] * 6, p(7), B, T, H, N, H200, sa=p(8), ckpt=p(9), **{**work, "segments": 1})
    assert [o.name for o in one] == ["wkv7c_intra", "wkv7c_forward_state"] and one[1].grid == (P, H, B)
    assert {k: launch_args(one[1])[k] for k in ("seg", "m", "summary")} == {"seg": 0, "m": W.n_chunks(T, "chunked"),
                                                                             "summary": 0}
    assert launch_args(one[0])["rec"] == 1600


def test_wkv7_segments_need_a_chunked_method():
    p = lambda i=1: DevPtr(16 * i, "f32")      # noqa: E731
    with pytest.raises(ValueError, match="segments"):
        W.forward(*[p()] * 7, 1, 100, 1, 64, H200, segments=2)
    with pytest.raises(ValueError, match="segments"):
        W.backward(*[p()] * 15, 1, 100, 1, 64, H200, segments=2)
    with pytest.raises(ValueError, match="segments"):
        W.scratch_elems(1, 100, 1, 64, H200, segments=2)
    with pytest.raises(ValueError, match="segments"):
        W.forward(*[p()] * 7, 1, 100, 1, 64, H200, method="chunked", partials=p(), segments=0)
    with pytest.raises(ValueError, match="65535"):
        W.forward(*[p()] * 7, 65535, 100, 1, 64, H200, method="chunked", partials=p(), segments=2)
