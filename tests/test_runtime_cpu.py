"""CPU tests of the GPU runtime: op validation, GEMM helper mapping, Plan packing, the no-GPU error."""
import struct

import numpy as np
import pytest

from gemm_cases import GEMM_CASES
from rwkvx.runtime import Copy, CopyDtoH, CopyHtoD, DevPtr, Gemm, GemmPrecision, Launch, Memset, flatten_ops
from rwkvx.runtime import gemm as G
from rwkvx.precision import PRECISION_NAMES, resolve_precision
from rwkvx.runtime.ops import as_ptr

from seeding import seeded_rng


# ---------------------------------------------------------------- op records
def test_launch_normalizes():
    op = Launch("m", "k", grid=4, block=(32, 2), args=[("p", 16), ("i", -3), ("l", 1 << 40),
                                                        ("f", 1), ("d", 2.5)], defines={"HEAD_SIZE": 64})
    assert op.grid == (4, 1, 1) and op.block == (32, 2, 1)
    assert op.args == (("p", 16), ("i", -3), ("l", 1 << 40), ("f", 1.0), ("d", 2.5))
    assert op.defines == (("HEAD_SIZE", "64"),)
    assert hash(op) == hash(Launch("m", "k", (4,), (32, 2, 1), 0, op.args, (("HEAD_SIZE", 64),)))


class _Buf:
    ptr = 4096


def test_launch_accepts_buffers_as_pointers():
    assert Launch("m", "k", args=(("p", _Buf()),)).args == (("p", 4096),)
    assert Memset(_Buf(), 8).ptr == 4096


@pytest.mark.parametrize("args", [
    (("x", 1),),                 # unknown kind
    (("p", 1.5),),               # float as pointer
    (("p", "0x10"),),            # str as pointer
    (("i", 2.0),),               # float as int
    (("i", True),),              # bool is not an int argument
    (("f", "1"),),               # str as float
    (("f", None),),
    ("p",),                      # not a pair
    ((("p", 1, 2)),),            # triple
    "p",                         # not a sequence of pairs
])
def test_launch_bad_args_type_error(args):
    with pytest.raises(TypeError):
        Launch("m", "k", args=args)


@pytest.mark.parametrize("args", [(("i", 1 << 31),), (("i", -(1 << 31) - 1),), (("l", 1 << 63),),
                                  (("p", -1),)])
def test_launch_bad_arg_values(args):
    with pytest.raises(ValueError):
        Launch("m", "k", args=args)


def test_launch_bad_shapes():
    with pytest.raises(ValueError):
        Launch("m", "k", grid=(0, 1, 1))
    with pytest.raises(TypeError):
        Launch("m", "k", grid=(1, 1, 1, 1))
    with pytest.raises(TypeError):
        Launch("m", "k", block=(1.0,))
    with pytest.raises(ValueError):
        Launch("m", "k", smem=-1)
    with pytest.raises(TypeError):
        Launch("", "k")
    with pytest.raises(TypeError):
        Launch("m", None)
    with pytest.raises(TypeError):
        Launch("m", "k", defines={"bad name": 1})


