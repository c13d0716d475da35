"""Launch builders, one module per rwkvx/cu/<family>.cu, each starting with the file's declared
interface (:class:`rwkvx.runtime.kernel.KernelFile`); importing this package declares every kernel."""
from . import adamw, channelmix, decode, embedding, layernorm, loss, moba, reduce, timemix, wkv7

__all__ = ["adamw", "channelmix", "decode", "embedding", "layernorm", "loss", "moba", "reduce", "timemix", "wkv7"]
