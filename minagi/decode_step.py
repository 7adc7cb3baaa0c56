"""The one-character step's math as functions of tensors: what `decode.Decoder` runs eagerly, captures
in a CUDA graph and, with `compiled`, hands to torch.compile. Every weight is an argument, never a
module, so one compiled piece serves every row without a recompile (dynamo guards on a module's
identity; on a tensor argument's shape, dtype and strides, which every row shares).

Shape legend: B streams, D model width, H heads, Dh head width, E experts, K top_k, S = B*K routed
rows, F expert width, V vocabulary.

A row is `qkv_step` (norm, qkv, RoPE), the cache write (decode.py: in place, so it stays outside any
compiled piece: compiled, an in-place update of a graph input became a copy of the whole cache,
../shared/REFERENCE.md §9), the attention over the cache (SDPA, or `attend_step`), then `tail_step`
(projection, residual, norm, MLP, residual). Each computes what the model's own modules compute, in
the same order and dtypes.

`products` (a compiled step of few streams): the matrix-vector products of qkv, projection, router
and head are written as products and a sum (`linear_step`), the gathered experts' too, the attention
as `attend_step`, the top-k as rounds of argmax (`top_k_by_rounds`); the dense twin's SwiGLU and the
grouped path keep their GEMMs. Eagerly that would materialise every product; compiled, inductor
makes each one reduction kernel that reads its weights once and fuses what feeds it and what
follows (the experts' gather, the router's softmax with the top-k), where the extern GEMV, sort and
SDPA kernels were ~2.6 µs each and many (docs/benchmarks.md §11). The same math up to the order of
fp32 sums.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .dense import dense_swiglu
from .dispatch import make_plan, run_native
from .mlp import compute_dtype
from .router import choose_experts, route  # noqa: F401  (choose_experts: the tests compare against it here)
from .swiglu import swiglu_eager

__all__ = ["MLPWeights", "attend_step", "head_step", "linear_step", "mlp_step", "qkv_step", "rope_step",
           "route_step", "tail_step", "top_k_by_rounds"]


class MLPWeights(NamedTuple):
    """A row's MLP for the step. kind: `gathered` (each routed row's top_k experts gathered, as
    gpt-fast's mixtral-moe), `grouped` (torch's grouped GEMM on the whole stacks: an expert read once
    however many streams chose it), `dense`, `stack` (gathered through the expert-weights seam:
    frozen stacks dequantize just the chosen experts), or `module` (the row's own MLP module, for a
    prefill's many positions where no other kind applies: its output alone). tensors: router [E, D], its selection bias
    [E] or None, then the stacks gate_up [E, D, 2F], down [E, F, D] (`dense`: [D, 2H], [H, D]; `stack`:
    the router's two only; `gathered` with `products`: the stacks transposed, [E, 2F, D] and [E, D, F],
    so that each product sums along contiguous memory)."""
    kind: str
    tensors: tuple
    top_k: int = 0
    fused: bool = False  # the grouped path's SwiGLU may use the Triton kernels
    stack: object = None  # `stack`: its `weights(dtype, experts=ids)`; `module`: the module
    products: bool = False  # the row's projection, router, top-k and gathered experts as sums (module docstring)
    in_place: bool = False  # `stack`, offloaded: read the chosen experts from their pinned homes


def linear_step(x_BI: Tensor, w_OI: Tensor, products: bool) -> Tensor:
    """F.linear [B, I] x [O, I] -> [B, O] in the compute dtype; with `products`, as products summed in
    fp32 (one reduction kernel compiled; it reads the weight once per row, so for few rows only)."""
    if not products:
        return F.linear(x_BI, w_OI)
    dtype = compute_dtype(x_BI)  # both operands rounded to it, as autocast rounds F.linear's
    return (x_BI.to(dtype)[..., None, :].float() * w_OI.to(dtype).float()).sum(-1).to(dtype)


def top_k_by_rounds(scores_NE: Tensor, k: int) -> Tensor:
    """The top k indices [N, K] in descending order, as `topk`, by k rounds of argmax: compiled, one
    fused reduction instead of a sort. Ties go to the lower index (topk promises no order there);
    -inf scores are clamped first, so a chosen expert (masked to -inf) is never chosen again."""
    experts_E = torch.arange(scores_NE.shape[-1], device=scores_NE.device)
    scores_NE = scores_NE.clamp(min=torch.finfo(scores_NE.dtype).min)  # NaN stays NaN: argmax's largest, as topk's
    ids = []
    for _ in range(k):
        ids.append(scores_NE.argmax(-1))
        scores_NE = scores_NE.masked_fill(experts_E == ids[-1][:, None], -math.inf)
    return torch.stack(ids, -1)


def attend_step(q_BHd: Tensor, k_BHWd: Tensor, v_BHWd: Tensor, mask_B11W: Tensor) -> Tensor:
    """SDPA of one query a stream over the window, as products and sums in fp32: [B, H, 1, Dh]."""
    scores_BHW = (q_BHd.float()[:, :, None, :] * k_BHWd.float()).sum(-1) * q_BHd.shape[-1] ** -0.5
    p_BHW = (scores_BHW + mask_B11W[:, :, 0, :]).softmax(-1)
    return (p_BHW[..., None] * v_BHWd.float()).sum(2, keepdim=True).to(q_BHd.dtype)


def rope_step(x: Tensor, cos_d: Tensor, sin_d: Tensor) -> Tensor:
    """model.apply_rope's rotation, bit for bit, in fewer kernels: x cos + roll(x) sin, with tables
    cos_d = [cos, cos] and sin_d = [-sin, sin] ([..., Dh], broadcast against x [..., Dh])."""
    x_f = x.float()
    return (x_f * cos_d + x_f.roll(x.shape[-1] // 2, -1) * sin_d).to(x.dtype)


def route_step(x_BD: Tensor, router_ED: Tensor, bias_E: Tensor | None, top_k: int,
               products: bool = False, score: str = "softmax") -> tuple[Tensor, Tensor]:
    """(expert ids [B, K], gates [B, K] fp32): `router.Router`'s choice, in fp32 as there, from
    tensors (the router's own rule, `router.route`, without its replay memo). `score`: the pool's
    `router_score`."""
    with torch.autocast(x_BD.device.type, enabled=False):
        logits_BE = linear_step(x_BD.float(), router_ED.float(), products)
        ids_BK, gates_BK, _ = route(logits_BE, score, bias_E, top_k, top_k_fn=top_k_by_rounds if products else None)
        return ids_BK, gates_BK


def mlp_step(x_BD: Tensor, mlp: MLPWeights) -> Tensor:
    """[B, D] -> [B, D] in the compute dtype. (The residual add promotes it: the same bits as casting first.)"""
    dtype = compute_dtype(x_BD)
    if mlp.kind == "module":
        return mlp.stack(x_BD, dropless=True, in_place=mlp.in_place)[0]
    if mlp.kind == "dense":
        return dense_swiglu(x_BD.to(dtype), *mlp.tensors)
    router_ED, bias_E = mlp.tensors[:2]
    ids_BK, gates_BK = route_step(x_BD, router_ED, bias_E, mlp.top_k, mlp.products)
    if mlp.kind == "grouped":
        gate_up_EDF2, down_EFD = mlp.tensors[2:]
        plan = make_plan(ids_BK, gate_up_EDF2.shape[0])
        return run_native(x_BD.to(dtype), gates_BK.to(dtype), gate_up_EDF2, down_EFD, plan, {}, fused=mlp.fused)
    if mlp.products and mlp.kind == "gathered":
        return gathered_products(x_BD.to(dtype), gates_BK.to(dtype), ids_BK, *mlp.tensors[2:])
    ids_S = ids_BK.reshape(-1)
    if mlp.kind == "stack":
        gate_up_SDF2, down_SFD = mlp.stack.weights(dtype, experts=ids_S, in_place=mlp.in_place)
    else:
        gate_up_SDF2 = mlp.tensors[2].index_select(0, ids_S).to(dtype)
        down_SFD = mlp.tensors[3].index_select(0, ids_S).to(dtype)
    B, D = x_BD.shape
    K = mlp.top_k
    x_S1D = x_BD.to(dtype)[:, None, :].expand(B, K, D).reshape(B * K, 1, D)
    act_S1F = swiglu_eager(torch.bmm(x_S1D, gate_up_SDF2), gates_BK.to(dtype).reshape(B * K, 1))
    return torch.bmm(act_S1F, down_SFD).view(B, K, D).sum(1)  # the K outputs in routing order, as combine


def gathered_products(x_BD: Tensor, gates_BK: Tensor, ids_BK: Tensor, gate_up_EF2D: Tensor,
                      down_EDF: Tensor) -> Tensor:
    """The gathered path as products and sums over the transposed stacks: each routed row's expert
    read where it lies (compiled, the gather is the reduction's own indexed load, no copy; the sums
    run along contiguous memory: the stacks' own layout made the down sum 5x slower). [B, D] -> [B, D]."""
    dtype = x_BD.dtype
    h_BKF2 = (x_BD[:, None, None, :].float() * gate_up_EF2D[ids_BK].float()).sum(-1).to(dtype)
    act_BKF = swiglu_eager(h_BKF2, gates_BK)
    y_BKD = (act_BKF[:, :, None, :].float() * down_EDF[ids_BK].float()).sum(-1).to(dtype)
    return y_BKD.sum(1)  # the K outputs in routing order, as combine


def qkv_step(x_BD: Tensor, norm_D: Tensor, eps: float | None, w_qkv: Tensor, cos_B11d: Tensor, sin_B11d: Tensor,
             n_heads: int, products: bool = False) -> tuple[Tensor, Tensor]:
    """The attention's inputs for one position a stream: q [B, H, Dh] and the rotated k with v,
    [B, 2, H, Dh] (one source for the cache write)."""
    B, D = x_BD.shape
    qkv_B3Hd = linear_step(F.rms_norm(x_BD, (D,), norm_D, eps), w_qkv, products).view(B, 3, n_heads, -1)
    qk_B2Hd = rope_step(qkv_B3Hd[:, :2], cos_B11d, sin_B11d)  # q and k rotated together
    return qk_B2Hd[:, 0], torch.stack([qk_B2Hd[:, 1], qkv_B3Hd[:, 2]], 1)


def tail_step(x_BD: Tensor, y_BHd: Tensor, w_proj: Tensor, norm_D: Tensor, eps: float | None,
              mlp: MLPWeights) -> Tensor:
    """The row after attention: x + proj(y), then + MLP(norm(x)). [B, D] -> [B, D]."""
    B, D = x_BD.shape
    x_BD = x_BD + linear_step(y_BHd.reshape(B, -1), w_proj, mlp.products)
    return x_BD + mlp_step(F.rms_norm(x_BD, (D,), norm_D, eps), mlp)


def head_step(x_BD: Tensor, norm_D: Tensor, eps: float | None, w_head: Tensor, products: bool = False) -> Tensor:
    """fp32 logits [B, V]."""
    return linear_step(F.rms_norm(x_BD, (x_BD.shape[-1],), norm_D, eps), w_head, products).float()