def test_gemm_validation():
    g = Gemm("N", "T", 3, 4, 5, 1, 8, 3, 16, 4, 0, 24, 3)
    assert g.transa is False and g.transb is True and isinstance(g.alpha, float)
    with pytest.raises(ValueError):      # lda < m for transa=N
        Gemm("N", "N", 3, 4, 5, 1.0, 8, 2, 16, 5, 0.0, 24, 3)
    with pytest.raises(ValueError):      # ldb < n for transb=T
        Gemm("N", "T", 3, 4, 5, 1.0, 8, 3, 16, 3, 0.0, 24, 3)
    with pytest.raises(ValueError):      # ldc < m
        Gemm("N", "N", 3, 4, 5, 1.0, 8, 3, 16, 5, 0.0, 24, 2)
    with pytest.raises(TypeError):
        Gemm("X", "N", 3, 4, 5, 1.0, 8, 3, 16, 5, 0.0, 24, 3)
    with pytest.raises(TypeError):
        Gemm("N", "N", 3, 4, 5, "1", 8, 3, 16, 5, 0.0, 24, 3)
    with pytest.raises(TypeError):
        Gemm("N", "N", 3.0, 4, 5, 1.0, 8, 3, 16, 5, 0.0, 24, 3)
    with pytest.raises(TypeError):
        Gemm("N", "N", 3, 4, 5, 1.0, 8, 3, 16, 5, 0.0, 24, 3, precision="bf16")
    bf = GemmPrecision("bf16", "bf16", "f32")
    assert Gemm("N", "N", 3, 4, 5, 1.0, DevPtr(8, "bf16"), 3, DevPtr(16, "bf16"), 5, 0.0, DevPtr(24, "f32"), 3,
                bf).precision.codes() == (14, 14, 0, 68)
    with pytest.raises(TypeError):      # an f32 buffer where the precision says bf16
        Gemm("N", "N", 3, 4, 5, 1.0, DevPtr(8, "f32"), 3, DevPtr(16, "bf16"), 5, 0.0, DevPtr(24, "f32"), 3, bf)
    assert g.D == g.C == 24                                      # in place unless D is given
    assert Gemm("N", "T", 3, 4, 5, 1.0, 8, 3, 16, 4, 1.0, 24, 3, D=32).D == 32
    with pytest.raises(TypeError):      # D has C's element type
        Gemm("N", "N", 3, 4, 5, 1.0, DevPtr(8, "bf16"), 3, DevPtr(16, "bf16"), 5, 0.0, DevPtr(24, "f32"), 3, bf,
             DevPtr(32, "bf16"))


@pytest.mark.parametrize("kwargs", [dict(a="f64"), dict(c="f16"), dict(compute="fp16"),
                                    dict(a="bf16", b="bf16", compute="tf32"), dict(compute="fp64"),
                                    dict(a="f64", b="f64", c="f64")])
def test_gemm_precision_validation(kwargs):
    with pytest.raises(ValueError):
        GemmPrecision(**kwargs)


def test_gemm_precisions_carry_their_compute_type():
    assert G.FP32.codes() == (0, 0, 0, 68) and G.TF32.codes() == (0, 0, 0, 77)
    assert G.FP64.codes() == (1, 1, 1, 70)       # CUDA_R_64F operands and output, CUBLAS_COMPUTE_64F
    assert G.linear(1, 2, 3, 10, 4, 6, precision=G.TF32).precision is G.TF32
    assert tuple(G.PRESETS) == PRECISION_NAMES


def test_gemm_mode_resolves_from_operand_types():
    bf16, tf32 = resolve_precision("bf16").gemm, resolve_precision("tf32").gemm
    x, w, y32 = DevPtr(256, "bf16"), DevPtr(512, "bf16"), DevPtr(1024, "f32")
    assert G.linear(x, w, y32, 10, 4, 6, precision=bf16).precision == GemmPrecision("bf16", "bf16", "f32")
    assert G.linear(x, w, DevPtr(2048, "bf16"), 10, 4, 6, precision=bf16).precision.c == "bf16"
    f = DevPtr(256, "f32")
    assert G.linear(f, f, f, 10, 4, 6, precision=tf32).precision == G.TF32
    with pytest.raises(TypeError):
        G.linear(f, w, y32, 10, 4, 6, precision=bf16)       # a bf16 GEMM with an fp32 operand
    with pytest.raises(TypeError):
        G.linear(x, w, y32, 10, 4, 6, precision="bf16")     # modes are resolved by rwkvx.precision only


def test_precision_is_resolved_once_by_name():
    p = resolve_precision("bf16")
    assert resolve_precision(p) is p and (p.xtype, str(p)) == ("bf16", "bf16")
    assert [resolve_precision(n).xtype for n in PRECISION_NAMES] == ["f32", "f32", "bf16"]
    with pytest.raises(ValueError, match="fp32, tf32, bf16"):
        resolve_precision("fp16")
    with pytest.raises(TypeError):
        resolve_precision(16)


def test_typed_pointers():
    p = DevPtr(4096, "bf16")
    assert p.offset(3) == 4102 and p.offset(3).elem == "bf16" and int(p + 2) == 4098
    assert not isinstance(p + 2, DevPtr)            # arithmetic drops the type: use offset()
    assert as_ptr(None) == 0 and as_ptr(p) == 4096 and as_ptr(_Buf()) == 4096
    with pytest.raises(ValueError):
        DevPtr(8, "f16")


