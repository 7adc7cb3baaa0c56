"""The optimizer step alone, side by side (CUDA): torch's fused AdamW (fp32 moments) against AdamWBF16 (bf16
moments, `train.optimizer_states = "bf16"`) in its foreach form and with its Triton kernel.

Each optimizer steps its own copy of a profile's weights (their groups and decay as the trainer makes
them), with one set of random gradients; rounds of `--block` steps of each, in rotating order, so a
slow spell of the host falls on all. Printed per optimizer: the median step synced (host included),
the median step between CUDA events around a block (the host queueing ahead; its gaps still count
where it falls behind), the bytes a weight that form reads and writes, the rate of the events' time at
those bytes, and the memory the step holds above the weights, grads and states (the update's
temporaries).

    python tools/bench_optim.py --profiles h200_shakespeare h200_gutenberg
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from minagi.config import ConfigError, load_config
from minagi.optim import AdamWBF16
from minagi.trainer import build_training

VOCAB = 96
# Bytes a weight each form moves: the weight read and written (4 + 4), its fp32 gradient read (4), and the
# two moments read and written (fp32: 4 + 4 each; bf16: 2 + 2 each). The foreach form also writes and
# reads fp32 copies of the moments, a denominator and the random bits: it is given no figure.
BYTES = {"torch AdamW, fp32 states": 28, "AdamWBF16, foreach": None, "AdamWBF16, Triton kernel": 20}


def param_groups(profile: str, sets: list[str], device: torch.device):
    """(the profile's weights in the trainer's groups: their params and weight decay, its config)."""
    cfg = load_config(profile, [f"train.device={device.type}", "train.optimizer_states=fp32", *sets])
    training = build_training(cfg, VOCAB, device, 1)
    return [{"params": list(g["params"]), "weight_decay": g["weight_decay"]} for g in training.optimizer.param_groups], cfg


def copies(groups: list[dict], gen: torch.Generator) -> list[dict]:
    """The groups' weights copied, each with a gradient (drawn from `gen`: the same for every optimizer)."""
    out = []
    for g in groups:
        params = []
        for p in g["params"]:
            q = torch.nn.Parameter(p.detach().clone())
            q.grad = torch.randn(q.shape, device=q.device, generator=gen) * 1e-3
            params.append(q)
        out.append({"params": params, "weight_decay": g["weight_decay"]})
    return out


def build(name: str, groups: list[dict], lr: float, betas, device: torch.device) -> torch.optim.Optimizer:
    if name.startswith("torch"):
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda")
    return AdamWBF16(groups, lr=lr, betas=betas, fused=name.endswith("kernel"))


def kernel_runs(device: torch.device) -> bool:
    """Whether the Triton kernel takes part: where the trainer would take it (CUDA, Triton, its probe passed;
    else said once, and the row left out). The CPU is a smoke run of the other two."""
    fuses = AdamWBF16([torch.nn.Parameter(torch.zeros(1, device=device))]).fuses(device)
    if device.type == "cuda" and not fuses:
        print(f"bench_optim.py: the Triton kernel does not run on {device} here: its row is left out", file=sys.stderr)
    return fuses


def bench(profile: str, sets: list[str], device: torch.device, rounds: int, block: int) -> None:
    groups, cfg = param_groups(profile, sets, device)
    n = sum(p.numel() for g in groups for p in g["params"])
    tensors = sum(len(g["params"]) for g in groups)
    optimizers = {}
    names = [k for k in BYTES if not k.endswith("kernel") or kernel_runs(device)]
    for name in names:
        opt = build(name, copies(groups, torch.Generator(device=device).manual_seed(0)), cfg.train.lr,
                    (cfg.train.beta1, cfg.train.beta2), device)
        opt.step()  # the states made, the kernels compiled
        optimizers[name] = opt
    synced, gpu, held = {k: [] for k in names}, {k: [] for k in names}, {k: 0 for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            synced_ms, gpu_ms, held_bytes = timed(optimizers[name], block, device)
            synced[name].append(synced_ms)
            gpu[name].append(gpu_ms)
            held[name] = max(held[name], held_bytes)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{profile}: {n / 1e6:.1f}M weights in {tensors} tensors, {where}, torch {torch.__version__}; "
          f"median of {rounds} rounds of {block} steps")
    first = statistics.median(synced[names[0]])
    for name in names:
        ms, g_ms = statistics.median(synced[name]), statistics.median(gpu[name])
        rate = f"{BYTES[name] * n / g_ms / 1e6:,.0f} GB/s at {BYTES[name]} B a weight" if BYTES[name] else "-"
        print(f"  {name:32s} step {ms:7.3f} ms ({first / ms:4.2f}x the first), GPU events {g_ms:7.3f} ms, "
              f"{rate}, held above the states {held[name] / 2**20:,.0f} MiB")


def timed(opt: torch.optim.Optimizer, block: int, device: torch.device) -> tuple[float, float, int]:
    """(ms a step synced, ms a step of GPU time back to back, bytes held above what was allocated before)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(block):
            opt.step()
        ms = (time.perf_counter() - t0) * 1e3 / block
        return ms, ms, 0
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(block):
        opt.step()
    end.record()
    torch.cuda.synchronize(device)
    ms = (time.perf_counter() - t0) * 1e3 / block
    return ms, start.elapsed_time(end) / block, torch.cuda.max_memory_allocated(device) - base


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", nargs="+", default=["h200_shakespeare"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--device", default="cuda", help="cuda (the figures), or cpu: a smoke run without the kernel")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_optim.py: no CUDA GPU here (--device cpu runs the other two, as a smoke run)", file=sys.stderr)
        return 2
    for profile in args.profiles:
        try:
            bench(profile, args.set, device, args.rounds, args.block)
        except ConfigError as e:
            print(f"bench_optim.py: {e}", file=sys.stderr)
            return 2
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
