"""The Triton kernel of `AdamWBF16`'s update (minagi/optim.py says when it runs): one pass a tensor.

Shapes: weight [n] fp32, its gradient [n] (any float dtype), the two moments [n] bf16, all contiguous.
The kernel reads each once and writes the weight and both moments once: 4 + 4 + 2 + 2 bytes read and
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

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024      # weights a program updates: 8 per thread at 4 warps
NUM_WARPS = 4


@triton.jit
def _round_bits(x, r):
    # fp32 x -> the bf16 bit pattern (int32, in its low 16 bits) of x rounded up or down at random by r.
    bits = x.to(tl.int32, bitcast=True)
    up = (bits + (r & 0xFFFF).to(tl.int32)) & -65536  # -65536 = 0xFFFF0000
    finite = (x == x) & (tl.abs(x) != float("inf"))
    return tl.where(finite, up, bits) >> 16


@triton.jit(do_not_specialize=["seed"])  # a new seed every step and tensor: never a reason to compile again
def _update_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, seed, keep, lerp_w, beta2, one_minus_beta2, step_size,
                   sqrt_c2, eps, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
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


def _on(t: Tensor):
    """Launch on t's GPU, not on the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def fits(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor) -> bool:
    """Whether the kernel can update these in place: an fp32 weight, bf16 moments, all contiguous and alike in size."""
    return (p.dtype == torch.float32 and exp_avg.dtype == exp_avg_sq.dtype == torch.bfloat16
            and grad.is_floating_point() and p.numel() == grad.numel() == exp_avg.numel() == exp_avg_sq.numel()
            and all(t.is_contiguous() for t in (p, grad, exp_avg, exp_avg_sq)))


def update_(p: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *, lr: float, beta1: float,
            beta2: float, eps: float, weight_decay: float, step: int, seed: int) -> None:
    """One AdamW step of `p` and its bf16 moments, in place; the rounding's bits from `seed`."""
    if not fits(p, grad, exp_avg, exp_avg_sq):
        raise RuntimeError(f"the fused bf16 AdamW needs an fp32 weight and bf16 moments, contiguous and of one "
                           f"size; got {p.dtype} {tuple(p.shape)}, grad {grad.dtype}, moments {exp_avg.dtype}")
    n = p.numel()
    if n == 0:
        return
    c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step
    with _on(p):
        _update_kernel[(triton.cdiv(n, BLOCK),)](
            p, grad, exp_avg.view(torch.int16), exp_avg_sq.view(torch.int16), n, seed % 2**63,
            1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, lr / c1, c2 ** 0.5, eps,
            BLOCK=BLOCK, num_warps=NUM_WARPS)


_WORKS: dict[tuple, str] = {}  # (device, torch version) -> "" where the kernel passed, else why not


def works(device: torch.device) -> str:
    """"" where the kernel runs on `device` and gives the foreach form's weights and bf16 neighbours of its
    moments, else what failed: asked once a device and torch version in a process, on 2 blocks and a part
    (a compile error, a kernel this GPU lacks, or wrong arithmetic all mean the foreach form)."""
    key = (str(device), torch.__version__)
    if key not in _WORKS:
        try:
            _WORKS[key] = _probe(device)
        except Exception as e:  # noqa: BLE001 -- any failure of a kernel never run here means: not here
            _WORKS[key] = f"failed to run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return _WORKS[key]


def _probe(device: torch.device) -> str:
    gen = torch.Generator().manual_seed(0)
    n = 2 * BLOCK + 5
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = (0.1 * torch.randn(n, generator=gen)).bfloat16(), (0.01 * torch.rand(n, generator=gen)).bfloat16()
    lr, beta1, beta2, eps, decay, step = 1e-2, 0.9, 0.95, 1e-8, 0.1, 3
    want_m = m.float().lerp(g, 1 - beta1)
    want_v = (v.float() * beta2).addcmul(g, g, value=1 - beta2)
    denom = want_v.sqrt() / (1 - beta2 ** step) ** 0.5 + eps
    want_p = (p * (1 - lr * decay)).addcdiv(want_m, denom, value=-lr / (1 - beta1 ** step))
    got = [t.to(device) for t in (p, g, m, v)]
    update_(*got, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=decay, step=step, seed=1)
    got_p, _, got_m, got_v = (t.cpu().float() for t in got)
    if not torch.allclose(got_p, want_p, rtol=1e-5, atol=1e-6):
        return "moved the weights otherwise than the foreach form"
    for got_x, want_x in ((got_m, want_m), (got_v, want_v)):
        if not ((got_x - want_x).abs() <= want_x.abs() * 2 ** -7 + 1e-30).all():  # one bf16 step at most
            return "rounded the moments off their bf16 neighbours"
    return ""