def test_memset_copy_validation():
    assert Copy(1, 2, 3).nbytes == 3 and CopyHtoD(1, 2, 3).host_ptr == 2 and CopyDtoH(1, 2, 3).src == 2
    with pytest.raises(ValueError):
        Memset(1, -1)
    with pytest.raises(TypeError):
        Memset("1", 8)
    with pytest.raises(TypeError):
        Copy(1, 2, 3.0)


def test_flatten_ops():
    a, b, c = Memset(1, 1), Copy(1, 2, 3), Launch("m", "k")
    assert flatten_ops([a, [b, (c,)], []]) == [a, b, c]
    with pytest.raises(TypeError):
        flatten_ops([a, "not an op"])


# ---------------------------------------------------------------- GEMM mapping (column-major emulation)
def _cm_index(rows, cols, ld):
    return np.arange(rows)[:, None] + np.arange(cols)[None, :] * ld


def emulate_sgemm(g: Gemm, mem: dict):
    """Column-major cuBLAS GEMM on flat float64 numpy arrays keyed by pointer."""
    A, B, C, D = mem[g.A], mem[g.B], mem[g.C], mem[g.D]
    opA = A[_cm_index(g.k, g.m, g.lda)].T if g.transa else A[_cm_index(g.m, g.k, g.lda)]
    opB = B[_cm_index(g.n, g.k, g.ldb)].T if g.transb else B[_cm_index(g.k, g.n, g.ldb)]
    idx = _cm_index(g.m, g.n, g.ldc)
    D[idx] = g.alpha * (opA @ opB) + g.beta * C[idx]


def _rowmajor_buffer(arr, ld):
    """Row-major 2-D array stored with row stride ld (>= cols) in a flat buffer (padding = NaN)."""
    r, c = arr.shape
    flat = np.full(r * ld, np.nan)
    flat.reshape(r, ld)[:, :c] = arr
    return flat


def _read_rowmajor(flat, r, c, ld):
    return flat.reshape(r, ld)[:, :c]


X, W, Y = 1000, 2000, 3000


@pytest.mark.parametrize("helper", GEMM_CASES)
@pytest.mark.parametrize("beta", [0.0, 0.5])
@pytest.mark.parametrize("pad", [0, 3])
def test_gemm_helper_mapping(helper, beta, pad):
    """Each helper's Gemm, run column-major on padded row-major operands (X holds the first, W the second,
    Y the output), gives its row-major product and leaves the padding alone."""
    rng = seeded_rng(0)
    R, n_in, n_out, alpha = 7, 5, 6, 1.5
    case = GEMM_CASES[helper]
    sizes = case.sizes(R, n_in, n_out)
    first, second, out0 = [rng.normal(size=shape) for shape in sizes]
    ref = alpha * case.product(first, second) + beta * out0
    lds = {keyword: cols + pad for keyword, (_, cols) in zip(case.ld_keywords, sizes)}
    g = getattr(G, helper)(X, W, Y, R, n_in, n_out, beta, alpha=alpha, **lds)
    assert isinstance(g, Gemm)
    out_ld = lds[case.ld_keywords[2]]
    mem = {p: _rowmajor_buffer(arr, ld) for p, arr, ld in zip((X, W, Y), (first, second, out0), lds.values())}
    if beta == 0.0:      # beta = 0 must not read C: poison it (NaN * 0 would leak through otherwise)
        mem[Y][:] = np.where(np.isnan(mem[Y]), np.nan, 0.0)
    emulate_sgemm(g, mem)
    got = _read_rowmajor(mem[Y], *ref.shape, out_ld)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)
    if pad:   # padding columns untouched
        assert np.isnan(mem[Y].reshape(ref.shape[0], out_ld)[:, ref.shape[1]:]).all()


