"""rwkvx's CUDA kernels executed on the CPU (tests/cuda_cpu: the kernel files compiled by g++, every GPU
thread a fiber) through the GPU tests' own case functions at small shapes: against the float64 twins with
the GPU tests' limits, each case run twice (threads in increasing, then decreasing order) with
bit-identical results. And the tool's own failures: a missing barrier, out-of-bounds writes, a deadlock,
a copy read before its wait; and its warp collectives against CUDA's documented results. Skipped, with the reason, where g++ or x86-64 is missing."""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

from cuda_cpu.executor import INCLUDE, CpuDevice, KernelFault, unavailable_reason  # noqa: E402
from harness import KernelCase, check  # noqa: E402
from rwkvx.runtime.kernel import F32_IN, F32_OUT, I32_OUT, INT, KernelFile  # noqa: E402
from rwkvx.runtime.nvrtc import CU_DIR  # noqa: E402

import test_channelmix  # noqa: E402
import test_decode  # noqa: E402
import test_embedding  # noqa: E402
import test_layernorm  # noqa: E402
import test_loss  # noqa: E402
import test_moba  # noqa: E402
import test_reduce  # noqa: E402
import test_timemix  # noqa: E402
import test_wkv7 as wkv7  # noqa: E402
from seeding import seeded_rng  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def cpu():
    """One CPU device for the module (its compiled kernel files are kept)."""
    return CpuDevice()


# ------------------------------------------------------------------------------------------ WKV7 sequential
SEQUENTIAL = [  # (B, T, H, N, state): T below and past the staging (8 / 16 tokens) and the checkpoint chunk
    # (8); B*H small, so the default splits are the largest (the backward's partial sums and their reduce);
    # N = 128 needs the backward split; from s0 with B > 1 (ds0's reduce over the sequences). One token from a
    # zero state takes two heads: with one, y = v·(k·r) hangs on one 16-term dot, and a draw where it cancels
    # is the whole output's relative error (about 0.4% of draws over 1e-5 in fp32, the kernel as exact as fp32)
    (1, 1, 2, 16, False), (2, 21, 2, 16, False), (3, 19, 2, 16, True), (2, 17, 1, 64, False), (2, 11, 1, 64, True),
    (1, 9, 1, 128, False),
]


@pytest.mark.parametrize("xtype", ["f32", "bf16"])
@pytest.mark.parametrize("B,T,H,N,state", SEQUENTIAL, ids=[f"B{b}-T{t}-H{h}-N{n}{'-s0' * s}" for b, t, h, n, s in SEQUENTIAL])
def test_wkv7_sequential(cpu, xtype, B, T, H, N, state):
    """wkv7/sequential.cu forward and backward (and its reduces) against the twins."""
    wkv7.run_case(KernelCase(cpu, xtype), cpu, B, T, H, N, state=state)


def test_wkv7_sequential_all_splits(cpu):
    """Every forward row split gives the same bits; every backward split is right (N = 16, fp32)."""
    wkv7.test_wkv7_all_splits(cpu, "f32", 16)


# ------------------------------------------------------------------------------------------ WKV7 chunked
CHUNKED = [  # (xtype, method, B, T, H, N, state, segments, key warps): one and two warps per 8 state rows, the
    # one walk and the segmented scan (2 segments: no carry; 3: the carry kernel), T not a multiple of the
    # chunk (16); tf32 products (the TF32 limit in fp32, bf16's limit) and 3xTF32 (the fp32 limit)
    ("f32", "chunked", 2, 37, 1, 32, False, 1, 1), ("f32", "chunked", 1, 75, 1, 32, False, 3, 2),
    ("bf16", "chunked", 1, 40, 2, 64, True, None, 2), ("f32", "chunked_exact", 2, 37, 1, 32, True, 2, 2),
]


@pytest.mark.parametrize("xtype,method,B,T,H,N,state,segments,key_warps", CHUNKED,
                         ids=[f"{x}-{m}-B{b}-T{t}-H{h}-N{n}{'-s0' * s}-S{g}-kw{k}" for x, m, b, t, h, n, s, g, k in CHUNKED])
def test_wkv7_chunked(cpu, monkeypatch, xtype, method, B, T, H, N, state, segments, key_warps):
    """wkv7/chunked.cu (tensor-core mma, cp.async staging, named barriers): every kernel of the forward and
    the backward against the twins."""
    monkeypatch.setattr(wkv7.W, "chunked_key_warps", lambda *_: key_warps)
    wkv7.run_case(KernelCase(cpu, xtype), cpu, B, T, H, N, method=method, state=state, segments=segments)


