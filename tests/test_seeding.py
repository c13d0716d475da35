"""tests/seeding.py: seeded generators, fresh seeds, the seeds in a failing test's report and their replay."""
import re

import numpy as np
import pytest

import seeding
from seeding import REPLAY_ENV, fresh_seed, seed_report, seeded_rng

pytest_plugins = ["pytester"]

FAILING_TEST = """
from seeding import seeded_rng

def test_draws():
    fixed = seeded_rng(5).integers(1 << 30)
    fresh = seeded_rng().integers(1 << 30)
    print(f"drew {fixed} {fresh}")
    assert False

def test_passes():
    seeded_rng()
"""
CONFTEST = "from seeding import pytest_runtest_makereport, pytest_runtest_setup  # noqa: F401\n"


def test_seeded_rng_is_default_rng_of_the_seed():
    assert seeded_rng(7).integers(1 << 40, size=4).tolist() == \
        np.random.default_rng(7).integers(1 << 40, size=4).tolist()


@pytest.fixture(autouse=True)
def own_record(monkeypatch):
    """A record of seeds of this test's own (the module's is restored after it) and no replay list."""
    monkeypatch.setattr(seeding, "_used", [])
    monkeypatch.delenv(REPLAY_ENV, raising=False)


def test_fresh_seeds_differ_and_are_recorded():
    seeded_rng(3)
    seeded_rng()
    seeded_rng()
    (s0, f0), (s1, f1), (s2, f2) = seeding._used
    assert (s0, f0, f1, f2) == (3, False, True, True)
    assert s1 != s2 and 0 <= s1 < 1 << seeding.SEED_BITS


@pytest.mark.parametrize("seed", [-1, 1.5, "3", True])
def test_bad_seeds_are_refused(seed):
    with pytest.raises(TypeError, match="seed must be an int"):
        seeded_rng(seed)


def test_replay_seeds_are_taken_in_order(monkeypatch):
    monkeypatch.setenv(REPLAY_ENV, "11, 12")
    assert [fresh_seed(), seeded_rng(4) is not None, seeded_rng().integers(99)] == \
        [11, True, np.random.default_rng(11).integers(99)]
    assert seeded_rng().integers(99) == np.random.default_rng(12).integers(99)
    with pytest.raises(ValueError, match="draws more fresh ones"):
        seeded_rng()
    monkeypatch.setenv(REPLAY_ENV, "1,x")
    with pytest.raises(ValueError, match="comma-separated ints"):
        fresh_seed()


def test_report_lists_seeds_and_the_replay_command():
    assert seed_report("t.py::a") is None
    seeded_rng(2)
    assert seed_report("t.py::a") == "seeds drawn, in order: 2"
    seeded_rng()
    fresh = seeding._used[-1][0]
    assert seed_report("t.py::a") == (f"seeds drawn, in order: 2, {fresh} (fresh)\n"
                                      f"replay: {REPLAY_ENV}={fresh} python -m pytest 't.py::a'")


def test_failure_report_names_the_seeds_and_replays(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_inner=FAILING_TEST)
    first = pytester.runpytest("-q", "-p", "no:cacheprovider")
    first.assert_outcomes(failed=1, passed=1)
    out = first.stdout.str()
    seeds_section = [line for line in out.splitlines() if line.startswith("seeds drawn")]
    assert len(seeds_section) == 1, out                 # the failing test only
    fresh = int(re.fullmatch(r"seeds drawn, in order: 5, (\d+) \(fresh\)", seeds_section[0]).group(1))
    assert f"{REPLAY_ENV}={fresh} python -m pytest 'test_inner.py::test_draws'" in out
    drew = [line for line in out.splitlines() if line.startswith("drew ")]

    monkeypatch.setenv(REPLAY_ENV, str(fresh))
    again = pytester.runpytest("-q", "-p", "no:cacheprovider", "test_inner.py::test_draws")
    again.assert_outcomes(failed=1)
    assert [line for line in again.stdout.str().splitlines() if line.startswith("drew ")] == drew
