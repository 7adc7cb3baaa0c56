"""minagi's own grouped GEMM in Triton: the packed path (dispatch "triton") where torch's is not fast.

torch's grouped GEMM has a fused kernel on sm90+ only. Below that (A100, RTX 30/40) torch copies the
offsets to the host and runs one GEMM per expert (a host sync a call), and inductor's Triton template
for it is gated off there (pytorch#186620, pytorch#191718). minagi's bucketed path took those cards:
a layout made on the host, a sync per row, shapes that change every step, nothing torch.compile or a
CUDA graph can hold. These kernels take the native path's packed rows and device offsets as they are:
no padding, no host sync, the same shapes every call, so a whole step compiles and is captured.

Shapes: x [R, I], rows packed by expert (expert e's rows are offs[e-1]:offs[e], offs int32 [E],
offs[-1] = R), w [E, I, O] (any strides: the input gradient passes W transposed), y [R, O], the
weight gradient [E, I, O]. Products accumulate in fp32; results are stored in x's dtype.

  rows kernel    y = x_e W_e: one [BLOCK_M, BLOCK_N] tile of one expert's rows per program. Each
                 program finds its tile from offs on the device (every expert's rows cut into BLOCK_M
                 tiles, in order), so the grid is a fixed cdiv(R, BLOCK_M) + E row tiles, the last
                 ones idle: at most one partly filled tile per expert, never padding copied.
  weight kernel  dW_e = x_e^T dy_e: one [BLOCK_I, BLOCK_O] tile of one expert per program, looping
                 over that expert's rows; an expert without rows gets zeros.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["grouped_mm", "weight_grad"]


@triton.jit
def _tile_of(offs_ptr, E, tile, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, one past the expert's last row, row tiles in all) of row tile `tile`."""
    e = tl.arange(0, E_POW2)
    inside = e < E
    ends = tl.load(offs_ptr + e, mask=inside, other=0)
    starts = tl.load(offs_ptr + e - 1, mask=inside & (e > 0), other=0)
    tiles = tl.where(inside, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    past = tl.cumsum(tiles, 0)                        # one past each expert's last tile
    expert = tl.sum((past <= tile).to(tl.int32), 0)
    pick = e == expert
    first_tile = tl.sum(tl.where(pick, past - tiles, 0), 0)
    row0 = tl.sum(tl.where(pick, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(pick, ends, 0), 0)
    return expert, row0, row_end, tl.sum(tiles, 0)


@triton.jit
def _rows_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, E, I: tl.constexpr, O: tl.constexpr,
                 stride_xr, stride_xi, stride_we, stride_wi, stride_wo, stride_yr, stride_yo,
                 E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n_col_tiles = tl.cdiv(O, BLOCK_N)
    tile = tl.program_id(0) // n_col_tiles  # the column tiles of one row tile run side by side: x's tile is shared
    col_tile = tl.program_id(0) % n_col_tiles
    expert, row0, row_end, n_tiles = _tile_of(offs_ptr, E, tile, E_POW2, BLOCK_M)
    if tile < n_tiles:
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < row_end, cols < O
        x_rows = x_ptr + rows[:, None] * stride_xr
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wo
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < I
            a = tl.load(x_rows + ks[None, :] * stride_xi, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_cols + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        tl.store(y_ptr + rows[:, None] * stride_yr + cols[None, :] * stride_yo, acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weight_kernel(x_ptr, g_ptr, dw_ptr, offs_ptr, I: tl.constexpr, O: tl.constexpr,
                   stride_xr, stride_xi, stride_gr, stride_go, stride_we, stride_wi, stride_wo,
                   BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    n_o_tiles = tl.cdiv(O, BLOCK_O)
    i_tile = tl.program_id(0) // n_o_tiles
    o_tile = tl.program_id(0) % n_o_tiles
    expert = tl.program_id(1)
    end = tl.load(offs_ptr + expert)
    start = tl.load(offs_ptr + expert - 1, mask=expert > 0, other=0)
    i_s = i_tile * BLOCK_I + tl.arange(0, BLOCK_I)
    o_s = o_tile * BLOCK_O + tl.arange(0, BLOCK_O)
    i_ok, o_ok = i_s < I, o_s < O
    acc = tl.zeros((BLOCK_I, BLOCK_O), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        ok = rows < end
        a = tl.load(x_ptr + rows[None, :] * stride_xr + i_s[:, None] * stride_xi,
                    mask=i_ok[:, None] & ok[None, :], other=0.0)   # x_e^T tile [BLOCK_I, BLOCK_R]
        b = tl.load(g_ptr + rows[:, None] * stride_gr + o_s[None, :] * stride_go,
                    mask=ok[:, None] & o_ok[None, :], other=0.0)   # dy_e tile [BLOCK_R, BLOCK_O]
        acc = tl.dot(a, b, acc)
    out = dw_ptr + expert.to(tl.int64) * stride_we + i_s[:, None] * stride_wi + o_s[None, :] * stride_wo
    tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=i_ok[:, None] & o_ok[None, :])


@functools.cache
def _stages(device_index: int) -> int:
    """Pipeline stages the device's shared memory holds, 32 KiB of tiles a stage: 3 (96 KiB) where a
    block may take 128 KiB or more (A100, H100), else 2 (RTX 30/40: ~100 KiB)."""
    props = torch.cuda.get_device_properties(device_index)
    optin = getattr(props, "shared_memory_per_block_optin", 0)
    return 3 if optin >= 128 * 1024 else 2


# Tile sizes: (BLOCK_M or BLOCK_I, BLOCK_N or BLOCK_O, BLOCK_K or BLOCK_R) and warps; docs/benchmarks.md
# section 23 has the H200 sweep they were chosen from.
ROWS_TILES = (128, 128, 64)
WEIGHT_TILES = (128, 128, 64)
WARPS = 8


def _launch_options(t: Tensor) -> dict:
    return {"num_warps": WARPS, "num_stages": _stages(t.device.index)} if t.is_cuda else {}


def _check(x_RI: Tensor, other: Tensor, offs_E: Tensor, what: str) -> None:
    """Ranks and dtypes the kernels assume (they read memory by the shapes: a mismatch would read out of
    bounds, not fail). `what`: the second operand, "w" [E, I, O] or "the output gradient" [R, O]."""
    dims = 3 if what == "w" else 2
    torch._check(x_RI.dim() == 2 and other.dim() == dims, lambda: f"grouped_mm: x must be [R, I] and {what} "
                 f"{dims}-D; got {tuple(x_RI.shape)} and {tuple(other.shape)}")
    torch._check(x_RI.dtype == other.dtype and x_RI.dtype in (torch.bfloat16, torch.float16),
                 lambda: f"grouped_mm: x and {what} must both be bf16 or fp16; got {x_RI.dtype} and {other.dtype}")
    torch._check(offs_E.dim() == 1 and offs_E.dtype == torch.int32,
                 lambda: f"grouped_mm: offsets must be int32 [E]; got {offs_E.dtype} {tuple(offs_E.shape)}")


def _rows(x_RI: Tensor, w_EIO: Tensor, offs_E: Tensor) -> Tensor:
    _check(x_RI, w_EIO, offs_E, "w")
    R, I = x_RI.shape
    E, I_w, O = w_EIO.shape
    torch._check(I_w == I and offs_E.shape[0] == E, lambda: f"grouped_mm: x {tuple(x_RI.shape)}, w {tuple(w_EIO.shape)} "
                 f"and offsets [{offs_E.shape[0]}] do not fit: x [R, I], w [E, I, O], offsets [E]")
    y_RO = x_RI.new_empty(R, O)
    # Few rows an expert (small cards' batches): half-height tiles waste less of each expert's last one.
    block_m, block_n, block_k = ROWS_TILES
    block_m = min(block_m, 64) if R < 128 * E else block_m
    grid = ((triton.cdiv(R, block_m) + E) * triton.cdiv(O, block_n),)
    with _on(x_RI):
        _rows_kernel[grid](x_RI, w_EIO, y_RO, offs_E, E, I, O, *x_RI.stride(), *w_EIO.stride(), *y_RO.stride(),
                           E_POW2=triton.next_power_of_2(E), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           **_launch_options(x_RI))
    return y_RO


def _weights(x_RI: Tensor, grad_RO: Tensor, offs_E: Tensor, n_experts: int) -> Tensor:
    _check(x_RI, grad_RO, offs_E, "the output gradient")
    (R, I), O = x_RI.shape, grad_RO.shape[1]
    torch._check(grad_RO.shape[0] == R and offs_E.shape[0] == n_experts, lambda: f"grouped_mm's weight gradient: x "
                 f"{tuple(x_RI.shape)}, the output gradient {tuple(grad_RO.shape)} and offsets [{offs_E.shape[0]}] do "
                 f"not fit {n_experts} experts")
    dw_EIO = x_RI.new_empty(n_experts, I, O)
    block_i, block_o, block_r = WEIGHT_TILES
    grid = (triton.cdiv(I, block_i) * triton.cdiv(O, block_o), n_experts)
    with _on(x_RI):
        _weight_kernel[grid](x_RI, grad_RO, dw_EIO, offs_E, I, O, *x_RI.stride(), *grad_RO.stride(), *dw_EIO.stride(),
                             BLOCK_I=block_i, BLOCK_O=block_o, BLOCK_R=block_r, **_launch_options(x_RI))
    return dw_EIO


def _on(t: Tensor):
    """Triton launches on the current device: make it the tensor's (a probe of cuda:1, a tool's device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# Custom ops, so torch.compile traces through the launches (as ops with fakes and an autograd formula)
# and a whole step that holds them compiles and is captured as a CUDA graph.

@torch.library.custom_op("minagi::grouped_mm", mutates_args=())
def grouped_mm(x_RI: Tensor, w_EIO: Tensor, offs_E: Tensor) -> Tensor:
    """Rows of expert e (offs_E[e-1]:offs_E[e]) times w_EIO[e], packed: [R, I] -> [R, O]."""
    return _rows(x_RI, w_EIO, offs_E)


@grouped_mm.register_fake
def _(x_RI: Tensor, w_EIO: Tensor, offs_E: Tensor) -> Tensor:
    _check(x_RI, w_EIO, offs_E, "w")
    return x_RI.new_empty(x_RI.shape[0], w_EIO.shape[2])


@torch.library.custom_op("minagi::grouped_mm_weight_grad", mutates_args=())
def weight_grad(x_RI: Tensor, grad_RO: Tensor, offs_E: Tensor, n_experts: int) -> Tensor:
    """x_e^T dy_e for each expert e: [E, I, O] (zeros for an expert without rows)."""
    return _weights(x_RI, grad_RO, offs_E, n_experts)


@weight_grad.register_fake
def _(x_RI: Tensor, grad_RO: Tensor, offs_E: Tensor, n_experts: int) -> Tensor:
    _check(x_RI, grad_RO, offs_E, "the output gradient")
    return x_RI.new_empty(n_experts, x_RI.shape[1], grad_RO.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x_RI, w_EIO, offs_E = inputs
    ctx.save_for_backward(x_RI, w_EIO, offs_E)


def _backward(ctx, grad_RO: Tensor):
    x_RI, w_EIO, offs_E = ctx.saved_tensors
    grad_x = grouped_mm(grad_RO, w_EIO.transpose(1, 2), offs_E) if ctx.needs_input_grad[0] else None
    grad_w = weight_grad(x_RI, grad_RO, offs_E, w_EIO.shape[0]) if ctx.needs_input_grad[1] else None
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
