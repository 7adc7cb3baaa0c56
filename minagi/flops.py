"""Model FLOPs utilisation: the FLOPs a character costs, the matmul rate of the device, and their ratio.

MFU = model FLOPs per character x characters per second / (the bf16 matmul rate x ranks). Model FLOPs
per character follow nanoGPT's convention: 6 x the parameters a character uses (attention, router,
its top_k experts or the dense MLP, the head; not the embedding lookup) + 12 x rows x width x context
for attention. Recomputation under row checkpointing is not counted: it is work the model does not
need. The rate is not a datasheet figure but measured, once a process and device: an 8192^3 bf16
matmul timed on the device (CUDA only; None elsewhere, and so is MFU). Used by the trainer (the
progress line and every history record) and tools/bench_train.py.
"""
from __future__ import annotations

import torch

__all__ = ["flops_per_char", "matmul_tflops", "mfu"]

_MATMUL_N = 8192  # the product timed: 3 x 128 MiB of bf16, freed after
_RATES: dict[tuple, float | None] = {}


def flops_per_char(cfg, vocab: int) -> float:
    """Training FLOPs (forward and backward) of one character of a model of config `cfg`."""
    m, p = cfg.model, cfg.pool
    per_row = 4 * m.d_model ** 2
    if m.mlp == "dense":
        per_row += 3 * m.d_model * cfg.dense_width
    else:
        # The router, the top_k routed experts and the always-on shared ones (one SwiGLU of their width).
        per_row += m.d_model * p.n_experts + (p.top_k + p.shared_experts) * 3 * m.d_model * p.d_expert
    params = m.n_rows * per_row + m.d_model * vocab
    return 6 * params + 12 * m.n_rows * m.d_model * m.context


def matmul_tflops(device: torch.device) -> float | None:
    """The bf16 matmul rate of `device` in TFLOP/s, measured the first time it is asked in this process
    (3 products to warm up, 10 timed by CUDA events); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch.cuda.get_device_name(index))
    if key not in _RATES:
        _RATES[key] = _time_matmul(torch.device("cuda", index))
    return _RATES[key]


def _time_matmul(device: torch.device) -> float:
    n = _MATMUL_N
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del a, b
    torch.cuda.empty_cache()  # the 384 MiB go back: training's allocator figures start from its own
    return 2 * n ** 3 * 10 / seconds / 1e12


def mfu(per_char: float, chars_per_s: float | None, tflops: float | None, ranks: int = 1) -> float | None:
    """The fraction of `ranks` devices' matmul rate that `chars_per_s` (all ranks' characters) uses."""
    if chars_per_s is None or not tflops:
        return None
    return per_char * chars_per_s / (tflops * 1e12 * ranks)
