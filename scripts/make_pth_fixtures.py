"""Write the PyTorch ``.pth`` test fixtures of tests/fixtures/ with PyTorch's own ``torch.save``.

  python scripts/make_pth_fixtures.py [OUT_DIR]        # default: tests/fixtures (needs torch)

The model is a tiny RWKV-7 (x070) state dict with RWKV-LM's names and shapes, spelled out here from
RWKV-LM's module definitions (not from rwkvx): V=16, C=8, H=2 heads of N=4, L=2 blocks, FFN width 24,
LoRA ranks w=4, a=2, v=6, g=10. Its values are drawn with numpy and chosen exactly representable in
bf16 and fp16, so every variant holds the same numbers, recorded in ``rwkv7_tiny_ref.npz`` for the
tests to compare against:

* ``rwkv7_tiny_bf16.pth``: bf16, as RWKV-LM's training code saves it (block 0 has the unused
  ``att.v0/v1/v2``);
* ``rwkv7_tiny_fp16.pth``: fp16, without block 0's ``att.v0/v1/v2`` (as stripped releases);
* ``rwkv7_tiny_fp32_views.pth``: fp32 where some tensors are views: a transpose, slices of a shared
  storage (offsets), a strided slice and a stride-0 ``expand``;

and files that must be refused: a pickled ``os.system`` call (``bad_global.pth``), a numpy array
(``numpy_value.pth``), a plain int entry (``int_value.pth``), a complex tensor (``complex.pth``) and
the legacy non-zip format (``legacy.pth``).
"""
import os
import sys
from pathlib import Path

import numpy as np
import torch

V, C, H, N, L, F = 16, 8, 2, 4, 2, 24
DW, DA, DV, DG = 4, 2, 6, 10


def rwkv_lm_shapes() -> dict[str, tuple[int, ...]]:
    """RWKV-LM x070 state-dict names and shapes (RWKV-v7/train_temp/src/model.py's parameters)."""
    shapes = {"emb.weight": (V, C)}
    for i in range(L):
        b = f"blocks.{i}."
        if i == 0:
            shapes |= {b + "ln0.weight": (C,), b + "ln0.bias": (C,)}
        shapes |= {b + "ln1.weight": (C,), b + "ln1.bias": (C,), b + "ln2.weight": (C,), b + "ln2.bias": (C,)}
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            shapes[b + "att." + x] = (1, 1, C)
        shapes |= {b + "att.w0": (1, 1, C), b + "att.w1": (C, DW), b + "att.w2": (DW, C),
                   b + "att.a0": (1, 1, C), b + "att.a1": (C, DA), b + "att.a2": (DA, C),
                   b + "att.v0": (1, 1, C), b + "att.v1": (C, DV), b + "att.v2": (DV, C),
                   b + "att.g1": (C, DG), b + "att.g2": (DG, C),
                   b + "att.k_k": (1, 1, C), b + "att.k_a": (1, 1, C), b + "att.r_k": (H, N)}
        for m in ("receptance", "key", "value", "output"):
            shapes[b + f"att.{m}.weight"] = (C, C)
        shapes |= {b + "att.ln_x.weight": (C,), b + "att.ln_x.bias": (C,), b + "ffn.x_k": (1, 1, C),
                   b + "ffn.key.weight": (F, C), b + "ffn.value.weight": (C, F)}
    shapes |= {"ln_out.weight": (C,), "ln_out.bias": (C,), "head.weight": (V, C)}
    return shapes


def master_values(seed: int = 12) -> dict[str, np.ndarray]:
    """float32 values exactly representable in bf16 and fp16 (8 significant bits, |x| in
    [2^-14, 2^15) or 0)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in rwkv_lm_shapes().items():
        if name.endswith(("ln0.weight", "ln1.weight", "ln2.weight", "ln_x.weight", "ln_out.weight")):
            x = 1 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("att.k_a"):
            x = np.full(shape, 1.02)                     # constant: stored as a stride-0 expand below
        elif name.endswith("att.w1"):
            x = np.zeros(shape)                           # RWKV-LM initialises some LoRAs to zeros
        else:
            x = 0.3 * rng.standard_normal(shape)
        x = torch.from_numpy(x.astype(np.float32)).bfloat16().float().numpy()
        x[np.abs(x) < 2.0 ** -14] = 0.0
        assert np.array_equal(torch.from_numpy(x).half().float().numpy(), x), name
        out[name] = x
    return out


def views_state_dict(ref: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The float32 state dict with some tensors stored as views of other storages."""
    sd = {k: torch.from_numpy(v.copy()) for k, v in ref.items()}
    for i in range(L):
        b = f"blocks.{i}."
        sd[b + "att.key.weight"] = torch.from_numpy(ref[b + "att.key.weight"].T.copy()).t()
        names = [b + n for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias")]
        packed = torch.from_numpy(np.concatenate([np.zeros(3, np.float32)] + [ref[n] for n in names]))
        for j, n in enumerate(names):
            sd[n] = packed[3 + j * C: 3 + (j + 1) * C]
        wide = torch.zeros(H, 2 * N)
        wide[:, ::2] = torch.from_numpy(ref[b + "att.r_k"])
        sd[b + "att.r_k"] = wide[:, ::2]
        sd[b + "att.k_a"] = torch.tensor(float(ref[b + "att.k_a"].flat[0])).expand(1, 1, C)
    taller = torch.zeros(V + 2, C)
    taller[1:V + 1] = torch.from_numpy(ref["head.weight"])
    sd["head.weight"] = taller[1:V + 1]
    assert not sd["blocks.0.att.key.weight"].is_contiguous() and sd["blocks.0.att.k_a"].stride() == (0, 0, 0)
    assert sd["blocks.0.att.r_k"].stride() == (2 * N, 2) and sd["head.weight"].storage_offset() == C
    assert sd["blocks.1.ln2.bias"].storage_offset() == 3 + 3 * C
    return sd


class SystemCall:
    """Unpickles to an ``os.system`` call: what a malicious checkpoint would carry."""

    def __reduce__(self):
        return os.system, ("echo 'a checkpoint ran a command'",)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    ref = master_values()
    np.savez(out / "rwkv7_tiny_ref.npz", **ref)
    plain = {k: torch.from_numpy(v) for k, v in ref.items()}
    variants = {
        "rwkv7_tiny_bf16.pth": {k: v.bfloat16() for k, v in plain.items()},
        "rwkv7_tiny_fp16.pth": {k: v.half() for k, v in plain.items()
                                if k not in ("blocks.0.att.v0", "blocks.0.att.v1", "blocks.0.att.v2")},
        "rwkv7_tiny_fp32_views.pth": views_state_dict(ref),
    }
    for name, sd in variants.items():
        torch.save(sd, out / name)
        back = torch.load(out / name, weights_only=True)
        assert all(np.array_equal(back[k].float().numpy(), ref[k]) for k in back), name
    small = {"emb.weight": plain["emb.weight"].bfloat16()}
    torch.save({**small, "payload": SystemCall()}, out / "bad_global.pth")
    torch.save({**small, "extra": np.zeros(3, np.float32)}, out / "numpy_value.pth")
    torch.save({**small, "step": 7}, out / "int_value.pth")
    torch.save({**small, "z": torch.zeros(2, dtype=torch.complex64)}, out / "complex.pth")
    torch.save(small, out / "legacy.pth", _use_new_zipfile_serialization=False)
    for p in sorted(out.glob("*")):
        print(f"{p}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "tests" / "fixtures")
