"""Model configurations of the GPU parity test (tests/gpu/test_model_parity.py), a few of which
scripts/compare_step.py also dumps: name -> (Config keywords, B, T). Plain data with no imports, so that
the script can load this file by path whichever rwkvx it runs."""

MODEL_CASES = {
    "rwkv_only": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=3), 2, 40),
    "sparse_hybrid": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                           moba_chunk_size=8, moba_top_k=2), 2, 64),
    "top_k_1": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                     moba_chunk_size=8, moba_top_k=1), 2, 48),
    "no_ln0": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                    moba_chunk_size=8, moba_top_k=3, ln0=False), 2, 48),
    "leftover_blocks": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=5, n_attn_layer=2,
                             moba_chunk_size=8, moba_top_k=2), 1, 48),
    "batch_3": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                     moba_chunk_size=16, moba_top_k=2), 3, 64),
    "odd_T": (dict(vocab_size=67, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                   moba_chunk_size=12, moba_top_k=2), 2, 45),
    "C256_N64": (dict(vocab_size=300, n_embd=256, head_size=64, n_rwkv_layer=2, n_attn_layer=1,
                      moba_chunk_size=32, moba_top_k=3), 2, 160),
    "T1024": (dict(vocab_size=97, n_embd=64, head_size=16, n_rwkv_layer=2, n_attn_layer=1,
                   moba_chunk_size=64, moba_top_k=3), 1, 1024),
}
