"""Stateful generation: :func:`generate` (and :func:`stream`, the same one token at a time).

The prompt is processed once, in parallel, and leaves each block's state behind: the WKV state and the
two token-shift rows of every RWKV block, the keys, values and complete-block key means of every MoBA
block. Each new token is then one step of constant work per RWKV block (MoBA attends over at most
``top_k`` blocks of the cache), instead of a forward over the whole window.

Two sessions do this with one interface (``prefill(prompt) -> logits``, ``step(tokens) -> logits``):

* on the CPU, :meth:`rwkvx.oracle.Oracle.stateful_forward` (the reference);
* on the GPU, :class:`rwkvx.decoder.Decoder`: the model's forward kernels for the prompt, then
  single-token step kernels replayed as one CUDA graph per token. The decoder reads the model's resident
  weights and is kept on the model (:func:`rwkvx.decoder.decoder_for`), so only the first call for a
  batch size builds it.

Sampling follows :mod:`rwkvx.sampling`'s contract: each new token of each sequence is chosen from its
logits and one uniform draw u in [0, 1), the B draws of a step taken from numpy's ``Generator`` seeded
by ``seed`` on the host (one call ``rng.random(B)`` per step, greedy steps included), so the same inputs
give the same tokens on the CPU and the GPU alike (up to the logits themselves).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterator, Protocol

import numpy as np

from .sampling import Sampling, check_vocab
from .validate import check_tokens


class Session(Protocol):
    """A stateful forward of a batch of B sequences that chooses each next token (see the module
    docstring)."""

    def prefill(self, tokens: np.ndarray, u: np.ndarray, sampling: Sampling) -> np.ndarray:
        """Process the prompt int64 [B, P]; the first new token of each sequence, int64 [B], chosen
        with its draw ``u`` [B] and ``sampling`` (kept for the steps)."""

    def step(self, tokens: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Feed one token per sequence (int64 [B]); the next, int64 [B], chosen with the draws ``u``."""

    def close(self) -> None:
        """End the generation (a session kept for later calls keeps its buffers)."""


class OracleSession:
    """A :class:`Session` over :meth:`rwkvx.oracle.Oracle.stateful_forward` (CPU), sampling with
    :mod:`rwkvx.sampling`'s numpy implementation."""

    def __init__(self, oracle: Any) -> None:
        self.oracle = oracle
        self.state = None
        self.sampling = Sampling()

    def prefill(self, tokens: np.ndarray, u: np.ndarray, sampling: Sampling) -> np.ndarray:
        logits, self.state = self.oracle.stateful_forward(tokens)
        self.sampling = sampling
        return sampling.rows(logits[:, -1], u)

    def step(self, tokens: np.ndarray, u: np.ndarray) -> np.ndarray:
        if self.state is None:
            raise RuntimeError("step() before prefill()")
        logits, self.state = self.oracle.stateful_forward(tokens[:, None], self.state)
        return self.sampling.rows(logits[:, 0], u)

    def close(self) -> None:
        self.state = None


def _config_of(source: Any):
    from .config import Config

    cfg = getattr(source, "cfg", None)
    if not isinstance(cfg, Config):
        raise TypeError("generate() needs an rwkvx.Trainer, rwkvx.Model or rwkvx.oracle.Oracle, "
                        f"got {type(source).__name__}")
    return cfg


def _check_prompt(prompt_tokens: Any, vocab_size: int) -> tuple[np.ndarray, bool]:
    """(prompt int64 [B, P], whether it was given 1-D)."""
    prompt = np.asarray(prompt_tokens)
    if prompt.ndim not in (1, 2):
        raise ValueError(f"prompt_tokens must be 1-D [P] or 2-D [B, P], got shape {prompt.shape}")
    if prompt.size == 0:      # before the dtype: an empty list is a float array
        raise ValueError(f"prompt_tokens must be non-empty, got shape {prompt.shape}")
    if prompt.dtype.kind not in "iu":
        raise TypeError(f"prompt_tokens must be integer token ids, got dtype {prompt.dtype}")
    flat = prompt.ndim == 1
    return check_tokens(prompt[None] if flat else prompt, vocab_size, "prompt_tokens"), flat


