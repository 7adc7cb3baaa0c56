"""Benchmark PooledMLP dispatch paths: forward + backward of one pool over a routing-skew sweep.

Each case is timed beside two baselines of the same routed FLOPs, in the same run: a dense SwiGLU MLP
over R = T*K rows (`vs_dense`: the same work without routing) and its six GEMMs alone (`vs_matmul`:
the matmul floor, no elementwise work). Ratios > 1 mean faster than the baseline.

    python tools/bench_dispatch.py                      # the H200 sweep of docs/benchmarks.md
    python tools/bench_dispatch.py --device cpu --chars 64 --experts 8 --top-k 2 --width 32 --repeat 2

Prints a table; writes every number to --json (default bench_dispatch.json).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from minagi.config import PoolConfig
from minagi.dense import dense_swiglu
from minagi.dispatch import PACKED, PATHS, native_supported, resolve_dispatch
from minagi.pool import PooledMLP
from minagi.swiglu import implementation

SKEWS = ("uniform", "hot", "sink94", "collapse")


def make_routing(skew: str, n_chars: int, n_experts: int, top_k: int, gen: torch.Generator):
    """Expert ids [N, K] (distinct per character) and gates for one skew of the sweep."""
    scores = torch.rand(n_chars, n_experts, generator=gen)
    if skew == "hot":          # a hot set of K*2 experts takes most of the rows
        scores[:, : 2 * top_k] += 0.6
    elif skew == "sink94":     # one sink picked by 94% of characters (the seed case)
        scores[: round(0.94 * n_chars), 0] += 2.0
        scores = scores[torch.randperm(n_chars, generator=gen)]
    elif skew == "collapse":   # every character picks the same K experts
        scores[:, :top_k] += 2.0
    ids = scores.topk(top_k, -1).indices
    gates = torch.softmax(torch.randn(n_chars, top_k, generator=gen), -1)
    return ids, gates


def timed(fn, repeat: int, device: torch.device) -> tuple[float, float, int]:
    """(median ms synced per call, median ms back to back, peak bytes of one run over the baseline).

    Synced: the host waits for each call, so the call pays its own launch latency (what one isolated
    layer costs). Back to back: calls follow each other with no wait (triton.testing.do_bench's way),
    so the host launches ahead while the GPU works, as it does across the rows of a model; a host
    sync inside the call (the bucketed path has one) still drains the queue and shows in both.
    """
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    back_to_back = statistics.median(times)
    peak = 0
    if device.type == "cuda":
        torch.cuda._sleep(20_000_000)  # ~10 ms of queued GPU work: the host gets ahead from the first call
        events = [torch.cuda.Event(enable_timing=True) for _ in range(repeat + 1)]
        events[0].record()
        for i in range(repeat):
            fn()
            events[i + 1].record()
        torch.cuda.synchronize()
        back_to_back = statistics.median(a.elapsed_time(b) for a, b in zip(events, events[1:]))
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return statistics.median(times), back_to_back, peak


def dense_step(rows: int, width: int, expert_width: int, device, dtype):
    """Forward + backward of a dense SwiGLU MLP over `rows` rows: the same FLOPs as the routed experts."""
    x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(width, 2 * expert_width, device=device, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(expert_width, width, device=device, dtype=dtype) * 0.02).requires_grad_()
    grad_out = torch.randn(rows, width, device=device, dtype=dtype)

    def step():
        torch.autograd.grad(dense_swiglu(x, w1, w2), (x, w1, w2), grad_out)
    return step


def matmul_step(rows: int, width: int, expert_width: int, device, dtype):
    """Only the six GEMMs of that forward + backward (no activation, no autograd): the matmul floor."""
    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)
    x, w1, w2 = rand(rows, width), rand(width, 2 * expert_width), rand(expert_width, width)
    act, grad_y, grad_h = rand(rows, expert_width), rand(rows, width), rand(rows, 2 * expert_width)

    def step():
        torch.mm(x, w1)                 # h = x W1
        torch.mm(act, w2)               # y = act W2
        torch.mm(grad_y, w2.t())        # d act
        torch.mm(act.t(), grad_y)       # d W2
        torch.mm(x.t(), grad_h)         # d W1
        torch.mm(grad_h, w1.t())        # d x
    return step


# The SwiGLU's reads and writes per computed row, in elements of width F, counted from each
# implementation's kernels (forward + backward; the gate's [rows] ignored):
#   triton     forward reads h (2F), writes act (F); backward reads h and grad, writes grad h   3 + 5
#   jiterator  forward as triton; backward's kernel reads h and grad, writes grad a, grad b and the
#              gate terms; the cat reads and writes grad h; the sum reads the terms          3 + 11
#   eager      silu, x up, x gate (7); backward: grad x gate, the gate terms and their sum, x up,
#              x silu, silu's backward, the two halves into grad h (19)                        7 + 19
SWIGLU_ELEMENTS = {"triton": 8, "jiterator": 14, "eager": 26}


def bytes_per_routed_row(path: str, load: list[int], D: int, F: int, elem: int, swiglu: str = "triton") -> float | None:
    """Bytes of device memory a forward + backward of the experts reads and writes per routed row,
    counted from the shapes (`elem` bytes an element): the weights — the card read by the forward and
    by the input gradient, its gradient written; a gathered expert copied in forward and again in
    backward and its gradient added back (read, read, write) — and the activations of each computed
    row (the input gathered in, h [2F] written, the down GEMM reading [F], the output [D] written and
    summed out: backward about twice the forward's traffic; the SwiGLU as `SWIGLU_ELEMENTS` counts
    for the implementation `swiglu` that ran). None for the loop reference."""
    from minagi.layout import Layout, layered_layout
    E, card_bytes = len(load), len(load) * 3 * D * F * elem
    routed = sum(load)
    if path == "loop" or routed == 0:
        return None
    if path in PACKED:  # the packed rows: no padding, the card read twice and its gradient written
        rows, weights = routed, 3 * card_bytes
    else:
        layout = layered_layout(load) if path == "grouped" else Layout(tuple(load), max(load), ())
        gathered = sum(len(m) for _, m in layout.groups)
        rows = layout.padded_rows
        weights = (3 * card_bytes if layout.card else 0) + gathered * (card_bytes // E) * 7
    activations = rows * (3 * (2 * D + 2 * F + F + D + D) + SWIGLU_ELEMENTS[swiglu] * F) * elem
    return (weights + activations) / routed


def pool_step(pool: PooledMLP, path: str, x, ids, gates, grad_out, seen: dict | None = None):
    """One forward + backward of the experts; `seen` gets the last call's RouteCounts."""
    def step():
        y, counts = pool.experts_forward(x, ids, gates, path=path)
        torch.autograd.grad(y, (x, pool.experts.gate_up, pool.experts.down, gates), grad_out)
        if seen is not None:
            seen["counts"] = counts
    return step


def profile_paths(pool, paths, n_chars, skew, E, K, D, device, dtype) -> None:
    """Where the time goes: the top kernels of one forward + backward per path."""
    from torch.profiler import ProfilerActivity, profile
    ids, gates = make_routing(skew, n_chars, E, K, torch.Generator().manual_seed(1))
    ids, gates = ids.to(device), gates.to(device=device, dtype=dtype).requires_grad_()
    x = torch.randn(n_chars, D, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn(n_chars, D, device=device, dtype=dtype)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for path in paths:
        step = pool_step(pool, path, x, ids, gates, grad_out)
        step()
        with profile(activities=activities) as prof:
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
        sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        print(f"\n## profile: {path}, {n_chars} chars, {skew}")
        print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60))


