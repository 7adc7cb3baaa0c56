"""Past one process: DDP, FSDP2 and expert parallelism on torch.distributed, and the whole-model
state they save and load (docs/multi_gpu.md).

  train.parallel = "ddp"   every rank holds the whole model; DDP averages the gradients (one process:
                           no wrapper). Today's behaviour.
  train.parallel = "fsdp"  each row, then the root (embedding, final norm, head), wrapped with FSDP2's
                           `fully_shard` on a 1-D DeviceMesh of every rank: parameters, gradients and
                           optimizer state sharded on dim 0 (an expert stack [E, ...] on its expert
                           dimension), a row's weights all-gathered in its pre-forward hook and again
                           before its backward (where a checkpointed row replays), the gradients
                           reduce-scattered after it.
  train.expert_parallel = N  each rank holds n_experts / N experts of every pool; routed rows are
                           exchanged with all_to_all_single (minagi/exchange.py). The rest of the model
                           stays data-parallel (DDP or FSDP) over every rank.

The mesh: expert parallelism inside data parallelism. Every rank trains its own 1/W of the global
batch; the data-parallel wrappers run on the 1-D mesh ("dp",) of all W ranks, and the experts on a
2-D mesh ("edp", "ep") = (W/N, N) of the same ranks: an "ep" group is N consecutive ranks (one node's
GPUs for N <= 8), which together hold one whole card; an "edp" group is the ranks that hold the same
experts. An expert slice's gradient arrives whole from every rank of its ep group through the
exchange's backward; it is summed over its edp group and divided by W (`Sharded.clip_grads`), which
is the gradient of the global batch's mean loss, as DDP's average is for every other parameter.
Expert slices are left out of DDP and of FSDP (`ignored_params`): they are not the same tensors on
every rank of the data-parallel mesh.

Mixed precision as one process trains: fp32 master weights, fp32 gradients and reductions
(`MixedPrecisionPolicy(reduce_dtype=float32)`), bf16 compute on CUDA from autocast. FSDP gathers the
fp32 weights: an FSDP run computes the bits a DDP run does (param_dtype = bf16 would halve the
gathered bytes but round the router's and the norms' weights, put the embedding's output, the
residual stream, in bf16, and take rms_norm off its fused kernel for mismatched dtypes).

Frozen stacks (NF4 or bf16 buffers) are replicated, not sharded: FSDP2 shards parameters only, a
frozen stack never has a gradient or optimizer state (the 12 of the 16 bytes a trainable weight costs
that sharding saves), and it is dequantized from its own bytes at each of the three uses of a step
(forward, replay, backward), which sharded bytes would turn into three all-gathers a row. Their LoRA
adapters are parameters, sharded with their row.

Checkpoints stay one file of the unwrapped, whole model (`Sharded.full_states`: each sharded tensor
gathered in turn with `DTensor.full_tensor`, an expert slice over its ep group, rank 0 keeping a CPU
copy), so any number of ranks, one process, sample.py and the tools read them; loading splits them
again (`Sharded.load_states`: torch's `set_model_state_dict(full_state_dict=True)` distributes the
model, `distribute_tensor` the optimizer state).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import distributed
from .checkpoint import CheckpointError
from .config import Config, ConfigError
from .exchange import ExpertExchange
from .experts import LocalExpertStack
from .frozen import frozen_stacks
from .loading import check_fits

__all__ = ["Layout", "Parallel", "Sharded", "check_layout", "expert_slices", "model_bytes_per_rank", "wrap"]


def _fully_shard():
    """FSDP2's `fully_shard` and `MixedPrecisionPolicy`, or None on a torch without them."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        return None
    return fully_shard, MixedPrecisionPolicy


def check_layout(cfg: Config, world_size: int) -> None:
    """One-line ConfigErrors for a layout these ranks cannot run (before any rank starts, where it can)."""
    tc = cfg.train
    if tc.parallel == "fsdp" and _fully_shard() is None:
        raise ConfigError(f"train.parallel = \"fsdp\" needs FSDP2 (torch.distributed.fsdp.fully_shard); torch "
                          f"{torch.__version__} has none: use \"ddp\"", "train.parallel")
    if world_size % tc.expert_parallel:
        raise ConfigError(f"train.expert_parallel = {tc.expert_parallel} must divide the {world_size} rank(s) "
                          "(--nproc-per-node, or torchrun --nproc_per_node); --set train.expert_parallel=1 "
                          "turns it off (a resume may change it)",
                          "train.expert_parallel")


