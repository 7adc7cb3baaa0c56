"""What `train.py --plan` prints: a run's memory plan (minagi/plan.py) as text, for its layout's shares
of the weights, on this machine's kind of device or another, and whether it fits the card."""
from __future__ import annotations

from .config import Config
from .plan import TARGETS, GiB, MemoryPlan, Target, gib, plan_memory

__all__ = ["describe", "layout_shards", "local_target", "plan_report"]


def describe(plan: MemoryPlan, title: str = "") -> str:
    """The plan as text: the parts, the peak allocated, the slack, the peak reserved, the notes."""
    width = max(len(p.name) for p in (*plan.parts, plan.slack))
    lines = [f"memory plan{' for ' + title if title else ''} on {plan.target.about}:"]
    for part in plan.parts:
        lines.append(f"  {part.name:<{width}}  {gib(part.bytes):>10}   {part.how}")
    lines.append(f"  {'peak allocated':<{width}}  {gib(plan.peak_allocated):>10}   during the {plan.phase}")
    if plan.target.gpu:
        lines.append(f"  {plan.slack.name:<{width}}  {gib(plan.slack.bytes):>10}   {plan.slack.how}")
        lines.append(f"  {'peak reserved':<{width}}  {gib(plan.peak_reserved):>10}   what the card must have free")
    else:
        lines.append("  (the CPU: tensors only; the process also holds torch itself, a few hundred MiB)")
    lines += [f"  - {note}" for note in plan.notes]
    return "\n".join(lines)


def local_target() -> tuple[Target, int | None]:
    """This machine's kind (its first GPU's, else the CPU) and that GPU's memory in bytes (None on the CPU).
    Asks the driver for properties only: nothing is allocated."""
    import torch
    if not torch.cuda.is_available():
        return TARGETS["cpu"], None
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        kind = "rocm"
    else:
        kind = "sm90" if (props.major, props.minor) >= (9, 0) else "sm80" if props.major >= 8 else "sm75"
    return TARGETS[kind], props.total_memory


def layout_shards(cfg: Config, world_size: int) -> tuple[int, int]:
    """(weight_shards, expert_shards) of cfg's layout on `world_size` ranks: train.parallel = "fsdp" shards
    every weight W ways; train.expert_parallel = N splits the expert stacks N ways (FSDP the rest)."""
    fsdp = world_size if cfg.train.parallel == "fsdp" else 1
    ep = cfg.train.expert_parallel
    return fsdp, ep if ep > 1 else fsdp


def plan_report(cfg: Config, title: str, target: str = "auto", *, world_size: int = 1,
                vocab_size: int | None = None) -> str:
    """`describe` of the plan for `target` ("auto": this machine), with whether it fits this GPU (or
    memory.gpu_cap_gib) and how to plan for another kind of card. `vocab_size`: the run's, when known
    (a resumed run's); else 256 assumed."""
    vocab = f"vocabulary of {vocab_size}" if vocab_size else "vocabulary of 256 assumed"
    vocab_size = vocab_size or 256
    here, total = local_target()
    chosen = here if target == "auto" else TARGETS[target]
    weight_shards, expert_shards = layout_shards(cfg, world_size)
    plan = plan_memory(cfg, chosen, vocab_size=vocab_size, world_size=world_size, weight_shards=weight_shards,
                       expert_shards=expert_shards)
    layout = (f", weights sharded {weight_shards} ways" if weight_shards > 1 else "") + (
        f", experts {expert_shards} ways" if expert_shards > 1 else "")
    lines = [describe(plan, f"{title} ({world_size} rank{'s' if world_size > 1 else ''}{layout}, {vocab})")]
    cap = cfg.memory.gpu_cap_gib * GiB if cfg.memory.gpu_cap_gib > 0 else None
    limits = [x for x in (cap, total if chosen is here else None) if x is not None]
    room = min(limits) if limits else None
    if room is not None and chosen.gpu:
        verdict = "fits" if plan.peak_reserved <= room else "does NOT fit"
        what = "memory.gpu_cap_gib" if cap is not None and room == cap else "this GPU's memory"
        lines.append(f"{verdict}: peak reserved {gib(plan.peak_reserved)} against {gib(room)} ({what})")
    others = ", ".join(name for name in TARGETS if name != chosen.name)
    lines.append(f"(planned for {chosen.name}{' (this machine)' if chosen is here else ''}; "
                 f"--plan NAME plans for another: {others})")
    return "\n".join(lines)
