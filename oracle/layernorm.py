"""Twin of rwkvx/cu/layernorm/layernorm.cu: LayerNorm over the last axis, forward and backward.

The variance is the biased (population) one, eps inside the square root, as torch.nn.LayerNorm. The loops
are the one-group case of the oracle's GroupNorm (oracle/_norm.pyx), in double (see _common for the float64
convention).
"""
from __future__ import annotations

import numpy as np

from ._common import LN_EPS, float64_op
from ._norm import norm_backward, norm_forward


@float64_op
def layernorm_forward(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = LN_EPS,
                      return_stats: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
    """LayerNorm over the last axis of x [..., C] (typically [R, C]); w, b [C].

    Returns y, or with ``return_stats`` (y, mean [R], rstd [R]): what the GPU forward saves for its
    backward, rstd = 1 / sqrt(var + eps)."""
    y, mean, rstd = norm_forward(x, w, b, 1, eps)
    return (y, mean[:, 0], rstd[:, 0]) if return_stats else y


@float64_op
def layernorm_backward(x: np.ndarray, w: np.ndarray, dy: np.ndarray,
                       eps: float = LN_EPS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dx, dw, db) of :func:`layernorm_forward`; the bias is not needed."""
    return norm_backward(x, w, dy, 1, eps)
