"""torchrun worker for tests/test_parallel.py: layouts of minagi/parallel.py on gloo ranks against one
process with the whole batch, built and stepped in this same process. Rank 0 saves what it measured.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/parallel_ranks.py OUT NAME...

For each named scenario (`SCENARIOS`): the one-process training and the layout's are built from the
same settings and seed; the first batch's gradients are compared (every parameter's whole gradient,
gathered), then three training steps (losses, aux loss, gradient norm, routing loads, padded rows, the
selection bias), then the layout's whole state is gathered, loaded into a newly built layout and one
more step is taken by both. Tiny models: a scenario takes well under a second.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.getcwd())
from minagi.assemble import build_training  # noqa: E402
from minagi.config import load_config  # noqa: E402
from minagi.frozen import dequant_summary  # noqa: E402
from minagi.trainer import train_step  # noqa: E402

BASE = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
        "pool.top_k=2", "pool.d_expert=32", "pool.aux_free_bias=true", "pool.bias_update_rate=0.01",
        "train.batch_size=4", "train.steps=10", "train.warmup_steps=1", "train.device=cpu",
        "train.checkpoint_rows=true"]
EP, FSDP = "train.expert_parallel=2", "train.parallel=fsdp"
FROZEN = ["experts.frozen=true", "experts.blocksize=32", "experts.lora_rank=8", "experts.replay_pin=on"]
SCENARIOS = {
    "ep_grouped": [EP], "ep_loop": [EP, "pool.dispatch=loop"], "ep_native": [EP, "pool.dispatch=native"],
    "ep_rectangle_fsdp": [EP, FSDP, "pool.dispatch=rectangle"],
    "sink_loop": [EP, "pool.dispatch=loop"], "sink_grouped_fsdp": [EP, FSDP],
    "fsdp_frozen_pin": [FSDP, *FROZEN], "fsdp_dense": [FSDP, "model.mlp=dense"],
}
VOCAB = 20
CPU = torch.device("cpu")


def one_process(sets: list[str]) -> list[str]:
    return [s for s in sets if not s.startswith(("train.expert_parallel", "train.parallel"))]


def sink(training) -> None:
    """Every character's top-2 on experts 0 and 1, rank 0's: rank 1 receives no rows at all."""
    for pool in training.model.pools():
        pool.router.selection_bias.copy_(torch.tensor([1.0, 1.0, 0.0, 0.0]))


def whole_grads(training, is_main: bool) -> dict:
    """Every parameter's gradient as one process holds it (gathered shards and slices; rank 0)."""
    wrapped = training.parallel
    slices = getattr(wrapped, "slices", {})
    out = {}
    for name, p in training.model.named_parameters():
        if p.grad is None:
            continue
        out[name] = wrapped.whole(p.grad, name in slices, is_main) if wrapped.sharded else p.grad.clone()
    return out


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(((x.float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp(min=1e-6)).item()
               for k, x in a.items())


def first_gradients(ref, par, x, y, rank: int, world: int) -> float | None:
    """The whole batch's gradients in one process against the layout's (this rank's shard of the batch)."""
    b = x.shape[0] // world
    for t, xs, ys in ((ref, x, y), (par, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b])):
        out = t.forward(xs, ys)
        (out.loss + out.aux_loss).backward()
        t.parallel.clip_grads(t.params, 0.0)
    got = whole_grads(par, rank == 0)
    diff = max_diff(got, whole_grads(ref, True)) if rank == 0 else None
    for t in (ref, par):
        t.optimizer.zero_grad(set_to_none=True)
    return diff


def steps(ref, par, batches, first: int, rank: int, world: int) -> list[dict]:
    out = []
    for i, (x, y) in enumerate(batches, start=first):
        b = x.shape[0] // world
        a = train_step(ref, x, y, step=i, grad_clip=1.0, world_size=1, device=CPU)
        c = train_step(par, x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b], step=i, grad_clip=1.0,
                       world_size=world, device=CPU)
        ref.updating = par.updating = False
        rec = {"ce": (a.ce, c.ce), "aux": (a.aux, c.aux), "norm": (a.grad_norm, c.grad_norm)}
        if a.counts is not None:
            rec.update(loads=(a.counts.load_LE.tolist(), c.counts.load_LE.tolist()),
                       chars=(a.counts.chars, c.counts.chars), padded=c.counts.padded)
            rec["bias"] = max((p.router.selection_bias - q.router.selection_bias).abs().max().item()
                              for p, q in zip(ref.model.pools(), par.model.pools()))
        out.append(rec)
    return out


def state_diffs(ref, par, rank: int) -> tuple[float, float] | None:
    """The gathered whole model and optimizer state against one process's."""
    full = par.parallel.full_states(par.model, par.optimizer, rank == 0)
    if rank != 0:
        return None
    model, optim = full
    assert all(not type(v).__name__ == "DTensor" and v.device.type == "cpu" for v in model.values())
    ref_optim = ref.optimizer.state_dict()["state"]
    optim_diff = max(max_diff(s, ref_optim[i]) for i, s in optim["state"].items())
    return max_diff(model, ref.model.state_dict()), optim_diff


def scenario(name: str, rank: int, world: int) -> dict:
    sets = BASE + SCENARIOS[name]
    ref_cfg, cfg = load_config(None, one_process(sets)), load_config(None, sets)
    ref, par = build_training(ref_cfg, VOCAB, CPU, 1), build_training(cfg, VOCAB, CPU, world, rank=rank)
    if name.startswith("sink"):
        sink(ref), sink(par)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g))
               for _ in range(5)]
    result = {"grad_diff": first_gradients(ref, par, *batches[0], rank, world),
              "local_numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in par.params)}
    dequant_summary(par.model, 1)  # the gradient check's dequants are not the steps'
    result["steps"] = steps(ref, par, batches[:3], 0, rank, world)
    result["dequants"] = dequant_summary(par.model, 3)
    # Frozen stacks' buffers: whole plain tensors on every rank, the same bytes as one process's.
    ref_buffers = dict(ref.model.named_buffers())
    whole = torch.tensor([type(b) is torch.Tensor and torch.equal(b, ref_buffers[n])
                          for n, b in par.model.named_buffers() if ".experts." in n], dtype=torch.int32)
    dist.all_reduce(whole, op=dist.ReduceOp.MIN)  # every rank's
    result["frozen_whole"] = whole.bool().tolist()
    result["state_diff"] = state_diffs(ref, par, rank)
    # The whole state into a new layout (every rank reads the same file in a run: here, rank 0's gather).
    box = [par.parallel.full_states(par.model, par.optimizer, rank == 0)]
    dist.broadcast_object_list(box, src=0)
    again = build_training(cfg, VOCAB, CPU, world, rank=rank)
    again.parallel.load_states(again.model, again.optimizer, *box[0], "gathered")
    again.scheduler.load_state_dict(par.scheduler.state_dict())
    result["resumed"] = steps(ref, again, batches[3:], 3, rank, world)
    return result


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out, names = sys.argv[1], sys.argv[2:]
    results = {name: scenario(name, rank, world) for name in names}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from minagi.train import _leave_as_rank
    _leave_as_rank(0)  # as train.py's own rank does: no interpreter finalisation (its docstring)
