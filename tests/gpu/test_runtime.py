"""GPU tests of rwkvx.runtime and rwkvx._core: launches through a Plan, memset/copies, cuBLAS GEMMs,
error reporting, graph capture/replay, pinned copies, memory accounting."""
from __future__ import annotations

import gc
import struct
import zlib

import numpy as np
import pytest

from gemm_cases import GEMM_CASES
from rwkvx.oracle import rel_err
from rwkvx.runtime import (Copy, CopyDtoH, CopyHtoD, CudaError, Event, Graph, Launch, Memset,
                           gemm as G)
from rwkvx.runtime.dtypes import round_to, to_storage

from seeding import seeded_rng

MOD = "rwkvx_test_runtime"
SRC = r'''
extern "C" __global__ void rt_axpy(float* y, const float* x, float a, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}

extern "C" __global__ void rt_args(unsigned long long* out, long long l, int i, float f, double d,
                                   const float* p) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        out[0] = (unsigned long long)l;
        out[1] = (unsigned long long)(long long)i;
        out[2] = (unsigned long long)__float_as_uint(f);
        out[3] = (unsigned long long)__double_as_longlong(d);
        out[4] = (unsigned long long)p;
    }
}

extern "C" __global__ void rt_smem(float* out, int n) {
    extern __shared__ float s[];
    for (int j = threadIdx.x; j < n; j += blockDim.x) s[j] = (float)j;
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) out[j] = s[n - 1 - j];
}

#ifndef HEAD_SIZE
#define HEAD_SIZE 1
#endif
extern "C" __global__ void rt_define(int* out) { out[0] = HEAD_SIZE; }
'''


@pytest.fixture(scope="module")
def d(dev):
    dev.add_source(MOD, SRC)
    return dev


def plan_of(dev, ops):
    from rwkvx._core import Plan
    return Plan(dev, ops)


def axpy(y, x, a, n):
    return Launch(MOD, "rt_axpy", grid=((n + 127) // 128,), block=(128,), args=(("p", y), ("p", x), ("f", a),
                                                                                 ("i", n)))


# ------------------------------------------------------------------------------------------ device
def test_device_singleton_and_arch(d):
    from rwkvx.runtime import Device
    assert Device.get() is d
    major, minor = d.compute_capability
    assert d.arch == f"sm_{major}{minor}"
    assert d.stream_handle != 0 and d.context_handle != 0


def test_memory_accounting(d):
    gc.collect()
    before = d.memory_info()
    buf = d.alloc(64 << 20)
    mid = d.memory_info()
    assert mid["allocated"] == before["allocated"] + (64 << 20)
    assert mid["peak_allocated"] >= mid["allocated"]
    assert 0 < mid["free"] <= mid["total"]
    buf.close()
    buf.close()                       # idempotent
    assert d.memory_info()["allocated"] == before["allocated"]


def test_upload_download_roundtrip(d):
    x = seeded_rng(0).normal(size=(33, 7)).astype(np.float32)
    buf = d.to_device(x)
    np.testing.assert_array_equal(d.download(buf, x.shape, np.float32), x)


# ------------------------------------------------------------------------------------------ launches
def test_kernel_through_plan(d):
    n = 1000
    rng = seeded_rng(1)
    x, y = rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32)
    bx, by = d.to_device(x), d.to_device(y)
    plan = plan_of(d, [axpy(by, bx, 2.0, n)])
    plan.run()
    d.synchronize()
    np.testing.assert_array_equal(d.download(by, n), y + np.float32(2.0) * x)
    plan.run()                        # a plan runs many times
    d.synchronize()
    np.testing.assert_allclose(d.download(by, n), y + 4 * x.astype(np.float64), rtol=1e-6, atol=1e-6)


def test_all_argument_kinds_reach_the_kernel(d):
    out = d.zeros(5 * 8)
    p = d.alloc(16)
    plan = plan_of(d, [Launch(MOD, "rt_args", args=(("p", out), ("l", -(1 << 40) - 3), ("i", -123456),
                                                     ("f", 0.1), ("d", -2.0 / 3.0), ("p", p)))])
    plan.run()
    d.synchronize()
    got = d.download(out, 5, np.uint64)
    assert struct.unpack("<q", struct.pack("<Q", int(got[0])))[0] == -(1 << 40) - 3
    assert struct.unpack("<q", struct.pack("<Q", int(got[1])))[0] == -123456
    assert struct.unpack("<f", struct.pack("<I", int(got[2])))[0] == np.float32(0.1)
    assert struct.unpack("<d", struct.pack("<Q", int(got[3])))[0] == -2.0 / 3.0
    assert int(got[4]) == p.ptr


def test_large_dynamic_shared_memory(d):
    n = 20000                         # 80 000 bytes > the 48 KiB default limit
    out = d.alloc(4 * n)
    plan_of(d, [Launch(MOD, "rt_smem", grid=1, block=256, smem=4 * n, args=(("p", out), ("i", n)))]).run()
    d.synchronize()
    np.testing.assert_array_equal(d.download(out, n), np.arange(n, dtype=np.float32)[::-1])


