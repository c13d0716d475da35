"""Each launch of a chunked WKV7 method timed alone (CUDA events, 20 runs), at the default state-pass
split and segments: where the forward's and the backward's time goes (benchmarks/bench_wkv7.py times them
together).

Usage: python scripts/wkv7_launches.py [LABEL] [--method chunked|chunked_exact] [--xtype bf16|f32]
[--stages NS] [--split-operators 0|1] [--split P] [--key-warps 1|2] [--segments S] [--shape B,T,H ...].
--stages and --split-operators time other values of rwkvx/cu/wkv7/ops.py's CHUNKED_STAGES and
SPLIT_OPERATORS[xtype] (the kernels are compiled with them), --split, --key-warps and --segments other
state-pass shapes than chunked_split, chunked_key_warps and chunked_segments choose, for choosing those.
Needs a GPU.
"""
import argparse

from rwkvx._core import Plan
from rwkvx.cu import wkv7
from rwkvx.runtime import Device
from rwkvx.workloads import BASE_SHAPES, WKV7_SHAPES, RandomBuffers, time_alone, wkv7_inputs

N = BASE_SHAPES.N
SHAPES = (WKV7_SHAPES["B8_T4096_H12"], WKV7_SHAPES["B1_T16384_H12"])    # the 0.22B step, one long sequence


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("label", nargs="?", default="")
    ap.add_argument("--method", default="chunked", choices=wkv7.CHUNKED_METHODS)
    ap.add_argument("--xtype", choices=("bf16", "f32"), help="default: f32 for chunked_exact, else bf16")
    ap.add_argument("--stages", type=int, help="chunks in flight in the state passes (CHUNKED_STAGES)")
    ap.add_argument("--split-operators", type=int, choices=(0, 1), help="3xTF32 chunk operators (1) or not")
    ap.add_argument("--shape", action="append", help=f"B,T,H at N = {N} (repeatable; default: SHAPES)")
    ap.add_argument("--split", type=int, help="state-pass row split P (default: chunked_split)")
    ap.add_argument("--key-warps", type=int, choices=(1, 2), help="warps per 8 state rows (chunked_key_warps)")
    ap.add_argument("--segments", type=int, help="segments of the state passes (default: chunked_segments)")
    args = ap.parse_args()
    args.xtype = args.xtype or ("f32" if args.method == "chunked_exact" else "bf16")
    if args.key_warps is not None:
        wkv7.chunked_key_warps = lambda *_: args.key_warps
    if args.stages is not None:     # both the compile's define and the launch's shared-memory size
        wkv7.CHUNKED_STAGES = wkv7.CUC.constants["WKV_STAGES"] = args.stages
    if args.split_operators is not None:
        wkv7.SPLIT_OPERATORS[args.xtype] = bool(args.split_operators)
    dev = Device.get()

    # only when given: the script also times kernel trees from before segments (git checkout REV -- rwkvx/cu/wkv7)
    seg = {} if args.segments is None else {"segments": args.segments}
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else SHAPES
    for B, T, H in shapes:
        b = RandomBuffers(dev, args.xtype)
        inp, n = wkv7_inputs(b, B, T, H, N)
        sizes = wkv7.scratch_elems(B, T, H, N, dev.info, method=args.method, **seg)
        sa, ckpt, part = b(sizes["sa"], "f32"), b(sizes["ckpt"], "f32"), b(sizes["partials"], "f32")
        fwd = wkv7.forward(*inp, b(n), B, T, H, N, dev.info, sa=sa, ckpt=ckpt, method=args.method, partials=part,
                           split=args.split, **seg)
        times = [time_alone(dev, op) for op in fwd]
        Plan(dev, fwd).run()                    # real checkpoints for the backward
        bwd = wkv7.backward(*inp, b(n), sa, ckpt, b(n), *[b(n, "f32") for _ in range(5)], B, T, H, N, dev.info,
                            partials=part, method=args.method, split=args.split, **seg)
        times += [time_alone(dev, op) for op in bwd]
        walk = fwd[-1]                          # the walk writing the outputs (the last of a segmented scan)
        print(f"{args.label} B{B} T{T} H{H} N{N} {args.method} {args.xtype} split {walk.grid[0]} key warps "
              f"{walk.block[0] * walk.grid[0] // (4 * N)} segments {walk.grid[2] // B}: "
              + " ".join(f"{op.name} {ms:.3f}" for op, ms in zip(fwd + bwd, times)), flush=True)


if __name__ == "__main__":
    main()
