"""Sharing a model: a checkpoint written as a folder that needs no minagi pickle to read.

    minagi-export runs/<name> out/            # the run's best.pt (else last.pt)
    minagi-export runs/<name>/last.pt out/    # a checkpoint file
    python -m minagi.export runs/<name> out/

writes three files into `out/` (made if missing; one that already holds an export is refused):

  model.safetensors   the model's state dict, tensor by tensor as the checkpoint holds it (safetensors:
                      no code runs to read it; the optimizer, RNG and meters are left out)
  config.json         {"format": "minagi-export", "format_version", "minagi_version", "step",
                      "run_name", "best_heldout_loss", "vocab_size", "config": the resolved config
                      by section (as run.json), "frozen_stacks": the NF4 layout of each frozen stack}
  vocab.json          {character: id}, ids 0..V-1 in the vocabulary's (sorted) order

Frozen NF4 stacks are exported as they are stored: their packed bytes and absmax (or its
double-quantized triple), never dequantized; config.json names each stack's shape, blocksize,
tensors and the byte layout (`NF4_LAYOUT`, docs/nf4.md), so another reader can unpack them.
sample.py and tools/evaluate.py load such a folder as they load a .pt (minagi/loading.py). The
safetensors package is an optional extra (`pip install safetensors`); without it, writing or
reading an export is a one-line error.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from . import __version__
from .atomic import atomic_write
from .checkpoint import Checkpoint, CheckpointError
from .config import ConfigError, config_from_dict, config_to_dict
from .data import DataError, Vocab

__all__ = ["EXPORT_FILES", "FORMAT", "FORMAT_VERSION", "NF4_LAYOUT", "export_model", "is_export", "main",
           "read_export"]

FORMAT, FORMAT_VERSION = "minagi-export", 1
EXPORT_FILES = ("model.safetensors", "config.json", "vocab.json")
NF4_LAYOUT = ("bitsandbytes NF4: the stack's weights [E, I, O] flattened row-major, cut into blocks of "
              "`blocksize` weights; `packed` (uint8 [n/2]) holds weight 2i in the high nibble and 2i+1 in the low "
              "one; weight = NF4_TABLE[code] * absmax[block] (absmax fp32 [n/blocksize]); with double_quant, "
              "absmax[b] = DYNAMIC_MAP[absmax_q[b]] * absmax2[b // 256] + offset (bitsandbytes' signed 8-bit "
              "dynamic map); docs/nf4.md")


class ExportError(ValueError):
    """An export that cannot be written; one line."""


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise CheckpointError("an exported model is read and written with the safetensors package, which this "
                              "Python does not have: pip install safetensors (or pip install "
                              "minagi[safetensors])") from None
    return safetensors.torch


def is_export(path: str | Path) -> bool:
    """Whether `path` is a folder written by `export_model` (it holds model.safetensors and config.json)."""
    p = Path(path)
    return p.is_dir() and (p / "model.safetensors").is_file() and (p / "config.json").is_file()


def export_model(source: str | Path, out_dir: str | Path) -> dict:
    """Write the checkpoint at `source` (a .pt file) into `out_dir`; returns config.json's content."""
    from .loading import load_trained  # the model built and the weights checked against it, as sample.py does
    st = _safetensors()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    held = [name for name in EXPORT_FILES if (out / name).exists()]
    if held:
        raise ExportError(f"{out}: already holds {', '.join(held)}; export into another folder, or remove them")
    model, vocab, ckpt = load_trained(source, "cpu")
    state = {name: t.detach().contiguous() for name, t in ckpt.model.items()}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "minagi_version": __version__,
            "source": str(source), "step": ckpt.step, "run_name": ckpt.run_name,
            "best_heldout_loss": ckpt.best_heldout_loss if math.isfinite(ckpt.best_heldout_loss) else None,
            "vocab_size": vocab.size, "config": config_to_dict(ckpt.config),
            "frozen_stacks": _frozen_layout(model)}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "model.safetensors",
                 lambda tmp: st.save_file(state, str(tmp), metadata={"format": "pt", "minagi": FORMAT}))
    _write_json(out / "vocab.json", {c: i for i, c in enumerate(vocab.chars)})
    _write_json(out / "config.json", meta)  # last: a folder without it is not an export
    return meta


def _frozen_layout(model) -> dict:
    """{stack name: its shape, quantisation and tensors} for every frozen stack; {} without any."""
    from .frozen import frozen_stacks
    from .nf4 import NF4_TABLE
    stacks = {}
    for name, stack in frozen_stacks(model).items():
        tensors = sorted(f"{name}.{key}" for key in stack.stored())
        entry = {"shape": list(stack.shape), "quant": stack.quant, "tensors": tensors}
        if stack.quant == "nf4":
            entry.update(blocksize=stack.blocksize, double_quant=hasattr(stack, "absmax_q"), layout=NF4_LAYOUT)
        stacks[name] = entry
    return {"nf4_table": list(NF4_TABLE), "stacks": stacks} if stacks else {}


def _write_json(path: Path, obj: dict) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    atomic_write(path, write)


def read_export(path: str | Path) -> Checkpoint:
    """A model checkpoint (model, config, vocab, step) from an export folder; CheckpointError naming it."""
    folder = Path(path)
    st = _safetensors()
    try:
        meta = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        ids = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{folder}: not a readable export ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{folder}: config.json is not a minagi export (no \"format\": \"{FORMAT}\")")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{folder}: export format_version {meta['format_version']} is newer than this code "
                              f"reads ({FORMAT_VERSION}); update minagi to load it")
    try:
        config = config_from_dict(meta["config"], source=str(folder / "config.json"))
        order = sorted(ids.items(), key=lambda kv: kv[1])
        if [i for _, i in order] != list(range(len(order))):
            raise DataError("ids are not 0..V-1")
        vocab = Vocab.from_chars("".join(c for c, _ in order))
        state = st.load_file(str(folder / "model.safetensors"))
    except (ConfigError, DataError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{folder}: not a usable export ({e})") from None
    except (OSError, RuntimeError) as e:  # safetensors' own errors for a truncated file (SafetensorError)
        raise CheckpointError(f"{folder / 'model.safetensors'}: cannot read it ({str(e).splitlines()[0]})") from None
    best = meta.get("best_heldout_loss")
    return Checkpoint(model=state, config=config, vocab=vocab, step=meta.get("step"), run_name=meta.get("run_name"),
                      best_heldout_loss=math.inf if best is None else float(best), source=str(folder))


def main(argv: list[str] | None = None) -> int:
    from .cli import OneLineParser
    from .loading import resolve_model_path
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="a run folder (its best.pt, else last.pt) or a .pt checkpoint")
    p.add_argument("out", help="the folder to write model.safetensors, config.json and vocab.json into")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        source = resolve_model_path(args.source)
        if is_export(source):
            raise ExportError(f"{source}: already an export (model.safetensors and config.json)")
        meta = export_model(source, args.out)
    except (CheckpointError, ExportError) as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return 2
    size = (Path(args.out) / "model.safetensors").stat().st_size
    frozen = len(meta["frozen_stacks"].get("stacks", {})) if meta["frozen_stacks"] else 0
    print(f"exported {source} (step {'?' if meta['step'] is None else meta['step']}) to {args.out}: model.safetensors "
          f"({size / 2**20:.1f} MiB{f', {frozen} frozen stacks as stored' if frozen else ''}), config.json, "
          f"vocab.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
