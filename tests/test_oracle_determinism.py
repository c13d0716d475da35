"""The oracle's results do not depend on the BLAS thread count: bit-identical loss, logits and gradients.

What it proves: every GEMM of the oracle is a float64 dgemm (oracle/_common.py ``matmul``), and
OpenBLAS splits a dgemm across threads by rows and columns of the output only, never along the inner
dimension, so each output element is summed in the same order whatever the thread count; everything
else in the oracle is single-threaded. The check runs the float32 and the float64 oracle in fresh
subprocesses with OPENBLAS_NUM_THREADS (and OMP_NUM_THREADS, MKL_NUM_THREADS) = 1 and = 2 on a
problem whose GEMMs are large enough (M*N*K > 4 * 65536) for OpenBLAS to use threads at all; once
with the BLAS kernels this CPU gets, once with OPENBLAS_CORETYPE=Haswell (the kernels of AVX2
CPUs such as AMD Zen) where the CPU can run them. OpenBLAS's Haswell *sgemm* gives different
results for 1 and 2 threads (measured: every float32 gradient of the former sgemm-based oracle
differed on this problem), so the test would catch a float32 GEMM creeping back.

Under which BLAS: numpy's own, whatever it is. With OpenBLAS (numpy's wheels bundle it) the
subprocess also asks the library for its thread count and the test asserts it took the setting.
With MKL, MKL_NUM_THREADS sets the threads (MKL may split the inner dimension unless its CNR mode
is on); with a BLAS that reads none of these variables the two runs use the same threads and the
test only proves run-to-run determinism. It does not cover other CPUs or BLAS kernels (set with
OPENBLAS_CORETYPE): there the float32 oracle is measured bit-identical too (Haswell, SkylakeX,
Sandybridge, Prescott kernels; numpy's AVX2 and AVX512 paths), while float64 results differ at
~1e-13, the last bits of differently ordered float64 sums.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

_SCRIPT = r"""
import ctypes, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
from conftest import make_random_params
from rwkvx import Config
from rwkvx.oracle import Oracle


def openblas_threads():
    # The thread count of the OpenBLAS that numpy loaded (None if numpy's BLAS is not OpenBLAS).
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                     "openblas_get_num_threads"):
            if hasattr(lib, name):
                return getattr(lib, name)()
    return None


cfg = Config(vocab_size=64, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
             moba_chunk_size=16, moba_top_k=2)
params = {n: p.astype(np.float32) for n, p in make_random_params(cfg, 3).items()}
rng = np.random.default_rng(3)
tokens = rng.integers(0, cfg.vocab_size, (2, 64))      # R = 128 rows: 128*64*64 > 4 * 65536
targets = rng.integers(0, cfg.vocab_size, (2, 64))
out = {"threads": np.array(-1 if openblas_threads() is None else openblas_threads())}
for dtype in (np.float32, np.float64):
    oracle = Oracle(cfg, params, dtype=dtype)
    tag = np.dtype(dtype).name
    loss, grads = oracle.loss_and_grads(tokens, targets)
    out[f"{tag}/loss"] = np.array(loss)
    out[f"{tag}/logits"] = oracle.forward(tokens)
    out.update({f"{tag}/{n}": g for n, g in grads.items()})
np.savez(sys.argv[1], **out)
"""


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":")[1].split()) for line in f if line.startswith("flags")),
                        set())
    except OSError:
        return set()


CORETYPES = [None] + (["Haswell"] if {"avx2", "fma"} <= _cpu_flags() else [])


def _run(tmp_path: Path, threads: int, coretype: str | None) -> dict:
    path = tmp_path / f"threads{threads}_{coretype}.npz"
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    env.pop("OPENBLAS_CORETYPE", None)
    if coretype:
        env["OPENBLAS_CORETYPE"] = coretype
    subprocess.run([sys.executable, "-c", _SCRIPT, str(path), str(Path(__file__).parent)], env=env,
                   check=True, capture_output=True, timeout=300)
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
@pytest.mark.parametrize("coretype", CORETYPES, ids=lambda c: c or "native")
def test_results_bit_identical_across_blas_thread_counts(tmp_path, coretype):
    one, two = _run(tmp_path, 1, coretype), _run(tmp_path, 2, coretype)
    if one["threads"] >= 0:                                # OpenBLAS: the setting took effect
        assert (int(one["threads"]), int(two["threads"])) == (1, 2)
    keys = sorted(k for k in one if k != "threads")
    assert keys == sorted(k for k in two if k != "threads")
    assert {k.split("/")[0] for k in keys} == {"float32", "float64"}
    differ = [k for k in keys if one[k].dtype != two[k].dtype or one[k].tobytes() != two[k].tobytes()]
    assert not differ, f"results depend on the BLAS thread count: {differ[:8]}"
