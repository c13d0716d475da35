"""The time mix's elementwise and row kernels around WKV7 (rwkvx/cu/timemix: token shift, LoRA activations,
the WKV inputs' preparation, GroupNorm and gate) timed at the 0.22B step's shapes
(rwkvx.workloads.BASE_SHAPES: R = B·T rows, C, head size N), in fp32 and bf16 activations; conftest.py's
``record`` reports ms, GB/s and the copy-rate share. Skipped without a GPU."""
from __future__ import annotations

import pytest

from rwkvx.cu import timemix
from rwkvx.runtime.dtypes import ELEM_BYTES, XTYPES
from rwkvx.workloads import BASE, BASE_SHAPES, RandomBuffers

R, T, C, N = BASE_SHAPES.R, BASE_SHAPES.T, BASE_SHAPES.C, BASE_SHAPES.N


def mixes(b):
    return [b(C, "f32", 0.2, 0.5) for _ in range(6)]


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_shift_forward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = timemix.shift_forward(b(R * C, "f32"), mixes(b), [b(R * C) for _ in range(6)], R, C, T, dev.info)
    record(ops, nbytes=R * C * (4 + 6 * ELEM_BYTES[xtype]))


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_shift_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = timemix.shift_backward(b(R * C, "f32"), mixes(b), [b(R * C) for _ in range(6)], b(R * C, "f32"),
                                 [b(C, "f32") for _ in range(6)], b(timemix.scratch_elems(R, C, N, dev.info), "f32"),
                                 R, C, T, dev.info)
    record(ops, nbytes=R * C * (8 + 6 * ELEM_BYTES[xtype]))     # x and dx f32, six gradients read


@pytest.mark.parametrize("xtype", XTYPES)
@pytest.mark.parametrize("kind", ["tanh_forward", "sigmoid_backward"])
def test_timemix_lora_activation(record, dev, xtype, kind):
    b = RandomBuffers(dev, xtype)
    n = R * BASE.config.dim_g                      # the gate LoRA's hidden layer
    x = b(n)
    ops = (timemix.tanh_forward(x, x, n, dev.info) if kind == "tanh_forward"
           else timemix.sigmoid_backward(b(n, scale=0.2, offset=0.5), x, x, n, dev.info))
    record(ops, nbytes=(2 if kind == "tanh_forward" else 3) * n * ELEM_BYTES[xtype])


def prep(b, layer):
    return dict(k=b(R * C), v=b(R * C), wl=b(R * C), al=b(R * C), vl=b(R * C) if layer else None,
                v_first=b(R * C), w0=b(C, "f32", 1.0, -2.0), a0=b(C, "f32"), v0=b(C, "f32") if layer else None,
                k_k=b(C, "f32", 0.1, 0.7), k_a=b(C, "f32", 0.1, 1.0), R=R, C=C, N=N, layer=layer)


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_prep_forward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = timemix.prep_forward(**prep(b, 1), decay=b(R * C, "f32"), kp=b(R * C), vp=b(R * C), wa=b(R * C),
                               wb=b(R * C), dev=dev.info)
    record(ops, nbytes=R * C * (4 + 10 * ELEM_BYTES[xtype]))       # the decay f32


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_prep_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    g = {n: b(R * C, "f32" if n in ("d_decay", "dkp", "dvp", "dwa", "dwb") else "x")     # WKV7's f32 grads
         for n in ("d_decay", "dkp", "dvp", "dwa", "dwb", "dkp2", "dvp2", "dr", "dr2", "dk", "dv", "dwl", "dal",
                   "dvl", "dv_first")}
    ops = timemix.prep_backward(**prep(b, 1), **g, dr_out=g["dr"], partials=b(timemix.scratch_elems(R, C, N, dev.info),
                                                                             "f32"),
                                dparams=[b(C, "f32") for _ in range(5)], dev=dev.info)
    record(ops, nbytes=(18 * ELEM_BYTES[xtype] + 5 * 4) * R * C)   # 16 read (5 of them f32), 7 written


def gn(b):
    return dict(y=b(R * C), r=b(R * C), kp=b(R * C), vp=b(R * C), g=b(R * C), ln_w=b(C, "f32", 0.1, 1.0),
                ln_b=b(C, "f32", 0.1), r_k=b(C, "f32", 0.1), R=R, C=C, N=N, dev=b.dev.info)


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_gn_forward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    record(timemix.gn_forward(**gn(b), z=b(R * C)), nbytes=6 * R * C * ELEM_BYTES[xtype])


@pytest.mark.parametrize("xtype", XTYPES)
def test_timemix_gn_backward(record, dev, xtype):
    b = RandomBuffers(dev, xtype)
    ops = timemix.gn_backward(**gn(b), dz=b(R * C), dy=b(R * C), dg=b(R * C), dr2=b(R * C), dkp2=b(R * C),
                              dvp2=b(R * C), partials=b(timemix.scratch_elems(R, C, N, dev.info), "f32"),
                              dparams=[b(C, "f32") for _ in range(3)])
    record(ops, nbytes=11 * R * C * ELEM_BYTES[xtype])
