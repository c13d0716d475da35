"""Each launch of MoBA's forward and backward timed alone (CUDA events, 20 runs), at the benchmarks'
shapes: where one attention block's time goes (benchmarks/test_kernels.py times the forward and the
backward as wholes). With --torch, also the FlashAttention-class peer torch ships (SDPA, flash and cuDNN
backends, bf16) on the same work in dense pieces (benchmarks/test_kernels.py's sdpa_dense).

Usage: python scripts/moba_launches.py [LABEL] [--xtype bf16|f32] [--method mma|exact] [--torch]
[--shape B,T,CHUNK ...]. Needs a GPU (and torch for --torch: an outside reference, never the package's).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from test_kernels import C, H, MOBA_SHAPES, N, TOP_K, Buffers, sdpa_dense, time_alone  # noqa: E402

from rwkvx.cu import moba  # noqa: E402
from rwkvx._core import Plan  # noqa: E402
from rwkvx.runtime import Device  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("label", nargs="?", default="")
    ap.add_argument("--xtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--method", default="mma", choices=moba.METHODS)
    ap.add_argument("--torch", action="store_true", help="also time torch's SDPA on the same work")
    ap.add_argument("--shape", action="append", help="B,T,CHUNK at H = 12, N = 64 (default: the benchmarks')")
    args = ap.parse_args()
    dev = Device.get()

    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape
              else list(MOBA_SHAPES.values()))
    for B, T, chunk in shapes:
        b = Buffers(dev, args.xtype)
        rc = B * T * C
        q, k, v, o = b(rc), b(rc), b(rc), b(rc)
        scratch = {name: (b(count, elem) if count else None)
                   for name, (count, elem) in moba.scratch_sizes(B, T, H, N, chunk, TOP_K).items()}
        fwd = moba.forward(q, k, v, o, scratch, B, T, H, N, chunk, TOP_K, dev.info, method=args.method)
        times = [time_alone(dev, op) for op in fwd]
        Plan(dev, fwd).run()
        bwd = moba.backward(q, k, v, o, b(rc), b(rc), b(rc), b(rc), scratch, B, T, H, N, chunk, TOP_K, dev.info,
                            method=args.method)
        times += [time_alone(dev, op) for op in bwd]
        ops = fwd + bwd
        print(f"{args.label} B{B} T{T} chunk {chunk} {args.method} {args.xtype}: "
              + " ".join(f"{op.name} {ms:.3f}" for op, ms in zip(ops, times))
              + f" | forward {sum(times[:len(fwd)]):.3f} backward {sum(times[len(fwd):]):.3f}", flush=True)
        if args.torch:
            peer = [(name, *sdpa_dense(B, T, chunk, name)[:2]) for name in ("flash", "cudnn")]
            print(f"{args.label} B{B} T{T} chunk {chunk} torch sdpa bf16 in dense pieces: "
                  + "; ".join(f"{name} fwd {f:.3f} bwd {fb - f:.3f}" for name, f, fb in peer), flush=True)


if __name__ == "__main__":
    main()
