"""Training settings of one profile side by side in one process, their steps alternating in blocks.

    python tools/bench_paired.py --profile strix_large --set pool.dispatch=grouped \
        --variant "train.compile=rows" --variant "train.compile=rows train.compile_mode=reduce-overhead" \
        --variant "train.compile=false"
    python tools/bench_paired.py --device cpu --profile cpu_tiny --variant "" --variant "train.compile=rows" --rounds 2

Where the host sets a step's pace (the bucketed path on a fast GPU), its speed drifts by ±25% within one
device call (docs/benchmarks.md §22): figures from processes run one after another do not resolve a
10% change. Here every variant is built in the same process, warmed up, then timed in rounds: each
round runs `--block` steps of every variant (the order rotating), so a slow spell of the host falls on
all of them. Printed per variant: the median step and char/s over the rounds, their range, and the
median over rounds of the first variant's block time over this one's (the paired speed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from minagi.config import ConfigError, load_config
from minagi.trainer import build_training, train_step

VOCAB = 96


class Variant:
    """One variant's training, its random characters and its block times (ms a step)."""

    def __init__(self, name: str, profile: str, sets: list[str], device: torch.device):
        self.name = name
        self.cfg = load_config(profile, [f"train.device={device.type}", "train.steps=100000", "train.warmup_steps=1",
                                         *sets])
        self.training = build_training(self.cfg, VOCAB, device, 1)
        self.device, self.step, self.times = device, 0, []
        self.shape = (self.cfg.train.accum_steps * self.cfg.train.batch_size, self.cfg.model.context)
        self.generator = torch.Generator(device=device).manual_seed(0)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            x, y = (torch.randint(0, VOCAB, self.shape, device=self.device, generator=self.generator) for _ in range(2))
            train_step(self.training, x, y, step=self.step, grad_clip=self.cfg.train.grad_clip, world_size=1,
                       device=self.device)
            self.training.updating = False
            self.step += 1


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variants: list[Variant], rounds: int, block: int, warmup: int) -> int:
    """Warm every variant up, then time the rounds; the graphs torch.compile made during the rounds (a
    recompile: a variant may then have run eagerly, past dynamo's limit)."""
    from torch._dynamo.utils import counters
    for v in variants:
        v.run(warmup)
    graphs = counters["stats"]["unique_graphs"]
    device = variants[0].device
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            synchronize(device)
            start = time.perf_counter()
            v.run(block)
            synchronize(device)
            v.times.append((time.perf_counter() - start) / block * 1e3)
    return counters["stats"]["unique_graphs"] - graphs


def summary(variants: list[Variant]) -> list[dict]:
    first = variants[0].times
    out = []
    for v in variants:
        step_ms = statistics.median(v.times)
        out.append({"variant": v.name, "median_step_ms": step_ms, "chars_per_s": v.shape[0] * v.shape[1] / step_ms * 1e3,
                    "min_step_ms": min(v.times), "max_step_ms": max(v.times),
                    "paired_speed": statistics.median(a / b for a, b in zip(first, v.times)), "times_ms": v.times})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="for every variant")
    ap.add_argument("--variant", action="append", required=True, metavar='"SECTION.KEY=VALUE ..."',
                    help="one variant's settings, space-separated (\"\" for the profile as it is); the first is the "
                         "one the others are paired against")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=5, help="steps of a variant in a row, each round")
    ap.add_argument("--warmup", type=int, default=10, help="steps of each variant before the rounds (compiles)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    try:
        variants = [Variant(v or "(as the profile)", args.profile, [*args.sets, *v.split()], device) for v in args.variant]
    except ConfigError as e:
        print(f"bench_paired: {e}", file=sys.stderr)
        return 2
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "profile": args.profile, "sets": args.sets, "rounds": args.rounds, "block": args.block}
    print(json.dumps(meta), flush=True)
    meta["recompiles_in_rounds"] = measure(variants, args.rounds, args.block, args.warmup)
    results = summary(variants)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if meta["recompiles_in_rounds"]:
        print(f"bench_paired: {meta['recompiles_in_rounds']} graph(s) compiled during the timed rounds: a variant "
              "recompiled (more --warmup, or fewer variants that compile)", file=sys.stderr)
    print(f"| {args.profile} variant | char/s (median) | step ms: median (range) | paired speed vs the first |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['chars_per_s']:,.0f} | {r['median_step_ms']:.1f} ({r['min_step_ms']:.1f}-"
              f"{r['max_step_ms']:.1f}) | {r['paired_speed']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
