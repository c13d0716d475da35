"""The sampling contract (rwkvx.sampling) on hand-built rows: greedy and its ties, top-k = 1, tiny and
full top-p, ties in the order, temperature, infinite and NaN logits, how u maps to a token, and the
probabilities it gives against softmax. The GPU's dec_sample is checked against the same function by
tests/gpu/test_decode.py."""
import math

import numpy as np
import pytest

from rwkvx.sampling import (MAX_VOCAB, WEIGHT_BITS, WEIGHT_CUTOFF, check_vocab, contract_exp, sample_rows,
                            sample_token)

from seeding import seeded_rng

U_GRID = (np.arange(10000) + 0.5) / 10000      # u spread evenly: each token's share of it is its probability


def frequencies(logits, temperature, top_k=0, top_p=1.0):
    V = len(logits)
    chosen = [sample_token(logits, u, temperature, top_k, top_p) for u in U_GRID]
    return np.bincount(chosen, minlength=V) / len(U_GRID)


def softmax(z, temperature):
    p = np.exp((np.asarray(z, np.float64) - np.max(z)) / temperature)
    return p / p.sum()


def test_contract_exp_is_exp():
    x = np.linspace(WEIGHT_CUTOFF, 0.0, 100001)
    assert np.max(np.abs(contract_exp(x) / np.exp(x) - 1)) < 1e-14
    assert contract_exp(np.array([0.0]))[0] == 1.0         # the first token weighs exactly 2**32


def test_greedy_is_the_first_maximum():
    logits = np.array([0.5, 3.0, -1.0, 3.0, np.nan], np.float32)
    for u in (0.0, 0.3, 0.999):
        assert sample_token(logits, u, 0.0) == 1                    # ties: the lower id
        assert sample_token(logits, u, 2.0, top_k=1) == 1           # top_k = 1 is greedy at any temperature
    assert sample_token(np.array([np.nan, -np.inf, 2.0], np.float32), 0.5, 0.0) == 2   # NaN counts as -inf


def test_ties_are_drawn_in_id_order():
    logits = np.zeros(4, np.float32)
    assert [sample_token(logits, u, 1.0) for u in (0.0, 0.24, 0.25, 0.5, 0.74, 0.75, 0.9999)] == [0, 0, 1, 2, 2, 3, 3]
    # top_p = 1/2 of four equal weights: the first two; a hair more: the first three
    assert {sample_token(logits, u, 1.0, top_p=0.5) for u in U_GRID} == {0, 1}
    assert {sample_token(logits, u, 1.0, top_p=0.5 + 1e-6) for u in U_GRID} == {0, 1, 2}
    assert {sample_token(logits, u, 1.0, top_k=3) for u in U_GRID} == {0, 1, 2}


def test_u_maps_through_the_running_sum_in_order():
    logits = np.log(np.array([0.1, 0.6, 0.3], np.float32))     # order: 1, 2, 0
    assert sample_token(logits, 0.0, 1.0) == 1
    assert sample_token(logits, 0.59, 1.0) == 1
    assert sample_token(logits, 0.61, 1.0) == 2
    assert sample_token(logits, 0.89, 1.0) == 2
    assert sample_token(logits, 0.91, 1.0) == 0
    assert sample_token(logits, np.nextafter(1.0, 0.0), 1.0) == 0


def test_tiny_top_p_is_the_most_likely_token():
    rng = seeded_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    best = int(np.argmax(logits))
    assert all(sample_token(logits, u, 1.5, top_p=1e-9) == best for u in rng.random(50))


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_frequencies_are_softmax(temperature):
    logits = seeded_rng(1).standard_normal(12).astype(np.float32)
    np.testing.assert_allclose(frequencies(logits, temperature), softmax(logits, temperature), atol=2e-4)


def test_top_k_and_top_p_restrict_then_renormalise():
    logits = np.log(np.array([0.05, 0.4, 0.25, 0.2, 0.1], np.float32))    # order: 1, 2, 3, 4, 0
    want = np.array([0, 0.4, 0.25, 0.2, 0]) / 0.85
    np.testing.assert_allclose(frequencies(logits, 1.0, top_k=3), want, atol=2e-4)
    want = np.array([0, 0.4, 0.25, 0, 0]) / 0.65     # 0.4 < 0.6 <= 0.65: the first two reach the mass
    np.testing.assert_allclose(frequencies(logits, 1.0, top_p=0.6), want, atol=2e-4)
    want = np.array([0, 0.4, 0, 0, 0])               # the mass is counted inside the top-k
    np.testing.assert_allclose(frequencies(logits, 1.0, top_k=2, top_p=0.6), want / 0.4, atol=2e-4)


def test_infinite_logits():
    logits = np.array([np.inf, 0.0, np.inf, np.nan], np.float32)
    np.testing.assert_allclose(frequencies(logits, 1.0), [0.5, 0, 0.5, 0])
    nothing = np.array([-np.inf, np.nan, -np.inf], np.float32)     # no finite logit: uniform
    np.testing.assert_allclose(frequencies(nothing, 1.0), [1 / 3] * 3, atol=2e-4)


def test_far_tokens_weigh_nothing():
    """Weights are counted in units of 2**-32 of the best token's: a token that far below weighs 0 and is
    never drawn; one that weighs a single unit is drawn for the last unit of u."""
    logits = np.array([0.0, WEIGHT_CUTOFF - 1e-3, -22.0], np.float32)
    q2 = math.floor(math.exp(-22.0) * 2 ** WEIGHT_BITS)
    assert q2 == 1
    N = 2 ** WEIGHT_BITS + q2
    assert {sample_token(logits, u, 1.0) for u in np.linspace(0, (N - 2) / N, 4097)} == {0}
    assert sample_token(logits, (N - 0.5) / N, 1.0) == 2


def test_rows_and_vocabulary_limit():
    rng = seeded_rng(2)
    logits = rng.standard_normal((3, 50)).astype(np.float32)
    u = rng.random(3)
    got = sample_rows(logits, u, 0.8, 5, 0.9)
    assert got.dtype == np.int64
    assert list(got) == [sample_token(row, ui, 0.8, 5, 0.9) for row, ui in zip(logits, u)]
    check_vocab(MAX_VOCAB)
    with pytest.raises(ValueError, match="up to"):
        check_vocab(MAX_VOCAB + 1)
