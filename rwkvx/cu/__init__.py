"""The CUDA kernels, one folder per kernel family (see README.md); importing this package declares
every kernel file."""
from . import adamw, channelmix, decode, embedding, init, layernorm, loss, moba, reduce, timemix, wkv7

__all__ = ["adamw", "channelmix", "decode", "embedding", "init", "layernorm", "loss", "moba", "reduce", "timemix", "wkv7"]
