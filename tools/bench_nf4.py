"""Benchmark NF4 dequantization: the torch reference, torch.compile of it and the Triton kernel.

Bandwidth = (packed bytes + absmax bytes read + output bytes written) / time, for a whole stack of
experts and for a subset of them (dequantize_rows), beside a device-to-device copy of the same output
size (bytes read + written) measured in the same run. Before timing, every implementation's output
is compared with the reference bit for bit (the `equal` column). CUDA times are medians of CUDA-event
timings with the L2 cache flushed before each repetition; CPU times are medians of wall times.
With --double-quant, torch.compile may fuse the absmax's multiply and add into one FMA: its `equal`
may then say NO by a last bit (the eager reference and the Triton path keep the two ops apart).

    python tools/bench_nf4.py                          # [256, 1024, 2048] stack, blocksize 64, bf16 out
    python tools/bench_nf4.py --tiles 2048:4 4096:8    # also try other Triton tile bytes : warps
    python tools/bench_nf4.py --device cpu --small     # tiny sizes on the CPU: a smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minagi import nf4

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, repeat: int, device: torch.device, flush: torch.Tensor | None) -> float:
    """Median milliseconds of fn() after one warm-up call (compiles, autotunes)."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    pairs = []
    for _ in range(repeat):
        flush.zero_()  # evicts the previous repetition's bytes from L2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def implementations(q: nf4.NF4Packed, index, dtype, names: list[str]) -> dict[str, tuple]:
    """name -> (full-stack callable, subset callable)."""
    impls = {}
    for name in names:
        if name == "torch":
            impls[name] = (lambda: nf4.dequantize_nf4(q, dtype), lambda: nf4.dequantize_rows(q, index, dtype))
        elif name == "compiled":
            full, rows = torch.compile(nf4.dequantize_nf4), torch.compile(nf4.dequantize_rows)
            impls[name] = (lambda full=full: full(q, dtype), lambda rows=rows: rows(q, index, dtype))
        elif name == "triton":
            impls[name] = (lambda: nf4.dequantize_nf4(q, dtype, backend="triton"),
                           lambda: nf4.dequantize_rows(q, index, dtype, backend="triton"))
    return impls


def traffic(q: nf4.NF4Packed, n_out: int, dtype: torch.dtype) -> int:
    """Bytes a dequantization of n_out of q's elements moves: packed + absmax read, output written."""
    share = n_out / q.numel
    return round(q.nbytes * share) + n_out * torch.empty((), dtype=dtype).element_size()


def run_cases(q, index, dtype, args, device) -> list[dict]:
    n_full, n_sub = q.numel, index.numel() * (q.numel // q.shape[0])
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    results = []
    for case, n_out in (("full", n_full), ("subset", n_sub)):
        src = torch.empty(n_out * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        ms = timed(lambda: dst.copy_(src), args.repeat, device, flush)
        results.append({"case": case, "impl": "copy", "ms": ms, "bytes": 2 * src.numel(), "equal": None})
        del src, dst
    reference = (nf4.dequantize_nf4(q, dtype), nf4.dequantize_rows(q, index, dtype))
    names = [n for n in args.impls if n != "triton" or nf4.select_dequant(device) == "triton"]
    tiles = args.tiles if "triton" in names else []
    for name, fns in implementations(q, index, dtype, names).items():
        for tile in (tiles if name == "triton" else [None]):
            label = name if tile is None else f"triton {tile}"
            if tile is not None:
                from minagi import nf4_triton
                nf4_triton.TILE_BYTES, nf4_triton.NUM_WARPS = (int(v) for v in tile.split(":"))
            for case, fn, ref, n_out in (("full", fns[0], reference[0], n_full), ("subset", fns[1], reference[1], n_sub)):
                equal = torch.equal(fn(), ref)
                ms = timed(fn, args.repeat, device, flush)
                results.append({"case": case, "impl": label, "ms": ms, "bytes": traffic(q, n_out, dtype),
                                "equal": equal})
                print(f"  {case} {label}: {ms:.3f} ms", file=sys.stderr, flush=True)
    return results


def print_table(results: list[dict], header: str) -> None:
    copy = {r["case"]: r["bytes"] / r["ms"] for r in results if r["impl"] == "copy"}
    print(header)
    print("| case | impl | ms | GB/s | vs copy | equal |")
    print("|---|---|---|---|---|---|")
    for r in results:
        r["gbps"] = r["bytes"] / r["ms"] / 1e6
        r["vs_copy"] = r["bytes"] / r["ms"] / copy[r["case"]]
        equal = "" if r["equal"] is None else ("yes" if r["equal"] else "NO")
        print(f"| {r['case']} | {r['impl']} | {r['ms']:.3f} | {r['gbps']:.0f} | {r['vs_copy']:.2f} | {equal} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--small", action="store_true", help="a [8, 16, 128] stack, subset of 3 (smoke test)")
    ap.add_argument("--shape", type=int, nargs=3, default=(256, 1024, 2048), metavar=("E", "ROWS", "COLS"))
    ap.add_argument("--subset", type=int, default=16, help="experts in the subset case")
    ap.add_argument("--blocksize", type=int, default=64)
    ap.add_argument("--double-quant", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=tuple(DTYPES))
    ap.add_argument("--impls", nargs="+", default=["torch", "compiled", "triton"],
                    choices=("torch", "compiled", "triton"))
    ap.add_argument("--tiles", nargs="+", default=["2048:4"], help="Triton TILE_BYTES:NUM_WARPS to try")
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; use --device cpu --small", file=sys.stderr)
        return 2
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    shape, subset = ((8, 16, 128), 3) if args.small else (tuple(args.shape), args.subset)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
    q = nf4.quantize_nf4(x, args.blocksize, args.double_quant)
    del x
    index = torch.randperm(shape[0], generator=gen, device=device)[:subset]
    results = run_cases(q, index, dtype, args, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print_table(results, f"# {name}, torch {torch.__version__}, stack {list(shape)}, subset {subset}, "
                         f"blocksize {args.blocksize}, double quant {args.double_quant}, {args.dtype} out, "
                         f"median of {args.repeat}")
    if args.json:
        args.json.write_text(json.dumps({"shape": list(shape), "subset": subset, "blocksize": args.blocksize,
                                         "results": results}, indent=1))
    return 0 if all(r["equal"] is not False for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
