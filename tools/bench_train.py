"""Training throughput and MFU of profiles, side by side in one run, beside the matmul rate measured there.

    python tools/bench_train.py --profiles h200 cuda_small --compile off on --steps 60
    python tools/bench_train.py --profiles h200 --compile on --trace            # + where the step's time goes
    python tools/bench_train.py --profiles h200 --compile on --data "" --warmup 300   # routing after training
    python tools/bench_train.py --device cpu --profiles cpu_tiny --steps 3 --warmup 1   # a smoke run
    python tools/bench_train.py --profiles h200 --compile off on --set train.parallel=fsdp   # FSDP2's cost, one GPU

MFU = model FLOPs per character x characters per second / the bf16 matmul rate (an 8192^3 product
timed in the same run): minagi/flops.py, the formula the trainer's progress line and history use
(shared experts included). Per profile and compile setting: char/s and MFU over
`--steps` steps after `--warmup` (random characters, or with --data batches of a corpus, so that the
measured steps see the routing that training leaves), host syncs per step (counted by
torch.cuda.set_sync_debug_mode over one step), recompiles over the measured steps, peak allocated,
the busiest expert's load over its fair share (the worst row, last step); with --trace, the GPU time of
one step by kind of kernel and how much of it the GPU sat idle.

Bytes per trainable weight (`bytes_per_weight`), from persistent memory after the first step: on CUDA the
allocated bytes then (weights and optimizer state; gradients are freed after the update) minus the
model's other tensors (frozen stacks, buffers), over the trainable weights; on the CPU from the
optimizer's state tensors. A step's gradient adds 4 more (fp32) while it runs:

    python tools/bench_train.py --profiles h200 --steps 3 --warmup 1 --set train.optimizer_states=fp32
    python tools/bench_train.py --profiles h200 --steps 3 --warmup 1 --set train.optimizer_states=bf16
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from pathlib import Path

import torch

from minagi.config import load_config
from minagi.data import DataError, batch_on, load_corpus
from minagi.devices import host_syncs
from minagi.distributed import one_rank_group
from minagi.flops import flops_per_char, matmul_tflops, mfu
from minagi.optim import state_bytes
from minagi.trainer import build_training, train_step

VOCAB = 96
KINDS = (  # kernel name fragments -> what the time is spent on (first match wins)
    ("grouped GEMM (experts)", ("grouped", "_grouped_mm", "ptr_array", "group")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "efficient")),
    ("dense GEMM", ("gemm", "sm90_xmma", "cublas", "nvjet", "cutlass")),
    ("SwiGLU (Triton)", ("_forward_kernel", "_backward_kernel")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("compiled elementwise (inductor)", ("triton_poi", "triton_red", "triton_per", "triton_")),
    ("gathers / scatter / sort", ("index", "gather", "scatter", "sort", "searchsorted", "radix", "cub")),
    ("reductions", ("reduce", "norm", "softmax", "logsumexp", "sum")),
    ("copies / casts", ("copy", "cat", "to_copy", "memcpy", "memset", "fill")),
)


def busiest_expert(stats) -> float | None:
    """The last step's busiest expert over its fair share, in the worst row (None for a dense model)."""
    if stats.counts is None:
        return None
    load_LE = stats.counts.load_LE.float()
    return float((load_LE.max(1).values / load_LE.mean(1)).max())


