"""Sink report: how a trained checkpoint routes held-out text, row by row.

    python tools/sink_report.py runs/<name>/best.pt
    python tools/sink_report.py runs/<name>/last.pt --data other.txt --batches 4 --top 0 \\
        --heatmap load.png --device cuda

Runs `--batches` held-out batches (the run's own: train.accum_steps x train.batch_size x
model.context characters each, drawn with train.seed exactly as the trainer's evaluation draws them) through the model and prints,
per row: the busiest experts (load, share of characters, ratio to the fair share N*K/E), the sink
count (experts over the pool's sink_ratio), dead experts, the routing entropy of the load
distribution, the dropped fraction, the padding ratio, the dispatch path and MaxVio (the busiest
expert's load over the fair share, minus 1: the Loss-Free Balancing paper's measure), with its mean
over the rows. `--heatmap` writes a
rows x experts PNG of each expert's share of its row's routed rows (needs matplotlib).
Exit status: 0 done, 2 bad checkpoint / data / device, or --heatmap without matplotlib.
"""
from __future__ import annotations

import math
import struct
import sys
import warnings
from pathlib import Path

import torch

from minagi import devices
from minagi.checkpoint import CheckpointError
from minagi.cli import OneLineParser, non_negative_int, one_line_warnings, positive_int
from minagi.config import ConfigError
from minagi.data import DataError, DataWarning, heldout_batches, load_corpus
from minagi.diagnostics import RoutingMeter, max_vio, step_counts
from minagi.loading import load_trained, resolve_model_path

MATPLOTLIB_MISSING = "sink_report needs matplotlib for --heatmap: pip install matplotlib"
USAGE_ERRORS = (CheckpointError, ConfigError, DataError, devices.DeviceError)


def entropy_bits(load: list[int]) -> float:
    """Shannon entropy (bits) of the load normalised to a distribution; 0 when nothing was routed."""
    total = sum(load)
    return -sum(n / total * math.log2(n / total) for n in load if n) if total else 0.0


def sink_table(diagnostics: list[dict], top_k: int, sink_ratio: float, top: int = 5) -> dict:
    """The report as plain data, from `RoutingMeter.read()` dicts (one per row).

    Returns {"characters", "top_k", "routed", "n_experts", "sink_ratio", "max_vio", "rows": [...]};
    each row: row, path, characters, routed, load (all experts), fair_share, busiest (the `top`
    busiest, 0 = all, each {expert, load, share, ratio}: share = load / characters, ratio = load /
    fair_share), sinks (experts with ratio > sink_ratio), dead, entropy_bits, entropy_fraction (of
    log2 E), dropped_fraction, padding_ratio, max_vio (max load / fair share - 1). The table's
    max_vio is the rows' mean (None without rows).
    """
    rows = []
    for d in diagnostics:
        load = list(d["load"])
        n_experts, routed, chars = len(load), sum(load), d["chars"]
        fair = routed / n_experts if routed else 0.0
        # Stable order: the busiest first, ties by expert id.
        order = sorted(range(n_experts), key=lambda e: (-load[e], e))
        busiest = [{"expert": e, "load": load[e],
                    "share": load[e] / chars if chars else 0.0,
                    "ratio": load[e] / fair if fair else 0.0}
                   for e in (order if top <= 0 else order[:top])]
        h = entropy_bits(load)
        rows.append({
            "row": d["row"], "path": d["path"], "characters": chars, "routed": routed, "load": load,
            "fair_share": fair, "busiest": busiest,
            "sinks": sum(1 for n in load if fair and n > sink_ratio * fair),
            "dead": sum(1 for n in load if n == 0) if routed else 0,
            "entropy_bits": h,
            "entropy_fraction": h / math.log2(n_experts) if n_experts > 1 else 1.0,
            "dropped_fraction": d["dropped_fraction"], "padding_ratio": d["padding_ratio"],
            "max_vio": max_vio(load),
        })
    chars = rows[0]["characters"] if rows else 0
    return {"characters": chars, "top_k": top_k, "routed": chars * top_k,
            "n_experts": len(rows[0]["load"]) if rows else 0, "sink_ratio": sink_ratio,
            "max_vio": sum(r["max_vio"] for r in rows) / len(rows) if rows else None, "rows": rows}


@torch.no_grad()
def route_heldout(model, batches, device: torch.device | str) -> list[dict]:
    """Sink diagnostics of `model` over `batches`: the routing counts its forwards return, summed."""
    device = torch.device(device)
    meter = RoutingMeter()
    with devices.autocast(device):
        for x, _ in batches:
            meter.add(step_counts(model(x.to(device)).routing))
    return meter.read(model.pool_cfg.sink_ratio)


def format_table(table: dict) -> str:
    """The printed report: the totals line, then one block per row."""
    e = table["n_experts"]
    lines = [f"characters {table['characters']}, top_k {table['top_k']}, routed {table['routed']}",
             f"experts {e} per row, fair share {table['routed'] / e if e else 0:.1f} routed rows each, "
             f"sink ratio {table['sink_ratio']:g}"]
    if table["max_vio"] is not None:
        lines.append(f"MaxVio (busiest over fair share - 1), mean over rows {table['max_vio']:.3f}")
    for r in table["rows"]:
        lines += ["",
                  f"row {r['row']}: path {r['path']}, sinks {r['sinks']}, dead {r['dead']}, "
                  f"entropy {r['entropy_bits']:.3f} bits = {r['entropy_fraction']:.3f} of log2({e}), "
                  f"dropped {r['dropped_fraction']:.4f}, padding {r['padding_ratio']:.3f}, "
                  f"max_vio {r['max_vio']:.3f}",
                  f"  {'expert':>6} {'load':>10} {'share':>8} {'x fair':>7}"]
        lines += [f"  {b['expert']:>6} {b['load']:>10} {b['share']:>8.2%} {b['ratio']:>7.2f}"
                  for b in r["busiest"]]
        if len(r["busiest"]) < e:
            rest = r["routed"] - sum(b["load"] for b in r["busiest"])
            lines.append(f"  {'rest':>6} {rest:>10} ({e - len(r['busiest'])} experts)")
    return "\n".join(lines)


