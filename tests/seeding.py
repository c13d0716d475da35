"""Random test inputs with known seeds: every test draws its randomness from :func:`seeded_rng`, which
records the seed, and the report of a failing test names the seeds it used (the hooks below, which
tests/conftest.py installs), so any failure can be replayed.

A test that wants fixed inputs passes a seed; one that wants fresh inputs every run passes none and
gets a seed from ``os.urandom``. To replay a failure with fresh seeds, set the environment variable
``RWKVX_TEST_SEEDS`` to the seeds its report lists (comma-separated): the fresh draws of each test
then take them in order instead.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

REPLAY_ENV = "RWKVX_TEST_SEEDS"
SEED_BITS = 63                 # fresh seeds are non-negative 63-bit ints (they print and paste as plain ints)

_used: list[tuple[int, bool]] = []      # (seed, fresh) of every draw in the current test, in order


def _replay_seeds() -> list[int] | None:
    """The seeds ``RWKVX_TEST_SEEDS`` lists, or None when it is unset or empty."""
    text = os.environ.get(REPLAY_ENV, "").strip()
    if not text:
        return None
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise ValueError(f"{REPLAY_ENV} must be comma-separated ints, got {text!r}") from None


def fresh_seed() -> int:
    """A seed for fresh inputs: the next one of ``RWKVX_TEST_SEEDS`` when replaying, else random bits
    from ``os.urandom``."""
    replay = _replay_seeds()
    if replay is None:
        return int.from_bytes(os.urandom(8), "little") >> (64 - SEED_BITS)
    n = sum(fresh for _, fresh in _used)
    if n >= len(replay):
        raise ValueError(f"{REPLAY_ENV} lists {len(replay)} seed(s); this test draws more fresh ones")
    return replay[n]


def seeded_rng(seed: int | None = None) -> np.random.Generator:
    """``np.random.default_rng(seed)`` with the seed recorded for the failure report; ``seed`` None draws
    a fresh one (:func:`fresh_seed`)."""
    fresh = seed is None
    if fresh:
        seed = fresh_seed()
    elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise TypeError(f"seed must be an int >= 0 or None, got {seed!r}")
    _used.append((int(seed), fresh))
    return np.random.default_rng(int(seed))


def seeded_batches(n: int, vocab_size: int, batch_size: int, seq_len: int,
                   seed: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``n`` training batches ``(tokens, targets)``, int64 ``[batch_size, seq_len]`` each, of random
    tokens from :func:`seeded_rng` (``seed``): the targets are the tokens shifted by one."""
    rng = seeded_rng(seed)
    out = []
    for _ in range(n):
        x = rng.integers(0, vocab_size, (batch_size, seq_len + 1))
        out.append((x[:, :-1], x[:, 1:]))
    return out


def seed_report(nodeid: str) -> str | None:
    """The failure note of the current test: the seeds it drew and, if any was fresh, the command that
    replays it; None when it drew none."""
    if not _used:
        return None
    lines = ["seeds drawn, in order: " + ", ".join(f"{s}{' (fresh)' if f else ''}" for s, f in _used)]
    fresh = [str(s) for s, f in _used if f]
    if fresh:
        lines.append(f"replay: {REPLAY_ENV}={','.join(fresh)} python -m pytest '{nodeid}'")
    return "\n".join(lines)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start each test's record of seeds before its fixtures draw any."""
    _used.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Add the seeds to the report of a failed setup, call or teardown (a section named "seeds",
    printed with the failure)."""
    report = yield
    if report.failed:
        note = seed_report(item.nodeid)
        if note:
            report.sections.append(("seeds", note))
    return report
