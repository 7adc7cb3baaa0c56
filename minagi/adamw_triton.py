"""The Triton kernel of `AdamWBF16`'s update (minagi/optim.py says when it runs): one launch updates
every tensor of a group, each in one pass (a table on the GPU names each tensor's memory, size, step
and seed; each program updates one block of one tensor).

Shapes, a tensor: weight [n] fp32, its gradient [n] (fp32, bf16 or fp16), the two moments [n] bf16, all
contiguous. The kernel reads each once and writes the weight and both moments once: 4 + 4 + 2 + 2 bytes read and
4 + 2 + 2 written a weight, where the foreach form (minagi/optim.py `_update`) makes fp32 copies of
the moments, a denominator and the rounding's random bits, and launches ~20 kernels a chunk.

The arithmetic is the foreach form's, in its order (torch's AdamW's): m lerped towards g, v = beta2 v
+ (1 - beta2) g^2, the weight decayed, then moved by -lr / c1 * m / (sqrt(v) / sqrt(c2) + eps). The
moments go back to bf16 by stochastic rounding: 16 random bits added below the fp32 pattern's top 16,
then cut (inf and NaN kept). The bits are Philox's (Triton's `randint4x`) at (seed, element index):
another stream than the foreach form's torch.randint, so the two implementations round differently,
each reproducibly. The moments are read and written as int16 words, the bf16 bit patterns: no float
cast to round (Triton's CPU interpreter, which the tests use, truncates its fp32 -> bf16 casts).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024      # weights a program updates: 8 per thread at 4 warps
NUM_WARPS = 4
ROW = 8           # int64 words of a tensor's row in the launch's table (`_table`)


@triton.jit
def _round_bits(x, r):
    # fp32 x -> the bf16 bit pattern (int32, in its low 16 bits) of x rounded up or down at random by r.
    bits = x.to(tl.int32, bitcast=True)
    up = (bits + (r & 0xFFFF).to(tl.int32)) & -65536  # -65536 = 0xFFFF0000
    finite = (x == x) & (tl.abs(x) != float("inf"))
    return tl.where(finite, up, bits) >> 16


@triton.jit
def _update_kernel(table_ptr, block_tensor_ptr, keep, lerp_w, beta2, one_minus_beta2, eps,
                   GRAD: tl.constexpr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    # Program -> (its tensor t, its block of t); t's row of the table (`_table`): 8 int64 words.
    pid = tl.program_id(0)
    row = table_ptr + tl.load(block_tensor_ptr + pid).to(tl.int64) * ROW
    p_ptr = tl.load(row).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(row + 1).to(tl.pointer_type(GRAD))
    m_ptr = tl.load(row + 2).to(tl.pointer_type(tl.int16))   # bf16 bit patterns
    v_ptr = tl.load(row + 3).to(tl.pointer_type(tl.int16))
    n, first, seed = tl.load(row + 4), tl.load(row + 5), tl.load(row + 6)
    step_size = tl.load((row + 7).to(tl.pointer_type(tl.float32)))       # word 7: two fp32,
    sqrt_c2 = tl.load((row + 7).to(tl.pointer_type(tl.float32)) + 1)     # lr / c1 and sqrt(c2)
    offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)  # int64: an element's index in its tensor
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = (tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    v = (tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    m = tl.where(lerp_w < 0.5, m + lerp_w * (g - m), g - (g - m) * (1 - lerp_w))  # torch.lerp(m, g, 1 - beta1)
    v = v * beta2 + one_minus_beta2 * (g * g)     # mul_(beta2), addcmul_(g, g, 1 - beta2)
    p = p * keep                                  # decoupled decay: 1 - lr * weight_decay
    # IEEE square root and division (Triton's plain ones are approximate on NVIDIA), as torch's ops round.
    denom = tl.div_rn(tl.sqrt_rn(v), sqrt_c2) + eps
    p = p - step_size * tl.div_rn(m, denom)       # addcdiv_(m, denom, -lr / c1)
    tl.store(p_ptr + offs, p, mask=mask)
    r_m, r_v, _, _ = tl.randint4x(seed, offs)
    tl.store(m_ptr + offs, _round_bits(m, r_m).to(tl.int16), mask=mask)
    tl.store(v_ptr + offs, _round_bits(v, r_v).to(tl.int16), mask=mask)


_GRAD = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _on(t: Tensor):
    """Launch on t's GPU, not on the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def fits(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> bool:
    """Whether the kernel can update these in place: an fp32 weight, bf16 moments, all contiguous and alike in size."""
    return (p.dtype == torch.float32 and exp_avg.dtype == exp_avg_sq.dtype == torch.bfloat16 and grad.dtype in _GRAD
            and p.numel() == grad.numel() == exp_avg.numel() == exp_avg_sq.numel() and p.is_contiguous()
            and grad.is_contiguous() and exp_avg.is_contiguous() and exp_avg_sq.is_contiguous())


def update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, step: int, seed: int, **settings) -> None:
    """One AdamW step of one tensor: `update_many_` of one."""
    update_many_([(p, grad, exp_avg, exp_avg_sq)], steps=[step], seeds=[seed], **settings)


