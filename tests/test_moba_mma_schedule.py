"""CPU check of the double-buffered tile schedules of mma.cu's tensor-core kernels (method "mma").

Transliterates the loops of moba_mfwd_attend / moba_mdq_attend (key tiles) and moba_bwd_dkdv_mma
(query tiles, with the query-list entries fetched to QRAW one tile ahead) as sequences of phases
between barriers. cp.async copies issued in a phase land at an unknown time before the next barrier
(cp.async.wait_group 0 + __syncthreads), so within one phase no buffer may be both read and written, and
every read must see what the loop means it to: the tile being computed, the entries of the tile being
staged. Also checks that the tiles cover exactly the own-block queries and then the list's queries.
"""

import pytest

from rwkvx.cu import moba


class Buffers:
    """Shared-memory buffers as name -> content, with the reads and writes of the current phase."""

    def __init__(self):
        self.landed, self.pending, self.reads, self.writes = {}, {}, set(), set()

    def write(self, name, content):
        assert name not in self.reads, f"{name} overwritten while read in the same phase"
        self.pending[name] = content
        self.writes.add(name)

    def read(self, name):
        assert name not in self.writes, f"{name} read while its copy is in flight"
        self.reads.add(name)
        return self.landed[name]

    def barrier(self):                     # cp_wait<0>(); __syncthreads();
        self.landed.update(self.pending)
        self.pending, self.reads, self.writes = {}, set(), set()


def key_loop(u, uend, MK):
    """moba_mfwd_attend / moba_mdq_attend: the key tiles each iteration computes on."""
    sm, seen = Buffers(), []
    sm.write("KV0", u)                     # moba_mstage_keys(..., 0, ..., u, uend)
    buf = 0
    for u0 in range(u, uend, MK):
        sm.barrier()
        if u0 + MK < uend:
            sm.write(f"KV{buf ^ 1}", u0 + MK)
        assert sm.read(f"KV{buf}") == u0
        seen.append(u0)
        buf ^= 1
    return seen


def dkdv_loop(u0, bend, entries, K1, MKVQ):
    """moba_bwd_dkdv_mma: the query tokens of each tile it computes on."""
    nown = -(-(bend - u0) // MKVQ)
    ntiles = nown + -(-len(entries) // MKVQ)
    sm, seen = Buffers(), []

    def fetch(tile):                       # moba_kv_fetch
        if tile < ntiles and tile >= nown:
            e0 = (tile - nown) * MKVQ
            sm.write(f"QRAW{tile & 1}", (tile, entries[e0:e0 + MKVQ]))

    def stage(tile):                       # moba_mstage_kv_queries
        if tile < nown:
            first = u0 + tile * MKVQ
            toks = [t for t in range(first, first + MKVQ) if t < bend]
        else:
            got, raw = sm.read(f"QRAW{tile & 1}")
            assert got == tile
            toks = [e // K1 for e in raw]
        sm.write(f"Q{tile & 1}", (tile, toks))

    stage(0)
    fetch(1)
    for tile in range(ntiles):
        sm.barrier()
        if tile + 1 < ntiles:
            stage(tile + 1)
            fetch(tile + 2)
        got, toks = sm.read(f"Q{tile & 1}")
        assert got == tile
        seen.extend(toks)
    return seen


@pytest.mark.parametrize("n", [1, 63, 64, 65, 128, 512, 4096])
def test_key_tiles_in_order(n):
    MK = moba.MMA_ROWS
    assert key_loop(1000, 1000 + n, MK) == list(range(1000, 1000 + n, MK))


@pytest.mark.parametrize("N", moba.MMA_HEAD_SIZES)
@pytest.mark.parametrize("own,listed", [(64, 0), (17, 0), (64, 1), (64, 64), (33, 65), (64, 700), (5, 129)])
def test_dkdv_tiles_cover_own_then_listed_queries(N, own, listed):
    MKVQ, K1 = moba.mma_tiles(N, "bf16")["MOBA_MMA_KVQ"], 3
    u0 = 512
    entries = [(2000 + 3 * i) * K1 + i % K1 for i in range(listed)]
    assert dkdv_loop(u0, u0 + own, entries, K1, MKVQ) == list(range(u0, u0 + own)) + [e // K1 for e in entries]


def test_a_wrong_buffer_is_caught():
    """The model can fail: fetching the entries into the buffer being staged from is a race."""
    sm = Buffers()
    sm.write("QRAW1", (1, [3]))
    sm.barrier()
    sm.read("QRAW1")
    with pytest.raises(AssertionError):
        sm.write("QRAW1", (3, [6]))
