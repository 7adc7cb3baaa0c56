"""The one-character step's math as functions of tensors: what `decode.Decoder` runs eagerly, captures
in a CUDA graph and, with `compiled`, hands to torch.compile. Every weight is an argument, never a
module, so one compiled piece serves every row without a recompile (dynamo guards on a module's
identity; on a tensor argument's shape, dtype and strides, which every row shares).

Shape legend: B streams, D model width, H heads, Dh head width, E experts, K top_k, S = B*K routed
rows, F expert width, V vocabulary.

A row is `qkv_step` (norm, qkv, RoPE), the attention over the cache (decode.py: written in place,
so it stays outside any compiled piece: compiled, an in-place update of a graph input became a copy
of the whole cache, ../shared/REFERENCE.md §9), then `tail_step` (projection, residual, norm, MLP,
residual). Each computes what the model's own modules compute, in the same order and dtypes.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .dense import dense_swiglu
from .dispatch import make_plan, run_native
from .pool import compute_dtype
from .router import chosen_gates, choose_experts
from .swiglu import swiglu_eager

__all__ = ["MLPWeights", "head_step", "mlp_step", "qkv_step", "rope_step", "route_step", "tail_step"]


class MLPWeights(NamedTuple):
    """A row's MLP for the step. kind: `gathered` (each routed row's top_k experts gathered, as
    gpt-fast's mixtral-moe), `grouped` (torch's grouped GEMM on the whole stacks: an expert read once
    however many streams chose it), `dense`, or `stack` (gathered through the expert-weights seam:
    frozen stacks dequantize just the chosen experts). tensors: router [E, D], its selection bias
    [E] or None, then the stacks gate_up [E, D, 2F], down [E, F, D] (`dense`: [D, 2H], [H, D]; `stack`:
    the router's two only)."""
    kind: str
    tensors: tuple
    top_k: int = 0
    fused: bool = False  # the grouped path's SwiGLU may use the Triton kernels
    stack: object = None  # `stack`: its `weights(dtype, experts=ids)`


def rope_step(x: Tensor, cos_d: Tensor, sin_d: Tensor) -> Tensor:
    """model.apply_rope's rotation, bit for bit, in fewer kernels: x cos + roll(x) sin, with tables
    cos_d = [cos, cos] and sin_d = [-sin, sin] ([..., Dh], broadcast against x [..., Dh])."""
    x_f = x.float()
    return (x_f * cos_d + x_f.roll(x.shape[-1] // 2, -1) * sin_d).to(x.dtype)


def route_step(x_BD: Tensor, router_ED: Tensor, bias_E: Tensor | None, top_k: int) -> tuple[Tensor, Tensor]:
    """(expert ids [B, K], gates [B, K] fp32): `router.Router`'s choice, in fp32 as there, from
    tensors (the router's own functions, without its replay memo)."""
    with torch.autocast(x_BD.device.type, enabled=False):
        probs_BE = F.linear(x_BD.float(), router_ED.float()).softmax(-1)
        ids_BK = choose_experts(probs_BE, bias_E, top_k)
        return ids_BK, chosen_gates(probs_BE, ids_BK)


def mlp_step(x_BD: Tensor, mlp: MLPWeights) -> Tensor:
    """[B, D] -> [B, D] in the compute dtype. (The residual add promotes it: the same bits as casting first.)"""
    dtype = compute_dtype(x_BD)
    if mlp.kind == "dense":
        return dense_swiglu(x_BD.to(dtype), *mlp.tensors)
    router_ED, bias_E = mlp.tensors[:2]
    ids_BK, gates_BK = route_step(x_BD, router_ED, bias_E, mlp.top_k)
    if mlp.kind == "grouped":
        gate_up_EDF2, down_EFD = mlp.tensors[2:]
        plan = make_plan(ids_BK, gate_up_EDF2.shape[0])
        return run_native(x_BD.to(dtype), gates_BK.to(dtype), gate_up_EDF2, down_EFD, plan, {}, fused=mlp.fused)
    ids_S = ids_BK.reshape(-1)
    if mlp.kind == "stack":
        gate_up_SDF2, down_SFD = mlp.stack.weights(dtype, experts=ids_S)
    else:
        gate_up_SDF2 = mlp.tensors[2].index_select(0, ids_S).to(dtype)
        down_SFD = mlp.tensors[3].index_select(0, ids_S).to(dtype)
    B, D = x_BD.shape
    K = mlp.top_k
    x_S1D = x_BD.to(dtype)[:, None, :].expand(B, K, D).reshape(B * K, 1, D)
    act_S1F = swiglu_eager(torch.bmm(x_S1D, gate_up_SDF2), gates_BK.to(dtype).reshape(B * K, 1))
    return torch.bmm(act_S1F, down_SFD).view(B, K, D).sum(1)  # the K outputs in routing order, as combine


def qkv_step(x_BD: Tensor, norm_D: Tensor, eps: float | None, w_qkv: Tensor, cos_B11d: Tensor, sin_B11d: Tensor,
             n_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's inputs for one position a stream: q, k (rotated), v, each [B, H, Dh]."""
    B, D = x_BD.shape
    qkv_B3Hd = F.linear(F.rms_norm(x_BD, (D,), norm_D, eps), w_qkv).view(B, 3, n_heads, -1)
    qk_B2Hd = rope_step(qkv_B3Hd[:, :2], cos_B11d, sin_B11d)  # q and k rotated together
    return qk_B2Hd[:, 0], qk_B2Hd[:, 1], qkv_B3Hd[:, 2]


def tail_step(x_BD: Tensor, y_BHd: Tensor, w_proj: Tensor, norm_D: Tensor, eps: float | None,
              mlp: MLPWeights) -> Tensor:
    """The row after attention: x + proj(y), then + MLP(norm(x)). [B, D] -> [B, D]."""
    B, D = x_BD.shape
    x_BD = x_BD + F.linear(y_BHd.reshape(B, -1), w_proj)
    return x_BD + mlp_step(F.rms_norm(x_BD, (D,), norm_D, eps), mlp)


def head_step(x_BD: Tensor, norm_D: Tensor, eps: float | None, w_head: Tensor) -> Tensor:
    """fp32 logits [B, V]."""
    return F.linear(F.rms_norm(x_BD, (x_BD.shape[-1],), norm_D, eps), w_head).float()