def test_linear_with_an_addend_leaves_it_unchanged():
    """linear(..., addend=Z): Y = alpha * X @ W^T + beta * Z, Z as it was (cuBLASLt's C != D)."""
    rng = seeded_rng(0)
    x, w, z = rng.normal(size=(7, 5)), rng.normal(size=(6, 5)), rng.normal(size=(7, 6))
    Z = 0x4000
    g = G.linear(X, W, Y, 7, 5, 6, beta=1.0, addend=Z)
    assert (g.C, g.D) == (Z, Y)
    mem = {X: x.ravel().copy(), W: w.ravel().copy(), Y: np.full(42, np.nan), Z: z.ravel().copy()}
    emulate_sgemm(g, mem)
    np.testing.assert_allclose(mem[Y].reshape(7, 6), x @ w.T + z, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(mem[Z], z.ravel())


def test_gemm_helper_defaults_dense():
    g = G.linear(1, 2, 3, rows=10, n_in=4, n_out=6)
    assert (g.transa, g.transb, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.beta) == (True, False, 6, 10, 4, 4, 4, 6, 0.0)
    assert (g.A, g.B, g.C) == (2, 1, 3)


# ---------------------------------------------------------------- Plan packing (no GPU: never run)
class _FakePrepared:
    def __init__(self, i):
        self.desc, self.layouts, self.algo_ptr = 0xD00 + i, (0xA00 + i, 0xB00 + i, 0xC00 + i), 0xE00 + i


class _FakeCublas:
    """Stands in for rwkvx.runtime.cublas.CublasLt: fake descriptors numbered by the GEMM's place."""
    handle = 0x1234
    matmul_ptr = 0x5678
    workspace_ptr = 0x9000
    workspace_bytes = 4096

    def __init__(self):
        self.prepared = []

    def prepare(self, ops):
        self.prepared.append(list(ops))
        return [_FakePrepared(i) for i in range(len(ops))]


class _FakeDev:
    stream_handle = 0
    context_handle = 0
    driver_procs: dict = {}
    cublas = _FakeCublas()

    def __init__(self):
        self.calls = []

    def kernel(self, module, name, defines):
        self.calls.append((module, name, defines))
        return 0x1000 + len(self.calls)

    def prepare_kernel(self, fn, smem, name):
        pass


def _core():
    return pytest.importorskip("rwkvx._core", reason="rwkvx._core is not built (python setup.py build_ext --inplace)")


def test_plan_packs_arguments():
    core = _core()
    dev = _FakeDev()
    ops = [Launch("m", "k1", args=(("p", 0xDEADBEEF01), ("i", -7), ("l", -(1 << 40)), ("f", 0.1), ("d", 0.1)),
                  defines={"HEAD_SIZE": 64}),
           [Gemm("N", "N", 2, 2, 2, 1.0, 8, 2, 16, 2, 0.0, 24, 2), Memset(8, 4)],
           Launch("m", "k2"), Copy(1, 2, 3), CopyHtoD(1, 2, 3), CopyDtoH(1, 2, 3)]
    plan = core.Plan(dev, ops)
    assert len(plan) == 7
    assert dev.calls == [("m", "k1", (("HEAD_SIZE", "64"),)), ("m", "k2", ())]
    assert plan.names[0] == "k1" and plan.names[1] == "cublasLtMatmul op #1" and plan.names[3] == "k2"
    assert plan.names[2] == "cuMemsetD8Async op #2" and plan.names[4:] == [
        "cuMemcpyDtoDAsync op #4", "cuMemcpyHtoDAsync op #5", "cuMemcpyDtoHAsync op #6"]
    assert [len(p) for p in dev.cublas.prepared][-1] == 1      # one prepare call with the plan's one GEMM
    packed = plan.packed_args(0)
    assert len(packed) == 5 * 8
    assert struct.unpack_from("<Q", packed, 0)[0] == 0xDEADBEEF01
    assert struct.unpack_from("<i", packed, 8)[0] == -7
    assert struct.unpack_from("<q", packed, 16)[0] == -(1 << 40)
    assert struct.unpack_from("<f", packed, 24)[0] == np.float32(0.1)
    assert struct.unpack_from("<d", packed, 32)[0] == 0.1
    assert plan.packed_args(3) == b""
    with pytest.raises(TypeError):
        plan.packed_args(1)
    with pytest.raises(RuntimeError):      # fake device has no driver entry points: refuses, no crash
        plan.run()


def test_plan_rejects_bad_input():
    core = _core()
    with pytest.raises(TypeError):
        core.Plan(_FakeDev(), [], precision="fp16")
    with pytest.raises(TypeError):
        core.Plan(_FakeDev(), [Memset(1, 1), 42])


def test_sum_float64():
    core = _core()
    x = seeded_rng(1).normal(size=1001)
    s = 0.0
    for v in x:
        s += float(v)
    assert core.sum_float64(x) == s
    assert core.sum_float64(x.reshape(7, 143)) == s
    assert core.sum_float64(np.zeros(0)) == 0.0
    with pytest.raises(TypeError):
        core.sum_float64(x.astype(np.float32))


# ---------------------------------------------------------------- no GPU
def test_device_get_without_gpu_is_helpful():
    from rwkvx.runtime import Device
    try:
        dev = Device.get()
    except RuntimeError as e:
        msg = str(e)
        assert "no CUDA GPU" in msg and "rwkvx.oracle.Oracle" in msg
    else:
        pytest.skip(f"a GPU is available here ({dev.name}); the no-GPU path is not exercised")


# ---------------------------------------------------------------- Plan.run dispatch, with fake entry points
def test_plan_run_dispatch_with_fake_driver():
    """Plan.run's nogil loop against ctypes stand-ins for the driver and cublasLtMatmul: order, arguments,
    error naming, stop at the first failure."""
    import ctypes as C
    core = _core()
    calls = []
    fail_fn = {"addr": None}

    LAUNCH = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint, C.c_uint,
                         C.c_uint, C.c_void_p, C.POINTER(C.c_void_p), C.c_void_p)

    def launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        first = C.cast(params[0], C.POINTER(C.c_uint64))[0] if params else None
        second = C.cast(params[1], C.POINTER(C.c_float))[0] if params else None
        calls.append(("launch", f, (gx, gy, gz), (bx, by, bz), smem, stream, first, second))
        return 1 if f == fail_fn["addr"] else 0

    MEMSET = C.CFUNCTYPE(C.c_int, C.c_ulonglong, C.c_ubyte, C.c_size_t, C.c_void_p)
    DTOD = C.CFUNCTYPE(C.c_int, C.c_ulonglong, C.c_ulonglong, C.c_size_t, C.c_void_p)
    HTOD = C.CFUNCTYPE(C.c_int, C.c_ulonglong, C.c_void_p, C.c_size_t, C.c_void_p)
    DTOH = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_ulonglong, C.c_size_t, C.c_void_p)
    CTXG = C.CFUNCTYPE(C.c_int, C.POINTER(C.c_void_p))
    CTXS = C.CFUNCTYPE(C.c_int, C.c_void_p)
    GEMM = C.CFUNCTYPE(C.c_int, *[C.c_void_p] * 14, C.c_size_t, C.c_void_p)
    ctx = {"cur": 0}

    def gemm(h, desc, alpha, A, la, B, lb, beta, Cp, lc, D, ld, algo, ws, ws_bytes, stream):
        calls.append(("gemm", h, desc, C.cast(alpha, C.POINTER(C.c_float))[0], A, la, B, lb,
                      C.cast(beta, C.POINTER(C.c_float))[0], Cp, lc, D, ld, algo, ws, ws_bytes, stream))
        return 0

    def ctx_get(p):
        p[0] = ctx["cur"]
        return 0

    def ctx_set(c):
        calls.append(("ctx_set", c))
        ctx["cur"] = c
        return 0

    keep = [LAUNCH(launch), MEMSET(lambda d, v, n, s: calls.append(("memset", d, v, n, s)) or 0),
            DTOD(lambda d, s_, n, s: calls.append(("dtod", d, s_, n, s)) or 0),
            HTOD(lambda d, h, n, s: calls.append(("htod", d, h, n, s)) or 0),
            DTOH(lambda h, d, n, s: calls.append(("dtoh", h, d, n, s)) or 0),
            CTXG(ctx_get), CTXS(ctx_set), GEMM(gemm)]
    addr = [C.cast(f, C.c_void_p).value for f in keep]

    class Cub(_FakeCublas):
        handle = 0xAB
        matmul_ptr = addr[7]

    class Dev(_FakeDev):
        stream_handle = 0x5150
        context_handle = 0xC0
        driver_procs = dict(zip(core.DRIVER_PROCS[:5] + ("cuCtxGetCurrent", "cuCtxSetCurrent"), addr[:7]))
        cublas = Cub()

    assert core.DRIVER_PROCS == ("cuLaunchKernel", "cuMemsetD8Async", "cuMemcpyDtoDAsync", "cuMemcpyHtoDAsync",
                                 "cuMemcpyDtoHAsync", "cuCtxGetCurrent", "cuCtxSetCurrent")
    dev = Dev()
    ops = [Launch("m", "ka", grid=(3, 2), block=(64,), smem=128, args=(("p", 0x1234), ("f", 2.5))),
           G.linear(0x10, 0x20, 0x30, rows=6, n_in=4, n_out=5, beta=0.5, precision=G.TF32, addend=0x38),
           Memset(0x40, 16), Memset(0x40, 0), Copy(0x50, 0x60, 8), CopyHtoD(0x70, 0x80, 4), CopyDtoH(0x90, 0xA0, 4),
           Launch("m", "kb")]
    plan = core.Plan(dev, ops)
    plan.run()
    S = 0x5150
    assert calls == [
        ("ctx_set", 0xC0),
        ("launch", 0x1001, (3, 2, 1), (64, 1, 1), 128, S, 0x1234, 2.5),
        ("gemm", 0xAB, 0xD00, 1.0, 0x20, 0xA00, 0x10, 0xB00, 0.5, 0x38, 0xC00, 0x30, 0xC00, 0xE00, 0x9000, 4096, S),
        ("memset", 0x40, 0, 16, S),                       # the empty memset is skipped
        ("dtod", 0x50, 0x60, 8, S), ("htod", 0x70, 0x80, 4, S), ("dtoh", 0x90, 0xA0, 4, S),
        ("launch", 0x1002, (1, 1, 1), (1, 1, 1), 0, S, None, None),
    ]
    calls.clear()
    plan.run()                                            # context already current: no second ctx_set
    assert calls[0][0] == "launch" and len(calls) == 7

    # each GEMM carries its own types (fp32, and bf16 operands with an fp32 output, in one plan) to
    # prepare, and runs with the descriptors prepare gives it
    gemms = [G.linear(0x10, 0x20, 0x30, rows=6, n_in=4, n_out=5, precision=G.FP32),
             G.linear(0x10, 0x20, 0x30, rows=6, n_in=4, n_out=5, precision=G.BF16)]
    mixed = core.Plan(dev, gemms)
    assert [op.precision.codes() for op in dev.cublas.prepared[-1]] == [(0, 0, 0, 68), (14, 14, 0, 68)]
    calls.clear()
    mixed.run()
    assert [(c[2], c[5], c[7], c[10], c[13]) for c in calls] == [(0xD00, 0xA00, 0xB00, 0xC00, 0xE00),
                                                                  (0xD01, 0xA01, 0xB01, 0xC01, 0xE01)]

    # the first failing op stops the loop and is named
    fail_fn["addr"] = 0x1001
    calls.clear()
    from rwkvx.runtime import CudaError
    with pytest.raises(CudaError) as ei:
        plan.run()
    assert "cuLaunchKernel" in str(ei.value) and "ka" in str(ei.value) and "op #0" in str(ei.value)
    assert [c[0] for c in calls] == ["launch"]
    del keep