class Layout:
    """How this job's ranks split the model: the device meshes and the experts' exchange, made once
    the process group is joined (before the model is built: the exchange decides its stacks)."""

    def __init__(self, cfg: Config, world_size: int, device: torch.device):
        check_layout(cfg, world_size)
        self.world_size, self.ep = world_size, cfg.train.expert_parallel
        joined = dist.is_available() and dist.is_initialized()
        # fsdp wraps whenever a process group is joined (one rank too: tools/bench_train.py's cost
        # measure); ddp only with several ranks, as before.
        self.fsdp = cfg.train.parallel == "fsdp" and joined
        self.mesh = self.experts_mesh = self.exchange = None
        if self.fsdp:
            self.mesh = _mesh(device, (world_size,), ("dp",))
        if self.ep > 1:
            self.experts_mesh = _mesh(device, (world_size // self.ep, self.ep), ("edp", "ep"))
            self.exchange = ExpertExchange(self.experts_mesh.get_group("ep"), cfg.pool.n_experts)

    @property
    def sharded(self) -> bool:
        """Whether some tensor of the model is not whole on every rank (its state is gathered together)."""
        return self.fsdp or self.ep > 1


def _mesh(device: torch.device, shape: tuple[int, ...], names: tuple[str, ...]):
    from torch.distributed.device_mesh import init_device_mesh  # here: only once a process group is joined
    return init_device_mesh(device.type, shape, mesh_dim_names=names)


def expert_slices(model: nn.Module) -> dict[str, nn.Parameter]:
    """The expert-parallel slices' parameters by name (empty without expert parallelism)."""
    return {f"{name}.{p}": param for name, m in model.named_modules() if isinstance(m, LocalExpertStack)
            for p, param in m.named_parameters(recurse=False)}


def wrap(model: nn.Module, layout: Layout, device: torch.device) -> tuple[Callable, "Parallel"]:
    """The training forward (DDP, the model sharded in place by FSDP2, or the model) and what the step,
    saving and loading do for this layout."""
    slices = expert_slices(model)
    if layout.fsdp:
        _shard(model, layout.mesh, ignored=set(slices.values()))
        forward = model
    elif layout.world_size > 1:
        # Frozen stacks are the same on every rank and have no gradient, expert slices differ by rank:
        # neither is DDP's to sync.
        frozen = [f"{name}.{b}" for name, s in frozen_stacks(model).items() for b, _ in s.named_buffers()]
        forward = distributed.wrap_ddp(model, device, ignore=frozen + list(slices))
    else:
        forward = model
    return forward, (Sharded(layout, slices) if layout.sharded else Parallel())


def _shard(model: nn.Module, mesh, ignored: set[nn.Parameter]) -> None:
    """fully_shard each row, then the root (what is left: embedding, final norm, head), bottom-up."""
    fully_shard, MixedPrecisionPolicy = _fully_shard()
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    for row in model.rows:
        fully_shard(row, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)


class Parallel:
    """One process, or DDP: every rank holds the whole model (today's behaviour)."""
    sharded = False

    def clip_grads(self, params: list[Tensor], max_norm: float) -> Tensor:
        """After the step's backward: the gradient norm, clipped to `max_norm` when > 0."""
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])

    def full_states(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    is_main: bool) -> tuple[dict, dict] | None:
        """(model state, optimizer state) of the whole model on rank 0, None elsewhere."""
        return (model.state_dict(), optimizer.state_dict()) if is_main else None

    def load_states(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict, source: str) -> None:
        from .loading import load_weights
        load_weights(model, model_state, source)
        _load_optimizer(optimizer, optimizer_state, source)


def _load_optimizer(optimizer: torch.optim.Optimizer, state: dict, source: str) -> None:
    try:
        optimizer.load_state_dict(state)
    except (KeyError, ValueError) as e:  # torch's own words, e.g. a parameter group of another size
        raise CheckpointError(f"{source}: the optimizer state does not fit the model ({e})") from None


