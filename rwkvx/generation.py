"""Stateful generation: :func:`generate` (and :func:`stream`, the same one step at a time).

The prompts are processed once, in parallel, and leave each block's state behind: the WKV state and
the two token-shift rows of every RWKV block, the keys, values and complete-block key means of every
MoBA block. Each new token is then one step of constant work per RWKV block (MoBA attends over at most
``top_k`` blocks of the cache), instead of a forward over the whole window.

A batch of B sequences may have prompts of different lengths; each sequence stops at its own
``end_token`` or after ``max_new_tokens``. Two sessions do this with one interface (``prefill(prompts,
sampling) -> prompt tokens consumed``, then ``step(tokens, u, active) -> next tokens``; the driver
:func:`stream` feeds each sequence the rest of its prompt, then its own tokens):

* on the CPU, :meth:`rwkvx.oracle.Oracle.stateful_forward` (the reference) per sequence, sampling with
  :mod:`rwkvx.sampling`'s numpy implementation;
* on the GPU, :class:`rwkvx.decoder.Decoder`: the model's forward kernels for the prompts, then
  single-token step kernels and the device sampler replayed as one CUDA graph per token. The decoder
  reads the model's resident weights and is kept on the model (:func:`rwkvx.decoder.decoder_for`), so
  only the first call for a batch size builds it.

Sampling follows :mod:`rwkvx.sampling`'s contract: each new token is chosen from its logits and one
uniform draw u in [0, 1). Sequence b's k-th new token uses draw k of ``numpy.random.default_rng([seed,
b])`` (greedy tokens included), so a sequence's tokens do not depend on how the steps are scheduled
(prompt lengths, the other sequences, CPU or GPU), only on its logits.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Iterator, Protocol

import numpy as np

from .sampling import Sampling, check_vocab
from .validate import check_tokens


class Session(Protocol):
    """A stateful forward of B sequences, each at its own length, that chooses each next token (see the
    module docstring)."""

    def prefill(self, prompts: list[np.ndarray], sampling: Sampling) -> np.ndarray:
        """Start the B sequences with ``prompts`` (int64 [P_b] each) and ``sampling``; process a prefix of
        each (at most P_b - 1 tokens) and return those lengths, int64 [B]."""

    def step(self, tokens: np.ndarray, u: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Feed ``tokens[b]`` to each sequence b with ``active[b]``; the next token of each, int64 [B]
        (meaningful where active), chosen with its draw ``u[b]``."""

    def close(self) -> None:
        """End the generation (a session kept for later calls keeps its buffers)."""


class OracleSession:
    """A :class:`Session` over :meth:`rwkvx.oracle.Oracle.stateful_forward` (CPU), one state per
    sequence, sampling with :mod:`rwkvx.sampling`'s numpy implementation."""

    def __init__(self, oracle: Any) -> None:
        self.oracle = oracle
        self.states: list = []
        self.sampling = Sampling()

    def prefill(self, prompts: list[np.ndarray], sampling: Sampling) -> np.ndarray:
        self.sampling = sampling
        self.states = [self.oracle.stateful_forward(p[None, :-1])[1] if len(p) > 1 else None for p in prompts]
        return np.array([len(p) - 1 for p in prompts], np.int64)

    def step(self, tokens: np.ndarray, u: np.ndarray, active: np.ndarray) -> np.ndarray:
        if not self.states:
            raise RuntimeError("step() before prefill()")
        new = np.zeros(len(tokens), np.int64)
        for b in np.flatnonzero(active):
            logits, self.states[b] = self.oracle.stateful_forward(np.array([[tokens[b]]]), self.states[b])
            new[b] = self.sampling.rows(logits[:, 0], u[b:b + 1])[0]
        return new

    def close(self) -> None:
        self.states = []


def _config_of(source: Any):
    from .config import Config

    cfg = getattr(source, "cfg", None)
    if not isinstance(cfg, Config):
        raise TypeError("generate() needs an rwkvx.Trainer, rwkvx.Model or rwkvx.oracle.Oracle, "
                        f"got {type(source).__name__}")
    return cfg


