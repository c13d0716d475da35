"""rwkvx's cache folder: compiled kernels (``cubin/``) and the GEMM algorithm choices live below it."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """rwkvx's cache folder (not created here): $RWKVX_CACHE_DIR, else $XDG_CACHE_HOME/rwkvx or ~/.cache/rwkvx."""
    root = os.environ.get("RWKVX_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rwkvx"