# ---------------------------------------------------------------- cuBLASLt shapes and algorithm choice (no GPU)
def test_gemm_shape_alignment_and_key():
    from rwkvx.runtime.gemm_shape import GemmShape, alignment
    assert [alignment(p) for p in (0x100, 0x7000, 0x108, 0x102, 0x10)] == [256, 256, 8, 2, 16]
    op = G.linear(DevPtr(0x1000, "bf16"), DevPtr(0x2008, "bf16"), DevPtr(0x3000, "f32"), rows=6, n_in=4, n_out=5,
                  beta=1.0, precision=resolve_precision("bf16").gemm)
    s = GemmShape.of(op)
    assert (s.m, s.n, s.k, s.transa, s.transb, s.reads_c) == (5, 6, 4, True, False, True)
    assert s.align == (8, 256, 256) and s.types == (14, 14, 0, 68)     # A is the weight (0x2008)
    assert s.key() == "TN m5 n6 k4 ld4,4,5 t14,14,0,68 beta1 al8,256,256"
    assert s.c_bytes() == (5 * 5 + 5) * 4
    assert GemmShape.of(G.linear(0x1000, 0x2008, 0x3000, rows=6, n_in=4, n_out=5)) != s


def test_gemm_algo_pick_keeps_the_first_within_the_margin():
    from rwkvx.runtime.gemm_algos import MARGIN, pick
    assert pick([1.0, 1.0 / (1 + MARGIN / 2), 2.0]) == 0
    assert pick([1.0, 0.9, 0.95]) == 1
    assert pick([float("inf"), 3.0, 2.0]) == 2


