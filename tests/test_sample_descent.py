"""CPU check of dec_sample's algorithm (rwkvx/cu/decode/sample.cu), before any GPU: its numpy model
(rwkvx/cu/decode/sample_model.py: order keys, radix descents a byte at a time, the 32-lane walk) chooses
the sampling contract's token (rwkvx.sampling.sample_token) on seeded rows with ties, NaN, infinities and
signed zeros, for every kind of option. The kernel itself is checked against the contract on the GPU
(tests/gpu/test_decode.py)."""
import numpy as np
import pytest

from rwkvx.cu.decode.sample_model import dec_sample
from rwkvx.sampling import sample_token

from seeding import seeded_rng

OPTIONS = [   # (temperature, top_p, top_k)
    (0.0, 1.0, 0), (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.95, 40), (2.0, 1.0, 1), (0.5, 1e-6, 3),
    (1.0, 1e-9, 0), (4.0, 0.5, 2), (0.8, 0.9, 100000), (3.0, 1.0, 7)]


def row_of(rng, V, kind):
    z = rng.standard_normal(V) * rng.choice([0.5, 3.0, 20.0])
    if kind == "ties":
        z = np.round(z)
    elif kind == "special":
        z[rng.random(V) < 0.1] = np.nan
        z[rng.random(V) < 0.1] = -np.inf
        z[rng.choice(V, 2, replace=False)] = np.inf
    elif kind == "zeros":
        z[rng.random(V) < 0.3] = -0.0
        z[rng.random(V) < 0.3] = 0.0
    return z.astype(np.float32)


@pytest.mark.parametrize("kind", ["plain", "ties", "special", "zeros"])
def test_descents_choose_the_contracts_token(kind):
    rng = seeded_rng()
    for trial in range(60):
        V = int(rng.choice([7, 60, 300, 5000]))
        row, u = row_of(rng, V, kind), float(rng.random())
        temperature, top_p, top_k = OPTIONS[trial % len(OPTIONS)]
        assert dec_sample(row, u, temperature, top_p, top_k) == sample_token(row, u, temperature, top_k, top_p), \
            f"trial {trial}: V={V}, options {OPTIONS[trial % len(OPTIONS)]}"


@pytest.mark.parametrize("row", [[np.nan] * 5, [-np.inf, np.nan, -np.inf, -np.inf], [-0.0, 0.0, -0.0]],
                         ids=["all_nan", "no_finite", "signed_zeros"])
def test_rows_without_a_finite_maximum(row):
    row = np.array(row, np.float32)
    for temperature, top_p, top_k in OPTIONS:
        for u in (0.0, 0.3, 0.77, 0.999):
            assert dec_sample(row, u, temperature, top_p, top_k) == sample_token(row, u, temperature, top_k, top_p)


@pytest.mark.parametrize("options", OPTIONS)
def test_descents_over_the_presets_vocabulary(options):
    """V = 65536 (the rwkv7 and RWKV-X presets' vocabulary), logits rounded to bf16 as the bf16 step
    stores them (thousands of exact ties): the byte-wise descents over every key of the row, and the
    masses they add (up to V·2^32), still choose the contract's token."""
    from rwkvx.runtime.dtypes import from_storage, to_storage
    rng = seeded_rng()
    temperature, top_p, top_k = options
    for scale in (1.0, 3.0, 12.0):
        row = from_storage("bf16", to_storage("bf16", rng.standard_normal(65536) * scale)).astype(np.float32)
        u = float(rng.random())
        assert dec_sample(row, u, temperature, top_p, top_k) == sample_token(row, u, temperature, top_k, top_p), \
            f"scale {scale}, u {u}, options {options}"
