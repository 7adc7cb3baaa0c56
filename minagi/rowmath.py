"""A row's math as functions of tensors, written once: what `model.Row.forward` computes (training,
evaluation, the uncached reference) and what `decode.Decoder` computes (its one-character step and
its prefill, through the pieces of minagi/decode_step.py).

Shape legend: B sequences (streams), T positions, D model width, H heads, Dh head width, V vocabulary,
W cache window, N = B*T characters.

A row is `attention_inputs` (norm, qkv, the heads), RoPE on q and k, the attention, then
`attention_residual` (projection, residual), `mlp_input` (norm), the row's MLP and `mlp_residual`
(residual); the model ends with `head` (final norm, head). The model passes its modules' weights; the decoder passes its own
copies (bf16 on CUDA) and writes each row's keys and values into its cache between the RoPE and the
attention (in place, so outside any compiled piece). Every weight is an argument, never a module:
one compiled piece serves every row without a recompile (dynamo guards on a module's identity; on a
tensor argument's shape, dtype and strides, which every row shares).

RoPE is written twice, bit for bit the same rotation eagerly, forward and backward: `apply_rope`, the
readable one (first half, second half; the tests' reference) and `rope_rolled`, the one the model and
the decoder run (q and k in one go: 9 kernels a row where the two rotations apart took 18 in bf16, and
about 8 fewer in backward; an eager step on a GPU waits on its launches, docs/benchmarks.md §29).

`products` (the decoder's compiled step of few streams, decode_step.py): a matrix-vector product
written as products and a sum (`linear`), the attention as `attend_products`. Eagerly that would
materialise every product; compiled, inductor makes each one reduction kernel that reads its weights
once and fuses what feeds it and what follows (docs/benchmarks.md §11). The same math up to the
order of fp32 sums; the model never uses it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .mlp import compute_dtype

__all__ = ["apply_rope", "attend_products", "attention_inputs", "attention_residual", "causal_attention", "head",
           "linear", "mlp_input", "mlp_residual", "product_sums", "rolled_tables", "rope_rolled", "rope_tables", "window_attention"]


# ------------------------------------------------------------------------------ RoPE

def rope_tables(positions_T: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin [T, Dh/2] of `positions_T`, fp32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=positions_T.device, dtype=torch.float32) / head_dim)
    angles_Td = torch.outer(positions_T.float(), inv_freq)  # [T, Dh/2]
    return angles_Td.cos(), angles_Td.sin()


def apply_rope(x_BHTd: Tensor, cos_Td: Tensor, sin_Td: Tensor) -> Tensor:
    """The rotation of q or k (first half, second half), in fp32, back to x's dtype: the readable form."""
    x1, x2 = x_BHTd.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos_Td - x2 * sin_Td, x1 * sin_Td + x2 * cos_Td), dim=-1)
    return rotated.to(x_BHTd.dtype)


def rolled_tables(cos_Td: Tensor, sin_Td: Tensor) -> tuple[Tensor, Tensor]:
    """`rope_rolled`'s tables [T, Dh] from `rope_tables`': [cos, cos] and [-sin, sin]."""
    return torch.cat([cos_Td, cos_Td], -1), torch.cat([-sin_Td, sin_Td], -1)