def _check_prompt(prompt_tokens: Any, vocab_size: int) -> tuple[list[np.ndarray], str]:
    """(the prompts, int64 [P_b] each, and the form given: "flat" (1-D [P]), "batch" (2-D [B, P]) or
    "ragged" (a list of 1-D prompts of different lengths))."""
    if (isinstance(prompt_tokens, (list, tuple)) and len(prompt_tokens) > 1
            and all(np.ndim(p) == 1 for p in prompt_tokens) and len({len(p) for p in prompt_tokens}) > 1):
        return [_one_prompt(p, vocab_size, f"prompt_tokens[{b}]") for b, p in enumerate(prompt_tokens)], "ragged"
    prompt = np.asarray(prompt_tokens)
    if prompt.ndim not in (1, 2):
        raise ValueError(f"prompt_tokens must be 1-D [P], 2-D [B, P] or a list of 1-D prompts, got shape "
                         f"{prompt.shape}")
    if prompt.ndim == 1:
        return [_one_prompt(prompt, vocab_size, "prompt_tokens")], "flat"
    _one_prompt(prompt.ravel(), vocab_size, "prompt_tokens")      # empty or not integer: named as given
    return list(check_tokens(prompt, vocab_size, "prompt_tokens")), "batch"


def _one_prompt(prompt: Any, vocab_size: int, name: str) -> np.ndarray:
    prompt = np.asarray(prompt)
    if prompt.size == 0:      # before the dtype: an empty list is a float array
        raise ValueError(f"{name} must be non-empty, got shape {prompt.shape}")
    if prompt.dtype.kind not in "iu":
        raise TypeError(f"{name} must be integer token ids, got dtype {prompt.dtype}")
    return check_tokens(prompt.reshape(1, -1), vocab_size, name)[0]


def _check_options(max_new_tokens: Any, temperature: Any, top_p: Any, seed: Any, top_k: Any, end_token: Any,
                   vocab_size: int) -> None:
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
    if end_token is not None and (not integer(end_token) or not 0 <= end_token < vocab_size):
        raise ValueError(f"end_token must be None or a token id in [0, {vocab_size}), got {end_token!r}")


def open_session(source: Any, batch: int, prompt_len: int, max_len: int) -> Session:
    """The session of ``source`` (Trainer, Model or Oracle) for ``batch`` sequences whose prompts have
    at most ``prompt_len`` tokens and that grow to at most ``max_len`` tokens fed to the model."""
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
    from .decoder import decoder_for
    from .model import Model
    if not isinstance(source, Model):
        raise TypeError(f"expected an rwkvx.Model, got {type(source).__name__}")
    return decoder_for(source, batch, prompt_len, max_len)


def stream(model_or_trainer: Any, prompt_tokens: Any, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, seed: int = 0, top_k: int = 0, end_token: int | None = None
           ) -> Iterator[np.ndarray]:
    """:func:`generate` one step at a time: yields int64 [B] (B = 1 for a 1-D prompt) after every step
    that gave at least one sequence a new token: that token, or -1 for a sequence that got none (it is
    still reading its prompt, or it has ended). With prompts of one length and no ``end_token`` every
    step gives every sequence a token. The arguments are checked, and the session built, when this is
    called (not at the first ``next``)."""
    cfg = _config_of(model_or_trainer)
    prompts, _ = _check_prompt(prompt_tokens, cfg.vocab_size)
    _check_options(max_new_tokens, temperature, top_p, seed, top_k, end_token, cfg.vocab_size)
    check_vocab(cfg.vocab_size)
    if max_new_tokens == 0:
        return iter(())
    longest = max(len(p) for p in prompts)
    # the last new token is only returned, never fed back
    session = open_session(model_or_trainer, len(prompts), longest, longest + max_new_tokens - 1)
    return _steps(session, prompts, int(max_new_tokens), Sampling(float(temperature), int(top_k), float(top_p)),
                  int(seed), end_token, model_or_trainer)


