"""CPU tests of the LayerNorm launch builders' fused LayerNorm + token shift (rwkvx/cu/layernorm/ops.py,
``forward_shift``): its launch (grid, variant), its input checks, and ptxas's report of every variant of
ln_shift.cu for sm_90 (no spills). No GPU needed."""
import pytest

from rwkvx.cu import layernorm as ln
from rwkvx.runtime import DevPtr, nvrtc


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


@pytest.mark.skipif(not nvrtc.nvrtc_available()[0], reason="NVRTC is not installed/usable")
@pytest.mark.parametrize("xtype", ["f32", "bf16"])
@pytest.mark.parametrize("nmix", ln.SHIFT_MIXES)
def test_ln_shift_does_not_spill(xtype, nmix):
    """ptxas: every LN_NQ build keeps the row and the previous row's output in registers (no spills)."""
    for nq in ln.SHIFT_NQS:
        defines = ln.SHIFT_CU.defines(xtype, {"LN_NQ": nq, "LNS_M": nmix})
        u = nvrtc.resource_usage("layernorm/ln_shift", "sm_90", defines)["ln_shift_fwd"]
        assert u.get("spill_stores", 0) == 0 and u.get("spill_loads", 0) == 0, (nq, u)
