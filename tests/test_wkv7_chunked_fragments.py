"""CPU check of the chunk records' fragment order of rwkvx/cu/wkv7/chunked.cu: wkv7c_intra writes element
(m, k) of an [M][K] A operand at frag_pos<K>(m, k); the state passes' frag_a(FragOp) gives lane l of k-step
k0 of an m-tile the four floats at ((k0 / 8) * 32 + l) * 4 of that tile. Those must be the lane's a0..a3 of
mma.m16n8k8 .tf32 as the PTX ISA defines them ("Matrix Fragments for mma.m16n8k8"): with g = l / 4,
q = l % 4, a0 = A(g, k0 + q), a1 = A(g + 8, k0 + q), a2 = A(g, k0 + q + 4), a3 = A(g + 8, k0 + q + 4).

frag_pos is read from the kernels' source (wkv7/fragments.cuh) and evaluated here (its body is integer
arithmetic that means the same in Python, / as //), so the test checks the formula the GPU runs; so is
put_section's inverse (which element of the operand each 16-byte piece of a section holds), against
frag_pos.
"""
import re

import numpy as np
import pytest

from rwkvx.runtime.nvrtc import CU_DIR

FRAGMENTS = CU_DIR / "wkv7" / "fragments.cuh"     # frag_pos, put_section

from seeding import seeded_rng


def _frag_pos():
    src = FRAGMENTS.read_text()
    body = re.search(r"int frag_pos\(int m, int k\) \{\s*return (.*?);\s*\}", src, re.S).group(1)
    expr = " ".join(body.split()).replace("/", "//")         # C's integer division (non-negative operands)
    return lambda m, k, K: eval(expr, {"K": K, "m": m, "k": k})   # noqa: S307 (the repository's own source)


@pytest.mark.parametrize("M, K", [(16, 64), (16, 32), (16, 16), (64, 16), (32, 16)])
def test_fragment_order_is_the_ptx_a_layout(M, K):
    pos = _frag_pos()
    A = seeded_rng(M * K).standard_normal((M, K))
    buf = np.full(M * K, np.nan)
    for m in range(M):
        for k in range(K):
            buf[pos(m, k, K)] = A[m, k]
    assert not np.isnan(buf).any()                     # a bijection onto the section
    for mt in range(M // 16):
        tile = buf[mt * 16 * K:(mt + 1) * 16 * K]      # FragOp{section + 16 mt K}
        for k0 in range(0, K, 8):
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                got = tile[((k0 >> 3) * 32 + lane) * 4:][:4]
                r = 16 * mt + g
                want = [A[r, k0 + q], A[r + 8, k0 + q], A[r, k0 + q + 4], A[r + 8, k0 + q + 4]]
                np.testing.assert_array_equal(got, want)


def _put_section_index():
    src = FRAGMENTS.read_text()
    found = re.search(r"void put_section\(.*?const int (tile = .*?);\s*const int (m = .*?);", src, re.S)
    body = ", ".join(found.groups())
    names = {}
    for part in re.split(r",\s*(?=\w+ = )", " ".join(body.split())):
        name, expr = part.split(" = ", 1)
        names[name] = expr.replace("/", "//")

    def index(f, K):
        env = {"f": f, "K": K}
        for name, expr in names.items():
            env[name] = eval(expr, dict(env))                   # noqa: S307 (the repository's own source)
        return env["m"], env["k"]
    return index


@pytest.mark.parametrize("M, K", [(16, 64), (64, 16), (16, 16)])
def test_put_section_writes_frag_pos(M, K):
    pos, index = _frag_pos(), _put_section_index()
    for f in range(M * K // 4):
        m, k = index(f, K)
        got = [pos(m, k, K), pos(m + 8, k, K), pos(m, k + 4, K), pos(m + 8, k + 4, K)]   # its a0..a3
        assert got == [4 * f, 4 * f + 1, 4 * f + 2, 4 * f + 3]