def test_defines_select_module_variants(d):
    out = d.zeros(8)
    ops = [Launch(MOD, "rt_define", args=(("p", out),), defines={"HEAD_SIZE": 64}),
           Launch(MOD, "rt_define", args=(("p", out.ptr + 4),), defines=(("HEAD_SIZE", 32),))]
    plan_of(d, ops).run()
    d.synchronize()
    assert d.download(out, 2, np.int32).tolist() == [64, 32]
    assert d.kernel(MOD, "rt_define", {"HEAD_SIZE": 64}) is d.kernel(MOD, "rt_define", (("HEAD_SIZE", "64"),))


def test_bad_launch_names_the_kernel(d):
    n = 64
    x, y = d.zeros(4 * n), d.zeros(4 * n)
    good = axpy(y, x, 1.0, n)
    bad = Launch(MOD, "rt_axpy", grid=1, block=(4096,), args=good.args)   # > 1024 threads per block
    with pytest.raises(CudaError) as ei:
        plan_of(d, [good, bad]).run()
    msg = str(ei.value)
    assert "rt_axpy" in msg and "op #1" in msg and "cuLaunchKernel" in msg
    d.synchronize()                   # an invalid configuration is not sticky: the context still works
    plan_of(d, [good]).run()
    d.synchronize()


def test_missing_kernel_is_named(d):
    with pytest.raises(CudaError, match="no_such_kernel"):
        d.kernel(MOD, "no_such_kernel")


# ------------------------------------------------------------------------------------------ memset / copies
def test_memset_and_copies(d):
    n = 4099
    a = seeded_rng(2).normal(size=n).astype(np.float32)
    src, dst = d.to_device(a), d.to_device(np.full(n, np.nan, np.float32))
    z = d.to_device(np.full(n, np.nan, np.float32))
    plan_of(d, [Copy(dst, src, 4 * n), Memset(z, 4 * n), Memset(z, 0), Copy(z, src, 0)]).run()
    d.synchronize()
    np.testing.assert_array_equal(d.download(dst, n), a)
    np.testing.assert_array_equal(d.download(z, n), np.zeros(n, np.float32))