def _check_options(max_new_tokens: Any, temperature: Any, top_p: Any, seed: Any, top_k: Any) -> None:
    def integer(value: Any) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    if not integer(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, numbers.Real) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if not integer(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not integer(top_k):
        raise TypeError(f"top_k must be an int (0: no limit), got {type(top_k).__name__}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no limit), got {top_k}")


def open_session(source: Any, batch: int, prompt_len: int, max_len: int) -> Session:
    """The session of ``source`` (Trainer, Model or Oracle) for ``batch`` sequences whose prompt has
    ``prompt_len`` tokens and that grow to at most ``max_len`` tokens fed to the model."""
    from .oracle import Oracle
    from .training.trainer import CPUBackend, GPUBackend, Trainer

    if isinstance(source, Trainer):
        source = source.backend
    if isinstance(source, CPUBackend):
        source = Oracle(source.cfg, source.params, dtype=source.dtype)
    elif isinstance(source, GPUBackend):
        source = source.model
    if isinstance(source, Oracle):
        return OracleSession(source)
    from .decoder import decoder_for
    from .model import Model
    if not isinstance(source, Model):
        raise TypeError(f"expected an rwkvx.Model, got {type(source).__name__}")
    return decoder_for(source, batch, prompt_len, max_len)


def stream(model_or_trainer: Any, prompt_tokens: Any, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, seed: int = 0, top_k: int = 0) -> Iterator[np.ndarray]:
    """:func:`generate` one step at a time: yields the new token of every sequence, int64 [B]
    (B = 1 for a 1-D prompt), as soon as it is sampled. The arguments are checked, and the session
    built, when this is called (not at the first ``next``)."""
    cfg = _config_of(model_or_trainer)
    prompt, _ = _check_prompt(prompt_tokens, cfg.vocab_size)
    _check_options(max_new_tokens, temperature, top_p, seed, top_k)
    check_vocab(cfg.vocab_size)
    if max_new_tokens == 0:
        return iter(())
    B, P = prompt.shape
    # the last new token is only returned, never fed back
    session = open_session(model_or_trainer, B, P, P + max_new_tokens - 1)
    return _steps(session, prompt, int(max_new_tokens), Sampling(float(temperature), int(top_k), float(top_p)),
                  np.random.default_rng(seed))


def _steps(session: Session, prompt: np.ndarray, n: int, sampling: Sampling,
           rng: np.random.Generator) -> Iterator[np.ndarray]:
    try:
        B = len(prompt)
        new = session.prefill(prompt, rng.random(B), sampling)
        yield new
        for _ in range(n - 1):
            new = session.step(new, rng.random(B))
            yield new
    finally:
        session.close()


def generate(model_or_trainer: Any, prompt_tokens: Any, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, seed: int = 0, top_k: int = 0) -> np.ndarray:
    """Continue ``prompt_tokens`` by ``max_new_tokens`` sampled tokens; returns them (int64).

    ``model_or_trainer``: an :class:`rwkvx.Trainer` (CPU or GPU backend), an :class:`rwkvx.Model`
    (GPU) or an :class:`rwkvx.oracle.Oracle` (CPU). ``prompt_tokens``: token ids, 1-D [P] or 2-D
    [B, P] (B sequences of one length), P >= 1, each < vocab_size. ``temperature`` 0 is greedy;
    otherwise each token is drawn from softmax(logits / temperature) restricted to the ``top_k`` most
    likely tokens (0: no limit), then to the smallest set of the most likely whose mass reaches
    ``top_p`` (0 < top_p <= 1): :mod:`rwkvx.sampling` states the contract exactly. ``seed`` seeds
    numpy's Generator: the result is deterministic. Returns [max_new_tokens] for a 1-D prompt, else
    [B, max_new_tokens]. Bad arguments raise ValueError / TypeError before any work.

    The prompt is processed once, in parallel; each further token is one stateful step (see the
    module docstring). On the GPU the decoder reads the model's resident weights (a training step in
    between is seen) and uses buffers of its own (the model's are untouched); it is built once per
    batch size and kept on the model (:func:`rwkvx.decoder.free_decoders` releases it).
    """
    cfg = _config_of(model_or_trainer)
    prompt, flat = _check_prompt(prompt_tokens, cfg.vocab_size)
    steps = list(stream(model_or_trainer, prompt, max_new_tokens, temperature, top_p, seed, top_k))
    out = np.stack(steps, axis=1) if steps else np.zeros((prompt.shape[0], 0), np.int64)
    return out[0] if flat else out
