"""Bad inputs to the oracle and to rwkvx.validate fail early with clear errors."""
import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.oracle import Oracle
from rwkvx.validate import check_targets, check_tokens

CFG = Config(vocab_size=10, n_embd=8, head_size=4, n_rwkv_layer=2, n_attn_layer=1,
             moba_chunk_size=2, moba_top_k=2, dim_w=2, dim_a=2, dim_v=2, dim_g=2)


@pytest.fixture(scope="module")
def oracle():
    return Oracle(CFG, init_params(CFG, 0))


def test_check_tokens_accepts_and_converts():
    out = check_tokens(np.array([[1, 2], [3, 9]], dtype=np.uint8), 10)
    assert out.dtype == np.int64 and out.flags.c_contiguous and out.tolist() == [[1, 2], [3, 9]]
    tgt = check_targets(np.array([[1, -100], [0, 9]], dtype=np.int32), (2, 2), 10, -100)
    assert tgt.dtype == np.int64 and tgt.tolist() == [[1, -100], [0, 9]]


@pytest.mark.parametrize("bad, exc, match", [
    ([[1, 2]], TypeError, "numpy integer array"),
    (np.array([[1.0, 2.0]]), TypeError, "integer dtype"),
    (np.array([[True, False]]), TypeError, "integer dtype"),
    (np.array([1, 2]), ValueError, r"2-D \[B, T\]"),
    (np.zeros((0, 4), np.int64), ValueError, "non-empty"),
    (np.zeros((2, 0), np.int64), ValueError, "non-empty"),
    (np.array([[1, 2, 10]]), ValueError, r"tokens\[0, 2\] = 10 is out of range \[0, 10\)"),
    (np.array([[1, 2], [3, -1]]), ValueError, r"tokens\[1, 1\] = -1"),
])
def test_bad_tokens(oracle, bad, exc, match):
    with pytest.raises(exc, match=match):
        check_tokens(bad, 10)
    with pytest.raises(exc, match=match):
        oracle.forward(bad)
    with pytest.raises(exc, match=match):
        oracle.moba_selection(bad)
    good_targets = np.zeros((1, 2), np.int64)
    with pytest.raises(exc, match=match):
        oracle.loss_and_grads(bad, good_targets)


@pytest.mark.parametrize("bad, exc, match", [
    ([[1, 2, 3]], TypeError, "numpy integer array"),
    (np.array([[1.0, 2.0, 3.0]]), TypeError, "integer dtype"),
    (np.array([[1, 2]]), ValueError, r"shape \(1, 2\) does not match tokens shape \(1, 3\)"),
    (np.array([[1, 2, 3]]).T, ValueError, "does not match"),
    (np.array([[1, 10, 3]]), ValueError, r"targets\[0, 1\] = 10 is out of range .* ignore_index=-100"),
    (np.array([[1, 2, -1]]), ValueError, r"targets\[0, 2\] = -1"),
])
def test_bad_targets(oracle, bad, exc, match):
    tokens = np.array([[1, 2, 3]])
    with pytest.raises(exc, match=match):
        check_targets(bad, tokens.shape, 10, -100)
    with pytest.raises(exc, match=match):
        oracle.loss_and_grads(tokens, bad)


def test_custom_ignore_index(oracle):
    tokens = np.array([[1, 2, 3]])
    loss, _ = oracle.loss_and_grads(tokens, np.array([[1, -1, 3]]), ignore_index=-1)
    assert np.isfinite(loss)
    with pytest.raises(ValueError, match="ignore_index=-1"):
        oracle.loss_and_grads(tokens, np.array([[1, -100, 3]]), ignore_index=-1)
    with pytest.raises(TypeError, match="ignore_index"):
        oracle.loss_and_grads(tokens, np.array([[1, 2, 3]]), ignore_index=1.5)


def test_bad_oracle_construction():
    params = init_params(CFG, 0)
    with pytest.raises(TypeError, match="Config"):
        Oracle({"vocab_size": 10}, params)
    with pytest.raises(ValueError, match="float32 or float64"):
        Oracle(CFG, params, dtype=np.float16)
    missing = dict(params)
    del missing["rwkv.head.weight"]
    with pytest.raises(ValueError, match="missing parameter.*rwkv.head.weight"):
        Oracle(CFG, missing)
    wrong = dict(params, **{"rwkv.head.weight": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match="shape"):
        Oracle(CFG, wrong)


def test_bad_selection(oracle):
    tokens = np.array([[1, 2, 3, 4, 5]])
    sel = oracle.moba_selection(tokens)
    assert len(sel) == 1 and sel[0].shape == (1, 2, 5, 1)
    np.testing.assert_array_equal(oracle.forward(tokens, selection=sel), oracle.forward(tokens))
    with pytest.raises(ValueError, match="one array per attention block"):
        oracle.forward(tokens, selection=[])
    with pytest.raises(ValueError, match=r"selection\[0\] has shape"):
        oracle.forward(tokens, selection=[sel[0][:, :, :4]])
    with pytest.raises(TypeError, match="integer"):
        oracle.forward(tokens, selection=[sel[0].astype(np.float64)])
