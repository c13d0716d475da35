"""Which cuBLASLt algorithm each GEMM shape runs: the fastest of the heuristic's candidates, timed once
per machine and remembered in ``<cache root>/gemm-algos.json``.

A new shape's candidates (up to CANDIDATES) each run REPEATS times in a CUDA graph, on the GEMM's own A
and B and on a scratch C (a plan may be built while its real output holds live data); the heuristic's
first candidate is kept unless another is more than MARGIN faster, so the choice does not flip on timing
noise. The file maps a machine key (GPU, multiprocessors, cuBLASLt version, workspace) to the chosen
algorithm of each shape, so every process on the machine runs the same algorithms — the same bits (exact
resume across processes). Another GPU, or another cuBLASLt, chooses anew. ``RWKVX_GEMM_TUNING=0`` skips
the timing and runs the heuristic's first candidate (what cublasGemmEx runs).
"""
from __future__ import annotations

import ctypes
import json
import os
import tempfile

from .cache import cache_root
from .errors import CudaError
from .gemm_shape import Algo, GemmShape

CANDIDATES = 8
REPEATS = 10
MARGIN = 0.02
CACHE_FILE = "gemm-algos.json"


def _machine_key(lt) -> str:
    dev = lt.dev
    return f"{dev.name} {dev.arch} x{dev.sm_count} cublasLt {lt.version} ws{lt.workspace_bytes}"


def _load() -> dict:
    try:
        with open(cache_root() / CACHE_FILE) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save(key: str, chosen: dict[str, str]) -> None:
    """Merge ``chosen`` into the file's entry for ``key`` (written to a temporary file, then renamed)."""
    path = cache_root() / CACHE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load()
        data.setdefault(key, {}).update(chosen)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".gemm-algos.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass        # a read-only cache folder: the choice is timed again by the next process


def _time_candidates(lt, shape: GemmShape, op, algos: list[Algo], scratch: int) -> list[float]:
    """Milliseconds per call of each candidate (inf where it fails), each replayed as a CUDA graph."""
    from .graph import Graph
    from .timing import EventTimer
    dev, timer = lt.dev, EventTimer(lt.dev)
    times = []
    try:
        for algo in algos:
            def run(algo=algo):
                for _ in range(REPEATS):
                    lt.matmul(shape, algo, op, c=scratch)
            try:
                run()               # eagerly first: a failing candidate raises here, outside any capture
                dev.synchronize()
            except RuntimeError:
                times.append(float("inf"))
                continue
            graph = Graph.capture(dev, run)
            try:
                graph.launch()
                times.append(timer.time_ms(graph.launch, 2) / REPEATS)
            finally:
                graph.close()
    finally:
        timer.close()
    return times


def pick(times: list[float]) -> int:
    """Index of the candidate to run: the fastest, unless the first is within MARGIN of it."""
    best = min(range(len(times)), key=times.__getitem__)
    return 0 if times[0] <= (1.0 + MARGIN) * times[best] else best


def choose(lt, new: dict, scratch: tuple[int, int] | None = None, tune: bool = True) -> dict:
    """The algorithm of each shape in ``new`` (GemmShape -> an ops.Gemm of that shape): from the cache
    file, else timed now (and saved), the outputs written to ``scratch`` (address, bytes; a buffer is
    allocated for them when None or too small). ``tune=False`` (or ``RWKVX_GEMM_TUNING=0``): the
    heuristic's first candidate, untimed and not saved."""
    if not new:
        return {}
    key = _machine_key(lt)
    known = _load().get(key, {})
    tune = tune and os.environ.get("RWKVX_GEMM_TUNING", "1") != "0"
    chosen, fresh = {}, {}
    todo = {}
    for shape, op in new.items():
        saved = known.get(shape.key())
        if tune and isinstance(saved, str) and len(saved) == 2 * ctypes.sizeof(Algo):
            chosen[shape] = Algo.from_buffer_copy(bytes.fromhex(saved))
        else:
            todo[shape] = op
    if not todo:
        return chosen
    dev = lt.dev
    if tune and dev._capturing:
        raise RuntimeError("a GEMM shape was first seen during graph capture: build the plan before capturing")
    owned, out = None, None
    need = max(s.c_bytes() for s in todo)
    if tune and scratch is not None and scratch[1] >= need:
        out = scratch[0]
    elif tune:
        try:
            owned = dev.alloc(need)
            out = owned.ptr
        except CudaError:       # no room for a scratch output: run the heuristic's first candidates, untimed
            tune = False
    try:
        for shape, op in todo.items():
            algos = lt.candidates(shape, CANDIDATES if tune else 1)
            index = pick(_time_candidates(lt, shape, op, algos, out)) if tune and len(algos) > 1 else 0
            chosen[shape] = algos[index]
            fresh[shape.key()] = bytes(algos[index]).hex()
    finally:
        if owned is not None:
            owned.close()
    if tune:
        _save(key, fresh)
    return chosen
