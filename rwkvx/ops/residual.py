"""Launch builders for rwkvx/cu/residual.cu: y = a + b over n float32 elements.

float4 when a, b, y are all 16-byte aligned (else scalar), grid-stride.
"""
from __future__ import annotations

import math

from ._common import Launch, ptr

MODULE = "residual"


def add(a, b, y, n: int) -> list:
    """residual_add: y = a + b (n floats). y may alias a or b."""
    if n <= 0:
        raise ValueError("residual.add: n must be positive")
    blocks = max(1, min(math.ceil(math.ceil(n / 4) / 256), 132 * 16))
    return [Launch(MODULE, "residual_add", grid=(blocks, 1, 1), block=(256, 1, 1),
                   args=(("p", ptr(a)), ("p", ptr(b)), ("p", ptr(y)), ("l", int(n))))]


def add_inplace(a, b, n: int) -> list:
    """a += b (n floats)."""
    return add(a, b, a, n)