# ------------------------------------------------------------------------------------------ other families
FAMILY_TESTS = [  # (a GPU test of tests/gpu, its parameters but case, dev and rng): small shapes of each kernel,
    # few head sizes (each one a compile)
    (test_layernorm.test_forward, dict(R=5, C=8, save_stats=True)),
    (test_layernorm.test_forward, dict(R=19, C=256, save_stats=False)),
    (test_layernorm.test_backward, dict(R=19, C=256, stats_valid=False, accumulate=True)),
    (test_layernorm.test_backward, dict(R=5, C=8, stats_valid=True, accumulate=False)),
    (test_layernorm.test_forward_shift, dict(B=3, T=13, C=64, nmix=6, keep_h=True)),
    (test_layernorm.test_forward_shift, dict(B=5, T=1, C=8, nmix=1, keep_h=False)),
    (test_layernorm.test_forward_shift, dict(B=2, T=9, C=2176, nmix=1, keep_h=True)),
    (test_layernorm.test_backward_shift, dict(B=3, T=13, C=64, rpt=7, nmix=6, accumulate=True)),
    (test_layernorm.test_backward_shift, dict(B=5, T=1, C=64, rpt=None, nmix=1, accumulate=False)),
    (test_layernorm.test_backward_shift, dict(B=2, T=5, C=768, rpt=3, nmix=6, accumulate=False)),
    (test_layernorm.test_backward_shift, dict(B=2, T=3, C=2176, rpt=4, nmix=1, accumulate=True)),
    (test_layernorm.test_backward_shift, dict(B=1, T=4, C=2048, rpt=None, nmix=6, accumulate=True)),
    (test_channelmix.test_shift_mix, dict(B=3, T=7, C=64, rpt=None)),
    (test_channelmix.test_mix_backward, dict(B=5, T=1, C=8, rpt=3, accumulate=True)),
    (test_channelmix.test_mix_backward, dict(B=3, T=7, C=64, rpt=None, accumulate=False)),
    (test_channelmix.test_relu_sq, dict(n=3 * 1001)),
    (test_channelmix.test_relu_sq_unaligned, {}),
    (test_timemix.test_shift_forward, dict(C=64, N=16, rpt=5)),
    (test_timemix.test_shift_backward, dict(C=192, N=64, rpt=None, accumulate=True)),
    (test_timemix.test_activations, dict(kind="tanh", n=1001, inplace=True)),
    (test_timemix.test_activations, dict(kind="sigmoid", n=test_timemix.R * 32, inplace=False)),
    (test_timemix.test_prep_forward, dict(C=64, N=16, rpt=None, layer=3)),
    (test_timemix.test_prep_backward, dict(C=64, N=16, rpt=5, layer=3, extras=True, vf_acc=True)),
    (test_timemix.test_prep_backward, dict(C=192, N=64, rpt=None, layer=0, extras=False, vf_acc=False)),
    (test_timemix.test_gn_forward, dict(C=64, N=16, rpt=None)),
    (test_timemix.test_gn_backward, dict(C=192, N=64, rpt=5)),
    (test_reduce.test_partials, dict(P=37, nout=3, C=40, by=8, accumulate=True)),
    (test_embedding.test_embedding_forward_backward, dict(B=3, T=100, V=7, C=64, kind="uniform")),
    (test_decode.test_dec_shift, dict(B=3, C=64, nmix=6)),
    (test_decode.test_dec_ln_shift, dict(B=3, C=64, nmix=6)),
    (test_decode.test_dec_wkv7, dict(B=2, H=3, N=16)),
    (test_decode.test_dec_tmix, dict(B=3, H=2, N=16, layer=0, ranks=(10, 6, 0, 7))),
    (test_decode.test_dec_gemv, dict(B=3, specs=test_decode.GEMV_SPECS["shapes"])),
    (test_decode.test_dec_gemv, dict(B=1, specs=test_decode.GEMV_SPECS["lora"])),
    (test_decode.test_dec_sample_is_the_contract, dict(B=2, V=1000)),
    (test_moba.test_moba_forward_backward, dict(name="N4-chunk1")),
    (test_moba.test_moba_mma_forward_backward, dict(name="T-le-chunk")),
    (test_loss.test_cross_entropy, dict(R=16, V=3, n_ign=2, in_place=False)),
    (test_loss.test_cross_entropy, dict(R=37, V=1001, n_ign=5, in_place=False)),
    (test_loss.test_cross_entropy, dict(R=5, V=4096, n_ign=1, in_place=True)),
    (test_loss.test_loss_only_and_extreme_logits, {}),
]
def _short(value) -> str:
    """A test parameter in a test id: GEMV_SPECS' lists by their name."""
    return next((k for k, v in test_decode.GEMV_SPECS.items() if v is value), str(value))


