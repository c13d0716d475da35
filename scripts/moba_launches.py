"""Each launch of MoBA's forward and backward timed alone (CUDA events, 20 runs), at the benchmarks'
shapes (rwkvx.workloads.MOBA_SHAPES): where one attention block's time goes (benchmarks/bench_moba.py times
the forward and the backward as wholes). With --torch, also the FlashAttention-class peer torch ships (SDPA,
flash and cuDNN backends, bf16) on the same work in dense pieces (rwkvx.workloads.sdpa_dense).

Usage: python scripts/moba_launches.py [LABEL] [--xtype bf16|f32] [--method mma|exact] [--torch]
[--shape B,T,CHUNK ...]. Needs a GPU (and torch for --torch: an outside reference, never the package's).
"""
import argparse

from rwkvx._core import Plan
from rwkvx.cu import moba
from rwkvx.runtime import Device
from rwkvx.workloads import BASE_SHAPES, MOBA_SHAPES, RandomBuffers, moba_buffers, sdpa_dense, time_alone

H, N, TOP_K = BASE_SHAPES.H, BASE_SHAPES.N, BASE_SHAPES.top_k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("label", nargs="?", default="")
    ap.add_argument("--xtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--method", default="mma", choices=moba.METHODS)
    ap.add_argument("--torch", action="store_true", help="also time torch's SDPA on the same work")
    ap.add_argument("--shape", action="append", help=f"B,T,CHUNK at H = {H}, N = {N} (default: the benchmarks')")
    args = ap.parse_args()
    dev = Device.get()

    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape
              else list(MOBA_SHAPES.values()))
    for B, T, chunk in shapes:
        b = RandomBuffers(dev, args.xtype)
        (q, k, v, o), scratch = moba_buffers(b, B, T, H, N, chunk, TOP_K)
        rc = B * T * H * N
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
            peer = [(name, *sdpa_dense(B, T, H, N, chunk, TOP_K, name)[:2]) for name in ("flash", "cudnn")]
            print(f"{args.label} B{B} T{T} chunk {chunk} torch sdpa bf16 in dense pieces: "
                  + "; ".join(f"{name} fwd {f:.3f} bwd {fb - f:.3f}" for name, f, fb in peer), flush=True)


if __name__ == "__main__":
    main()
