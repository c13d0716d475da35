"""CPU tests of the LayerNorm launch builders' fused LayerNorm + token shift (rwkvx/cu/layernorm/ops.py,
``forward_shift``, ``backward_shift``): their launches (grid, block, variant), their input checks, and
ptxas's report of every variant of ln_shift.cu and ln_shift_bwd.cu for sm_90 (no spills). No GPU needed."""
import pytest

from rwkvx.cu import layernorm as ln, timemix as tm
from rwkvx.runtime import DevPtr, nvrtc
from rwkvx.runtime.device import H200


def _buffers():
    addr = iter(range(0x10000, 0x10000 + 4096 * 512, 4096))
    return lambda elem="f32": DevPtr(next(addr), elem)


@pytest.mark.parametrize("R,T,C,nq", [(74, 37, 64, 1), (32768, 4096, 768, 6), (16384, 4096, 2048, 16),
                                      (6, 3, 4096, 16), (9, 9, 1028, 12)])
@pytest.mark.parametrize("nmix", ln.SHIFT_MIXES)
def test_forward_shift_launch(R, T, C, nq, nmix):
    """One launch: a warp per SHIFT_WALK rows, the fewest quads per lane that hold the row (16 at most),
    the unused mixes and outputs NULL, h NULL when not kept."""
    buf = _buffers()
    x, w, b, mean, rstd = buf(), buf(), buf(), buf(), buf()
    mixes, outs = [buf() for _ in range(nmix)], [buf("bf16") for _ in range(nmix)]
    for h in (None, buf()):
        (op,) = ln.forward_shift(x, w, b, mixes, outs, h, mean, rstd, R, C, T)
        d = dict(op.defines)
        args = {name: value for (name, _), (_, value) in zip(ln.LN_SHIFT_FWD.params, op.args)}
        assert op.name == "ln_shift_fwd" and op.block == (32 * ln.WARPS, 1, 1)
        warps = -(-R // ln.SHIFT_WALK)
        assert op.grid == (-(-warps // ln.WARPS), 1, 1)
        assert (d["LN_NQ"], d["LNS_M"], d["FLOATX_BF16"]) == (str(nq), str(nmix), "1")
        assert args["h"] == (int(h) if h is not None else 0)
        assert [args[f"o{j}"] for j in range(6)] == [int(o) for o in outs] + [0] * (6 - nmix)
        assert [args[f"m{j}"] for j in range(6)] == [int(m) for m in mixes] + [0] * (6 - nmix)


def test_forward_shift_checks():
    buf = _buffers()
    x, w, b, mean, rstd, h = buf(), buf(), buf(), buf(), buf(), buf()
    mixes, outs = [buf() for _ in range(6)], [buf("bf16") for _ in range(6)]
    R, C, T = 64, 32, 16
    with pytest.raises(ValueError, match="6 mixes and as many outputs"):
        ln.forward_shift(x, w, b, mixes[:2], outs[:2], h, mean, rstd, R, C, T)
    with pytest.raises(ValueError, match="6 mixes and as many outputs"):
        ln.forward_shift(x, w, b, mixes, outs[:5], h, mean, rstd, R, C, T)
    with pytest.raises(ValueError, match="multiple of T"):
        ln.forward_shift(x, w, b, mixes, outs, h, mean, rstd, R, C, 24)
    with pytest.raises(ValueError, match="no output may alias x"):
        ln.forward_shift(x, w, b, mixes, outs, x, mean, rstd, R, C, T)
    with pytest.raises(ValueError, match="required"):
        ln.forward_shift(x, w, None, mixes, outs, h, mean, rstd, R, C, T)
    with pytest.raises(ValueError, match="multiple of 4"):
        ln.forward_shift(x, w, b, mixes, outs, h, mean, rstd, R, 30, T)
    with pytest.raises(ValueError, match="not aligned"):
        ln.forward_shift(x, w, b, [mixes[0].offset(1)] + mixes[1:], outs, h, mean, rstd, R, C, T)
    with pytest.raises(TypeError, match="one element type"):
        ln.forward_shift(x, w, b, mixes, outs[:5] + [buf()], h, mean, rstd, R, C, T)


# (R, T, C, LN_NQ, threads): a row narrower than a warp, the model widths, a row past the registers
@pytest.mark.parametrize("R,T,C,nq,threads", [(74, 37, 64, 1, 32), (32768, 4096, 768, 1, 192),
                                              (16384, 4096, 2048, 2, 256), (6, 3, 4096, 2, 256)])
@pytest.mark.parametrize("nmix", ln.SHIFT_MIXES)
@pytest.mark.parametrize("frozen", [False, True])
def test_backward_shift_launch(R, T, C, nq, threads, nmix, frozen):
    """ln_shift_bwd: a block per walk of timemix.shift_backward's (its partial rows), the fewest quads per
    thread that hold the row in up to 256 threads, shared memory for the row's per-quad sums; then the
    mixes' partials reduced as timemix.shift_backward reduces them and the LayerNorm's after them in the
    scratch. Frozen parameters: no partials, no reductions."""
    buf = _buffers()
    x, w, b, mean, rstd, dx, scratch = (buf() for _ in range(7))
    mixes, douts = [buf() for _ in range(nmix)], [buf("bf16") for _ in range(nmix)]
    grads = [None] * (nmix + 2) if frozen else [buf() for _ in range(nmix + 2)]
    ops = ln.backward_shift(x, w, b, mean, rstd, mixes, douts, dx, grads[:nmix], grads[nmix], grads[nmix + 1],
                            scratch, R, C, T, H200, accumulate_dx=True, dx_copy=buf("bf16"))
    L = tm.shift_backward_layout(R, C, H200)
    op = ops[0]
    d = dict(op.defines)
    args = {name: value for (name, _), (_, value) in zip(ln.LN_SHIFT_BWD.params, op.args)}
    assert op.name == "ln_shift_bwd" and op.grid == (L["pp"], 1, 1) and op.block == (threads, 1, 1)
    assert (d["LN_NQ"], d["LNS_M"], d["FLOATX_BF16"]) == (str(nq), str(nmix), "1") and op.smem == 4 * C
    assert (args["rpt"], args["ry"], args["accumulate"]) == (L["rpt"], L["ry"], 1)
    assert [args[f"d{j}"] for j in range(6)] == [int(o) for o in douts] + [0] * (6 - nmix)
    if frozen:
        assert len(ops) == 1 and args["part_mix"] == args["part_ln"] == 0
    else:
        assert [o.name for o in ops[1:]] == ["reduce_partials"] * 2
        assert args["part_mix"] == int(scratch) and args["part_ln"] == int(scratch) + 4 * nmix * L["pp"] * C
        assert ln.shift_backward_scratch_elems(R, C, H200, nmix) == (nmix + 2) * L["pp"] * C


def test_backward_shift_checks():
    buf = _buffers()
    x, w, b, mean, rstd, dx, scratch, dw, db = (buf() for _ in range(9))
    mixes, douts, dmix = [buf() for _ in range(6)], [buf("bf16") for _ in range(6)], [buf() for _ in range(6)]
    R, C, T = 64, 32, 16

    def call(**change):
        args = dict(x=x, w=w, b=b, mean=mean, rstd=rstd, mixes=mixes, douts=douts, dx=dx, dmixes=dmix, dw=dw, db=db,
                    scratch=scratch, R=R, C=C, T=T, dev=H200)
        args.update(change)
        return ln.backward_shift(**args)

    with pytest.raises(ValueError, match="1 or 6 mixes and as many"):
        call(mixes=mixes[:2], douts=douts[:2], dmixes=dmix[:2])
    with pytest.raises(ValueError, match="1 or 6 mixes and as many"):
        call(douts=douts[:5])
    with pytest.raises(ValueError, match="all given, or all None"):
        call(dw=None)
    with pytest.raises(ValueError, match="all given, or all None"):
        call(dmixes=dmix[:5] + [None])
    with pytest.raises(ValueError, match="are required"):
        call(b=None)
    with pytest.raises(ValueError, match="multiple of T"):
        call(T=24)
    with pytest.raises(ValueError, match="must not alias"):
        call(dx=douts[3])
    with pytest.raises(ValueError, match="must not alias"):
        call(dx=x)
    with pytest.raises(ValueError, match="dx_copy must not alias"):
        call(dx_copy=dx)
    with pytest.raises(ValueError, match="dx_copy must not alias"):
        call(dx_copy=douts[0])
    with pytest.raises(ValueError, match="multiple of 4"):
        call(C=30)
    with pytest.raises(TypeError, match="one element type"):
        call(douts=douts[:5] + [buf()])


# kernel -> (its file, its LN_NQ builds)
SHIFT_KERNELS = {"ln_shift_fwd": (ln.SHIFT_CU, ln.SHIFT_NQS), "ln_shift_bwd": (ln.SHIFT_BWD_CU, ln.SHIFT_BWD_NQS)}


@pytest.mark.skipif(not nvrtc.nvrtc_available()[0], reason="NVRTC is not installed/usable")
@pytest.mark.parametrize("xtype", ["f32", "bf16"])
@pytest.mark.parametrize("nmix", ln.SHIFT_MIXES)
@pytest.mark.parametrize("kernel", list(SHIFT_KERNELS))
def test_ln_shift_kernels_do_not_spill(kernel, xtype, nmix):
    """ptxas: every LN_NQ build of ln_shift_fwd keeps the row and the previous row's output in registers,
    every build of ln_shift_bwd its quads' state (no spills)."""
    kf, nqs = SHIFT_KERNELS[kernel]
    for nq in nqs:
        u = nvrtc.resource_usage(kf.module, "sm_90", kf.defines(xtype, {"LN_NQ": nq, "LNS_M": nmix}))[kernel]
        assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, (nq, u)