def _steps(session: Session, prompts: list[np.ndarray], n: int, sampling: Sampling, seed: int,
           end_token: int | None, owner: Any) -> Iterator[np.ndarray]:
    """The steps of one generation; ``owner`` (the model or trainer the session reads its weights
    from) is held here so that it lives as long as the generation."""
    B = len(prompts)
    rows = np.arange(B)
    lens = np.array([len(p) for p in prompts])
    padded = np.zeros((B, lens.max()), np.int64)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    draws = np.stack([np.random.default_rng([seed, b]).random(n) for b in range(B)])
    made = np.zeros(B, np.int64)           # new tokens of each sequence so far
    last = np.zeros(B, np.int64)           # its last new token
    done = np.zeros(B, bool)
    try:
        fed = session.prefill(prompts, sampling)
        while not done.all():
            reading = fed < lens
            tokens = np.where(reading, padded[rows, np.minimum(fed, lens - 1)], last)
            emits = ~done & (fed >= lens - 1)          # fed its prompt's last token, or its own
            u = np.where(emits, draws[rows, np.minimum(made, n - 1)], 0.0)
            new = session.step(tokens, u, ~done)
            fed = fed + (reading & ~done)
            last = np.where(emits, new, last)
            made += emits
            done |= emits & ((made == n) | (new == end_token))
            if emits.any():
                yield np.where(emits, new, -1)
    finally:
        session.close()


def generate(model_or_trainer: Any, prompt_tokens: Any, max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, seed: int = 0, top_k: int = 0, end_token: int | None = None
             ) -> np.ndarray | list[np.ndarray]:
    """Continue ``prompt_tokens`` by up to ``max_new_tokens`` sampled tokens; returns them (int64).

    ``model_or_trainer``: an :class:`rwkvx.Trainer` (CPU or GPU backend), an :class:`rwkvx.Model`
    (GPU) or an :class:`rwkvx.oracle.Oracle` (CPU). ``prompt_tokens``: token ids, 1-D [P], 2-D [B, P]
    or a list of B 1-D prompts of different lengths, each of >= 1 ids < vocab_size. ``temperature`` 0
    is greedy; otherwise each token is drawn from softmax(logits / temperature) restricted to the
    ``top_k`` most likely tokens (0: no limit), then to the smallest set of the most likely whose mass
    reaches ``top_p`` (0 < top_p <= 1): :mod:`rwkvx.sampling` states the contract exactly. ``seed``
    seeds the draws (see the module docstring): the result is deterministic. A sequence ends after
    ``max_new_tokens`` tokens or at ``end_token`` (included), if given.

    Returns [n] for a 1-D prompt, [B, max_new_tokens] for a 2-D one without ``end_token``, else a list
    of B arrays, each as long as its sequence ran. Bad arguments raise ValueError / TypeError before any
    work.

    The prompts are processed once, in parallel; each further token is one stateful step (see the
    module docstring). On the GPU the decoder reads the model's resident weights (a training step in
    between is seen) and uses buffers of its own (the model's are untouched); it is built once per
    batch size and kept on the model (:func:`rwkvx.decoder.free_decoders` releases it).
    """
    cfg = _config_of(model_or_trainer)
    prompts, form = _check_prompt(prompt_tokens, cfg.vocab_size)
    outs: list[list[int]] = [[] for _ in prompts]
    for step in stream(model_or_trainer, prompts, max_new_tokens, temperature, top_p, seed, top_k, end_token):
        for b in np.flatnonzero(step >= 0):
            outs[b].append(int(step[b]))
    arrays = [np.array(o, np.int64) for o in outs]
    if form == "flat":
        return arrays[0]
    if form == "batch" and end_token is None:
        return np.stack(arrays) if max_new_tokens else np.zeros((len(prompts), 0), np.int64)
    return arrays
