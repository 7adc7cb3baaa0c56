"""The experts' grouped GEMM at a profile's training shapes, each product timed alone (CUDA, bf16):
forward, input gradient and weight gradient beside one dense GEMM of the same shape, then forward +
backward through autograd in three other forms, to see whether the layout is where time goes.

    python tools/bench_grouped_mm.py                 # h200: R = 524,288 routed rows, E = 64, D = 512
    python tools/bench_grouped_mm.py --out 512       # the down projection's width

Loads are drawn within +-40% of fair share (routing after training; docs/benchmarks.md §10). Forms:
  torch     the stack as stored [E, K, N], torch's own backward (what minagi runs)
  nt        the weight gradient as (dY^T X)^T, a grouped GEMM of the other operand order
  nk        the stack copied to [E, N, K] and used transposed (torchtitan's layout)
  nk+nt     both
Median of --repeat timed calls after three warm-ups; prints ms and TFLOP/s.
"""
from __future__ import annotations

import argparse
import sys

import torch

from minagi.dispatch import GROUPED_MM


class _WeightGradNT(torch.autograd.Function):
    """GROUPED_MM whose weight gradient is computed as grouped (dY^T X), then transposed (a view)."""

    @staticmethod
    def forward(ctx, x_RK, w_EKN, offs_E):
        ctx.save_for_backward(x_RK, w_EKN, offs_E)
        return GROUPED_MM(x_RK, w_EKN, offs=offs_E)

    @staticmethod
    def backward(ctx, dy_RN):
        x_RK, w_EKN, offs_E = ctx.saved_tensors
        dy_RN = dy_RN.contiguous()
        dx = GROUPED_MM(dy_RN, w_EKN.transpose(-2, -1), offs=offs_E)
        dw = GROUPED_MM(dy_RN.t(), x_RK, offs=offs_E).transpose(-2, -1)
        return dx, dw, None


def form_mm(form: str, x_RK, w_EKN, offs_E):
    if form.startswith("nk"):
        w_EKN = w_EKN.transpose(-2, -1).contiguous().transpose(-2, -1)
    if form.endswith("nt"):
        return _WeightGradNT.apply(x_RK, w_EKN, offs_E)
    return GROUPED_MM(x_RK, w_EKN, offs=offs_E)


def timed_ms(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=524_288, help="routed rows R (h200: 256 x 512 characters x top_k 4)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--width", type=int, default=512, help="K, the input width")
    ap.add_argument("--out", type=int, default=1024, help="N, the output width (gate/up: 2F; down: D)")
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or GROUPED_MM is None:
        print("needs CUDA and torch's grouped GEMM", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    E, R, K, N = args.experts, args.rows, args.width, args.out
    share_E = torch.rand(E) * 0.8 + 0.6
    counts_E = (share_E / share_E.sum() * R).long()
    counts_E[-1] += R - counts_E.sum()
    offs_E = counts_E.cumsum(0).to(torch.int32).cuda()
    x_RK = torch.randn(R, K, device="cuda", dtype=torch.bfloat16)
    dy_RN = torch.randn(R, N, device="cuda", dtype=torch.bfloat16)
    w_EKN = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16) * 0.02
    flop = 2 * R * K * N
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: R={R} E={E} K={K} N={N}, median of {args.repeat}")
    rows = [("one dense GEMM [R, K] x [K, N]", lambda: x_RK @ w_EKN[0], 1),
            ("forward", lambda: GROUPED_MM(x_RK, w_EKN, offs=offs_E), 1),
            ("input gradient", lambda: GROUPED_MM(dy_RN, w_EKN.transpose(1, 2), offs=offs_E), 1),
            ("weight gradient X^T dY", lambda: GROUPED_MM(x_RK.t(), dy_RN, offs=offs_E), 1)]
    for form in ("torch", "nt", "nk", "nk+nt"):
        w = w_EKN.float().requires_grad_(True)
        x = x_RK.clone().requires_grad_(True)
        rows.append((f"forward + backward, form {form}",
                     lambda form=form, w=w, x=x: form_mm(form, x, w.to(torch.bfloat16), offs_E).backward(dy_RN), 3))
    for name, fn, products in rows:
        ms = timed_ms(fn, args.repeat)
        print(f"  {name:<40} {ms:8.3f} ms  {products * flop / ms / 1e9:6.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
