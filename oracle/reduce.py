"""Twin of rwkvx/cu/reduce/reduce.cu: the column sums that turn per-tile partial sums into a [C] vector."""
from __future__ import annotations

import numpy as np

from ._common import float64_op


@float64_op
def column_sums(part: np.ndarray) -> np.ndarray:
    """part [P, C] -> [C]: the sum over rows (part.sum(axis=0)), computed in float64; also the
    gradient of a [C] vector broadcast over the rows of an op's input."""
    return part.sum(axis=0)
