"""CPU oracle timing: one loss_and_grads (forward, loss, full backward) and one forward.

float64 is the ground truth of the GPU tests; float32 is what the CPU training backend runs (each op
computes in float64 and rounds its outputs to float32, so it costs about as much as float64).
Target on a 2-core machine: <= 1 s for the config below (B=2, T=128).
"""
import numpy as np
import pytest

from rwkvx import Config, init_params
from rwkvx.oracle import Oracle

CFG = Config(vocab_size=256, n_embd=128, head_size=32, n_rwkv_layer=4, n_attn_layer=1,
             moba_chunk_size=16, moba_top_k=2)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    params = init_params(CFG, 0)
    # non-zero matrices everywhere, so no branch is trivially cheap
    params = {n: p + 0.01 * rng.standard_normal(p.shape).astype(np.float32) for n, p in params.items()}
    tokens = rng.integers(0, CFG.vocab_size, (2, 128))
    targets = rng.integers(0, CFG.vocab_size, (2, 128))
    return Oracle(CFG, params, dtype=np.float64), tokens, targets, params


def test_oracle_loss_and_grads_float64(benchmark, problem):
    oracle, tokens, targets, _ = problem
    loss, grads = benchmark(oracle.loss_and_grads, tokens, targets)
    assert np.isfinite(loss) and len(grads) == len(oracle.params)


def test_oracle_loss_and_grads_float32(benchmark, problem):
    _, tokens, targets, params = problem
    oracle = Oracle(CFG, params, dtype=np.float32)
    loss, grads = benchmark(oracle.loss_and_grads, tokens, targets)
    assert np.isfinite(loss) and all(g.dtype == np.float32 for g in grads.values())


def test_oracle_forward_float64(benchmark, problem):
    oracle, tokens, _, _ = problem
    logits = benchmark(oracle.forward, tokens)
    assert logits.shape == (2, 128, CFG.vocab_size)
