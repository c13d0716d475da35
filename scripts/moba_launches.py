"""Each launch of MoBA's forward and backward timed alone (CUDA events, 20 runs), at the benchmarks'
shapes: where one attention block's time goes (benchmarks/test_kernels.py times the forward and the
backward as wholes). With --torch, also the FlashAttention-class peer torch ships (SDPA, flash and cuDNN
backends, bf16) on the same work in dense form: the own blocks as causal attention over sequences of one
chunk, the past selections as non-causal attention of chunk-query groups over one chunk of keys.

Usage: python scripts/moba_launches.py [LABEL] [--xtype bf16|f32] [--method mma|exact] [--torch]
[--shape B,T,CHUNK ...]. Needs a GPU (and torch for --torch: an outside reference, never the package's).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from test_kernels import C, H, MOBA_SHAPES, N, TOP_K, Buffers  # noqa: E402  (the benchmarks' shapes)

from rwkvx.ops import moba  # noqa: E402
from rwkvx.runtime import Device, EventTimer, Plan  # noqa: E402


def torch_peer(B: int, T: int, chunk: int, runs: int = 20) -> str:
    """ms of torch SDPA (forward; forward + backward) per backend on MoBA's work in dense pieces."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    nblk = T // chunk
    past = B * sum(min(TOP_K - 1, j) for j in range(nblk))     # past (query block, key block) pairs
    shapes = {"own": (B * nblk, chunk, chunk, True), "past": (past, chunk, chunk, False)}
    out = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        total = [0.0, 0.0]
        for name, (nb, tq, tk, causal) in shapes.items():
            q = torch.randn(nb, H, tq, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(nb, H, tk, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(nb, H, tk, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            do = torch.randn(nb, H, tq, N, device="cuda", dtype=torch.bfloat16)
            try:
                with sdpa_kernel(backend):
                    def fwd():
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

                    def both():
                        fwd().backward(do)
                    for i, fn in enumerate((fwd, both)):
                        fn()
                        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                        start.record()
                        for _ in range(runs):
                            fn()
                        end.record()
                        torch.cuda.synchronize()
                        total[i] += start.elapsed_time(end) / runs
            except RuntimeError as err:
                out.append(f"{backend.name}: {str(err).splitlines()[0][:80]}")
                break
        else:
            out.append(f"{backend.name} fwd {total[0]:.3f} bwd {total[1] - total[0]:.3f}")
    return "torch sdpa bf16 (own causal + past groups): " + "; ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("label", nargs="?", default="")
    ap.add_argument("--xtype", default="bf16", choices=("bf16", "f32"))
    ap.add_argument("--method", default="mma", choices=moba.METHODS)
    ap.add_argument("--torch", action="store_true", help="also time torch's SDPA on the same work")
    ap.add_argument("--shape", action="append", help="B,T,CHUNK at H = 12, N = 64 (default: the benchmarks')")
    args = ap.parse_args()
    dev = Device.get()
    timer = EventTimer(dev)

    def alone(op) -> float:
        plan = Plan(dev, [op])
        plan.run()
        dev.synchronize()
        return timer.time_ms(plan.run, 20)

    shapes = ([tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape
              else list(MOBA_SHAPES.values()))
    for B, T, chunk in shapes:
        b = Buffers(dev, args.xtype)
        rc = B * T * C
        q, k, v, o = b(rc), b(rc), b(rc), b(rc)
        scratch = {name: (b(count, elem) if count else None)
                   for name, (count, elem) in moba.scratch_sizes(B, T, H, N, chunk, TOP_K).items()}
        fwd = moba.forward(q, k, v, o, scratch, B, T, H, N, chunk, TOP_K, dev.info, method=args.method)
        times = [alone(op) for op in fwd]
        Plan(dev, fwd).run()
        bwd = moba.backward(q, k, v, o, b(rc), b(rc), b(rc), b(rc), scratch, B, T, H, N, chunk, TOP_K, dev.info,
                            method=args.method)
        times += [alone(op) for op in bwd]
        ops = fwd + bwd
        print(f"{args.label} B{B} T{T} chunk {chunk} {args.method} {args.xtype}: "
              + " ".join(f"{op.name} {ms:.3f}" for op, ms in zip(ops, times))
              + f" | forward {sum(times[:len(fwd)]):.3f} backward {sum(times[len(fwd):]):.3f}", flush=True)
        if args.torch:
            print(f"{args.label} B{B} T{T} chunk {chunk} " + torch_peer(B, T, chunk), flush=True)


if __name__ == "__main__":
    main()