class _FakeLt:
    """cuBLASLt stand-in for gemm_algos.choose: candidates are numbered Algo structs; no timing needed."""
    version = 130102
    workspace_bytes = 1 << 20

    class dev:                       # noqa: N801 - a namespace standing in for the Device
        name, arch, sm_count, _capturing = "Fake GPU", "sm_90", 2, 0

    def __init__(self):
        self.asked = []

    def candidates(self, shape, count):
        from rwkvx.runtime.gemm_shape import Algo
        self.asked.append(count)
        algos = [Algo() for _ in range(count)]
        for i, a in enumerate(algos):
            a.data[0] = 100 + i
        return algos


def test_gemm_algo_choice_from_the_cache_file_or_untimed(tmp_path, monkeypatch):
    import json
    from rwkvx.runtime import gemm_algos
    from rwkvx.runtime.gemm_shape import Algo, GemmShape
    monkeypatch.setenv("RWKVX_CACHE_DIR", str(tmp_path))
    lt = _FakeLt()
    op = G.linear(0x1000, 0x2000, 0x3000, rows=6, n_in=4, n_out=5)
    shape = GemmShape.of(op)
    saved = Algo()
    saved.data[0] = 7
    (tmp_path / gemm_algos.CACHE_FILE).write_text(json.dumps(
        {gemm_algos._machine_key(lt): {shape.key(): bytes(saved).hex()}}))
    got = gemm_algos.choose(lt, {shape: op})
    assert got[shape].data[0] == 7 and lt.asked == []             # from the file: nothing asked, nothing timed
    monkeypatch.setenv("RWKVX_GEMM_TUNING", "0")                  # untimed: the heuristic's first candidate
    assert gemm_algos.choose(lt, {shape: op})[shape].data[0] == 100 and lt.asked == [1]
    other = G.linear(0x1000, 0x2000, 0x3000, rows=7, n_in=4, n_out=5)
    gemm_algos.choose(lt, {GemmShape.of(other): other})
    assert GemmShape.of(other).key() not in json.loads((tmp_path / gemm_algos.CACHE_FILE).read_text()).popitem()[1]