def _runs_as_asked(path: str, device, dtype) -> bool:
    """Whether `path` runs here as itself (a path that cannot is left out of the sweep, not warned about)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_dispatch(path, device, dtype) == path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chars", type=int, nargs="+", default=[1, 2081, 16384])
    ap.add_argument("--skews", nargs="+", default=list(SKEWS), choices=SKEWS)
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024, help="D = F")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", default="bench_dispatch.json")
    ap.add_argument("--swiglu", choices=["auto", "jiterator", "eager"], default="auto",
                    help="pool.swiglu: auto = minagi's Triton kernels where Triton is present; jiterator = "
                         "torch's run-time compiled kernels (a GPU without Triton); eager = torch ops")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top kernels for each path at the largest --chars, first skew")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    D = Fw = args.width
    E, K = args.experts, args.top_k
    default_path = resolve_dispatch("auto", device, dtype)
    swiglu_ran = implementation(torch.empty(1, 2, device=device, dtype=dtype, requires_grad=True), args.swiglu)
    paths = [p for p in args.paths if (p != "native" or native_supported(device, dtype))
             and (p != "triton" or _runs_as_asked(p, device, dtype))]  # triton: a CUDA GPU with Triton
    torch.manual_seed(0)
    pool = PooledMLP(D, PoolConfig(n_experts=E, top_k=K, d_expert=Fw, swiglu=args.swiglu)).to(device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "dtype": str(dtype), "experts": E, "top_k": K, "width": D,
        "default_path": default_path, "repeat": args.repeat, "swiglu": args.swiglu, "swiglu_ran": swiglu_ran,
    }
    results = []
    for n_chars in args.chars:
        rows = n_chars * K
        flops = 18 * D * Fw * rows  # fwd 6*D*F per routed row, bwd twice that
        dense_ms, dense_b2b, dense_peak = timed(dense_step(rows, D, Fw, device, dtype), args.repeat, device)
        matmul_ms, matmul_b2b, _ = timed(matmul_step(rows, D, Fw, device, dtype), args.repeat, device)
        for skew in args.skews:
            ids, gates = make_routing(skew, n_chars, E, K, gen)
            ids, gates = ids.to(device), gates.to(device=device, dtype=dtype).requires_grad_()
            x = torch.randn(n_chars, D, device=device, dtype=dtype, requires_grad=True)
            grad_out = torch.randn(n_chars, D, device=device, dtype=dtype)
            load = torch.bincount(ids.flatten(), minlength=E)
            for path in paths:
                seen = {}
                ms, b2b, peak = timed(pool_step(pool, path, x, ids, gates, grad_out, seen), args.repeat, device)
                padding_ratio = seen["counts"].padded_rows / rows
                row = {
                    "chars": n_chars, "skew": skew, "path": path, "ms": ms, "tflops": flops / ms / 1e9,
                    "dense_ms": dense_ms, "vs_dense": dense_ms / ms,
                    "matmul_ms": matmul_ms, "vs_matmul": matmul_ms / ms,
                    "ms_back_to_back": b2b, "dense_ms_back_to_back": dense_b2b, "vs_dense_back_to_back": dense_b2b / b2b,
                    "matmul_ms_back_to_back": matmul_b2b, "vs_matmul_back_to_back": matmul_b2b / b2b, "padding_ratio": padding_ratio,
                    "peak_bytes": peak, "dense_peak_bytes": dense_peak,
                    "peak_vs_dense": peak / dense_peak if dense_peak else None,
                    "max_over_fair": load.max().item() / (rows / E), "default": path == default_path,
                    "bytes_per_routed_row": bytes_per_routed_row(path, load.tolist(), D, Fw, x.element_size(), swiglu_ran),
                }
                results.append(row)
                print(f"  {n_chars:>6} {skew:<9} {path:<10} {ms:8.3f} ms ({b2b:.3f} back to back)", file=sys.stderr,
                      flush=True)
            del x, grad_out, ids, gates
            if device.type == "cuda":
                torch.cuda.empty_cache()

    if args.profile:
        profile_paths(pool, paths, max(args.chars), args.skews[0], E, K, D, device, dtype)
    Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"# {meta['device']}, torch {meta['torch']}, {meta['dtype']}, E={E} K={K} D=F={D}, "
          f"default path: {default_path}, SwiGLU: {swiglu_ran}, median of {args.repeat}")
    print("ms: synced per call; b2b: calls back to back (the dense MLP and matmuls timed the same way)")
    print("| chars | skew | path | ms | ms b2b | routed TFLOP/s | vs dense MLP | vs dense b2b | vs matmuls | "
          "padded/routed | peak MiB | peak vs dense | max/fair | KiB moved / routed row |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        pvd = f"{r['peak_vs_dense']:.2f}" if r["peak_vs_dense"] is not None else "-"
        moved = "-" if r["bytes_per_routed_row"] is None else f"{r['bytes_per_routed_row'] / 1024:.0f}"
        print(f"| {r['chars']} | {r['skew']} | {r['path']}{' *' if r['default'] else ''} | {r['ms']:.3f} | "
              f"{r['ms_back_to_back']:.3f} | {r['tflops']:.1f} | {r['vs_dense']:.2f} | {r['vs_dense_back_to_back']:.2f} | "
              f"{r['vs_matmul']:.2f} | {r['padding_ratio']:.2f} | "
              f"{r['peak_bytes'] / 2**20:.0f} | {pvd} | {r['max_over_fair']:.1f} | {moved} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