class Sharded(Parallel):
    """FSDP and/or expert parallelism: parameters sharded as DTensors, expert slices split by rank.
    Every rank takes part in gathering and splitting their state (collectives, in key order)."""
    sharded = True

    def __init__(self, layout: Layout, slices: dict[str, nn.Parameter]):
        self.layout, self.slices = layout, slices
        self.expert_ids = {id(p) for p in slices.values()}

    # ---------------------------------------------------------------- the step

    def clip_grads(self, params: list[Tensor], max_norm: float) -> Tensor:
        """The expert slices' gradients reduced (their edp group, / W), then the norm of the whole
        model's gradient: the sharded parameters' through their DTensors, the slices' summed over
        their ep group (each rank holds other experts); clipped to `max_norm` when > 0."""
        experts = [p for p in params if id(p) in self.expert_ids]
        self._reduce_slices(experts)
        dense = [p for p in params if id(p) not in self.expert_ids and p.grad is not None]
        squares = [_norm(dense).square()] if dense else []
        if experts:
            squares.append(_sum_over(_norm(experts).square(), self.layout.exchange.group))
        norm = torch.stack(squares).sum().sqrt()
        if max_norm > 0:
            for group in (dense, experts):  # apart: one foreach call takes DTensors or tensors, not both
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def _reduce_slices(self, experts: list[nn.Parameter]) -> None:
        if not experts:
            return
        replicas = self.layout.experts_mesh.get_group("edp")
        for p in experts:
            if p.grad is None:  # no rank sent it a row and no replica either: a zero gradient, as one process's
                p.grad = torch.zeros_like(p)
            if dist.get_world_size(replicas) > 1:
                dist.all_reduce(p.grad, group=replicas)
            p.grad.div_(self.layout.world_size)

    # ---------------------------------------------------------------- saving and loading

    def whole(self, value, expert: bool, is_main: bool):
        """One tensor of the state as one process holds it (rank 0: a CPU copy; None elsewhere)."""
        if not isinstance(value, Tensor):
            return value
        full = value.full_tensor() if _is_dtensor(value) else value
        if expert and full.dim() > 0:
            group = self.layout.exchange.group
            parts = [torch.empty_like(full) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, full.contiguous(), group=group)
            full = torch.cat(parts)
        return full.detach().cpu() if is_main else None

    def full_states(self, model, optimizer, is_main):
        """Gathered by every rank, tensor by tensor (the GPU holds one whole tensor at a time)."""
        model_state = {k: self.whole(v, k in self.slices, is_main) for k, v in model.state_dict().items()}
        saved = optimizer.state_dict()
        experts = self._expert_indices(optimizer)
        state = {i: {k: self.whole(v, i in experts, is_main) for k, v in s.items()}
                 for i, s in saved["state"].items()}
        return (model_state, {**saved, "state": state}) if is_main else None

    def _expert_indices(self, optimizer) -> set[int]:
        """The optimizer's indices (its state-dict keys) of the expert slices."""
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(flat) if id(p) in self.expert_ids}

    def _slice(self, value: Tensor) -> Tensor:
        """This rank's experts of a whole card's tensor [E, ...]."""
        first, count = self.layout.exchange.local_experts
        return value[first:first + count]

    def load_states(self, model, optimizer, model_state, optimizer_state, source):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        shapes = {k: _whole_shape(v, k in self.slices, self.layout.ep) for k, v in model.state_dict().items()}
        check_fits(shapes, model_state, source)
        local = {k: self._slice(v) if k in self.slices else v for k, v in model_state.items()}
        set_model_state_dict(model, local, options=StateDictOptions(full_state_dict=True, strict=True))
        _load_optimizer(optimizer, self._local_optimizer(optimizer, optimizer_state), source)

    def _local_optimizer(self, optimizer, saved: dict) -> dict:
        """The whole optimizer state split as the parameters are: DTensor shards, expert slices."""
        from torch.distributed.tensor import distribute_tensor
        flat = [p for group in optimizer.param_groups for p in group["params"]]
        state = {}
        for i, s in saved["state"].items():
            p = flat[i] if isinstance(i, int) and 0 <= i < len(flat) else None
            local = {}
            for k, v in s.items():
                if p is not None and isinstance(v, Tensor) and v.dim() > 0:
                    v = self._slice(v) if id(p) in self.expert_ids else v
                    v = (distribute_tensor(v.to(p.device), p.device_mesh, p.placements) if _is_dtensor(p)
                         else v)
                local[k] = v
            state[i] = local
        return {**saved, "state": state}


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _norm(params: list[Tensor]) -> Tensor:
    """The 2-norm of the parameters' gradients, DTensors' too (their shards' norms combined over the
    mesh)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    return norm.full_tensor() if _is_dtensor(norm) else norm


def _sum_over(t: Tensor, group) -> Tensor:
    out = t.detach().clone()
    dist.all_reduce(out, group=group)
    return out


def _whole_shape(value: Tensor, expert: bool, ep: int) -> torch.Size:
    """A state-dict entry's shape in the whole model (a DTensor's is its global shape already)."""
    shape = value.shape
    return torch.Size([shape[0] * ep, *shape[1:]]) if expert else shape


# ---------------------------------------------------------------------------- memory per rank, by formula

def model_bytes_per_rank(cfg: Config, world_size: int, vocab: int = 96) -> dict[str, int]:
    """What each rank holds for the model's training state under cfg's layout on `world_size` ranks, by
    formula (docs/multi_gpu.md; activations apart: they scale with the characters a rank trains).

    states: 16 bytes a trainable parameter (fp32 weight, gradient, AdamW's two moments), all of them on
    every rank under ddp, 1/W of them under fsdp, an expert slice's (1/N of the card) under expert
    parallelism, replicated over its W/N replicas; frozen stacks: their stored bytes on every rank.
    gathered (fsdp): the fp32 weights and gradients of the row in use and of the one prefetched (8
    bytes a parameter, two rows; expert slices are never gathered). casts (CUDA): each expert stack
    multiplied in bf16 (2 bytes a weight, kept for backward by every row without row checkpointing,
    by one with it) and its bf16 gradient (2 bytes, one row). The --plan of the small-cards work can
    take this as its world-size seam.
    """
    m, p, tc = cfg.model, cfg.pool, cfg.train
    w, ep = world_size, tc.expert_parallel
    pooled = m.mlp == "pooled"
    card = 3 * m.d_model * p.d_expert * p.n_experts if pooled else 3 * m.d_model * cfg.dense_width
    frozen = pooled and cfg.experts.frozen
    dense_row = 4 * m.d_model ** 2 + 2 * m.d_model + (m.d_model * p.n_experts if pooled else 0)
    lora = 0
    if frozen and cfg.experts.lora_rank:  # A [E, I, r] and B [E, r, O] of gate_up (D -> 2F) and down (F -> D)
        lora = cfg.experts.lora_rank * p.n_experts * (m.d_model + 2 * p.d_expert + p.d_expert + m.d_model)
    experts_row = 0 if frozen else card // (ep if pooled else 1)       # trainable experts a rank holds
    row = dense_row + lora + (0 if ep > 1 else experts_row)           # what FSDP shards of a row
    root = 2 * vocab * m.d_model + m.d_model
    shard = w if tc.parallel == "fsdp" else 1
    states = 16 * (m.n_rows * row + root) // shard + 16 * (m.n_rows * experts_row if ep > 1 else 0)
    if frozen:  # NF4: 4 bits a weight and an fp32 absmax a block (double quantization not counted)
        states += m.n_rows * card * (cfg.experts.blocksize // 2 + 4) // cfg.experts.blocksize \
            if cfg.experts.quant == "nf4" else m.n_rows * card * 2
    gathered = 2 * 8 * row if tc.parallel == "fsdp" and w > 1 else 0
    per_row_cast = 2 * (card // ep if not frozen else card)
    casts = per_row_cast * (1 if tc.checkpoint_rows else m.n_rows) + per_row_cast
    params = m.n_rows * (dense_row + lora + (0 if frozen else card)) + root
    return {"params": params, "states": states, "gathered": gathered, "casts": casts,  # params: trainable ones
            "total": states + gathered + casts}
