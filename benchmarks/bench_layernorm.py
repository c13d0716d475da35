"""LayerNorm (rwkvx/cu/layernorm) timed at the 0.22B step's shapes (rwkvx.workloads.BASE_SHAPES: R = B·T
rows of C), in fp32 and bf16 activations; conftest.py's ``record`` reports ms, GB/s and the copy-rate share.
Skipped without a GPU."""
from __future__ import annotations

import pytest

from rwkvx.cu import channelmix, layernorm, timemix
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE_SHAPES, KernelShapes, RandomBuffers, preset_workload

R, C = BASE_SHAPES.R, BASE_SHAPES.C


@pytest.mark.parametrize("xtype", XTYPES)
def test_layernorm_forward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = layernorm.forward(b(R * C, "f32"), b(C, "f32"), b(C, "f32"), b(R * C), b(R, "f32"), b(R, "f32"), R, C)
    record(ops, nbytes=R * C * (4 + ELEM_BYTES[xtype]) + 8 * R)    # x (the residual stream) f32, y floatX


@pytest.mark.parametrize("xtype", XTYPES)
def test_layernorm_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    copy = b(R * C) if xtype != "f32" else None                    # the GEMMs' copy of dx, as in the step
    ops = layernorm.backward(b(R * C, "f32"), b(C, "f32"), b(R * C, "f32"), b(R * C, "f32"), b(C, "f32"), b(C, "f32"),
                             b(R, "f32", 0.1, 0), b(R, "f32", 0.1, 1.0),
                             b(layernorm.scratch_elems(R, C, dev.info), "f32"), R, C, dev.info, accumulate_dx=True,
                             dx_copy=copy)
    record(ops, nbytes=16 * R * C + (ELEM_BYTES[xtype] * R * C if copy else 0) + 8 * R)  # x, dy, dx read; dx written


# LayerNorm fused with the token shift (ln_shift_fwd) against ln_forward + the shift kernel, bf16 mixes: the
# 0.22B step (C = 768), the 1.5B RWKV-7 (C = 2048) and the 7.2B one at its preset batch (C = 4096: a row
# past the channels the backward holds in registers, and few row walks per SM), 6 mixes (time mix) and 1
# (channel mix), h stored or not.
SHIFT_SHAPES = {"B8_T4096_C768": BASE_SHAPES, "B4_T4096_C2048": KernelShapes.of(preset_workload("rwkv7-1.5b", 4)),
                "B1_T4096_C4096": KernelShapes.of(preset_workload("rwkv7-7.2b", 1))}


def _shift_bytes(R: int, C: int, nmix: int, h_bytes: int) -> int:
    """x read (f32), the mixes written (bf16), h's bytes (written, or written and read back) and the statistics."""
    return R * C * (4 + 2 * nmix + h_bytes) + 8 * R


@pytest.mark.parametrize("shape", list(SHIFT_SHAPES))
@pytest.mark.parametrize("nmix", layernorm.SHIFT_MIXES)
@pytest.mark.parametrize("method", ["fused", "fused_h", "separate"])
def test_layernorm_shift_forward(record, dev, shape, nmix, method):
    """fused: ln_shift_fwd without h (its byte floor: x in, the mixes out); fused_h: with h stored (4 bytes
    more per element); separate: ln_forward (h f32 out) then tm_shift_fwd / cm_shift_mix (h read back)."""
    s = SHIFT_SHAPES[shape]
    R, C, T = s.R, s.C, s.T
    b = RandomBuffers(dev, "bf16")
    x, w, bias, mean, rstd = b(R * C, "f32"), b(C, "f32"), b(C, "f32"), b(R, "f32"), b(R, "f32")
    mixes, outs = [b(C, "f32", 0.3, 0.5) for _ in range(nmix)], [b(R * C) for _ in range(nmix)]
    if method == "separate":
        h = b(R * C, "f32")
        ops = layernorm.forward(x, w, bias, h, mean, rstd, R, C)
        ops += (timemix.shift_forward(h, mixes, outs, R, C, T, dev.info) if nmix == 6
                else channelmix.shift_mix(h, mixes[0], outs[0], R, T, C, dev.info))
        nbytes = _shift_bytes(R, C, nmix, 8)
    else:
        h = b(R * C, "f32") if method == "fused_h" else None
        ops = layernorm.forward_shift(x, w, bias, mixes, outs, h, mean, rstd, R, C, T)
        nbytes = _shift_bytes(R, C, nmix, 4 if h is not None else 0)
    record(ops, nbytes=nbytes)


def _shift_backward_bytes(R: int, C: int, nmix: int, separate: bool) -> int:
    """ln_shift_bwd's floor: x (f32) and the mixes' gradients (bf16) read, dx read and written (f32,
    accumulated), its bf16 copy written, the statistics read. The separate kernels add h read (f32), dh
    written (f32), then x and dh read by the dw/db pass and again by the dx pass."""
    fused = R * C * (4 + 2 * nmix + 8 + 2) + 8 * R
    return fused + (R * C * (4 + 4 + 8 + 8) if separate else 0)


@pytest.mark.parametrize("shape", list(SHIFT_SHAPES))
@pytest.mark.parametrize("nmix", layernorm.SHIFT_MIXES)
@pytest.mark.parametrize("method", ["fused", "separate"])
def test_layernorm_shift_backward(record, dev, shape, nmix, method):
    """fused: ln_shift_bwd (h recomputed, dh never in memory) and its reductions; separate: tm_shift_bwd /
    cm_mix_backward (h read, dh written) then the LayerNorm backward, the separate kernels. bf16
    mixes' gradients, dx accumulated with its bf16 copy, every parameter gradient formed."""
    s = SHIFT_SHAPES[shape]
    R, C, T = s.R, s.C, s.T
    b = RandomBuffers(dev, "bf16")
    x, w, bias, mean, rstd = b(R * C, "f32"), b(C, "f32"), b(C, "f32"), b(R, "f32", 0.1, 0), b(R, "f32", 0.1, 1.0)
    mixes, douts = [b(C, "f32", 0.3, 0.5) for _ in range(nmix)], [b(R * C) for _ in range(nmix)]
    dx, copy, dmix, dw, db = b(R * C, "f32"), b(R * C), [b(C, "f32") for _ in range(nmix)], b(C, "f32"), b(C, "f32")
    if method == "separate":
        h, dh = b(R * C, "f32"), b(R * C, "f32")
        ops = (timemix.shift_backward(h, mixes, douts, dh, dmix, b(timemix.scratch_elems(R, C, 4, dev.info), "f32"),
                                      R, C, T, dev.info) if nmix == 6
               else channelmix.mix_backward(douts[0], h, mixes[0], dh, dmix[0],
                                            b(channelmix.scratch_elems(R, C, dev.info), "f32"), R, T, C, dev.info))
        ops += layernorm.backward(x, w, dh, dx, dw, db, mean, rstd, b(layernorm.scratch_elems(R, C, dev.info), "f32"),
                                  R, C, dev.info, accumulate_dx=True, dx_copy=copy)
    else:
        ops = layernorm.backward_shift(x, w, bias, mean, rstd, mixes, douts, dx, dmix, dw, db,
                                       b(layernorm.shift_backward_scratch_elems(R, C, dev.info, nmix), "f32"), R, C, T,
                                       dev.info, accumulate_dx=True, dx_copy=copy)
    record(ops, nbytes=_shift_backward_bytes(R, C, nmix, method == "separate"))
