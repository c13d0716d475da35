"""Twin of rwkvx/cu/channelmix/channelmix.cu: the element-wise parts of the channel mix (FFN).

k = relu(Lin(x + (shift(x) - x) * x_k; key))^2 ; out = Lin(k; value). The two GEMMs are the model's
(oracle/model.py); here are the token-shift mix and the squared ReLU. Rows [R, C], R = B*T.
"""
from __future__ import annotations

import numpy as np

from ._common import float64_op, shift_mix_backward, shift_mix_forward


@float64_op
def channel_mix_shift_forward(x: np.ndarray, mix: np.ndarray, T: int,
                              prev: np.ndarray | None = None) -> np.ndarray:
    """xk [R, C] = x + (shift(x) - x) * mix for x [R, C], mix [C] (any shape with C elements);
    ``prev`` [B, C]: the row before each sequence (a stateful forward's carry), default zero."""
    return shift_mix_forward(x, mix.reshape(1, -1), T, prev)[0]


@float64_op
def channel_mix_shift_backward(dxk: np.ndarray, x: np.ndarray, mix: np.ndarray,
                               T: int) -> tuple[np.ndarray, np.ndarray]:
    """(dx [R, C], dmix [C]) of :func:`channel_mix_shift_forward` for output gradient dxk."""
    dx, dmix = shift_mix_backward(x, mix.reshape(1, -1), dxk[None], T)
    return dx, dmix[0]


@float64_op
def relu_sq_forward(h: np.ndarray) -> np.ndarray:
    """k = max(h, 0)^2."""
    return np.maximum(h, 0) ** 2


@float64_op
def relu_sq_backward(dk: np.ndarray, h: np.ndarray) -> np.ndarray:
    """dh = dk * 2 * max(h, 0), the gradient of :func:`relu_sq_forward` at h."""
    return dk * (2 * np.maximum(h, 0))