def bytes_per_weight(training, device: torch.device) -> dict:
    """Persistent bytes per trainable weight after a step: the weight itself, the optimizer's state
    (CUDA: measured, allocated minus the model's tensors; CPU: its state tensors), and their sum."""
    trainable = [p for p in training.model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    weights = sum(p.numel() * p.element_size() for p in trainable)
    model = sum(t.numel() * t.element_size() for t in (*training.model.parameters(), *training.model.buffers())
                if t.device.type == device.type)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        states = torch.cuda.memory_allocated(device) - model
        how = "measured: allocated after the step minus the model's tensors"
    else:
        states = state_bytes(training.optimizer)
        how = "the optimizer's state tensors"
    return {"weights": weights / n, "optimizer_states": states / n, "persistent": (weights + states) / n,
            "with_gradient": (weights + states) / n + 4, "trainable_weights": n, "how": how}


def kernel_time_by_kind(fn, device: torch.device) -> tuple[list[tuple[str, float]], list[tuple[str, float, int]]]:
    """GPU ms of one call by kind of kernel, and the 40 costliest kernels (name, ms, launches)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    totals: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if not us or e.key.startswith("ProfilerStep"):
            continue
        name = e.key.lower()
        kind = next((k for k, frags in KINDS if any(f in name for f in frags)), "other elementwise")
        totals[kind] = totals.get(kind, 0.0) + us / 1e3
        kernels.append((e.key[:90], us / 1e3, e.count))
    return sorted(totals.items(), key=lambda kv: -kv[1]), sorted(kernels, key=lambda k: -k[1])[:40]


def gpu_timeline(fn, device: torch.device, calls: int = 2, gaps: int = 8) -> dict:
    """Over `calls` calls back to back: the span from the first kernel's start to the last one's end,
    the time some kernel ran (the union of their intervals), and the longest idle gaps between
    kernels with the kernels on either side: where the GPU waits for the host."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda k: k[0])
    if not kernels:
        return {}
    busy, idle, end, last = 0.0, [], kernels[0][0], kernels[0][2]
    for start, stop, name in kernels:
        if start > end:
            idle.append((start - end, last[:60], name[:60]))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, last = stop, name
    span = end - kernels[0][0]
    return {"span_ms": span / 1e3 / calls, "busy_ms": busy / 1e3 / calls, "idle_ms": (span - busy) / 1e3 / calls,
            "gaps": [(round(us / 1e3, 3), before, after) for us, before, after in sorted(idle, reverse=True)[:gaps]]}


_COMPILE = {"off": "false", "on": "true", "rows": "rows"}  # --compile -> train.compile


def run(profile: str, compile_on: str, args, device: torch.device, rate: float | None, corpus=None) -> dict:
    cfg = load_config(profile, [f"train.compile={_COMPILE[compile_on]}", f"train.device={device.type}",
                                f"train.steps={args.warmup + args.steps + 10}", "train.warmup_steps=1", *args.sets])
    # train.parallel = "fsdp": FSDP2 around the model in this one process (a 1-rank process group), to
    # measure what the wrapper costs against none (docs/multi_gpu.md).
    with one_rank_group(device) if cfg.train.parallel == "fsdp" else contextlib.nullcontext():
        return measure(cfg, profile, compile_on, args, device, rate, corpus)


def measure(cfg, profile: str, compile_on: str, args, device: torch.device, rate: float | None, corpus) -> dict:
    vocab = VOCAB if corpus is None else corpus.vocab.size
    training = build_training(cfg, vocab, device, 1)
    g = torch.Generator(device=device).manual_seed(0)
    tc = cfg.train
    shape = (tc.accum_steps * tc.batch_size, cfg.model.context)  # a step: its micro-batches one after another
    step, last, ahead = [0], {}, {}

    def batch(s: int):
        if corpus is None:
            return [torch.randint(0, VOCAB, shape, device=device, generator=g) for _ in range(2)]
        # as the trainer makes them
        return batch_on(device, corpus.train_ids, tc.batch_size, shape[1], tc.seed, s, 0, 1, tc.accum_steps)

    def one():
        x, y = ahead.pop(step[0], None) or batch(step[0])
        # As the trainer: a corpus's next batch is made while this step's kernels run.
        meanwhile = None if corpus is None else (lambda s=step[0] + 1: ahead.update({s: batch(s)}))
        last["stats"] = train_step(training, x, y, step=step[0], grad_clip=cfg.train.grad_clip, world_size=1,
                                   device=device, meanwhile=meanwhile)  # autocast to train.precision inside
        training.updating = False
        step[0] += 1

    for i in range(args.warmup):
        one()
        if i == 0:
            persistent = bytes_per_weight(training, device)
    if args.warmup == 0:
        one()
        persistent = bytes_per_weight(training, device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    t0 = time.perf_counter()
    for _ in range(args.steps):
        one()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    out = {"profile": profile, "compile": compile_on, "data": args.data, "parallel": cfg.train.parallel,
           "sharded": training.parallel.sharded,
           "chars_per_s": shape[0] * shape[1] * args.steps / seconds,
           "step_ms": seconds / args.steps * 1e3, "gflop_per_char": flops_per_char(cfg, vocab) / 1e9,
           "recompiles": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before,
           "vocab": vocab, "busiest_expert": busiest_expert(last["stats"]), "bytes_per_weight": persistent,
           "optimizer_states": tc.optimizer_states, "precision": tc.precision, "compile_mode": tc.compile_mode,
           "compile_backend": tc.compile_backend}
    sites = host_syncs(one)  # one step more, after the timed ones
    out["syncs_per_step"] = len(sites)
    if args.sync_trace:
        out["sync_sites"] = sites
    if rate:
        out["mfu"] = mfu(flops_per_char(cfg, vocab), out["chars_per_s"], rate)
    if device.type == "cuda":
        out["peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        if args.trace:
            out["gpu_ms_by_kind"], out["top_kernels"] = kernel_time_by_kind(one, device)
            out["timeline"] = gpu_timeline(one, device)
    del training
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=["h200"])
    ap.add_argument("--compile", nargs="+", choices=list(_COMPILE), default=["off"],
                    help="train.compile: off, on (the whole step), rows (each row's attention half; dispatch eager)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--data", default=None, metavar="PATH",
                    help='train on this corpus ("" = the built-in default) instead of random characters: after '
                         '--warmup steps of training, the routing the balance term leaves, not the initial one')
    ap.add_argument("--trace", action="store_true", help="also the GPU time of one step by kind of kernel")
    ap.add_argument("--sync-trace", action="store_true", help="also where each host sync of a step comes from")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    try:  # once for every profile; a bad path is one line, not a traceback after the matmul probe
        corpus = None if args.data is None else load_corpus(args.data, 0.1)
    except DataError as e:
        print(f"bench_train: {e}", file=sys.stderr)
        return 2
    rate = matmul_tflops(device)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "matmul_tflops": rate}
    print(json.dumps(meta), flush=True)
    results = []
    for profile in args.profiles:
        for mode in args.compile:
            try:
                results.append(run(profile, mode, args, device, rate, corpus))
            except torch.OutOfMemoryError as e:
                results.append({"profile": profile, "compile": mode, "error": str(e).splitlines()[0]})
                gc.collect()
                torch.cuda.empty_cache()
            print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print("| profile | compile | char/s | step ms | GFLOP/char | MFU | syncs/step | recompiles | peak GiB "
          "(allocated / reserved) | busiest expert |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['profile']} | {r['compile']} | {r['error']} |")
            continue
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        peak = f"{r['peak_allocated_gib']:.2f} / {r['peak_reserved_gib']:.2f}" if "peak_allocated_gib" in r else "-"
        how = [r.get("compile_mode", "default"), r.get("compile_backend", "inductor")]
        how = [w for w in how if w not in ("default", "inductor")]
        mode = "" if r["compile"] == "off" or not how else f" ({', '.join(how)})"
        name = r["profile"] + (" (fsdp)" if r["parallel"] == "fsdp" else "")
        print(f"| {name} | {r['compile']}{mode} | {r['chars_per_s']:,.0f} | {r['step_ms']:.1f} | "
              f"{r['gflop_per_char']:.3f} | {mfu} | {r['syncs_per_step']} | {r['recompiles']} | {peak} | "
              f"{'-' if r['busiest_expert'] is None else format(r['busiest_expert'], '.2f') + 'x'} |")
    for r in results:
        if "bytes_per_weight" in r:
            b = r["bytes_per_weight"]
            print(f"{r['profile']} ({r['optimizer_states']} states): {b['persistent']:.2f} bytes per trainable weight "
                  f"between steps (weight {b['weights']:.2f} + optimizer {b['optimizer_states']:.2f}; {b['how']}), "
                  f"{b['with_gradient']:.2f} with the step's gradient, over {b['trainable_weights']:,} weights")
    for r in results:
        if r.get("gpu_ms_by_kind"):
            print(f"\n{r['profile']} compile={r['compile']}: GPU ms of one step by kind")
            for kind, ms in r["gpu_ms_by_kind"]:
                print(f"  {kind:<32} {ms:8.2f}")
            for name, ms, count in r["top_kernels"]:
                print(f"    {ms:8.2f} ms {count:5d}x  {name}")
            t = r.get("timeline")
            if t:
                print(f"  a step's GPU span {t['span_ms']:.1f} ms: kernels busy {t['busy_ms']:.1f}, idle {t['idle_ms']:.1f}; "
                      "longest gaps (ms, after, before):")
                for gap in t["gaps"]:
                    print(f"    {gap}")
        if r.get("sync_sites"):
            print(f"{r['profile']} compile={r['compile']}: host syncs at {r['sync_sites']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