# each test with a KernelCase in both element types, the others (their own types) once
FAMILY_CASES = [(t, p, x) for t, p in FAMILY_TESTS
                for x in (("f32", "bf16") if "case" in inspect.signature(t).parameters else ("f32",))]


@pytest.mark.parametrize("test,params,xtype", FAMILY_CASES, ids=[
    f"{t.__module__}.{t.__name__}[{','.join(f'{k}={_short(v)}' for k, v in p.items())}]-{x}" for t, p, x in FAMILY_CASES])
def test_family(cpu, test, params, xtype):
    """LayerNorm, channel mix, time mix, reduce, embedding, the decoder's step kernels and tf32 GEMV, MoBA's
    selection, exact and tensor-core attention: the GPU test itself, on the CPU device."""
    given = {"case": KernelCase(cpu, xtype), "dev": cpu, "rng": seeded_rng()}
    test(**{k: v for k, v in given.items() if k in inspect.signature(test).parameters}, **params)


# ------------------------------------------------------------------------------------------ the tool fails
TOY = KernelFile("cpuexec_toy/toy")
TOY_SOURCE = r"""
#include "common.cuh"
#include "cp_async.cuh"
// y[i] = x[63 - i] through shared memory; `fence` 0 leaves out the barrier between the write and the read
extern "C" __global__ void reverse(const float* x, float* y, int fence) {
    __shared__ float s[64];
    s[threadIdx.x] = x[threadIdx.x];
    if (fence) __syncthreads();
    y[threadIdx.x] = s[63 - threadIdx.x];
}
// y[i + shift] = x[i]
extern "C" __global__ void shifted(const float* x, float* y, int shift) { y[threadIdx.x + shift] = x[threadIdx.x]; }
// y[i] = x[i] through dynamic shared memory (64 floats) at an offset of `shift` elements
extern "C" __global__ void dynamic_shifted(const float* x, float* y, int shift) {
    extern __shared__ float dyn[];
    dyn[threadIdx.x + shift] = x[threadIdx.x];
    __syncthreads();
    y[threadIdx.x] = dyn[threadIdx.x + shift];
}
// lanes 0..15 shuffle with the whole warp while lanes 16..31 wait at the block barrier
extern "C" __global__ void split_warp(const float* x, float* y, int unused) {
    float v = x[threadIdx.x];
    if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
    __syncthreads();
    y[threadIdx.x] = v;
}
// y = x through shared memory by cp.async; `wait` 0 reads before the wait for the copy
extern "C" __global__ void staged(const float* x, float* y, int wait) {
    __shared__ __align__(16) float s[64];
    if (threadIdx.x < 16) { cp16(s + 4 * threadIdx.x, x + 4 * threadIdx.x); cp_commit(); }
    if (wait && threadIdx.x < 16) cp_wait<0>();
    __syncthreads();
    y[threadIdx.x] = s[threadIdx.x];
}
// each warp collective of one warp of lanes holding v = 10 l + 1 (and v > 15 as the vote), subgroups of `width`
extern "C" __global__ void collectives(int* y, int width) {
    const int l = threadIdx.x, v = 10 * l + 1;
    y[l] = __shfl_sync(0xffffffffu, v, 5 * l + 3, width);
    y[32 + l] = __shfl_up_sync(0xffffffffu, v, 3, width);
    y[64 + l] = __shfl_down_sync(0xffffffffu, v, 3, width);
    y[96 + l] = __shfl_xor_sync(0xffffffffu, v, 5, width);
    y[128 + l] = (int)__ballot_sync(0xffffffffu, v > 15 && l % 3);
    y[160 + l] = __any_sync(0xffffffffu, l == 31) + 2 * __all_sync(0xffffffffu, l < 31) + 4 * __all_sync(0xffffffffu, l < 32);
    if (l < 16) y[192 + l] = __shfl_xor_sync(0x0000ffffu, v, 1);    // a mask of half the warp
    __syncwarp();
    const long long w = __shfl_xor_sync(0xffffffffu, ((long long)(l + 100) << 32) | v, 5, width);   // 8 bytes
    y[224 + 2 * l] = (int)(w & 0xffffffff);
    y[225 + 2 * l] = (int)(w >> 32);
}
"""
_TOY_ARGS = dict(x=F32_IN, y=F32_OUT)
TOY_REVERSE = TOY.kernel("reverse", **_TOY_ARGS, fence=INT)
TOY_SHIFTED = TOY.kernel("shifted", **_TOY_ARGS, shift=INT)
TOY_DYNAMIC_SHIFTED = TOY.kernel("dynamic_shifted", **_TOY_ARGS, shift=INT)
TOY_SPLIT_WARP = TOY.kernel("split_warp", **_TOY_ARGS, unused=INT)
TOY_STAGED = TOY.kernel("staged", **_TOY_ARGS, wait=INT)
TOY_COLLECTIVES = TOY.kernel("collectives", y=I32_OUT, width=INT)
del KernelFile.registry[TOY.module]      # not a file of rwkvx/cu: the declaration checks must not see it