def write_heatmap(table: dict, out_path: Path, title: str) -> tuple[int, int]:
    """rows x experts image of load / routed (each row sums to 1); returns (width, height) in pixels.

    About 0.3 inch per expert (8 to 24 inches wide) and 0.5 inch per row, at 100 dpi."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    share = [[n / r["routed"] if r["routed"] else 0.0 for n in r["load"]] for r in table["rows"]]
    n_rows, e = len(share), table["n_experts"]
    dpi = 100
    width_in, height_in = min(24, max(8, 2.5 + 0.3 * e)), min(24, max(3, 1.5 + 0.5 * n_rows))
    fig, ax = plt.subplots(figsize=(width_in, height_in), dpi=dpi, layout="constrained")
    image = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, interpolation="nearest")
    fig.colorbar(image, ax=ax, label=f"load / routed (fair = 1/{e})")
    ax.set(xlabel="expert", ylabel="row", title=title)
    ax.set_yticks(range(n_rows), [str(r["row"]) for r in table["rows"]])
    if e <= 32:
        ax.set_xticks(range(e))
    if e <= 16 and n_rows <= 16:  # small enough to print the numbers in the cells
        top = max(max(row) for row in share) or 1.0
        for i, row in enumerate(share):
            for j, v in enumerate(row):  # dark cells get white text (viridis is dark at its low end)
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize="small",
                        color="white" if v < 0.6 * top else "black")
    fig.savefig(out_path, dpi=dpi)
    plt.close(fig)
    # The size as written (inches x dpi can land a pixel short in floating point).
    return struct.unpack(">II", Path(out_path).read_bytes()[16:24])


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a minagi checkpoint (last.pt / best.pt), or a run folder (its best.pt, else last.pt)")
    p.add_argument("--data", help="held-out text from this corpus instead of the checkpoint's data.path")
    p.add_argument("--batches", type=positive_int,
                   help="held-out batches (default: the run's train.eval_batches)")
    p.add_argument("--top", type=non_negative_int, default=5,
                   help="busiest experts listed per row (0 = all; default 5)")
    p.add_argument("--heatmap", metavar="PNG", help="write a rows x experts load-share heatmap")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="default cpu")
    args = p.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warnings(categories=(DataWarning,))  # a skipped file: one line
        return _report(args)


def _report(args) -> int:
    if args.heatmap:
        try:  # before the model runs: fail fast
            import matplotlib  # noqa: F401
        except ImportError:
            print(MATPLOTLIB_MISSING, file=sys.stderr)
            return 2
    try:
        device = devices.choose_device(args.device)
        args.checkpoint = str(resolve_model_path(args.checkpoint))  # a run folder: its best.pt, else last.pt
        model, vocab, ckpt = load_trained(args.checkpoint, device)
        cfg = ckpt.config
        data_path = cfg.data.path if args.data is None else args.data
        corpus = load_corpus(data_path, cfg.data.heldout_fraction, cfg.data.cache_dir, vocab=vocab,
                             strip_gutenberg=cfg.data.strip_gutenberg,
                             heldout_files=cfg.data.heldout_files if args.data is None else ())
        if corpus.heldout_chars < cfg.model.context + 1:  # the checkpoint's context is fixed: only the text can change
            raise DataError(f"{data_path or 'the standard library'}: its held-out split has {corpus.heldout_chars:,} "
                            f"characters, and the checkpoint's model.context = {cfg.model.context} needs at least "
                            f"{cfg.model.context + 1:,}: pass --data with a longer text")
        n_batches = args.batches or cfg.train.eval_batches
        batches = heldout_batches(corpus.heldout_ids, cfg.train.batch_size, cfg.model.context,
                                  n_batches, cfg.train.seed, accum_steps=cfg.train.accum_steps)
    except USAGE_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not model.pools():
        print(f"error: {args.checkpoint}: a dense model (model.mlp = \"dense\") has no experts to report",
              file=sys.stderr)
        return 2
    # The run's own threshold, the one the history's `sinks` counts with.
    table = sink_table(route_heldout(model, batches, device), cfg.pool.top_k, cfg.pool.sink_ratio, args.top)
    print(f"checkpoint {args.checkpoint} (step {'?' if ckpt.step is None else ckpt.step}), held-out text of "
          f"{data_path or 'the standard library sources'}: {n_batches} batches x "
          + (f"{cfg.train.accum_steps} micro-batches x " if cfg.train.accum_steps > 1 else "")
          + f"{cfg.train.batch_size} x {cfg.model.context} characters, device {device.type}")
    print(format_table(table))
    if args.heatmap:
        try:
            width, height = write_heatmap(table, Path(args.heatmap),
                                          f"{Path(args.checkpoint).name}: expert load share per row")
        except OSError as e:
            print(f"error: --heatmap {args.heatmap}: {e.strerror}", file=sys.stderr)
            return 2
        print(f"wrote {args.heatmap} ({width}x{height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
