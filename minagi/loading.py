"""Load a trained model from a checkpoint or an exported folder (minagi/export.py), for sampling and
reports (not for resuming training); find what a path names (`resolve_model_path`: a run folder's
best.pt, else last.pt); start a new run from a trained checkpoint's weights (`init_from_checkpoint`,
train.py --init); and load a state dict into a model with one-line errors naming the tensor at fault
(`load_weights`)."""
from __future__ import annotations

import os

from pathlib import Path

import torch

from . import export
from .checkpoint import Checkpoint, CheckpointError
from .data import Vocab
from .model import CharLM, build_model

_LISTED = 3  # tensor names a message lists before "(+N more)"
CHECKPOINT_NAMES = ("best.pt", "last.pt")  # what a run folder is read as, in order


def resolve_model_path(path: str | Path) -> Path:
    """A file as is; an exported folder as is; a run folder -> its best.pt, else its last.pt. A missing
    file is `load_trained`'s one-line error, naming it."""
    p = Path(path)
    if p.is_dir() and not export.is_export(p):
        for name in CHECKPOINT_NAMES:
            if (p / name).is_file():
                return p / name
        raise CheckpointError(f"{p}: no {' or '.join(CHECKPOINT_NAMES)} in this folder, nor an exported model "
                              "(model.safetensors and config.json)")
    return p


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:_LISTED]) + (f" (+{len(keys) - _LISTED} more)" if len(keys) > _LISTED else "")


def _check_names(expected, state: dict, source: str | Path) -> None:
    missing = [key for key in expected if key not in state]
    unexpected = [key for key in state if key not in expected]
    if missing or unexpected:
        parts = ([f"lacks {_names(missing)}"] if missing else []) + \
                ([f"has {_names(unexpected)}, which the model has no place for"] if unexpected else [])
        raise CheckpointError(f"{source}: the weights do not fit the model its config describes: it "
                              f"{'; it '.join(parts)}")


def check_fits(shapes: dict[str, torch.Size], state: dict, source: str | Path) -> None:
    """CheckpointError unless `state` holds exactly the tensors `shapes` names, each of its shape (a
    sharded model's whole shapes: minagi/parallel.py, which loads it in pieces)."""
    _check_names(shapes.keys(), state, source)
    for key, shape in shapes.items():
        if tuple(state[key].shape) != tuple(shape):
            raise CheckpointError(f"{source}: the weights do not fit the model its config describes ({key} is "
                                  f"{list(state[key].shape)}, the model's is {list(shape)})")


def load_weights(model: torch.nn.Module, state: dict, source: str | Path) -> None:
    """`model.load_state_dict(state)`, strict; CheckpointError naming the tensors missing from `state`,
    the ones the model has no place for, or the first whose shape differs."""
    _check_names(model.state_dict().keys(), state, source)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # torch's header line, then one line per tensor ("size mismatch for ...")
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise CheckpointError(f"{source}: the weights do not fit the model its config describes "
                              f"({lines[1] if len(lines) > 1 else lines[0] if lines else e})") from None


def load_trained(path: str | Path, device: torch.device | str = "cpu") -> tuple[CharLM, Vocab, Checkpoint]:
    """(model in eval mode on `device`, its vocabulary, the checkpoint) from a .pt file or an exported
    folder (whose checkpoint holds the model, config, vocabulary and step only).

    Every problem is a one-line CheckpointError naming the file. Checkpoints of format 1 (before the
    [pool] section) are read through `checkpoint.upgrade_payload`.
    """
    # Mapped, not read: the optimizer's moments (twice the model's bytes) are never read from the disk,
    # only the weights copied into the model (POSIX: on Windows a mapped file could not be replaced by
    # the training run's next save).
    ckpt = (export.read_export(path) if export.is_export(path) else
            Checkpoint.load(path, map_location="cpu", mmap=os.name == "posix"))
    cfg = ckpt.config
    model = build_model(cfg.model, cfg.pool, ckpt.vocab.size, device, dense_width=cfg.dense_width,
                        experts=cfg.experts, init_frozen=False, weights_loaded=True)
    load_weights(model, ckpt.model, path)
    return model.eval(), ckpt.vocab, ckpt


def _check_frozen_alike(ckpt: Checkpoint, frozen: dict, path) -> None:
    """A frozen run's stacks are stored as quantized (or bf16) bytes and adapters: only a model frozen
    the same way takes them. Said by its cause, before a tensor-by-tensor mismatch would be."""
    x = ckpt.config.experts
    if not (ckpt.config.model.mlp == "pooled" and x.frozen):
        return
    quants = {stack.quant for stack in frozen.values()}
    if not quants:
        raise CheckpointError(f"{path}: its run's experts are frozen (experts.frozen = true, experts.quant = "
                              f"{x.quant!r}) and this profile's are not: a run can start from frozen stacks "
                              f"only frozen the same way (set experts.frozen = true and experts.quant = {x.quant!r}), "
                              "or start from the trained run they were frozen from")
    if quants != {x.quant}:
        raise CheckpointError(f"{path}: its run's frozen stacks are stored as experts.quant = {x.quant!r}, this "
                              f"profile's as {sorted(quants)[0]!r}: set experts.quant = {x.quant!r}, or start from "
                              "the trained run they were frozen from")


@torch.no_grad()
def init_from_checkpoint(model: CharLM, ckpt: Checkpoint, path: str | Path) -> list[str]:
    """A trained checkpoint's weights into a newly built `model`: every tensor by name and shape;
    a trainable expert stack into a frozen one is quantized on the way. Returns the tensors the
    checkpoint did not have and the model starts fresh (LoRA adapters). Any other difference is a
    one-line CheckpointError naming the tensor. A dense twin's checkpoint into a pooled model is
    upcycled: its MLPs split into the pools' experts, the routers fresh (minagi/upcycle.py)."""
    from .frozen import frozen_stacks
    state = ckpt.model
    if ckpt.config.model.mlp == "dense" and model.pools():
        from .upcycle import upcycled_state
        state = upcycled_state(state, model, path)
    frozen = frozen_stacks(model)
    _check_frozen_alike(ckpt, frozen, path)
    saved = model.state_dict(keep_vars=True).keys()  # not the buffers a model remakes (RoPE tables)
    targets = {**dict(model.named_parameters()), **{k: b for k, b in model.named_buffers() if k in saved}}
    for key, value in state.items():
        if key in frozen:
            if tuple(value.shape) != frozen[key].shape:
                raise CheckpointError(f"{path}: {key} is {list(value.shape)}, the new model's is "
                                      f"{list(frozen[key].shape)}")
            frozen[key].load_weights(value)
            continue
        if key not in targets:
            raise CheckpointError(f"{path}: {key} has no place in the model this profile builds")
        if targets[key].shape != value.shape:
            raise CheckpointError(f"{path}: {key} is {list(value.shape)}, the new model's is "
                                  f"{list(targets[key].shape)}")
        targets[key].copy_(value)
    loaded_stacks = {k for k in frozen if k in state}
    fresh = [k for k in targets if k not in state and not any(k.startswith(f"{s}.") for s in loaded_stacks)]
    if [k for k in fresh if ".lora_" not in k]:
        first = next(k for k in fresh if ".lora_" not in k)
        raise CheckpointError(f"{path}: has no {first}: not a checkpoint of this model's shape")
    return fresh