@pytest.fixture(scope="module")
def toy_cpu():
    """A CPU device that knows the toy kernels' source."""
    return CpuDevice(sources=[(TOY, TOY_SOURCE)])


def _toy(dev, kernel, flag: int, smem: int = 0):
    """The case and the launch of toy ``kernel`` on 64 threads with its int argument ``flag``."""
    case = KernelCase(dev, "f32")
    x = case.input("x", seeded_rng().standard_normal(64), "f32")
    y = case.output("y", 64, "f32")
    return case, kernel.launch((1, 1, 1), (64, 1, 1), smem=smem, x=x, y=y, **{kernel.params[-1][0]: flag})


def test_missing_barrier_shows_between_thread_orders(toy_cpu):
    """With the barrier the two runs (increasing, decreasing thread order) agree and are right; without it
    they differ, which the harness's rerun reports."""
    case, op = _toy(toy_cpu, TOY_REVERSE, 1)
    check("y", case.run([op])["y"], case.seen["x"][::-1], 0.0)
    case, op = _toy(toy_cpu, TOY_REVERSE, 0)
    with pytest.raises(AssertionError, match="second run differs"):
        case.run([op])


def test_out_of_bounds_write_names_the_buffer(toy_cpu):
    """A write one element past the end of y (64 floats, a 256-byte buffer) hits its canary."""
    case, op = _toy(toy_cpu, TOY_SHIFTED, 0)
    check("y", case.run([op])["y"], case.seen["x"], 0.0)
    case, op = _toy(toy_cpu, TOY_SHIFTED, 1)
    with pytest.raises(KernelFault, match="shifted wrote out of bounds of the buffer of argument.s. y "):
        case.run([op])


def test_write_past_dynamic_shared_memory(toy_cpu):
    """A write one element past the launch's dynamic shared memory (64 floats) hits the canary after it."""
    case, op = _toy(toy_cpu, TOY_DYNAMIC_SHIFTED, 0, smem=256)
    check("y", case.run([op])["y"], case.seen["x"], 0.0)
    case, op = _toy(toy_cpu, TOY_DYNAMIC_SHIFTED, 1, smem=256)
    with pytest.raises(KernelFault, match=r"dynamic_shifted, block \(0,0,0\): wrote past its 256 bytes of dynamic"):
        case.run([op])


def test_deadlock_is_reported(toy_cpu):
    """Half a warp at a full-warp shuffle, the other half at __syncthreads: neither can complete."""
    case, op = _toy(toy_cpu, TOY_SPLIT_WARP, 0)
    with pytest.raises(KernelFault, match=r"deadlock in kernel split_warp, block \(0,0,0\): threads 0-15 wait at "
                                          r"__shfl_xor_sync \(mask 0xffffffff\); threads 16-63 wait at __syncthreads"):
        case.run([op])


def test_copy_read_before_its_wait_is_stale(toy_cpu):
    """cp.async copies land at the cp_wait that retires their group: read before it, shared memory still
    holds its undefined start (NaN here)."""
    case, op = _toy(toy_cpu, TOY_STAGED, 1)
    check("y", case.run([op])["y"], case.seen["x"], 0.0)
    case, op = _toy(toy_cpu, TOY_STAGED, 0)
    assert np.isnan(case.run([op])["y"]).all()


