"""The decoder's pieces (minagi/decode.py): a row's functions (minagi/rowmath.py) cut where the cache
write goes, and each MLP kind's step. What `decode.Decoder` runs eagerly, captures in a CUDA graph
and, with `compiled`, hands to torch.compile: every weight is an argument or a tensor held by a step
object, never a module, so one compiled piece serves every row without a recompile (dynamo guards
on a module's identity; on a step object's type and on its tensors' shapes, dtypes and strides,
which every row shares).

Shape legend: B streams, T positions, D model width, H heads, Dh head width, E experts, K top_k,
S = B*K routed rows, F expert width, V vocabulary, N characters.

A row is `qkv_step` (rowmath's norm, qkv and heads; RoPE on q and k at once), the cache write
(decode.py: in place, so it stays outside any compiled piece: compiled, an in-place update of a
graph input became a copy of the whole cache, ../shared/REFERENCE.md §9), the attention
(rowmath's `window_attention` or `attend_products`; a prefill's `causal_attention`), then `tail_step`
(projection, residual, norm, MLP, residual).

Each MLP kind makes its own step (`DenseMLP.decoder`, `PooledMLP.decoder`, from `dense_steps` and
`pooled_steps` here), all called alike, `step(x_ND) -> y_ND` in the compute dtype: `DenseStep` (its SwiGLU),
`GatheredStep` (each routed row's top_k experts gathered, as gpt-fast's mixtral-moe), `GroupedStep`
(torch's grouped GEMM on the whole stacks: an expert read once however many streams chose it),
`FrozenStep` (gathered through the expert-weights seam: a frozen stack dequantizes just the chosen
experts) and, for a prefill's many positions where no other kind applies, `PoolStep` (the pool's
own forward). Each MLP gives a step's form and a window's (the prefill's).

`products` (a compiled step of few streams): the matrix-vector products of qkv, projection, router
and head written as products and a sum (`rowmath.linear`), the gathered experts' too
(`gathered_products`), the attention as `rowmath.attend_products`, the top-k as rounds of argmax
(`top_k_by_rounds`); the dense twin's SwiGLU and the grouped path keep their GEMMs. Compiled,
inductor fuses the experts' gather, the router's softmax with the top-k, where the extern GEMV, sort
and SDPA kernels were ~2.6 µs each and many (docs/benchmarks.md §11). The same math up to the order
of fp32 sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import rowmath
from .dense import dense_swiglu
from .dispatch import PACKED, RUNNERS, make_plan
from .experts import ExpertStack
from .mlp import compute_dtype
from .router import choose_experts, route  # noqa: F401  (choose_experts: the tests compare against it here)
from .swiglu import swiglu_eager

__all__ = ["DenseStep", "FrozenStep", "GatheredStep", "GroupedStep", "PoolStep", "StepOptions", "auto_grouped",
           "dense_steps", "gathered_products", "head_step", "pooled_steps", "qkv_step", "route_step", "tail_step",
           "top_k_by_rounds"]


# ------------------------------------------------------------------------------ the row's pieces

def qkv_step(x_BTD: Tensor, norm_D: Tensor, eps: float | None, w_qkv: Tensor, cos_d: Tensor, sin_d: Tensor,
             n_heads: int, products: bool = False) -> tuple[Tensor, Tensor]:
    """q [B, H, T, Dh] rotated, and the rotated k with v, [B, 2, H, T, Dh] (one source for the cache
    write). cos_d, sin_d: `rowmath.rolled_tables`, broadcast against [B, H, T, Dh]."""
    qk_2BHTd, v_BHTd = rowmath.attention_inputs(x_BTD, norm_D, eps, w_qkv, n_heads, products)
    qk_2BHTd = rowmath.rope_rolled(qk_2BHTd, cos_d, sin_d)  # q and k rotated together
    return qk_2BHTd[0], torch.stack([qk_2BHTd[1], v_BHTd], 1)


def tail_step(x_BTD: Tensor, y_BHTd: Tensor, w_proj: Tensor, norm_D: Tensor, eps: float | None,
              mlp: Callable[[Tensor], Tensor], products: bool = False) -> Tensor:
    """The row after attention: x + proj(y), then + MLP(norm(x)), `mlp` a step of the row's MLP
    (below). [B, T, D] -> [B, T, D]."""
    x_BTD = rowmath.attention_residual(x_BTD, y_BHTd, w_proj, products)
    return rowmath.mlp_residual(x_BTD, mlp(rowmath.mlp_input(x_BTD, norm_D, eps)))


def head_step(x_BTD: Tensor, norm_D: Tensor, eps: float | None, w_head: Tensor, products: bool = False) -> Tensor:
    """fp32 logits [B, T, V]."""
    return rowmath.head(x_BTD, norm_D, eps, w_head, products).float()


# ------------------------------------------------------------------------------ routing

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


def route_step(x_ND: Tensor, router_ED: Tensor, bias_E: Tensor | None, top_k: int,
               products: bool = False, score: str = "softmax") -> tuple[Tensor, Tensor]:
    """(expert ids [N, K], gates [N, K] fp32): `router.Router`'s choice, in fp32 as there, from
    tensors (the router's own rule, `router.route`, without its replay memo). `score`: the pool's
    `router_score`."""
    if products:  # fp32 without an autocast region (rowmath.product_sums)
        logits_NE = rowmath.product_sums(x_ND.float(), router_ED.float())
    else:
        with torch.autocast(x_ND.device.type, enabled=False):
            logits_NE = F.linear(x_ND.float(), router_ED.float())
    ids_NK, gates_NK, _ = route(logits_NE, score, bias_E, top_k, top_k_fn=top_k_by_rounds if products else None)
    return ids_NK, gates_NK


def auto_grouped(pool, n_streams: int) -> bool:
    """Whether expert_path `auto` runs a resident pool grouped: where the pool itself runs a grouped
    GEMM (torch's or minagi's) and many streams choose each expert several times a step (there it was
    1.8x faster on the H200); at batch 1 its sort and plan cost more than gathering 4 experts."""
    return pool.path in PACKED and n_streams * pool.cfg.top_k >= 2 * pool.n_experts


# ------------------------------------------------------------------------------ the MLP steps

class DenseStep:
    """The dense twin's SwiGLU on gate_up [D, 2H], down [H, D]."""
    host_sync = False  # whether a call may read back from the device (a prefill that does is not captured)

    def __init__(self, gate_up_DH2: Tensor, down_HD: Tensor):
        self.gate_up_DH2, self.down_HD = gate_up_DH2, down_HD

    def __call__(self, x_ND: Tensor) -> Tensor:
        return dense_swiglu(x_ND.to(compute_dtype(x_ND)), self.gate_up_DH2, self.down_HD)


class _Routed:
    """A routed step's router [E, D], its selection bias [E] or None, top_k; `products`: the router
    as a sum and the top-k by rounds."""
    host_sync = False

    score = "softmax"  # the pool's router_score (set by `pooled_steps`)

    def __init__(self, router_ED: Tensor, bias_E: Tensor | None, top_k: int, products: bool):
        self.router_ED, self.bias_E, self.top_k, self.products = router_ED, bias_E, top_k, products

    def route(self, x_ND: Tensor) -> tuple[Tensor, Tensor]:
        return route_step(x_ND, self.router_ED, self.bias_E, self.top_k, self.products, self.score)


class SharedStep:
    """A routed step plus the pool's always-on shared experts (one SwiGLU: `PooledMLP.shared`)."""

    def __init__(self, routed, shared: DenseStep):
        self.routed, self.shared, self.host_sync = routed, shared, routed.host_sync

    def __call__(self, x_ND: Tensor) -> Tensor:
        return self.routed(x_ND) + self.shared(x_ND)


class GatheredStep(_Routed):
    """Each routed row's top_k experts gathered from resident stacks gate_up [E, D, 2F], down [E, F, D]
    (with `products`, the stacks transposed, [E, 2F, D] and [E, D, F], so that each product sums
    along contiguous memory), multiplied per routed row: no sort, no counts, no host sync."""

    def __init__(self, router_ED: Tensor, bias_E: Tensor | None, top_k: int, gate_up: Tensor, down: Tensor,
                 products: bool = False):
        super().__init__(router_ED, bias_E, top_k, products)
        self.gate_up, self.down = gate_up, down

    def __call__(self, x_ND: Tensor) -> Tensor:
        dtype = compute_dtype(x_ND)
        ids_NK, gates_NK = self.route(x_ND)
        if self.products:
            return gathered_products(x_ND.to(dtype), gates_NK.to(dtype), ids_NK, self.gate_up, self.down)
        ids_S = ids_NK.reshape(-1)
        gate_up_SDF2 = self.gate_up.index_select(0, ids_S).to(dtype)
        down_SFD = self.down.index_select(0, ids_S).to(dtype)
        return gathered_bmm(x_ND.to(dtype), gates_NK.to(dtype), gate_up_SDF2, down_SFD)


class FrozenStep(_Routed):
    """Gathered through the expert-weights seam: `stack.weights(dtype, experts=ids, in_place=...)`
    dequantizes just the chosen experts (`in_place`: offloaded, read from their pinned homes)."""

    def __init__(self, router_ED: Tensor, bias_E: Tensor | None, top_k: int, stack, in_place: bool = False,
                 products: bool = False):
        super().__init__(router_ED, bias_E, top_k, products)
        self.stack, self.in_place = stack, in_place

    def __call__(self, x_ND: Tensor) -> Tensor:
        dtype = compute_dtype(x_ND)
        ids_NK, gates_NK = self.route(x_ND)
        gate_up_SDF2, down_SFD = self.stack.weights(dtype, experts=ids_NK.reshape(-1), in_place=self.in_place)
        return gathered_bmm(x_ND.to(dtype), gates_NK.to(dtype), gate_up_SDF2, down_SFD)


class GroupedStep(_Routed):
    """The pool's own grouped-GEMM path (`path`: "native", torch's, or "triton", minagi's; dispatch.PACKED)
    on whole resident stacks gate_up [E, D, 2F], down [E, F, D]: sort and counts without a host sync.
    `kernels`: pool.swiglu (minagi/swiglu.py)."""

    def __init__(self, router_ED: Tensor, bias_E: Tensor | None, top_k: int, gate_up_EDF2: Tensor,
                 down_EFD: Tensor, kernels: str = "eager", products: bool = False, path: str = "native"):
        super().__init__(router_ED, bias_E, top_k, products)
        if path not in PACKED:
            raise ValueError(f"GroupedStep runs one of {', '.join(PACKED)}; got {path!r}")
        self.gate_up_EDF2, self.down_EFD, self.kernels, self.run = gate_up_EDF2, down_EFD, kernels, RUNNERS[path]

    def __call__(self, x_ND: Tensor) -> Tensor:
        dtype = compute_dtype(x_ND)
        ids_NK, gates_NK = self.route(x_ND)
        plan = make_plan(ids_NK, self.gate_up_EDF2.shape[0])
        return self.run(x_ND.to(dtype), gates_NK.to(dtype), self.gate_up_EDF2, self.down_EFD, plan, {},
                        kernels=self.kernels)


class PoolStep:
    """A prefill's pool where no other kind applies: the pool's own forward, dropless (its dispatch
    path, frozen stacks included; `in_place` as `PooledMLP.forward`). Its output alone."""
    host_sync = True  # the bucketed paths read their group sizes back

    def __init__(self, pool, in_place: bool = False):
        self.pool, self.in_place = pool, in_place

    def __call__(self, x_ND: Tensor) -> Tensor:
        return self.pool(x_ND, dropless=True, in_place=self.in_place)[0]


def gathered_bmm(x_ND: Tensor, gates_NK: Tensor, gate_up_SDF2: Tensor, down_SFD: Tensor) -> Tensor:
    """Each routed row through its gathered expert ([S, D, 2F], [S, F, D], S = N*K in routing order)
    by bmm, the K outputs summed in routing order, as combine. [N, D] -> [N, D]."""
    (N, D), K = x_ND.shape, gates_NK.shape[1]
    x_S1D = x_ND[:, None, :].expand(N, K, D).reshape(N * K, 1, D)
    act_S1F = swiglu_eager(torch.bmm(x_S1D, gate_up_SDF2), gates_NK.reshape(N * K, 1))
    return torch.bmm(act_S1F, down_SFD).view(N, K, D).sum(1)


def gathered_products(x_ND: Tensor, gates_NK: Tensor, ids_NK: Tensor, gate_up_EF2D: Tensor,
                      down_EDF: Tensor) -> Tensor:
    """The gathered path as products and sums over the transposed stacks: each routed row's expert
    read where it lies (compiled, the gather is the reduction's own indexed load, no copy; the sums
    run along contiguous memory: the stacks' own layout made the down sum 5x slower). [N, D] -> [N, D]."""
    dtype = x_ND.dtype
    h_NKF2 = (x_ND[:, None, None, :].float() * gate_up_EF2D[ids_NK].float()).sum(-1).to(dtype)
    act_NKF = swiglu_eager(h_NKF2, gates_NK)
    y_NKD = (act_NKF[:, :, None, :].float() * down_EDF[ids_NK].float()).sum(-1).to(dtype)
    return y_NKD.sum(1)  # the K outputs in routing order, as combine


# ------------------------------------------------------------------------------ each MLP's steps

@dataclass(frozen=True)
class StepOptions:
    """How the decoder runs its MLPs (`decode.Decoder`'s arguments, resolved)."""
    cast: Callable[[Tensor], Tensor]  # a weight in the writing dtype (on the CPU the parameter itself)
    n_streams: int
    expert_path: str = "auto"         # auto | gathered | grouped
    products: bool = False
    compiled: bool = False
    read_in_place: bool = False       # offloaded frozen stacks: the chosen experts read from their homes


def dense_steps(mlp, options: StepOptions) -> tuple[DenseStep, DenseStep]:
    """The dense twin's step and window forms: one SwiGLU on cast copies of its weights."""
    step = DenseStep(options.cast(mlp.gate_up), options.cast(mlp.down))
    return step, step


def pooled_steps(pool, options: StepOptions) -> tuple[_Routed, _Routed | PoolStep]:
    """A pool's step (gathered, grouped or frozen: `decode.Decoder`'s expert_path) and its window
    form: resident experts on the pool's grouped GEMM where it runs one (dispatch.PACKED: no host sync,
    so a slide can be captured), otherwise the pool's own forward."""
    router = pool.router
    route = (router.weight.detach(), router.selection_bias if router.aux_free_bias else None, pool.cfg.top_k)
    if not isinstance(pool.experts, ExpertStack):  # frozen: through the seam
        if options.expert_path == "grouped":
            raise ValueError("expert_path 'grouped' runs whole resident stacks; this pool's experts are "
                             "frozen (their chosen experts are dequantized: use 'gathered' or 'auto')")
        if options.compiled:
            raise ValueError("a compiled step runs resident experts; this pool's experts are frozen")
        return (_with_shared(pool, FrozenStep(*route, pool.experts, options.read_in_place, options.products), options),
                PoolStep(pool, options.read_in_place))
    grouped = options.expert_path == "grouped" or (options.expert_path == "auto"
                                                   and auto_grouped(pool, options.n_streams))
    gate_up, down = options.cast(pool.experts.gate_up), options.cast(pool.experts.down)
    kernels = pool.cfg.swiglu
    if grouped:
        step = GroupedStep(*route, gate_up, down, kernels, options.products,
                           path=pool.path if pool.path in PACKED else "native")
    elif options.products:  # gathered_products sums along contiguous memory: the stacks transposed
        gate_up, down = (s.transpose(1, 2).contiguous() for s in (gate_up, down))
        step = GatheredStep(*route, gate_up, down, products=True)
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)  # the window's: [E, D, 2F], [E, F, D] views
    else:
        step = GatheredStep(*route, gate_up, down)
    window = GroupedStep(*route, gate_up, down, kernels, path=pool.path) if pool.path in PACKED else PoolStep(pool)
    return _with_shared(pool, step, options), _with_shared(pool, window, options)


def _with_shared(pool, step, options: StepOptions):
    """The step with the pool's router score, and its shared experts added (a pool forward has both)."""
    if isinstance(step, PoolStep):
        return step
    step.score = pool.cfg.router_score
    if pool.shared is None:
        return step
    return SharedStep(step, DenseStep(options.cast(pool.shared.gate_up), options.cast(pool.shared.down)))