def test_pinned_htod_dtoh(d):
    n = 513
    h_in, h_out = d.alloc_pinned(4 * n), d.alloc_pinned(4 * n)
    vin, vout = h_in.array(np.float32, n), h_out.array(np.float32, (n,))
    vin[:] = np.arange(n, dtype=np.float32)
    vout[:] = np.nan
    x, y = d.to_device(np.ones(n, np.float32)), d.alloc(4 * n)
    plan = plan_of(d, [CopyHtoD(y, h_in, 4 * n), axpy(y, x, 0.5, n), CopyDtoH(h_out, y, 4 * n)])
    plan.run()
    d.synchronize()
    np.testing.assert_array_equal(vout, np.arange(n, dtype=np.float32) + 0.5)
    from rwkvx._core import sum_float64
    h64 = d.alloc_pinned(8 * n)
    v64 = h64.array(np.float64)
    v64[:] = np.arange(n)
    assert sum_float64(v64) == float(n * (n - 1) // 2)


def test_event_waits_for_the_work_recorded_before_it(d):
    n = 1 << 20
    event = Event(d)
    assert event.query()                                  # never recorded: nothing to wait for
    h_out, x = d.alloc_pinned(4 * n), d.to_device(np.arange(n, dtype=np.float32))
    out = h_out.array(np.float32, n)
    out[:] = np.nan
    plan = plan_of(d, [CopyDtoH(h_out, x, 4 * n)])
    plan.run()
    event.record()
    event.synchronize()
    assert event.query()
    np.testing.assert_array_equal(out, np.arange(n, dtype=np.float32))
    event.close()
    event.close()                                         # idempotent


# ------------------------------------------------------------------------------------------ GEMM
SHAPES = [(300, 256, 384), (1, 7, 5), (129, 64, 33)]


def _gemm_case(d, helper, rows, n_in, n_out, beta, rng, precision=G.FP32):
    """Returns (op, output buffer, output shape, float64 reference on the operands as stored)."""
    f32 = np.float32
    case = GEMM_CASES[helper]
    a, w, o = [rng.normal(size=shape) for shape in case.sizes(rows, n_in, n_out)]
    o = o.astype(f32)
    if beta == 0.0:
        o[:] = np.nan                  # beta = 0 must not read the output
    assert precision.a == precision.b        # both operands share the element type here
    ea = ew = precision.a
    ref = case.product(round_to(ea, a), round_to(ew, w)) + beta * np.nan_to_num(o.astype(np.float64))
    ba, bw, bo = d.to_device(to_storage(ea, a)), d.to_device(to_storage(ew, w)), d.to_device(o)
    op = getattr(G, helper)(ba.typed(ea), bw.typed(ew), bo.typed("f32"), rows, n_in, n_out, beta, precision=precision)
    return op, (ba, bw, bo), o.shape, ref


@pytest.mark.parametrize("helper", GEMM_CASES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision,tol", [("fp32", 1e-6), ("tf32", 5e-3), ("bf16", 1e-5)])
def test_gemm_vs_numpy(d, helper, shape, precision, tol):
    """fp32, tf32 and bf16 operands with fp32 accumulation (bf16: against float64 on the rounded operands)."""
    rng = seeded_rng(zlib.crc32(f"{helper}{shape}".encode()))
    beta = 0.5 if helper in ("linear_dx", "matmul_dw") else 0.0
    op, bufs, out_shape, ref = _gemm_case(d, helper, *shape, beta, rng, G.PRESETS[precision])
    plan_of(d, [op]).run()
    d.synchronize()
    got = d.download(bufs[2], out_shape, np.float32)
    assert np.isfinite(got).all()
    err = rel_err(got, ref)
    assert err < tol, f"{helper} {shape} {precision}: rel err {err:.3g}"


def test_fp32_is_not_tf32(d):
    """Strict fp32 must be clearly more accurate than TF32 on the same large-k product."""
    rng = seeded_rng(5)
    errs = {}
    for precision in ("fp32", "tf32"):
        op, bufs, shape, ref = _gemm_case(d, "linear", 256, 512, 256, 0.0, rng, G.PRESETS[precision])
        plan_of(d, [op]).run()
        d.synchronize()
        errs[precision] = rel_err(d.download(bufs[2], shape), ref)
    assert errs["fp32"] < 1e-6 and errs["tf32"] > 10 * errs["fp32"], errs


# ------------------------------------------------------------------------------------------ graphs
def _step_ops(d, rng, n=4096, rows=64, n_in=128, n_out=96):
    x = d.to_device(rng.normal(size=n).astype(np.float32))
    y = d.alloc(4 * n)
    init = d.to_device(rng.normal(size=n).astype(np.float32))
    a = d.to_device(rng.normal(size=(rows, n_in)).astype(np.float32))
    w = d.to_device(rng.normal(size=(n_out, n_in)).astype(np.float32))
    out = d.alloc(4 * rows * n_out)
    ops = [Copy(y, init, 4 * n), Memset(out, 4 * rows * n_out), axpy(y, x, 0.25, n), axpy(y, x, -1.5, n),
           G.linear(a.typed("f32"), w.typed("f32"), out.typed("f32"), rows, n_in, n_out, beta=1.0)]
    return ops, (x, y, init, a, w, out), (y, n, out, rows * n_out)


def test_graph_replay_equals_eager(d):
    ops, keep, (y, n, out, m) = _step_ops(d, seeded_rng(3))
    plan = plan_of(d, ops)
    plan.run()                        # eager (also warms modules and cuBLAS)
    d.synchronize()
    eager_y, eager_out = d.download(y, n), d.download(out, m)
    d.upload(y, np.full(n, np.nan, np.float32))
    d.upload(out, np.full(m, np.nan, np.float32))
    graph = Graph.capture(d, plan.run)
    d.synchronize()
    assert np.isnan(d.download(y, n)).all(), "capture must not execute the work"
    for _ in range(3):
        graph.launch()
        d.synchronize()
        np.testing.assert_array_equal(d.download(y, n), eager_y)
        np.testing.assert_array_equal(d.download(out, m), eager_out)
    graph.close()
    graph.close()


def test_graph_reads_pinned_input_at_replay(d):
    n = 256
    h_in, h_out = d.alloc_pinned(4 * n), d.alloc_pinned(4 * n)
    vin, vout = h_in.array(np.float32, n), h_out.array(np.float32, n)
    x, y = d.to_device(np.ones(n, np.float32)), d.alloc(4 * n)
    plan = plan_of(d, [CopyHtoD(y, h_in, 4 * n), axpy(y, x, 1.0, n), CopyDtoH(h_out, y, 4 * n)])
    vin[:] = 0
    plan.run()
    d.synchronize()
    graph = Graph.capture(d, plan.run)
    for k in range(3):
        vin[:] = np.arange(n, dtype=np.float32) * k
        graph.launch()
        d.synchronize()
        np.testing.assert_array_equal(vout, np.arange(n, dtype=np.float32) * k + 1)
    graph.close()


def test_capture_failure_ends_capture_and_reraises(d):
    class Boom(Exception):
        pass

    def fails():
        raise Boom("original")

    with pytest.raises(Boom, match="original"):
        Graph.capture(d, fails)
    # an illegal call during capture (synchronisation) surfaces as a CudaError naming that call
    with pytest.raises(CudaError, match="cuStreamSynchronize"):
        Graph.capture(d, d.synchronize)
    # the stream left capture mode and works
    buf = d.to_device(np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(d.download(buf, 4), np.arange(4, dtype=np.float32))
