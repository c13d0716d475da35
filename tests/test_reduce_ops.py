"""CPU tests of rwkvx/cu/reduce/ops.py: the partial-sum launch (its shape, its declared arguments, bad sizes
refused before any GPU work, none for frozen parameters) and the row tiling the calling backward kernels
use, on an H200 (no GPU needed)."""
import math

import pytest

from rwkvx.cu import reduce as rd
from rwkvx.runtime import DevPtr
from rwkvx.runtime.device import H200


def _buffer(i: int) -> DevPtr:
    return DevPtr(0x10000 * (i + 1), "f32")


@pytest.mark.parametrize("nout,C,by", [(1, 1, 1), (3, 40, 8), (6, 768, 16)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_partials_launch(nout, C, by, accumulate):
    outs = [_buffer(j + 1) for j in range(nout)]
    (op,) = rd.partials(_buffer(0), 37, C, outs, by, accumulate=accumulate)
    assert (op.module, op.name) == ("reduce/reduce", "reduce_partials")
    assert op.grid == (math.ceil(nout * C / 32), 1, 1) and op.block == (32, by, 1)
    args = dict(zip((name for name, _ in rd.REDUCE_PARTIALS.params), op.args))
    assert args["P"] == ("i", 37) and args["C"] == ("i", C) and args["nout"] == ("i", nout)
    assert args["accumulate"] == ("i", int(accumulate))
    assert [args[f"o{j}"] for j in range(6)] == [("p", int(o)) for o in outs] + [("p", 0)] * (6 - nout)


@pytest.mark.parametrize("nout,P,C,by,what", [(0, 4, 8, 8, "1..6 outputs"), (7, 4, 8, 8, "1..6 outputs"),
                                              (1, 0, 8, 8, "P=0"), (1, 4, 0, 8, "C=0"),
                                              (1, 4, 8, 0, "by=0"), (1, 4, 8, rd.MAX_BY + 1, "by=17")])
def test_partials_rejects_bad_sizes(nout, P, C, by, what):
    with pytest.raises(ValueError, match=what):
        rd.partials(_buffer(0), P, C, [_buffer(j + 1) for j in range(nout)], by)


def test_partials_of_frozen_parameters_are_not_formed():
    """Every output None (the gradients of frozen parameters): no launch; some None: an error."""
    assert rd.partials(_buffer(0), 4, 8, [None, None], 8) == []
    with pytest.raises(ValueError, match="every output or none"):
        rd.partials(_buffer(0), 4, 8, [_buffer(1), None], 8)


def test_layernorm_backward_without_parameter_gradients():
    """dw and db None (frozen parameters): the dx launch alone, the same as with them; one of the two
    alone is refused."""
    from rwkvx.cu import layernorm
    R, C = 64, 32
    x, w, dy, dx, mean, rstd, scratch = (DevPtr(0x100000 * (i + 1), "f32") for i in range(7))
    full = layernorm.backward(x, w, dy, dx, _buffer(20), _buffer(21), mean, rstd, scratch, R, C, H200)
    frozen = layernorm.backward(x, w, dy, dx, None, None, mean, rstd, scratch, R, C, H200)
    assert [op.name for op in full] == ["ln_backward_dwdb", "reduce_partials", "reduce_partials", "ln_backward_dx"]
    assert frozen == full[-1:]
    with pytest.raises(ValueError, match="both None"):
        layernorm.backward(x, w, dy, dx, _buffer(20), None, mean, rstd, scratch, R, C, H200)


@pytest.mark.parametrize("R,C", [(1, 8), (74, 256), (32768, 768), (65536, 4096), (5, 3072)])
def test_tiles_cover_the_rows(R, C):
    rpt, n = rd.tiles(R, C, H200)
    assert rpt % 8 == 0 and rpt >= 8 and rpt == rd.default_rows_per_tile(R, C, H200)
    assert n * rpt >= R > (n - 1) * rpt
    assert rd.scratch_elems(R, C, H200) == C * n
    assert rd.tiles(R, C, H200, rows_per_tile=5) == (5, math.ceil(R / 5))


def test_tiles_reject_bad_row_counts():
    with pytest.raises(ValueError, match="must be positive"):
        rd.tiles(100, 8, H200, rows_per_tile=0)
    with pytest.raises(ValueError, match="row tiles"):
        rd.tiles(65536 * 2, 8, H200, rows_per_tile=1)
