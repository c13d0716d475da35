"""Twin of rwkvx/cu/embedding/embedding.cu: the token-embedding gather and its gradient."""
from __future__ import annotations

import numpy as np

from ._common import float64_op


def _token_rows(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    tok = np.asarray(tokens)
    if tok.dtype.kind not in "iu":
        raise TypeError(f"tokens must be an integer array, got dtype {tok.dtype}")
    tok = tok.reshape(-1)
    if tok.size and (tok.min() < 0 or tok.max() >= vocab_size):
        raise ValueError(f"tokens must lie in [0, {vocab_size}), got [{tok.min()}, {tok.max()}]")
    return tok


def embedding_forward(tokens: np.ndarray, emb: np.ndarray) -> np.ndarray:
    """x [R, C] = emb[tokens] for int tokens of any shape (R = tokens.size) and emb [V, C]; a gather,
    so exact in the dtype of emb."""
    return emb[_token_rows(tokens, emb.shape[0])]


@float64_op
def embedding_backward(tokens: np.ndarray, dx: np.ndarray, vocab_size: int) -> np.ndarray:
    """demb [V, C]: row v is the sum of the rows of dx [R, C] whose token is v (summed in row order, in
    float64); rows of tokens that do not occur are zero."""
    demb = np.zeros((vocab_size, dx.shape[-1]))
    np.add.at(demb, _token_rows(tokens, vocab_size), dx.reshape(-1, dx.shape[-1]))
    return demb
