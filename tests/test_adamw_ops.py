"""CPU tests of rwkvx/cu/adamw/ops.py: the flat layout, the chunk table and the device state."""
import numpy as np

from rwkvx.cu import adamw as aw

SHAPES = {
    "rwkv.emb.weight": (97, 64),
    "rwkv.blocks.0.ln1.weight": (64,),
    "rwkv.blocks.0.att.w0": (1, 1, 64),
    "rwkv.blocks.0.att.r_k": (3, 5),
}


def test_table_and_state_helpers():
    segs, total = aw.flat_layout(SHAPES, align=4)
    assert all(off % 4 == 0 for _, off, _, _, _ in segs)
    names = [s[0] for s in segs]
    wd = dict(zip(names, [s[4] for s in segs]))
    assert wd["rwkv.emb.weight"] == 1 and wd["rwkv.blocks.0.ln1.weight"] == 0 and wd["rwkv.blocks.0.att.r_k"] == 0
    mult = dict(zip(names, [s[3] for s in segs]))
    assert mult["rwkv.blocks.0.att.w0"] == 2.0 and mult["rwkv.emb.weight"] == 1.0
    table, lrmul = aw.build_table(segs, 1024)
    assert table.dtype == np.int32 and table.shape[1] == 4 and lrmul.dtype == np.float32
    assert int(table[:, 2].sum()) == sum(s[2] for s in segs)
    assert (table[:, 2] <= 1024).all()
    big, _ = aw.build_table([(3 << 32, 10, 1.0, 1)], 8)
    assert big.tolist() == [[0, 3, 8, 1], [8, 3, 2, 1]]
    st = aw.state_array(1e-3, 1e-4, 10, None, None)
    assert st[aw.ST_TOTAL] == -1 and st[aw.ST_CLIP] == 0
