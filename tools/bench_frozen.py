"""Frozen-expert training steps side by side: the replay pin against recompute, offload with and
without prefetch against resident, and frozen NF4 stacks against the same pool trainable.

    python tools/bench_frozen.py --profile h200_frozen --modes recompute pin offload-sync offload-prefetch
    python tools/bench_frozen.py --profile h200_frozen --set pool.n_experts=64 --modes trainable frozen
    python tools/bench_frozen.py --device cpu --small --steps 2 --warmup 1     # a smoke run

Each mode builds the profile's model with a few settings changed (MODES), trains `--warmup` steps,
then times `--steps` steps on random characters (the step time is the wall time of a whole step:
forward, backward, optimizer, with the one host sync the trainer has). Printed per mode: median step
ms, char/s, peak and persistent allocated bytes, dequants per step by phase with their GPU ms, and
for offload the host-to-device bytes per step, the copy bandwidth on the side stream and the copy
time compute waited for. The device-to-device and pinned host-to-device bandwidths are measured in
the same run. A mode that runs out of memory says so and the others go on.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minagi.config import load_config
from minagi.frozen import dequant_summary, frozen_stacks
from minagi.trainer import build_training, train_step

MODES = {
    "frozen": [],                                                    # the profile as it is
    "recompute": ["train.checkpoint_rows=true", "experts.replay_pin=off"],
    "pin": ["train.checkpoint_rows=true", "experts.replay_pin=on"],
    "auto": ["train.checkpoint_rows=true", "experts.replay_pin=auto"],
    "offload-sync": ["experts.offload=cpu", "experts.prefetch=false"],
    "offload-prefetch": ["experts.offload=cpu", "experts.prefetch=true"],
    "frozen-bf16": ["experts.quant=none", "experts.offload=none"],
    "trainable": ["experts.frozen=false", "experts.lora_rank=0", "experts.offload=none"],
}
SMALL = ["model.n_rows=2", "model.d_model=64", "model.n_heads=2", "model.context=32", "pool.n_experts=8",
         "pool.top_k=2", "pool.d_expert=64", "train.batch_size=4", "experts.frozen=true", "experts.lora_rank=8",
         "train.warmup_steps=1"]
VOCAB = 96


def bandwidths(device: torch.device) -> dict:
    """Device-to-device copy (bytes read + written) and pinned host-to-device copy, GB/s."""
    if device.type != "cuda":
        return {}
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    host = torch.empty(2**30, dtype=torch.uint8).pin_memory()

    def rate(fn, nbytes):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return nbytes / (statistics.median(times) / 1e3) / 1e9
    out = {"d2d_GBps": rate(lambda: dst.copy_(src), 2 * src.numel()),
           "h2d_pinned_GBps": rate(lambda: dst.copy_(host, non_blocking=True), host.numel())}
    del src, dst, host
    torch.cuda.empty_cache()
    return out


def run_mode(name: str, cfg, device: torch.device, steps: int, warmup: int) -> dict:
    training = build_training(cfg, VOCAB, device, 1)
    for stack in frozen_stacks(training.model).values():
        stack.stats.timing = True
    if training.stager is not None:
        training.stager.timing = True
    g = torch.Generator(device=device).manual_seed(0)
    shape = (cfg.train.accum_steps * cfg.train.batch_size, cfg.model.context)  # the step's micro-batches
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            dequant_summary(training.model, 1)
            if training.stager is not None:
                training.stager.take_stats()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
        x = torch.randint(0, VOCAB, shape, device=device, generator=g)
        y = torch.randint(0, VOCAB, shape, device=device, generator=g)
        t0 = time.perf_counter()
        train_step(training, x, y, step=i, grad_clip=cfg.train.grad_clip, world_size=1, device=device)
        training.updating = False
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    out = {"mode": name, "step_ms": ms, "chars_per_s": shape[0] * shape[1] / (ms / 1e3),
           "dequants_per_step": dequant_summary(training.model, steps)}
    if device.type == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        out["persistent_allocated"] = torch.cuda.memory_allocated(device)
    if training.stager is not None:
        s = training.stager.take_stats()
        out["h2d_bytes_per_step"] = s["h2d_bytes"] / steps
        out["h2d_exposed_ms_per_step"] = s["h2d_exposed_ms"] / steps
        out["resident_expert_bytes"] = s["resident_bytes"]
        if s.get("h2d_copy_ms"):
            out["h2d_copy_GBps"] = s["h2d_bytes"] / (s["h2d_copy_ms"] / 1e3) / 1e9
    stacks = frozen_stacks(training.model)
    out["frozen_stored_bytes"] = sum(s.stored_bytes() for s in stacks.values())
    out["expert_params"] = sum(p.numel() for n, p in training.model.named_parameters() if ".experts." in n
                               and "lora" not in n) + sum(s.stack_numel() for s in stacks.values())
    del training
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="h200_frozen")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--modes", nargs="+", default=["recompute", "pin", "offload-sync", "offload-prefetch"],
                    choices=list(MODES))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    base = (SMALL if args.small else []) + [f"train.steps={args.warmup + args.steps + 1}", "train.warmup_steps=1",
                                            f"train.device={device.type}", *args.sets]
    meta = {"profile": args.profile, "torch": torch.__version__, "sets": args.sets, "steps": args.steps,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", **bandwidths(device)}
    print(json.dumps(meta), flush=True)
    results = []
    for name in args.modes:
        cfg = load_config(None if args.small else args.profile, base + MODES[name])
        try:
            results.append(run_mode(name, cfg, device, args.steps, args.warmup))
        except torch.OutOfMemoryError as e:
            results.append({"mode": name, "error": f"out of memory: {str(e).splitlines()[0]}"})
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print("| mode | step ms | char/s | peak GiB | persistent GiB | dequants/step f/r/b (pinned) | dequant ms/step "
          "| H2D GB/step | H2D GB/s | H2D ms waited/step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | {r['error']} |")
            continue
        d = r["dequants_per_step"] or {}
        gib = lambda k: f"{r[k] / 2**30:.2f}" if k in r else "-"  # noqa: E731
        print(f"| {r['mode']} | {r['step_ms']:.1f} | {r['chars_per_s']:,.0f} | {gib('peak_allocated')} | "
              f"{gib('persistent_allocated')} | "
              + (f"{d['forward']:.0f}/{d['replay']:.0f}/{d['backward']:.0f} ({d['pinned']:.0f})" if d else "-")
              + f" | {d.get('ms', 0):.2f} | "
              + (f"{r['h2d_bytes_per_step'] / 1e9:.2f} | {r.get('h2d_copy_GBps', 0):.1f} | "
                 f"{r['h2d_exposed_ms_per_step']:.1f} |" if "h2d_bytes_per_step" in r else "- | - | - |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
