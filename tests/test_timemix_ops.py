"""CPU tests of the time-mix launch builders (rwkvx/cu/timemix/ops.py): the row-kernel thread layout and
the launch lists of every builder, on an H200 (no GPU needed)."""
import pytest

from rwkvx.cu import timemix as tm
from rwkvx.runtime import DevPtr
from rwkvx.runtime.device import H200

LAYOUT_CASES = [(74, 64, 16), (74, 256, 64), (74, 192, 64), (74, 1280, 128), (74, 24, 4), (74, 40, 8),
                (74, 96, 32), (32768, 768, 64), (32768, 4096, 64), (65536, 2560, 128), (5, 3072, 4)]


@pytest.mark.parametrize("R,C,N", LAYOUT_CASES)
@pytest.mark.parametrize("rpt", [None, 5, 1])
def test_layout_invariants(R, C, N, rpt):
    if rpt is not None and -(-R // rpt) > 65535:
        with pytest.raises(ValueError):
            tm.layout(R, C, H200, N, rpt)
        return
    for n in (tm.SHIFT_N, N):
        L = tm.layout(R, C, H200, n, rpt)
        qx, ry = L["qx"], L["ry"]
        assert (C // 4) % qx == 0 and qx % (n // 4) == 0
        assert qx * ry <= 1024 and L["grid"][0] * qx == C // 4
        assert L["tiles"] * L["rpt"] >= R > (L["tiles"] - 1) * L["rpt"]
        assert L["pp"] == L["tiles"] * ry and L["tiles"] <= 65535
    S = tm.shift_backward_layout(R, C, H200, rpt)          # what shift_backward launches
    assert (C // 4) % S["qx"] == 0 and S["grid"][0] * S["qx"] == C // 4 and S["qx"] * S["ry"] <= 256
    assert S["tiles"] * S["rpt"] >= R > (S["tiles"] - 1) * S["rpt"] and S["pp"] == S["tiles"] * S["ry"]
    assert tm.scratch_elems(R, C, N, H200, rpt) >= C * 6 * S["pp"]
    assert tm.scratch_elems(R, C, N, H200, rpt) >= C * 5 * tm.layout(R, C, H200, N, rpt)["pp"]


def _buffers():
    addr = iter(range(0x10000, 0x10000 + 4096 * 512, 4096))
    return lambda elem="f32": DevPtr(next(addr), elem)


def test_builders_make_launches():
    R, C, N, T = 74, 256, 64, 37
    P = _buffers()
    ops = []
    ops += tm.shift_forward(P(), [P() for _ in range(6)], [P() for _ in range(6)], R, C, T, H200)
    ops += tm.shift_backward(P(), [P() for _ in range(6)], [P() for _ in range(6)], P(),
                             [P() for _ in range(6)], P(), R, C, T, H200)
    ops += tm.tanh_forward(P(), P(), R * 32, H200) + tm.tanh_backward(P(), P(), P(), R * 32, H200)
    ops += tm.sigmoid_forward(P(), P(), R * 64, H200) + tm.sigmoid_backward(P(), P(), P(), R * 64, H200)
    names = "k v wl al vl v_first w0 a0 v0 k_k k_a".split()
    for layer in (0, 1):
        ins = {n: P() for n in names}
        ops += tm.prep_forward(**ins, decay=P(), kp=P(), vp=P(), wa=P(), wb=P(), R=R, C=C, N=N, layer=layer,
                               dev=H200)
        grads = {n: P() for n in "d_decay dkp dvp dwa dwb dkp2 dvp2 dr dr2 dr_out dk dv dwl dal dvl dv_first "
                                 "partials".split()}
        ops += tm.prep_backward(**ins, **grads, dparams=[P() for _ in range(5)], R=R, C=C, N=N, layer=layer,
                                dev=H200)
    gn = {n: P() for n in "y r kp vp g ln_w ln_b r_k".split()}
    ops += tm.gn_forward(**gn, z=P(), R=R, C=C, N=N, dev=H200)
    ops += tm.gn_backward(**gn, **{n: P() for n in "dz dy dg dr2 dkp2 dvp2 partials".split()},
                          dparams=[P() for _ in range(3)], R=R, C=C, N=N, dev=H200)
    launched = [o.name for o in ops]
    assert launched.count("reduce_partials") == 4
    assert all(o.module in ("timemix/timemix", "reduce/reduce") for o in ops)
    # the layer-0 prep launch passes no v0 / vl / vp, and says it is layer 0
    pf0 = next(o for o in ops if o.name == "tm_prep_fwd")
    declared = [n for n, _ in tm.TM_PREP_FWD.params]
    for name in ("vl", "v0", "vp"):
        assert pf0.args[declared.index(name)] == ("p", 0)
    assert pf0.args[declared.index("layer")] == ("i", 0)
    # the kernels that ignore the head size share one build
    assert {dict(o.defines)["HEAD_SIZE"] for o in ops if o.name.startswith(("tm_shift", "tm_tanh"))} == {"4"}


def test_keyword_only_builders_reject_positional_calls():
    P = _buffers()
    with pytest.raises(TypeError):
        tm.gn_forward(*[P() for _ in range(9)], 74, 256, 64, H200)    # noqa: a positional call
