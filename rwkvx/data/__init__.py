"""Training data: token streams from text, raw token files, .npy and RWKV-LM binidx; batch sampling.

One job per module: :mod:`~rwkvx.data.stream` (the token stream and its scans),
:mod:`~rwkvx.data.detect` (a data argument's format), :mod:`~rwkvx.data.formats` (data files to
streams), :mod:`~rwkvx.data.binidx` (RWKV-LM's format, read and written), :mod:`~rwkvx.data.text` (text
and ``.jsonl`` documents to ids, ``prepare``) and
:mod:`~rwkvx.data.batches` (the validation split, the sampler, the evaluation batches). This module
re-exports their public names.
"""
from .batches import BatchSampler, eval_batches, scored_tokens, split_train_val
from .binidx import (BINIDX_DTYPES, BINIDX_MAGIC, BINIDX_VERSION, BinidxWriter, read_binidx_index,
                     write_binidx)
from .detect import TEXT_FORMATS, TEXT_SUFFIXES, detect_format
from .formats import DEFAULT_CORPUS, DEFAULT_CORPUS_PROMPT, default_corpus_path, load_tokens
from .stream import TokenData, unigram_entropy

__all__ = ["BINIDX_DTYPES", "BINIDX_MAGIC", "BINIDX_VERSION", "BatchSampler", "BinidxWriter", "DEFAULT_CORPUS",
           "DEFAULT_CORPUS_PROMPT", "TEXT_FORMATS", "TEXT_SUFFIXES", "TokenData", "default_corpus_path",
           "detect_format", "eval_batches", "load_tokens", "read_binidx_index", "scored_tokens", "split_train_val",
           "unigram_entropy", "write_binidx"]
