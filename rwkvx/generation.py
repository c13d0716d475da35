"""Stateful generation: :func:`generate` (and :func:`stream`, the same one token at a time).

The prompt is processed once, in parallel, and leaves each block's state behind: the WKV state and the
two token-shift rows of every RWKV block, the keys, values and complete-block key means of every MoBA
block. Each new token is then one step of constant work per RWKV block (MoBA attends over at most
``top_k`` blocks of the cache), instead of a forward over the whole window.

Two sessions do this with one interface (``prefill(prompt) -> logits``, ``step(tokens) -> logits``):

* on the CPU, :meth:`rwkvx.oracle.Oracle.stateful_forward` (the reference);
* on the GPU, :class:`rwkvx.decoder.Decoder`: the model's forward kernels for the prompt, then
  single-token step kernels replayed as one CUDA graph per token.

Sampling is done on the host in float64 with numpy's ``Generator`` seeded by ``seed``: the same
inputs give the same tokens.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterator, Protocol

import numpy as np

from .validate import check_tokens


class Session(Protocol):
    """A stateful forward of a batch of B sequences (see the module docstring)."""

    def prefill(self, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Process the prompt int64 [B, P]: logits float [B, V] of its last position ([B, P, V]
        of every position with ``all_logits``)."""

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per sequence (int64 [B]): logits float [B, V] of that position."""

    def close(self) -> None:
        """Free what the session holds (device memory, graphs)."""


class OracleSession:
    """A :class:`Session` over :meth:`rwkvx.oracle.Oracle.stateful_forward` (CPU)."""

    def __init__(self, oracle: Any) -> None:
        self.oracle = oracle
        self.state = None

    def prefill(self, tokens: np.ndarray, all_logits: bool = False) -> np.ndarray:
        logits, self.state = self.oracle.stateful_forward(tokens)
        return logits if all_logits else logits[:, -1]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if self.state is None:
            raise RuntimeError("step() before prefill()")
        logits, self.state = self.oracle.stateful_forward(tokens[:, None], self.state)
        return logits[:, 0]

    def close(self) -> None:
        self.state = None


def sample_next(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token from ``logits`` [V], in float64: greedy at temperature 0; else from softmax(logits /
    temperature) restricted, when top_p < 1, to the nucleus: the smallest set of most likely tokens
    (ties: the lower id first) whose mass reaches top_p, drawn in that order."""
    z = np.asarray(logits, dtype=np.float64)
    if temperature == 0:
        return int(np.argmax(z))
    z = z / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p >= 1:
        return int(rng.choice(len(p), p=p))
    order, cum = _nucleus_order(p, top_p)
    keep = max(1, min(int(np.searchsorted(cum, top_p) + 1), len(order)))
    chosen = order[:keep]
    return int(chosen[rng.choice(keep, p=p[chosen] / p[chosen].sum())])


def _nucleus_order(p: np.ndarray, mass: float) -> tuple[np.ndarray, np.ndarray]:
    """(order, cumulative mass): the most likely entries of p, most likely first (ties: lower index
    first), enough of them to hold ``mass`` (all if need be). Only a candidate set is sorted (the k
    largest and their ties, k growing 8x until it holds the mass), so a large vocabulary costs about a
    partition, and the result is the prefix of the full sort."""
    V, k = len(p), 64
    while True:
        cand = np.flatnonzero(p >= np.partition(p, V - k)[V - k]) if k < V else np.arange(V)
        order = cand[np.lexsort((cand, -p[cand]))]
        cum = np.cumsum(p[order])
        if k >= V or cum[-1] >= mass:
            return order, cum
        k = min(V, 8 * k)


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


def _check_options(max_new_tokens: Any, temperature: Any, top_p: Any, seed: Any) -> None:
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


def open_session(source: Any, batch: int, prompt_len: int, max_len: int) -> Session:
    """The session of ``source`` (Trainer, Model or Oracle) for ``batch`` sequences whose prompt has
    ``prompt_len`` tokens and that grow to at most ``max_len`` tokens fed to the model."""
    from .oracle import Oracle
    from .training.trainer import CPUBackend, GPUBackend, Trainer

    if isinstance(source, Trainer):
        source = source.backend
    if isinstance(source, CPUBackend):
        source = source.oracle()
    elif isinstance(source, GPUBackend):
        source = source.model
    if isinstance(source, Oracle):
        return OracleSession(source)
    from .decoder import Decoder
    return Decoder.from_model(source, batch, prompt_len, max_len)


def stream(model_or_trainer: Any, prompt_tokens: Any, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, seed: int = 0) -> Iterator[np.ndarray]:
    """:func:`generate` one step at a time: yields the new token of every sequence, int64 [B]
    (B = 1 for a 1-D prompt), as soon as it is sampled. The arguments are checked, and the session
    built, when this is called (not at the first ``next``)."""
    cfg = _config_of(model_or_trainer)
    prompt, _ = _check_prompt(prompt_tokens, cfg.vocab_size)
    _check_options(max_new_tokens, temperature, top_p, seed)
    if max_new_tokens == 0:
        return iter(())
    B, P = prompt.shape
    # the last new token is only returned, never fed back
    session = open_session(model_or_trainer, B, P, P + max_new_tokens - 1)
    return _steps(session, prompt, int(max_new_tokens), float(temperature), float(top_p),
                  np.random.default_rng(seed))


def _steps(session: Session, prompt: np.ndarray, n: int, temperature: float, top_p: float,
           rng: np.random.Generator) -> Iterator[np.ndarray]:
    try:
        logits = session.prefill(prompt)
        for i in range(n):
            new = np.array([sample_next(row, temperature, top_p, rng) for row in logits], np.int64)
            yield new
            if i + 1 < n:
                logits = session.step(new)
    finally:
        session.close()


def generate(model_or_trainer: Any, prompt_tokens: Any, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, seed: int = 0) -> np.ndarray:
    """Continue ``prompt_tokens`` by ``max_new_tokens`` sampled tokens; returns them (int64).

    ``model_or_trainer``: an :class:`rwkvx.Trainer` (CPU or GPU backend), an :class:`rwkvx.Model`
    (GPU) or an :class:`rwkvx.oracle.Oracle` (CPU). ``prompt_tokens``: token ids, 1-D [P] or 2-D
    [B, P] (B sequences of one length), P >= 1, each < vocab_size. ``temperature`` 0 is greedy;
    otherwise each token is drawn from softmax(logits / temperature) restricted to the smallest set of
    most likely tokens whose mass reaches ``top_p`` (0 < top_p <= 1). ``seed`` seeds numpy's
    Generator: the result is deterministic. Returns [max_new_tokens] for a 1-D prompt, else
    [B, max_new_tokens]. Bad arguments raise ValueError / TypeError before any work.

    The prompt is processed once, in parallel; each further token is one stateful step (see the
    module docstring). On the GPU the model's parameters are copied into a model built for the
    prompt's shape unless ``model_or_trainer`` is a Model of exactly that shape (batch_size = B,
    seq_len = P), which is then used as it is (its buffers are overwritten).
    """
    cfg = _config_of(model_or_trainer)
    prompt, flat = _check_prompt(prompt_tokens, cfg.vocab_size)
    steps = list(stream(model_or_trainer, prompt, max_new_tokens, temperature, top_p, seed))
    out = np.stack(steps, axis=1) if steps else np.zeros((prompt.shape[0], 0), np.int64)
    return out[0] if flat else out
