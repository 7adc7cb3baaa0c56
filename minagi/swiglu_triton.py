"""Triton kernels of the gated SwiGLU (minagi/swiglu.py says when they run).

Shapes: h [R, 2F] contiguous (gate half, then up half), gate [R], act and grad_act [R, F].
Math in fp32, results stored in the inputs' dtype. Offsets in int64: R * 2F passes 2^31 at
~1M rows of width 1024.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _forward_kernel(h_ptr, gate_ptr, act_ptr, R, F: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    # One [BLOCK_R, BLOCK_F] tile of act per program.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < R)[:, None] & (cols < F)[None, :]
    h_row = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
    a = tl.load(h_row, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h_row + F, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)
    act = a * tl.sigmoid(a) * b * g[:, None]
    tl.store(act_ptr + rows[:, None] * F + cols[None, :], act.to(act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(h_ptr, gate_ptr, grad_act_ptr, grad_h_ptr, grad_gate_ptr, R, F: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    # BLOCK_R whole rows per program: the gate's gradient (a sum over the row) is finished here,
    # with no second pass and no atomics.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    row_ok = rows < R
    g = tl.load(gate_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    grad_g = tl.zeros([BLOCK_R], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        h_row = h_ptr + rows[:, None] * (2 * F) + cols[None, :]
        a = tl.load(h_row, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(h_row + F, mask=mask, other=0.0).to(tl.float32)
        grad_act = tl.load(grad_act_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(a)
        silu = a * sig
        grad_g += tl.sum(silu * b * grad_act, axis=1)
        grad_gated = grad_act * g[:, None]
        grad_a = grad_gated * b * sig * (1.0 + a * (1.0 - sig))   # d silu(a) / da = sig * (1 + a (1 - sig))
        grad_b = grad_gated * silu
        out_row = grad_h_ptr + rows[:, None] * (2 * F) + cols[None, :]
        tl.store(out_row, grad_a.to(grad_h_ptr.dtype.element_ty), mask=mask)
        tl.store(out_row + F, grad_b.to(grad_h_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_gate_ptr + rows, grad_g.to(grad_gate_ptr.dtype.element_ty), mask=row_ok)


def _block_f(width: int) -> int:
    return min(triton.next_power_of_2(width), 256)


def _on(t: Tensor):
    """Launch on t's GPU, not on the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def forward(h_RF2: Tensor, gate_R: Tensor) -> Tensor:
    rows, width = h_RF2.shape[0], h_RF2.shape[1] // 2
    act_RF = h_RF2.new_empty(rows, width)
    if rows == 0:
        return act_RF
    block_r, block_f = 8, _block_f(width)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(width, block_f))
    with _on(h_RF2):
        _forward_kernel[grid](h_RF2, gate_R, act_RF, rows, width, BLOCK_R=block_r, BLOCK_F=block_f)
    return act_RF


def backward(h_RF2: Tensor, gate_R: Tensor, grad_RF: Tensor) -> tuple[Tensor, Tensor]:
    rows, width = h_RF2.shape[0], h_RF2.shape[1] // 2
    grad_h = torch.empty_like(h_RF2)
    grad_gate = torch.empty_like(gate_R)
    if rows == 0:
        return grad_h, grad_gate
    block_r = 4
    with _on(h_RF2):
        _backward_kernel[(triton.cdiv(rows, block_r),)](h_RF2, gate_R, grad_RF, grad_h, grad_gate, rows, width,
                                                        BLOCK_R=block_r, BLOCK_F=_block_f(width))
    return grad_h, grad_gate
