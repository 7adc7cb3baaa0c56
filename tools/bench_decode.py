"""Benchmark writing: the static decode path (CUDA graphs on and off) at batch 1 and with many
streams, beside the uncached reference (`sampling.generate`: the model's whole forward over the
window for every character); kernels, launch calls and host syncs per character; the
weight-bandwidth bound, all in one run on a random-init model of a profile. (The growing-cache
`generate` of earlier tables, "today's path", was removed: the reference stands in its row and its
check; `--today-chars` still names `--reference-chars`.)

    python tools/bench_decode.py --profile h200                  # the H200 table of docs/sampling.md
    python tools/bench_decode.py --profile cuda_small --streams 64
    python tools/bench_decode.py --profile cpu_tiny --device cpu --chars 40 --streams 4 --copy-mib 16
    python tools/bench_decode.py --profile h200_offload --chars 40 --streams 64   # offloaded experts

With a profile whose frozen experts are offloaded (`experts.offload = "cpu"`), the runs are the two
ways writing reads them, at batch 1 and with many streams: `experts` (each step's chosen experts
read in place from pinned memory, graphs on) and `rows` (every row staged whole, graphs off); the
bound is then the NF4 bytes a step reads over the pinned host-to-device bandwidth of this run.

char/s is the steady rate: from the first character written to the last (the prefill, and the
capture of the graph, are reported apart as `first ms`). Kernels per character are the GPU kernels
(memcpy/memset not counted) the profiler saw over `--profile-chars` characters; launch calls are the
host's cudaLaunchKernel / cudaGraphLaunch calls; syncs are what torch.cuda.set_sync_debug_mode("warn")
reports. The bound: the bytes of weights a character reads in bf16 (attention, router, head and the
top_k experts of each row; with B streams, up to min(E, B*top_k) experts a row per step) over the
device-to-device copy bandwidth measured in this run (bytes read + written). Prints a table; writes
every number to --json (default bench_decode.json here, a name .gitignore keeps out of the repository).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from minagi.config import load_config
from minagi.data import Vocab
from minagi.decode import Decoder, auto_grouped
from minagi.devices import host_syncs
from minagi.dispatch import PACKED
from minagi.frozen import frozen_stacks
from minagi.model import CharLM, build_model
from minagi.sampling import generate, write

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
PROMPT = "def main():\n    "


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default="h200", help="a profile of profiles/ (its model and pool; default h200)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config overrides")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--chars", type=int, default=600, help="characters per timed run (default 600)")
    p.add_argument("--reference-chars", "--today-chars", dest="reference_chars", type=int, default=100,
                   help="characters of the uncached reference, which is slow (default 100)")
    p.add_argument("--streams", type=int, default=64, help="streams of the many-streams runs (default 64)")
    p.add_argument("--vocab", type=int, default=96, help="vocabulary size (default 96, printable ASCII + newline)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--profile-chars", type=int, default=32, help="characters under torch.profiler (default 32)")
    p.add_argument("--copy-mib", type=int, default=1024, help="MiB of the bandwidth probe's copy (default 1024)")
    p.add_argument("--top-kernels", type=int, default=12, help="GPU kernels listed for the graphed step")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (torch.set_num_threads; 0 = torch's default)")
    p.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True,
                   help="also the compiled step (CUDA; default on)")
    p.add_argument("--json", default="bench_decode.json",
                   help="where every number goes (default bench_decode.json, ignored by git)")
    return p.parse_args(argv)


def make_model(args: argparse.Namespace, device: torch.device) -> tuple[CharLM, Vocab]:
    cfg = load_config(args.profile, args.set)
    chars = "".join(dict.fromkeys(PROMPT + "".join(chr(c) for c in range(32, 127))))  # the prompt's first
    chars += "".join(chr(c) for c in range(0x100, 0x100 + max(0, args.vocab - len(chars))))
    vocab = Vocab.from_text(chars[:max(args.vocab, len(set(PROMPT)))])
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.pool, vocab.size, device, dense_width=cfg.dense_width, experts=cfg.experts)
    return model.eval(), vocab


def offloaded(model: CharLM) -> bool:
    return model.stager is not None


def nf4_bytes(model: CharLM, streams: int) -> tuple[int, int]:
    """(NF4 bytes a step of `streams` characters reads in place, bytes of one row's stacks): each
    chosen expert's bytes once per choice (the gather does not merge repeats)."""
    stacks = list(frozen_stacks(model).values())
    row = sum(s.stored_bytes() for s in stacks) // model.cfg.n_rows
    per_expert = row // model.pool_cfg.n_experts
    return model.cfg.n_rows * streams * model.pool_cfg.top_k * per_expert, row


def pinned_bandwidth(device: torch.device, mib: int, repeat: int = 5) -> float:
    """Bytes per second of a pinned host-to-device copy."""
    src = torch.empty(mib << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device=device)
    times = []
    for _ in range(repeat + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return src.numel() / min(times[1:])


def weight_bytes(model: CharLM, streams: int = 1) -> int:
    """bf16 bytes of weights one step of `streams` characters reads (each weight once)."""
    cfg, D = model.cfg, model.cfg.d_model
    per_row = 4 * D * D  # qkv and proj
    if cfg.mlp == "pooled":
        pool = model.pool_cfg
        experts = min(pool.n_experts, streams * pool.top_k)
        per_row += pool.n_experts * D + experts * 3 * D * pool.d_expert
    else:
        per_row += 3 * D * model.rows[0].mlp.down.shape[0]
    return 2 * (cfg.n_rows * per_row + model.vocab_size * D + streams * D)


def copy_bandwidth(device: torch.device, mib: int, repeat: int = 5) -> float:
    """Bytes per second of a device-to-device copy, counting the bytes read and the bytes written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    return 2 * src.numel() / min(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(make_chars, device: torch.device, every: int = 1) -> dict:
    """Steady char/s of an iterator of per-step character lists, from its first yield to its last.
    `every`: steps written between two reads (write's sync_every). A read returns the steps before
    the one queued last, so the first yield comes when max(every, 2) steps were queued; the steps
    yielded with it are not counted in the steady steps, nor the one still running then."""
    t0 = time.perf_counter()
    chars = make_chars()
    next(chars)
    sync(device)
    first = time.perf_counter()
    rest = sum(1 for _ in chars) - (max(every, 2) - 1)
    sync(device)
    end = time.perf_counter()
    return {"first_ms": (first - t0) * 1e3, "steady_s": end - first, "steps": rest,
            "step_per_s": rest / (end - first) if end > first and rest > 0 else float("nan")}


def counted(make_chars, n: int, device: torch.device, top: int = 0) -> dict:
    """Kernels, launch calls and syncs per step over `n` steps after a few untimed ones."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile
    chars = make_chars()
    for _ in range(3):
        next(chars)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            next(chars)
        sync(device)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS)
    out = {"kernels_per_step": len(kernels) / n, "launch_calls_per_step": launches / n,
           "gpu_us_per_step": sum(e.device_time for e in kernels) / n}
    out["syncs_per_step"] = len(host_syncs(lambda: [next(chars) for _ in range(n)])) / n
    if top:
        totals: dict[str, float] = {}
        for e in kernels:
            totals[e.name] = totals.get(e.name, 0.0) + e.device_time / n
        out["top_kernels_us"] = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return out


def first_difference(a: str, b: str) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    model, vocab = make_model(args, device)
    if offloaded(model):
        return run_offloaded(model, vocab, device, args)
    T, B, n = args.temperature, args.streams, args.chars
    cuda = device.type == "cuda"
    cases = [("reference (generate, uncached)", "-", 1, args.reference_chars, 1,
              lambda k: ([c] for c in generate(model, vocab, PROMPT, k, T, 0, 1337, device)))]

    def case(name: str, graphs: str, streams: int, every: int, **kw) -> None:
        cases.append((name, graphs, streams, n, every, lambda k: write(model, vocab, [PROMPT] * streams, k, T, 0, 1337,
                                                                        device, graphs=graphs, sync_every=every, **kw)))
    for graphs in (("off", "on") if cuda else ("off",)):
        case("static", graphs, 1, 1)
    if cuda:  # what the per-character read-back costs
        case("static, read every 16", "on", 1, 16)
    case("static", "on" if cuda else "off", B, 16)
    if cuda and args.compiled:  # the step's pieces through torch.compile
        case("static, compiled", "on", 1, 1, compiled=True)
        case("static, compiled, read every 16", "on", 1, 16, compiled=True)
        case("static, compiled, GEMV/sort/SDPA kernels (no products)", "on", 1, 1, compiled=True, products=False)
        case("static, compiled", "on", B, 16, compiled=True)
    if model.cfg.mlp == "pooled" and model.pools()[0].path in PACKED and cuda:
        for streams in (1, B):  # the expert path auto does not take, beside the one it takes
            other = "gathered" if auto_grouped(model.pools()[0], streams) else "grouped"
            case(f"static, experts {other}", "on", streams, 1 if streams == 1 else 16, expert_path=other)
    bandwidth = copy_bandwidth(device, args.copy_mib)
    rows = []
    for name, graphs, streams, chars, every, make in cases:
        top = args.top_kernels if name in ("static", "static, compiled") and (graphs, streams) == ("on", 1) else 0
        row = {"path": name, "graphs": graphs, "streams": streams, "sync_every": every,
               **timed(lambda: make(chars), device, every),
               **counted(lambda: make(args.profile_chars + 3 + args.profile_chars), args.profile_chars, device, top)}
        row["char_per_s"] = row["step_per_s"] * streams
        row["bound_char_per_s"] = bandwidth * streams / weight_bytes(model, streams)
        rows.append(row)
    return {"device": str(device), "threads": torch.get_num_threads(), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "python": platform.python_version(), "profile": args.profile,
            "overrides": args.set, "params": sum(p.numel() for p in model.parameters()),
            "weight_bytes_per_char": weight_bytes(model), "copy_bytes_per_s": bandwidth, "results": rows,
            "slide_ms": slide_ms(model, device), "checks": checks(model, vocab, device, args)}


def run_offloaded(model: CharLM, vocab: Vocab, device: torch.device, args: argparse.Namespace) -> dict:
    """The two ways writing reads offloaded experts, at batch 1 and with `--streams`, in one run."""
    T, B = args.temperature, args.streams
    bandwidth = pinned_bandwidth(device, args.copy_mib) if device.type == "cuda" else float("nan")
    rows = []
    for streams in (1, B):
        for read in ("experts", "rows"):
            graphs = "on" if read == "experts" and device.type == "cuda" else "off"
            chars = args.chars if read == "experts" else max(4, args.chars // 8)  # a staged row is slow

            def make(k, s=streams, r=read, g=graphs):
                return write(model, vocab, [PROMPT] * s, k, T, 0, 1337, device, graphs=g, offload_read=r)
            row = {"path": f"offloaded, read {read}", "graphs": graphs, "streams": streams, **timed(lambda: make(chars),
                   device)}
            row["char_per_s"] = row["step_per_s"] * streams
            read_bytes, row_bytes = nf4_bytes(model, streams)
            step_bytes = read_bytes if read == "experts" else model.cfg.n_rows * row_bytes
            row.update(h2d_bytes_per_step=step_bytes, bound_char_per_s=bandwidth * streams / step_bytes)
            rows.append(row)
    greedy = ["".join(c for (c,) in write(model, vocab, [PROMPT], 12, 0.0, 0, 1337, device, offload_read=r))
              for r in ("experts", "rows")]
    return {"device": str(device), "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__, "python": platform.python_version(), "profile": args.profile,
            "overrides": args.set, "params": sum(p.numel() for p in model.parameters()),
            "pinned_h2d_bytes_per_s": bandwidth, "results": rows,
            "greedy_experts_equals_rows": greedy[0] == greedy[1]}


def print_offloaded(data: dict) -> None:
    print(f"device {data['device']} ({data['gpu'] or 'cpu'}), torch {data['torch']}, profile {data['profile']} "
          f"{' '.join(data['overrides'])}; pinned host-to-device copy {data['pinned_h2d_bytes_per_s'] / 1e9:.1f} GB/s\n")
    print("| offloaded experts read by | graphs | streams | char/s | first ms | NF4 MB over the bus per step "
          "| bound char/s | % of bound |")
    print("|---|---|---|---|---|---|---|---|")
    for r in data["results"]:
        print(f"| {r['path'].split()[-1]} | {r['graphs']} | {r['streams']} | {r['char_per_s']:.1f} "
              f"| {r['first_ms']:.0f} | {r['h2d_bytes_per_step'] / 1e6:.1f} | {r['bound_char_per_s']:.1f} "
              f"| {100 * r['char_per_s'] / r['bound_char_per_s']:.1f} |")
    print(f"\ngreedy, 12 chars: reading experts in place writes "
          f"{'the same text as' if data['greedy_experts_equals_rows'] else 'a DIFFERENT text from'} staging rows")


def slide_ms(model: CharLM, device: torch.device, repeat: int = 10) -> dict:
    """ms of one slide of one stream (its last keep - 1 characters prefilled again), median of `repeat`
    after a warm-up, with graphs as `write` chooses them on this device."""
    window = model.cfg.context
    decoder = Decoder(model, [0], window, graphs=device.type == "cuda")
    decoder.prefill([0], [[i % model.vocab_size for i in range(window)]])  # a full window
    decoder.prepare_slides([1])
    times = []
    for _ in range(repeat + 1):
        sync(device)
        t0 = time.perf_counter()
        decoder.slide([0])
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return {"keep": decoder.keep, "graphed": 1 in decoder._slides, "ms": sorted(times[1:])[repeat // 2]}


def checks(model: CharLM, vocab: Vocab, device: torch.device, args: argparse.Namespace) -> dict:
    """Greedy text of the uncached reference vs the static path; two streams of a batch vs each written alone."""
    n = args.reference_chars
    reference = "".join(generate(model, vocab, PROMPT, n, 0.0, 0, 1337, device))
    static = "".join(c for (c,) in write(model, vocab, [PROMPT], n, 0.0, 0, 1337, device))
    batch = ["".join(s) for s in zip(*write(model, vocab, [PROMPT] * args.streams, args.chars, args.temperature,
                                             0, 1337, device, sync_every=16))]
    alone = {i: "".join(c for (c,) in write(model, vocab, [PROMPT], args.chars, args.temperature, 0, 1337 + i,
                                            device)) for i in range(min(2, args.streams))}
    out = {}
    if device.type == "cuda" and args.compiled:
        compiled = "".join(c for (c,) in write(model, vocab, [PROMPT], n, 0.0, 0, 1337, device, compiled=True))
        out["compiled_greedy_first_difference"] = first_difference(reference, compiled)
    return {**out, "greedy_chars": n, "greedy_first_difference": first_difference(reference, static),
            "stream_chars": args.chars,
            "stream_first_difference": {i: first_difference(batch[i], text) for i, text in alone.items()}}


def fmt(value, spec: str = ".0f") -> str:
    return "—" if value is None else format(value, spec)


def print_table(data: dict) -> None:
    print(f"device {data['device']} ({data['gpu'] or platform.processor() or 'cpu'}), torch {data['torch']}, "
          f"profile {data['profile']} {' '.join(data['overrides'])}, {data['params'] / 1e6:.1f}M parameters")
    print(f"weights read per character (bf16): {data['weight_bytes_per_char'] / 1e6:.2f} MB; device-to-device "
          f"copy {data['copy_bytes_per_s'] / 1e9:.1f} GB/s (read + write)\n")
    print("| path | graphs | streams | char/s | first ms | kernels/char | launch calls/char | syncs/char "
          "| GPU us/char | bound char/s | % of bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in data["results"]:
        per_char = (lambda key: None if key not in r else r[key] / r["streams"])
        print(f"| {r['path']} | {r['graphs']} | {r['streams']} | {r['char_per_s']:.1f} | {r['first_ms']:.0f} "
              f"| {fmt(per_char('kernels_per_step'), '.1f')} | {fmt(per_char('launch_calls_per_step'), '.1f')} "
              f"| {fmt(per_char('syncs_per_step'), '.2f')} | {fmt(per_char('gpu_us_per_step'), '.1f')} "
              f"| {r['bound_char_per_s']:.0f} | {100 * r['char_per_s'] / r['bound_char_per_s']:.2f} |")
    for r in data["results"]:
        if r.get("top_kernels_us"):
            print(f"\nGPU kernels of the graphed step at batch 1 ({r['path']}), us per character:")
            for name, us in r["top_kernels_us"]:
                print(f"  {us:8.1f}  {name[:110]}")
    sl = data["slide_ms"]
    print(f"\na slide of one stream ({sl['keep'] - 1} characters prefilled again"
          f"{', a graph replay' if sl['graphed'] else ''}): {sl['ms']:.2f} ms")
    c = data["checks"]
    same = "the same" if c["greedy_first_difference"] is None else f"differs from char {c['greedy_first_difference']}"
    print(f"\ngreedy, {c['greedy_chars']} chars: the static path's text is {same} as the uncached reference's")
    if "compiled_greedy_first_difference" in c:
        d = c["compiled_greedy_first_difference"]
        print(f"greedy, compiled step: {'the same text' if d is None else f'differs from char {d}'} as the reference")
    for i, d in c["stream_first_difference"].items():
        print(f"stream {i} of the batch vs written alone (seed 1337+{i}, {c['stream_chars']} chars): "
              f"{'equal' if d is None else f'first differs at char {d}'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = run(args)
    (print_offloaded if "pinned_h2d_bytes_per_s" in data else print_table)(data)
    Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
