"""Benchmark the gated SwiGLU's implementations side by side (CUDA): eager ops, torch.compile, Triton, jiterator.

Forward + backward of the SwiGLU alone on [R, 2F], and of one PooledMLP (native and grouped paths)
with each implementation swapped in, beside a dense SwiGLU MLP of the same routed FLOPs. Timed
both ways bench_dispatch.py times (synced per call; back to back).

    python tools/bench_swiglu.py                 # T=16,384, E=128, top_k=8, D=F=1024, 94% sink
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench_dispatch import dense_step, make_routing, timed
from minagi import dispatch, swiglu, swiglu_jit

_compiled = None


def swiglu_compiled(h, gate):
    """torch.compile of the eager function, rows marked dynamic (the bucketed path's shapes vary)."""
    global _compiled
    if not h.requires_grad:
        return swiglu.swiglu_eager(h, gate)
    if _compiled is None:
        _compiled = torch.compile(swiglu.swiglu_eager, dynamic=None)
    lead = h.shape[:-1]
    h_flat, gate_flat = h.reshape(-1, h.shape[-1]), gate.reshape(-1)
    torch._dynamo.maybe_mark_dynamic(h_flat, 0)
    torch._dynamo.maybe_mark_dynamic(gate_flat, 0)
    return _compiled(h_flat, gate_flat).view(*lead, -1)


def swiglu_jiterator(h, gate):
    return swiglu.swiglu(h, gate, "jiterator")


IMPLEMENTATIONS = {"eager": swiglu.swiglu_eager, "compiled": swiglu_compiled, "triton": swiglu.swiglu,
                   "jiterator": swiglu_jiterator, "jiterator, one lane": swiglu_jiterator}
ONE_LANE = "jiterator, one lane"  # the jiterator kernels reading one element at a time (swiglu_jit.PACK_WORDS off)


def one_lane(step):
    def run():
        swiglu_jit.PACK_WORDS = False
        try:
            step()
        finally:
            swiglu_jit.PACK_WORDS = True
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=16384)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024, help="D = F")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16",
                    help="fp16: what a card without bf16 (T4, RTX 20) trains in; Triton's SwiGLU needs sm80 there")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    N, E, K, D = args.chars, args.experts, args.top_k, args.width
    R = N * K
    torch.manual_seed(0)
    gate_up = (torch.randn(E, D, 2 * D, device=dev, dtype=dt) * 0.02).requires_grad_()
    down = (torch.randn(E, D, D, device=dev, dtype=dt) * 0.02).requires_grad_()
    ids, gates = make_routing("sink94", N, E, K, torch.Generator().manual_seed(0))
    ids, gates = ids.to(dev), gates.to(device=dev, dtype=dt).requires_grad_()
    x = torch.randn(N, D, device=dev, dtype=dt, requires_grad=True)
    grad_out = torch.randn(N, D, device=dev, dtype=dt)
    h = torch.randn(R, 2 * D, device=dev, dtype=dt, requires_grad=True)
    gate_R = torch.rand(R, device=dev, dtype=dt, requires_grad=True)
    grad_act = torch.randn(R, D, device=dev, dtype=dt)

    def alone(fn):
        return lambda: torch.autograd.grad(fn(h, gate_R), (h, gate_R), grad_act)

    def pool(path, fn):
        def step():
            dispatch.swiglu = lambda h, g, kernels="auto": fn(h, g)  # the paths look it up in dispatch's namespace
            plan = dispatch.make_plan(ids, E, 0)
            y = dispatch.RUNNERS[path](x, gates, gate_up, down, plan, {})
            torch.autograd.grad(y, (x, gate_up, down, gates), grad_out)
        return step

    def maybe_one_lane(name, step):
        return one_lane(step) if name == ONE_LANE else step

    # fp16: the cards it stands for run neither torch's grouped GEMM (bf16, sm90) nor minagi's Triton SwiGLU
    kept = {k: f for k, f in IMPLEMENTATIONS.items() if args.dtype == "bf16" or k in ("eager", "jiterator", ONE_LANE)}
    cases = {"dense SwiGLU MLP": dense_step(R, D, D, dev, dt)}
    cases.update({f"SwiGLU alone [{R}, {2 * D}], {name}": maybe_one_lane(name, alone(fn)) for name, fn in kept.items()})
    for path in ("native", "grouped") if args.dtype == "bf16" else ("grouped",):
        cases.update({f"{path}, {name}": maybe_one_lane(name, pool(path, fn)) for name, fn in kept.items()})
    results = {}
    try:
        for name, fn in cases.items():
            results[name] = timed(fn, args.repeat, dev)[:2]
            print(f"  {name}: {results[name][0]:.3f} ms", file=sys.stderr, flush=True)
    finally:
        dispatch.swiglu = swiglu.swiglu
    dense, dense_b2b = results["dense SwiGLU MLP"]
    print(f"# {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {args.dtype}, T={N} E={E} K={K} D=F={D}, "
          f"94% sink, median of {args.repeat}")
    print("| case | ms | ms back to back | vs dense | vs dense back to back |")
    print("|---|---|---|---|---|")
    for name, (ms, b2b) in results.items():
        print(f"| {name} | {ms:.3f} | {b2b:.3f} | {dense / ms:.2f} | {dense_b2b / b2b:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
