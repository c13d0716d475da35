"""dec_gemv's partition of its jobs, on the CPU (rwkvx/cu/decode/gemv.cu's index arithmetic written out
with ops.py's constants): every (job, row, column) is stored by exactly one thread and sums every k of
its product exactly once, for both weight layouts, every k-slice count and partial tiles. The kernel's
arithmetic is checked against its twin on the GPU (tests/gpu/test_decode.py)."""
from collections import Counter

import pytest

from rwkvx.cu import decode as D
from rwkvx.runtime.dtypes import ELEM_BYTES
from rwkvx.runtime.ops import DevPtr

WARPS, CPW, ROWS = D.GEMV_WARPS, D.GEMV_CPW, D.GEMV_ROWS


def covered(job: D.GemvJob, B: int) -> Counter:
    """(row, column) -> the k indices summed into its stored value, from the blocks' assignment."""
    ks, vw = D.gemv_slices(job), 16 // ELEM_BYTES[job.w.elem]     # floatX elements of a 16-byte vector
    sums: dict = {}
    for t in range(D.gemv_tiles(job)):
        if job.kn:           # lane = column, warp w adds k in [w*ks, (w+1)*ks), then the warps in order
            step = -(-job.k // WARPS)
            for lane in range(32):
                col = t * D.GEMV_KN_COLS + lane
                if col < job.n:
                    ks_all = [k for w in range(WARPS) for k in range(w * step, min(job.k, (w + 1) * step))]
                    for b in range(B):
                        sums.setdefault((b, col), []).extend(ks_all)
            continue
        S, nv = 1 << ks, job.k // vw
        for warp in range(0, WARPS, S):           # a group's slice-0 warp stores its slices' sum
            cw = t * ((WARPS * CPW) >> ks) + (warp >> ks) * CPW
            for c in range(CPW):
                if cw + c >= job.n:
                    continue
                vs = [v for sl in range(S) for lane in range(32)
                      for v in range(sl * nv // S + lane, (sl + 1) * nv // S, 32)]
                for b in range(B):
                    sums.setdefault((b, cw + c), []).extend(k for v in vs for k in range(v * vw, (v + 1) * vw))
    return {key: Counter(ks) for key, ks in sums.items()}


@pytest.mark.parametrize("elem", ["f32", "bf16"])
@pytest.mark.parametrize("n, k, kn", [(96, 64, False), (40, 32, False), (23, 3072, False), (100, 768, False),
                                      (48, 64, True), (64, 20, True), (33, 96, True), (7, 9, True)])
@pytest.mark.parametrize("B", [1, 8])
def test_every_output_sums_every_k_once(elem, n, k, kn, B):
    ptr = DevPtr(1 << 20, elem)
    job = D.GemvJob(ptr, ptr, ptr, n, k, kn)
    sums = covered(job, B)
    assert set(sums) == {(b, c) for b in range(B) for c in range(n)}
    want = Counter(range(k))
    assert all(s == want for s in sums.values())


def test_long_rows_are_split_and_short_ones_not():
    def slices(k, elem):
        ptr = DevPtr(1 << 20, elem)
        return 1 << D.gemv_slices(D.GemvJob(ptr, ptr, ptr, 768, k, False))
    assert [slices(768, "bf16"), slices(3072, "bf16"), slices(768, "f32"), slices(3072, "f32")] == [1, 4, 2, 8]
    assert [slices(k, "bf16") for k in (64, 1 << 16)] == [1, WARPS]