@pytest.mark.parametrize("width", [32, 8])
def test_warp_collectives(toy_cpu, width):
    """Shuffles (index, up, down, xor) within subgroups of ``width`` lanes, votes, a half-warp mask, an
    8-byte shuffle: the values CUDA's documentation gives (a source lane outside the subgroup reads the
    lane's own value)."""
    case = KernelCase(toy_cpu, "f32")
    y = case.output("y", 288, "i32")
    out = case.run([TOY_COLLECTIVES.launch((1, 1, 1), (32, 1, 1), y=y, width=width)])["y"]
    lane = np.arange(32)
    v, seg = 10 * lane + 1, lane - lane % width
    src = {"idx": seg + (5 * lane + 3) % width,
           "up": np.where(lane % width >= 3, lane - 3, lane),
           "down": np.where(lane % width + 3 < width, lane + 3, lane),
           "xor": np.where((lane ^ 5) < seg + width, lane ^ 5, lane)}
    for i, (name, s) in enumerate(src.items()):
        np.testing.assert_array_equal(out[32 * i:32 * i + 32], v[s], err_msg=name)
    ballot = sum(1 << int(k) for k in lane if 10 * k + 1 > 15 and k % 3)
    assert (out[128:160] == np.int32(np.uint32(ballot).view(np.int32))).all()
    assert (out[160:192] == 1 + 0 + 4).all()
    np.testing.assert_array_equal(out[192:208], v[lane[:16] ^ 1])
    np.testing.assert_array_equal(out[224::2], v[src["xor"]])
    np.testing.assert_array_equal(out[225::2], lane[src["xor"]] + 100)


def test_launch_limits_are_the_drivers(toy_cpu):
    """A block of more than 1024 threads, or more dynamic shared memory than sm_90 allows, is refused."""
    case, _ = _toy(toy_cpu, TOY_REVERSE, 1)
    x, y = case.input("x2", np.zeros(64), "f32"), case.output("y2", 64, "f32")
    big_block = TOY_REVERSE.launch((1, 1, 1), (2048, 1, 1), x=x, y=y, fence=1)
    big_smem = TOY_REVERSE.launch((1, 1, 1), (64, 1, 1), smem=toy_cpu.info.smem_per_block + 16, x=x, y=y, fence=1)
    with pytest.raises(ValueError, match="exceeds the limits"):
        toy_cpu.plan([big_block]).run()
    with pytest.raises(ValueError, match="dynamic shared memory"):
        toy_cpu.plan([big_smem]).run()


@pytest.mark.parametrize("change, error", [
    ("", r"second run differs|non-finite"),
    ("mbarrier_wait_parity<1>(&cl_bar);", r"deadlock in kernel cross_entropy_loss, block \(0,0,0\)'s cluster .*"
                                          r"wait at mbarrier.try_wait.parity \(shared address \d+, parity 1\)"),
], ids=["no-wait", "wrong-phase"])
def test_cluster_exchange_faults_show(change, error):
    """loss.cu's cluster exchange (st.async into the other blocks' shared memory, counted on their
    mbarriers) without its mbarrier wait reads the slots before the other blocks' stores land; waiting for
    a phase that never completes is a deadlock."""
    kf = KernelFile.registry["loss/loss"]
    src = (CU_DIR / "loss/loss.cu").read_text()
    wait = "mbarrier_wait_parity<0>(&cl_bar);"
    assert src.count(wait) == 1
    dev = CpuDevice(sources=[(kf, src.replace(wait, change))])
    with pytest.raises((AssertionError, KernelFault), match=error):
        test_loss.test_cross_entropy(KernelCase(dev, "f32"), 5, 4096, 1, False)


def test_inline_asm_only_in_the_replaced_headers():
    """Kernel files and family headers take inline PTX from rwkvx/cu's shared headers only, the ones
    tests/cuda_cpu/include replaces, so every kernel file compiles for the CPU."""
    replaced = {CU_DIR / p.name for p in INCLUDE.iterdir()}
    asm = re.compile(r"\basm\s*(?:volatile\s*)?\(")
    offenders = [str(p.relative_to(CU_DIR)) for p in sorted(CU_DIR.rglob("*"))
                 if p.suffix in (".cu", ".cuh") and p not in replaced and asm.search(p.read_text())]
    assert not offenders, f"inline asm outside the shared PTX headers: {offenders}"
