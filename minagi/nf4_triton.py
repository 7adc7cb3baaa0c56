"""Triton NF4 dequantization, bitwise equal to minagi/nf4.py's reference (which says when it runs).

Shapes: packed [rows, row_bytes] uint8 (one row for a whole tensor, E for a stack of experts);
absmax [rows or K, row_blocks] fp32; index [K] (optional: experts to read) -> out [K or rows, n_out].
A program covers SEGS segments of SEG bytes of one output row, SEG = min(B/2, tile): a segment never
crosses a block, so each loads one absmax and broadcasts it. Bytes are read 16 to a thread, split into
nibbles, looked up in the 16-entry table (it stays in L1), scaled in fp32 and stored interleaved
(element 2i from the high nibble). Offsets in int64: a stack passes 2^31 elements.
CPU tensors mean Triton's interpreter (TRITON_INTERPRET=1, the tests): its fp32 -> bf16 cast
truncates, so there the kernel rounds to nearest even by hand, as the GPU's cast does.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE_BYTES = 2048  # bytes per program: 16 per thread at 4 warps
NUM_WARPS = 4
MAX_ROWS = 65535   # CUDA's limit on the grid's second dimension


@triton.jit
def _dequant_kernel(packed_ptr, absmax_ptr, table_ptr, index_ptr, out_ptr, row_bytes, row_blocks, n_out,
                    HALF_BLOCK: tl.constexpr, SEG: tl.constexpr, SEGS: tl.constexpr,
                    HAS_INDEX: tl.constexpr, ABSMAX_BY_INDEX: tl.constexpr, ROUND_BY_HAND: tl.constexpr):
    k = tl.program_id(1).to(tl.int64)  # the output row
    if HAS_INDEX:
        src = tl.load(index_ptr + k).to(tl.int64)  # the stored row (expert) it reads
    else:
        src = k
    if ABSMAX_BY_INDEX:
        absmax_row = src
    else:
        absmax_row = k
    seg = tl.program_id(0).to(tl.int64) * SEGS + tl.arange(0, SEGS)  # [SEGS] segments of the row
    byte = seg[:, None] * SEG + tl.arange(0, SEG)[None, :]  # [SEGS, SEG]
    bits = tl.load(packed_ptr + src * row_bytes + byte, mask=byte < row_bytes, other=0)
    scale = tl.load(absmax_ptr + absmax_row * row_blocks + (seg * SEG) // HALF_BLOCK,
                    mask=seg * SEG < row_bytes, other=0.0)[:, None]
    high = tl.load(table_ptr + (bits >> 4).to(tl.int32)) * scale  # fp32 products, no add to fuse
    low = tl.load(table_ptr + (bits & 15).to(tl.int32)) * scale
    values = tl.interleave(high, low)  # [SEGS, 2 SEG]
    if ROUND_BY_HAND:  # the interpreter truncates fp32 -> bf16; GPUs round to nearest even, as here
        bits32 = values.to(tl.uint32, bitcast=True)
        rounded = ((bits32 + 0x7FFF + ((bits32 >> 16) & 1)) >> 16).to(tl.uint16)
        values = rounded.to(tl.bfloat16, bitcast=True)
    col = seg[:, None] * (2 * SEG) + tl.arange(0, 2 * SEG)[None, :]  # an arange: stores stay vectorised
    tl.store(out_ptr + k * n_out + col, values.to(out_ptr.dtype.element_ty), mask=col < n_out)


def _on(t: Tensor):
    """Launch on t's GPU, not on the current one (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def dequantize(packed: Tensor, absmax: Tensor, table: Tensor, blocksize: int, n_out: int, dtype: torch.dtype,
               index: Tensor | None = None, absmax_by_index: bool = False) -> Tensor:
    """packed [rows, row_bytes], absmax [., row_blocks], table fp32 [16] -> [K or rows, n_out] in dtype.

    With `index`, output row k reads packed row index[k], and absmax row index[k] if
    `absmax_by_index`, else row k (an absmax already gathered for the chosen experts).
    TILE_BYTES and NUM_WARPS are read at each call (tools/bench_nf4.py --tiles sets them).
    """
    tile_bytes, num_warps = TILE_BYTES, NUM_WARPS
    rows_out = packed.shape[0] if index is None else index.numel()
    if rows_out > MAX_ROWS:
        raise ValueError(f"index: at most {MAX_ROWS} rows per call; got {rows_out}")
    out = torch.empty(rows_out, n_out, dtype=dtype, device=packed.device)
    if out.numel() == 0:
        return out
    row_bytes = packed.shape[1]
    seg = min(blocksize // 2, tile_bytes)
    segs = tile_bytes // seg
    grid = (triton.cdiv(row_bytes, seg * segs), rows_out)
    with _on(packed):
        _dequant_kernel[grid](packed, absmax, table, packed if index is None else index, out,
                              row_bytes, absmax.shape[1], n_out, HALF_BLOCK=blocksize // 2, SEG=seg, SEGS=segs,
                              HAS_INDEX=index is not None, ABSMAX_BY_INDEX=absmax_by_index,
                              ROUND_BY_HAND=dtype == torch.bfloat16 and packed.device.type == "cpu",
                              num_warps=num_warps)
    return out
