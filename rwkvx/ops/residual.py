"""Launch builders for rwkvx/cu/residual.cu: y = a + b over n float32 elements.

float4 when a, b, y are all 16-byte aligned (else scalar), grid-stride. ``dev`` is accepted first
(DESIGN.md) and unused.
"""
from __future__ import annotations

import math

from . import reduce as _reduce

MODULE = "residual"
_p = _reduce._p
_Launch = _reduce._Launch


def add(dev, a, b, y, n: int) -> list:
    """residual_add: y = a + b (n floats). y may alias a or b."""
    if n <= 0:
        raise ValueError("residual.add: n must be positive")
    blocks = max(1, min(math.ceil(math.ceil(n / 4) / 256), 132 * 16))
    return [_Launch(MODULE, "residual_add", grid=(blocks, 1, 1), block=(256, 1, 1),
                    args=(("p", _p(a)), ("p", _p(b)), ("p", _p(y)), ("l", int(n))))]


def add_inplace(dev, a, b, n: int) -> list:
    """a += b (n floats)."""
    return add(dev, a, b, a, n)
