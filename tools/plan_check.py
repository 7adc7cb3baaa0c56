"""The memory plan (`train.py --plan`, minagi/plan.py) against the real peak: a few training steps of each
profile on this GPU, the plan's peak allocated and reserved beside the allocator's, side by side.

    python tools/plan_check.py --profiles h200 h200_frozen strix_large cuda_small h200_offload --steps 3
    python tools/plan_check.py --profiles h200 --set train.optimizer_states=bf16 --set train.accum_steps=4

Each profile runs in a process of its own, so that its memory.alloc_conf is set before CUDA starts and
its memory.gpu_cap_gib (h200_offload's 16 GiB) applies to it alone. The steps train on random characters
(a vocabulary of 96, as tools/bench_train.py); the measured peak is over the steps after the first (the
optimizer's state exists then, as in every step but the first of a run). On the CPU the plan is printed
without a measurement (the CPU has no allocator figures).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


VOCAB = 96
GiB = 2 ** 30


def measure(profile: str, steps: int, sets: list[str]) -> dict:
    """This process: the plan for `profile` on this machine, then `steps` training steps, the peaks."""
    import torch
    from minagi import devices
    from minagi.config import load_config
    from minagi.plan import plan_memory
    from minagi.plan_report import local_target
    from minagi.trainer import build_training, train_step

    cfg = load_config(profile, [f"train.steps={steps + 10}", "train.warmup_steps=1", *sets])
    devices.apply_alloc_conf(cfg.memory.alloc_conf)  # before anything starts CUDA (local_target asks it)
    target, _ = local_target()
    plan = plan_memory(cfg, target, vocab_size=VOCAB)
    out = {"profile": profile, "target": target.name, "plan_allocated": plan.peak_allocated,
           "plan_reserved": plan.peak_reserved, "plan_phase": plan.phase,
           "plan_parts": {p.name: p.bytes for p in plan.parts}}
    if not torch.cuda.is_available():
        return out
    device = torch.device("cuda", 0)
    devices.apply_memory_cap(cfg.memory.gpu_cap_gib, device)
    t0 = time.perf_counter()
    training = build_training(cfg, VOCAB, device, 1)
    g = torch.Generator(device=device).manual_seed(0)
    shape = (cfg.train.accum_steps * cfg.train.batch_size, cfg.model.context)
    try:
        for step in range(steps):
            x, y = (torch.randint(0, VOCAB, shape, device=device, generator=g) for _ in range(2))
            train_step(training, x, y, step=step, grad_clip=cfg.train.grad_clip, world_size=1, device=device)
            training.updating = False
            if step == 0:
                torch.cuda.synchronize(device)
                out["allocated_after_step"] = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as e:
        out["error"] = str(e).splitlines()[0]
    out.update(measured_allocated=torch.cuda.max_memory_allocated(device),
               measured_reserved=torch.cuda.max_memory_reserved(device), seconds=time.perf_counter() - t0)
    return out


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def table(results: list[dict]) -> str:
    lines = ["| profile | target | plan peak allocated GiB | measured GiB | plan / measured | plan reserved GiB | "
             "measured reserved GiB | plan's peak phase |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r and "plan_allocated" not in r:
            lines.append(f"| {r['profile']} | {r['error']} |")
            continue
        real = r.get("measured_allocated")
        ratio = f"{r['plan_allocated'] / real - 1:+.1%}" if real else "-"
        note = f" ({r['error']})" if "error" in r else ""
        lines.append(f"| {r['profile']} | {r['target']} | {_gib(r['plan_allocated'])} | {_gib(real)}{note} | {ratio} | "
                     f"{_gib(r['plan_reserved'])} | {_gib(r.get('measured_reserved'))} | {r['plan_phase']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profiles", nargs="+",
                    default=["h200", "h200_frozen", "strix_large", "cuda_small", "h200_offload"])
    ap.add_argument("--steps", type=int, default=3,
                    help="training steps a profile (the peak is over all but the first)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--timeout", type=int, default=300, help="seconds a profile may take (its build included)")
    ap.add_argument("--json")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: one profile, its result as a JSON line
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.steps, args.sets)), flush=True)
        return 0
    results = []
    for profile in args.profiles:
        cmd = [sys.executable, __file__, "--one", profile, "--steps", str(args.steps),
               *[a for s in args.sets for a in ("--set", s)]]
        try:
            done = subprocess.run(cmd, capture_output=True, encoding="utf-8", errors="replace", timeout=args.timeout)
            lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
            results.append(json.loads(lines[-1]) if lines else
                           {"profile": profile, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
        except subprocess.TimeoutExpired:
            results.append({"profile": profile, "error": f"over {args.timeout} s"})
        print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
