"""Shared fixtures: random (non-zero) model parameters for the oracle tests; the hooks of tests/seeding.py,
which put the seeds a failing test drew in its report."""
import numpy as np
import pytest

from rwkvx import init_params

# hooks, found here by name: each test's seeds recorded, a failing test's listed in its report
from seeding import pytest_runtest_makereport, pytest_runtest_setup, seeded_rng  # noqa: F401


def make_random_params(cfg, seed=0):
    """init_params(cfg) with every tensor replaced by scaled random values.

    The training init has zero matrices (w1, a1, v1, g1, output, ffn.value) that would hide
    gradients; here every tensor is non-zero, activations stay O(1) (matrices scaled by
    1/sqrt(fan_in)), mixes stay in [0, 1] and the decay stays in its natural range.
    """
    rng = seeded_rng(seed)
    out = {}
    for name, value in init_params(cfg, seed).items():
        shape = value.shape
        leaf = name.rsplit(".", 2)
        if name.endswith(("ln0.weight", "ln1.weight", "ln2.weight", "ln_x.weight", "ln_out.weight")):
            new = 1 + 0.2 * rng.standard_normal(shape)
        elif leaf[-1] in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g") or name.endswith("ffn.x_k"):
            new = rng.uniform(0.05, 0.95, shape)
        elif leaf[-1] == "k_a":
            new = 1 + 0.3 * rng.standard_normal(shape)
        elif leaf[-1] == "k_k":
            new = 0.7 + 0.3 * rng.standard_normal(shape)
        elif leaf[-1] in ("w0", "a0", "v0"):
            new = rng.standard_normal(shape)
        elif name == "rwkv.emb.weight":
            new = rng.standard_normal(shape)
        elif len(shape) == 2 and name.endswith("weight"):   # Lin weight [out, in]
            new = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif len(shape) == 2 and leaf[-1] in ("w1", "a1", "v1", "g1", "w2", "a2", "v2", "g2"):
            new = rng.standard_normal(shape) / np.sqrt(shape[0])
        else:                                                # biases, r_k
            new = 0.3 * rng.standard_normal(shape)
        out[name] = new.astype(np.float64)
    return out


def make_training_like_params(cfg, seed=0):
    """docs/SPEC.md §4's training-like model: init_params(cfg) with its zero-initialised matrices (w1, a1, v1,
    g1, att.output, ffn.value) filled with N(0, 0.02^2); float32."""
    rng = seeded_rng(seed)
    return {k: (0.02 * rng.standard_normal(v.shape)).astype(np.float32) if v.ndim == 2 and not v.any()
            else v.astype(np.float32) for k, v in init_params(cfg, seed).items()}


@pytest.fixture
def random_params():
    """The :func:`make_random_params` factory."""
    return make_random_params


@pytest.fixture
def training_like():
    """The :func:`make_training_like_params` factory."""
    return make_training_like_params