# ---------------------------------------------------------------- host bf16 rounding
def test_f32_to_bf16_bits_rounds_to_nearest_even():
    """Every float32 bit pattern class (random patterns over the whole range, ties, the largest finite
    values, infinities, NaNs, signed zeros) against the nearest of the two bf16 neighbours, computed in
    float64; more values than one rounding slice, in a 2-D shape."""
    from rwkvx.runtime.dtypes import _BF16_SLICE, bf16_bits_to_f32, f32_to_bf16_bits
    rng = seeded_rng()
    bits = rng.integers(0, 1 << 32, _BF16_SLICE + 4099, dtype=np.uint64).astype(np.uint32)
    edges = [0x00000000, 0x80000000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFFFFFFF,
             0x3F808000, 0x3F818000, 0x00008000, 0x00018000, 0x7F7F8000, 0x7F7F7FFF]
    bits[:len(edges)] = edges
    x = bits.view(np.float32)
    got = f32_to_bf16_bits(x.reshape(-1, 1))
    assert got.shape == (x.size, 1) and got.dtype == np.uint16
    got = got.ravel()
    nan = np.isnan(x)
    assert np.isnan(bf16_bits_to_f32(got[nan])).all()
    down = (bits[~nan] >> 16).astype(np.uint16)                    # truncation: towards zero
    up = down + np.uint16(1)                                       # the next bf16 away from zero
    v = x[~nan].astype(np.float64)
    lo = bf16_bits_to_f32(down).astype(np.float64)
    # past the largest finite bf16 the neighbour away from zero is infinity: nearest-even rounds to it
    # from half an ulp up, as float32 -> bf16 conversion on the GPU does
    top = np.abs(lo) == np.float64(bf16_bits_to_f32(np.uint16(0x7F7F)))
    half_ulp = 2.0 ** (127 - 8)
    with np.errstate(over="ignore", invalid="ignore"):
        hi = np.where(np.abs(lo) == np.inf, lo, bf16_bits_to_f32(up).astype(np.float64))
        d_lo, d_hi = np.abs(v - lo), np.abs(hi - v)
        take_up = np.where(top, d_lo >= half_ulp, (d_hi < d_lo) | ((d_hi == d_lo) & (down & 1 == 1)))
    want = np.where(take_up, up, down)
    bad = np.flatnonzero(got[~nan] != want)
    assert bad.size == 0, f"{bad.size} values rounded wrongly, e.g. bits {bits[~nan][bad[:4]]}"
