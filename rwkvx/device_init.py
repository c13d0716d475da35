"""The GPU path of :func:`rwkvx.init_params` (``device="gpu"``): every random tensor drawn and
orthonormalised on the device, downloaded once (docs/SPEC.md §2.4; the kernels: rwkvx/cu/init).

One tensor at a time: the embedding is drawn as float32 straight into the staging buffer; an orthogonal
tensor of shape (rows, cols) draws its float64 Gaussian [m, n] (m = max, n = min) into scratch A, then a
Cholesky QR pass runs as one plan — G = AᵀA, L = chol(G), A = A L⁻ᵀ, G = AᵀA, max |G − I| — and when
that is above ORTHOGONALITY_TOL a second pass (L = chol(G), A = A L⁻ᵀ). A Gram matrix that is not
numerically positive definite (a draw whose condition number is near 1e8, rare) sends that tensor's draw
to the host's Householder QR. The result, times the gain and transposed when the shape is wide, is
stored as float32 and downloaded into the returned array. The plans of a shape are built once and
reused by every tensor of that shape.

Scratch (:func:`scratch_sizes`): A (float64, the largest draw, the head's V x C), G (float64, n x n of
the largest n), the float32 staging buffer (the largest tensor) and two scalars — 3.1 GiB for the 7.2B
preset, 1.9 GiB for 2.9B — allocated from free device memory when init starts and freed before it
returns, so before a Trainer builds its Model's arena.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .config import Config
from .cu import init as kernels
from .cu._common import DeviceInfo, carve, carved_bytes
from .params import (EMB_INIT_RANGE, EMB_WEIGHT, ORTHOGONALITY_TOL, ParamDict, householder_columns,
                     orthogonal_tensors)
from .runtime.ops import Gemm, Memset


def _draw_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """(m, n) of the Gaussian draw behind an orthogonal tensor of ``shape``: m >= n."""
    return max(shape), min(shape)


def scratch_sizes(cfg: Config) -> dict[str, tuple[int, str]]:
    """The device scratch of :func:`random_params` for ``cfg``: name -> (elements, element type)."""
    draws = [_draw_shape(shape) for shape, _ in orthogonal_tensors(cfg).values()]
    largest = max([cfg.vocab_size * cfg.n_embd] + [m * n for m, n in draws])
    return {"a": (max(m * n for m, n in draws), "f64"), "g": (max(n * n for _, n in draws), "f64"),
            "out": (largest, "f32"), "info": (1, "i32"), "deviation": (1, "f64")}


def scratch_bytes(cfg: Config) -> int:
    """Bytes of device memory :func:`random_params` allocates for ``cfg`` (freed when it returns)."""
    return carved_bytes(scratch_sizes(cfg))


def pass_ops(buf: dict, m: int, n: int, dev: DeviceInfo, first: bool) -> list:
    """One Cholesky QR pass over the [m, n] draw in scratch ``buf`` (:func:`scratch_sizes`, carved): the
    first from A (G = AᵀA, L = chol(G), A = A L⁻ᵀ, then G = AᵀA and its deviation from I), the second
    from that G (L = chol(G), A = A L⁻ᵀ). ``info`` is zeroed first and non-zero after a failed factor."""
    a, g, info = buf["a"], buf["g"], buf["info"]
    ops = [Memset(info, 4), *(kernels.gram(a, m, n, g) if first else []), *kernels.cholesky(g, n, info),
           *kernels.solve(a, m, n, g)]
    if first:
        ops += [*kernels.gram(a, m, n, g), *kernels.deviation(g, n, buf["deviation"], dev)]
    return ops


class _Runner:
    """The scratch buffers on one device and the plans of each draw shape, built once."""

    def __init__(self, dev, cfg: Config):
        self.dev, self.info = dev, dev.info
        self.buffer = dev.alloc(scratch_bytes(cfg))
        self.buf = carve(self.buffer.ptr, scratch_sizes(cfg))
        self._plans: dict = {}

    def close(self) -> None:
        self._plans.clear()
        self.buffer.close()

    def plan(self, ops: list):
        """A Plan of ``ops``; its fp64 GEMMs run the heuristic's first algorithm (each runs a few times)."""
        from ._core import Plan
        gemms = [op for op in ops if isinstance(op, Gemm)]
        if gemms:
            self.dev.cublas.prepare(gemms, tune=False)
        return Plan(self.dev, ops)

    def _cached(self, key: tuple, build: Callable[[], list]):
        if key not in self._plans:
            self._plans[key] = self.plan(build())
        return self._plans[key]

    def _read_info(self) -> int:
        return int(self.dev.download(self.buf["info"], (1,), np.int32)[0])

    def _fallback(self, draw, m: int, n: int) -> None:
        """A = Householder Q of the draw, on the host (a Gram matrix was not positive definite)."""
        draw.run()
        a = self.dev.download(self.buf["a"], (m, n), np.float64)
        self.dev.upload(self.buf["a"], householder_columns(a))

    def orthogonal(self, seed: int, name: str, shape: tuple[int, int], gain: float) -> np.ndarray:
        """The float32 orthogonal tensor ``name`` (see the module docstring)."""
        b = self.buf
        m, n = _draw_shape(shape)
        draw = self.plan(kernels.normal(b["a"], m * n, seed, name, self.info))
        first = self._cached((True, m, n), lambda: pass_ops(b, m, n, self.info, first=True))
        draw.run()
        first.run()
        if self._read_info():
            self._fallback(draw, m, n)
        elif self.dev.download(b["deviation"], (1,), np.float64)[0] > ORTHOGONALITY_TOL:
            self._cached((False, m, n), lambda: pass_ops(b, m, n, self.info, first=False)).run()
            if self._read_info():
                self._fallback(draw, m, n)
        wide = shape[0] < shape[1]
        self.plan(kernels.store(b["out"], b["a"], m, n, gain, wide, self.info)).run()
        return self.dev.download(b["out"], shape, np.float32)

    def embedding(self, seed: int, shape: tuple[int, int]) -> np.ndarray:
        """The float32 embedding, uniform in [-EMB_INIT_RANGE, EMB_INIT_RANGE)."""
        count = shape[0] * shape[1]
        self.plan(kernels.uniform(self.buf["out"], count, seed, EMB_WEIGHT, -EMB_INIT_RANGE,
                                  2 * EMB_INIT_RANGE, self.info)).run()
        return self.dev.download(self.buf["out"], shape, np.float32)


