"""CPU tests of rwkvx/cu/embedding/ops.py: the host-side token sort behind the deterministic gradient."""
import numpy as np

from rwkvx.cu import embedding as emb


def test_sort_tokens():
    tok = np.array([[5, 1, 5, 0], [1, 5, 9, 1]])
    order, seg, n = emb.sort_tokens(tok)
    assert order.dtype == np.int32 and seg.dtype == np.int32 and n.dtype == np.int32
    assert order.tolist() == [3, 1, 4, 7, 0, 2, 5, 6]
    assert n.tolist() == [4]
    assert seg.tolist() == [0, 1, 4, 7, 8, 8, 8, 8, 8]