def rope_rolled(x: Tensor, cos_d: Tensor, sin_d: Tensor) -> Tensor:
    """`apply_rope`'s rotation, bit for bit, in fewer kernels: x cos + roll(x) sin, with
    `rolled_tables` (broadcast against x [..., Dh]). q and k can go in together."""
    x_f = x.float()
    return (x_f * cos_d + x_f.roll(x.shape[-1] // 2, -1) * sin_d).to(x.dtype)


# ------------------------------------------------------------------------------ the row

def linear(x_BI: Tensor, w_OI: Tensor, products: bool = False) -> Tensor:
    """F.linear [..., I] x [O, I] -> [..., O] in the compute dtype; with `products`, as products
    summed in fp32 (one reduction kernel compiled; it reads the weight once per row, so for few rows)."""
    if not products:
        return F.linear(x_BI, w_OI)
    dtype = compute_dtype(x_BI)  # both operands rounded to it, as autocast rounds F.linear's
    return product_sums(x_BI.to(dtype), w_OI.to(dtype)).to(dtype)


def product_sums(x_BI: Tensor, w_OI: Tensor) -> Tensor:
    """x w^T [..., O] as fp32 products summed: mul and sum, which autocast leaves in fp32, so it needs
    no autocast region (one inside a compiled graph keeps AOTAutograd's cache from serving it)."""
    return (x_BI[..., None, :].float() * w_OI.float()).sum(-1)


def attention_inputs(x_BTD: Tensor, norm_D: Tensor, eps: float | None, w_qkv: Tensor, n_heads: int,
                     products: bool = False) -> tuple[Tensor, Tensor]:
    """The attention's inputs before RoPE: norm, qkv, the heads. (q and k [2, B, H, T, Dh], v [B, H, T, Dh]),
    views. q and k apart from v, split off qkv's columns: RoPE rotates them in one go, and the backward
    joins the two gradients with one cat (a slice or select of one [3, ...] view would add zeros and copies)."""
    B, T, D = x_BTD.shape
    qk_BT2D, v_BTD = linear(F.rms_norm(x_BTD, (D,), norm_D, eps), w_qkv, products).split([2 * D, D], -1)
    return qk_BT2D.view(B, T, 2, n_heads, -1).permute(2, 0, 3, 1, 4), v_BTD.view(B, T, n_heads, -1).transpose(1, 2)


def causal_attention(q_BHTd: Tensor, k_BHTd: Tensor, v_BHTd: Tensor, dropout_p: float = 0.0) -> Tensor:
    """Each of T positions attends to itself and those before it: [B, H, T, Dh]."""
    return F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, is_causal=True, dropout_p=dropout_p)


def window_attention(q_BH1d: Tensor, k_BHWd: Tensor, v_BHWd: Tensor, mask_B11W: Tensor) -> Tensor:
    """One query a stream over a window of cached keys, `mask_B11W` additive (0 or -inf): [B, H, 1, Dh]."""
    return F.scaled_dot_product_attention(q_BH1d, k_BHWd, v_BHWd, attn_mask=mask_B11W)


def attend_products(q_BH1d: Tensor, k_BHWd: Tensor, v_BHWd: Tensor, mask_B11W: Tensor) -> Tensor:
    """`window_attention` as products and sums in fp32 (`products`): [B, H, 1, Dh]."""
    scores_BHW = (q_BH1d.float() * k_BHWd.float()).sum(-1) * q_BH1d.shape[-1] ** -0.5
    p_BHW = (scores_BHW + mask_B11W[:, :, 0, :]).softmax(-1)
    return (p_BHW[..., None] * v_BHWd.float()).sum(2, keepdim=True).to(q_BH1d.dtype)


def attention_residual(x_BTD: Tensor, y_BHTd: Tensor, w_proj: Tensor, products: bool = False,
                       drop: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """x + proj(the heads merged): [B, T, D]. `drop`: the residual dropout (training)."""
    B, T, D = x_BTD.shape
    out_BTD = linear(y_BHTd.transpose(1, 2).reshape(B, T, D), w_proj, products)
    return x_BTD + (out_BTD if drop is None else drop(out_BTD))


def mlp_input(x_BTD: Tensor, norm_D: Tensor, eps: float | None) -> Tensor:
    """The MLP's input: norm(x), one row per character. [B, T, D] -> [N, D]."""
    B, T, D = x_BTD.shape
    return F.rms_norm(x_BTD, (D,), norm_D, eps).reshape(B * T, D)


def mlp_residual(x_BTD: Tensor, y_ND: Tensor, drop: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """x + the MLP's output: [B, T, D]. The add promotes y to x's dtype: the same bits as casting first.
    (The caller runs the MLP between `mlp_input` and this, from its own frame: a graph break inside
    the pool's forward then splits a compiled model where it always did.)"""
    y_BTD = y_ND.view(x_BTD.shape)
    return x_BTD + (y_BTD if drop is None else drop(y_BTD.to(x_BTD.dtype)))  # dropout scales in x's dtype


def head(x_BTD: Tensor, norm_D: Tensor, eps: float | None, w_head: Tensor, products: bool = False) -> Tensor:
    """Logits [B, T, V] in the compute dtype: final norm, head."""
    return linear(F.rms_norm(x_BTD, (x_BTD.shape[-1],), norm_D, eps), w_head, products)