def random_params(cfg: Config, seed: int, dev=None,
                  progress: Callable[[int, int], None] | None = None) -> ParamDict:
    """The random tensors of ``cfg`` (the embedding and :func:`rwkvx.params.orthogonal_tensors`) drawn on
    ``dev`` (default: ``Device.get()``) for ``seed`` (< 2^64); ``progress(done, total)`` after each, in
    parameters. Equal to :func:`rwkvx.oracle.init.random_params` within float32 rounding."""
    kernels.seed_key(seed)                           # a bad seed fails before any GPU work
    if dev is None:
        from .runtime import Device
        dev = Device.get()
    specs = orthogonal_tensors(cfg)
    emb_shape = (cfg.vocab_size, cfg.n_embd)
    total = int(np.prod(emb_shape)) + sum(int(np.prod(shape)) for shape, _ in specs.values())
    runner = _Runner(dev, cfg)
    try:
        out = {EMB_WEIGHT: runner.embedding(seed, emb_shape)}
        done = out[EMB_WEIGHT].size
        if progress is not None:
            progress(done, total)
        for name, (shape, gain) in specs.items():
            out[name] = runner.orthogonal(seed, name, shape, gain)
            done += out[name].size
            if progress is not None:
                progress(done, total)
    finally:
        runner.close()
    return out