def update_many_(tensors: list[tuple[Tensor, Tensor, Tensor, Tensor]], *, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, steps: list[int], seeds: list[int], fitted: bool = False) -> None:
    """One AdamW step of each (weight, grad, exp_avg, exp_avg_sq) in place, all on one GPU: one launch a gradient
    dtype. Tensor i is bias-corrected at `steps[i]` and its rounding's bits drawn from `seeds[i]` (< 2**63) at
    each element's index: the same bits as it alone would draw. `fitted`: the caller has checked `fits`."""
    for i, (p, grad, exp_avg, exp_avg_sq) in enumerate(tensors):
        if not fitted and not fits(p, grad, exp_avg, exp_avg_sq):
            raise RuntimeError(f"the fused bf16 AdamW needs an fp32 weight and bf16 moments, contiguous and of one "
                               f"size; tensor {i}: {p.dtype} {tuple(p.shape)}, grad {grad.dtype}, moments "
                               f"{exp_avg.dtype}")
    by_grad: dict[torch.dtype, list[int]] = {}
    for i, (p, grad, _, _) in enumerate(tensors):
        if p.numel():
            by_grad.setdefault(grad.dtype, []).append(i)
    for dtype, picked in by_grad.items():
        table, block_tensor = _table([tensors[i] for i in picked], [steps[i] for i in picked],
                                     [seeds[i] for i in picked], lr, beta1, beta2)
        with _on(tensors[picked[0]][0]):
            _update_kernel[(block_tensor.numel(),)](
                table, block_tensor, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps,
                GRAD=_GRAD[dtype], ROW=ROW, BLOCK=BLOCK, num_warps=NUM_WARPS)


def _table(tensors, steps, seeds, lr, beta1, beta2) -> tuple[Tensor, Tensor]:
    """(the launch's table on the tensors' GPU: [T, ROW] int64, a row a tensor: the addresses of its weight,
    grad and moments, its size, its first block, its seed, and two fp32 in the last word: lr / c1 and sqrt(c2);
    the tensor of each block [blocks] int32). The table goes from pinned memory without a wait: the host
    runs on while the GPU still works on the step's backward."""
    device = tensors[0][0].device
    numels = tuple(p.numel() for p, *_ in tensors)
    blocks = [-(-n // BLOCK) for n in numels]  # not triton.cdiv: a jit function, slow to call from the host
    firsts = np.cumsum([0, *blocks[:-1]])
    rows = np.empty((len(tensors), ROW), np.int64)
    rows[:, :7] = [[p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, first, seed % 2**63]
                   for (p, g, m, v), n, first, seed in zip(tensors, numels, firsts, seeds)]
    pairs = rows.view(np.float32)  # [T, 2 ROW]: word 7 is floats 14 and 15
    pairs[:, -2] = [lr / (1 - beta1 ** s) for s in steps]
    pairs[:, -1] = [(1 - beta2 ** s) ** 0.5 for s in steps]
    host = torch.from_numpy(rows)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return host, _block_tensor(device, numels, blocks)


_BLOCK_TENSOR: dict[tuple, Tensor] = {}  # (device, sizes, BLOCK) -> each block's tensor: the same every step


def _block_tensor(device: torch.device, numels: tuple, blocks: list[int]) -> Tensor:
    key = (str(device), numels, BLOCK)
    if key not in _BLOCK_TENSOR:
        if len(_BLOCK_TENSOR) >= 16:  # a probe's, a test's: a training run asks for one or two
            _BLOCK_TENSOR.pop(next(iter(_BLOCK_TENSOR)))
        each = torch.repeat_interleave(torch.arange(len(blocks), dtype=torch.int32), torch.tensor(blocks))
        _BLOCK_TENSOR[key] = each.to(device)
    return _BLOCK_TENSOR[key]


_WORKS: dict[tuple, str] = {}  # (device, torch version) -> "" where the kernel passed, else why not


def works(device: torch.device) -> str:
    """"" where the kernel runs on `device` and gives the foreach form's weights and bf16 neighbours of its
    moments, else what failed: asked once a device and torch version in a process, on two tensors of two
    steps in one launch, as training's (a compile error, a kernel this GPU lacks, or wrong arithmetic all
    mean the foreach form)."""
    key = (str(device), torch.__version__)
    if key not in _WORKS:
        try:
            _WORKS[key] = _probe(device)
        except Exception as e:  # noqa: BLE001 -- any failure of a kernel never run here means: not here
            _WORKS[key] = f"failed to run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return _WORKS[key]


def _probe(device: torch.device) -> str:
    gen = torch.Generator().manual_seed(0)
    lr, beta1, beta2, eps, decay, steps = 1e-2, 0.9, 0.95, 1e-8, 0.1, [3, 5]
    wants, homes = [], []
    for n, step in zip((2 * BLOCK + 16, BLOCK + 5), steps):  # two tensors, two steps, blocks whole and part
        p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        m, v = (0.1 * torch.randn(n, generator=gen)).bfloat16(), (0.01 * torch.rand(n, generator=gen)).bfloat16()
        want_m = m.float().lerp(g, 1 - beta1)
        want_v = (v.float() * beta2).addcmul(g, g, value=1 - beta2)
        denom = want_v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
        wants.append(((p * (1 - lr * decay)).addcdiv(want_m, denom, value=-lr / (1 - beta1 ** step)), want_m, want_v))
        homes.append(tuple(t.to(device) for t in (p, g, m, v)))
    update_many_(homes, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=decay, steps=steps, seeds=[1, 2])
    for (want_p, want_m, want_v), home in zip(wants, homes):
        got_p, _, got_m, got_v = (t.cpu().float() for t in home)
        if not torch.allclose(got_p, want_p, rtol=1e-5, atol=1e-6):
            return "moved the weights otherwise than the foreach form"
        for got_x, want_x in ((got_m, want_m), (got_v, want_v)):
            if not ((got_x - want_x).abs() <= want_x.abs() * 2 ** -7 + 1e-30).all():  # one bf16 step at most
                return "rounded the moments off their bf16 neighbours"
    return ""
