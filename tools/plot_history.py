"""Plot a run's history.jsonl: loss, throughput, memory and sink ratio over characters seen.

    python tools/plot_history.py runs/<name>              # writes runs/<name>/history.png
    python tools/plot_history.py runs/<name> --out plots  # writes plots/history.png

One PNG, HISTORY_PNG, of 2 x 2 panels (FIG_INCHES at DPI = 1600 x 1000 pixels):
  loss        train and held-out cross-entropy in bits/char
  throughput  training characters per second
  memory      GPU allocator figures (allocated, reserved, their interval peaks) when the run has
              them, else the process resident memory (rss_bytes); GiB
  sinks       per row, the busiest expert's load over the fair share (max_over_fair), with the
              run's pool.sink_ratio as a dashed line
Needs matplotlib (an optional extra). Exit status: 0 written, 2 no run / empty history / no matplotlib.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from minagi.config import upgrade_config_dict
from minagi.runlog import read_history, read_run_info

HISTORY_PNG = "history.png"
FIG_INCHES = (16, 10)
DPI = 100
GIB = 2**30
LN2 = math.log(2.0)
ALLOCATOR_FIELDS = ("mem_allocated", "mem_reserved", "mem_peak_allocated", "mem_peak_reserved")
MATPLOTLIB_MISSING = "plot_history needs matplotlib: pip install matplotlib"


class HistoryError(ValueError):
    """No run folder, no history.jsonl, or no records in it; one line naming the path."""


class EmptyHistory(HistoryError):
    """A run with no evaluation yet: nothing to plot or compare (compare_runs leaves it out)."""


def _num(value) -> float:
    """A history number as a float; None (a non-finite value, or absent) becomes NaN: a gap in the line."""
    return math.nan if value is None else float(value)


def read_run_history(run: str | Path) -> tuple[Path, Path, list[dict]]:
    """(run folder, history path, its records) of a run folder or a history.jsonl path; HistoryError
    naming the path for a missing folder or file, or an empty history."""
    path = Path(run)
    if not path.exists():
        raise HistoryError(f"{path}: no such run folder")
    if path.is_dir():
        run_dir, path = path, path / "history.jsonl"
        if not path.is_file():
            raise EmptyHistory(f"{run_dir}: no history.jsonl in this folder (not a run folder, or no "
                               "evaluation has run yet)")
    else:
        run_dir = path.parent
    records = read_history(path)
    if not records:
        raise EmptyHistory(f"{path}: empty history (no evaluation has run yet)")
    return run_dir, path, records


def load_series(run: str | Path) -> dict:
    """The plotted series as plain lists, all indexed like `chars`.

    run: a run folder or a history.jsonl path. Keys: chars, train_bpc, heldout_bpc, chars_per_s,
    memory ({label: [GiB]}), memory_source ("allocator" or "rss"), sink_ratio ({row: [ratio]}),
    sink_threshold (pool.sink_ratio from run.json, None when unknown), steps.
    """
    run_dir, path, records = read_run_history(run)

    missing = [k for k in ("step", "chars_seen", "train_loss", "heldout_bpc", "chars_per_s")
               if any(k not in r for r in records)]
    if missing:
        raise HistoryError(f"{path}: records lack {', '.join(missing)} (not a minagi history)")
    out = {"steps": [r["step"] for r in records],
           "chars": [_num(r["chars_seen"]) for r in records],
           "train_bpc": [_num(r["train_loss"]) / LN2 for r in records],
           "heldout_bpc": [_num(r["heldout_bpc"]) for r in records],
           "chars_per_s": [_num(r["chars_per_s"]) for r in records]}
    # GPU runs fill the allocator fields; CPU runs leave them None and only rss_bytes is measured.
    if any(r.get(k) is not None for r in records for k in ALLOCATOR_FIELDS):
        out["memory_source"] = "allocator"
        out["memory"] = {k.removeprefix("mem_").replace("_", " "): [_num(r.get(k)) / GIB for r in records]
                         for k in ALLOCATOR_FIELDS}
    else:
        out["memory_source"] = "rss"
        out["memory"] = {"resident (rss)": [_num(r.get("rss_bytes")) / GIB for r in records]}
    rows = sorted({d["row"] for r in records for d in (r.get("sinks") or [])})
    by_row = [{d["row"]: d for d in (r.get("sinks") or [])} for r in records]
    out["sink_ratio"] = {row: [_num(b[row]["max_over_fair"]) if row in b else math.nan for b in by_row]
                         for row in rows}
    try:
        config = upgrade_config_dict(read_run_info(run_dir)["config"])  # format 1 kept it under [model]
        out["sink_threshold"] = float(config["pool"]["sink_ratio"])
    except (OSError, ValueError, KeyError, TypeError):
        out["sink_threshold"] = None
    return out


def plot(series: dict, out_path: Path, title: str) -> tuple[int, int]:
    """Draw the four panels into out_path; returns its (width, height) in pixels."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, and no GUI toolkit is imported
    import matplotlib.pyplot as plt

    x = series["chars"]
    marker = "o" if len(x) <= 30 else None  # a few records: show where they are
    fig, axes = plt.subplots(2, 2, figsize=FIG_INCHES, dpi=DPI, layout="constrained")
    (loss, speed), (memory, sinks) = axes
    fig.suptitle(title)

    loss.plot(x, series["train_bpc"], marker=marker, label="train")
    loss.plot(x, series["heldout_bpc"], marker=marker, label="held-out")
    loss.set(title="loss", ylabel="bits/char")

    speed.plot(x, series["chars_per_s"], marker=marker, color="tab:green")
    speed.set(title="throughput", ylabel="characters / s")
    speed.set_ylim(bottom=0)

    for label, values in series["memory"].items():
        memory.plot(x, values, marker=marker, label=label)
    memory.set(title="memory (GPU allocator)" if series["memory_source"] == "allocator"
               else "memory (process resident; no GPU allocator figures)", ylabel="GiB")
    top = max((v for vs in series["memory"].values() for v in vs if v == v), default=0.0)
    memory.set_ylim(0, top * 1.15 or 1.0)  # headroom for the legend

    for row, values in series["sink_ratio"].items():
        sinks.plot(x, values, marker=marker, label=f"row {row}")
    if series["sink_threshold"] is not None:
        sinks.axhline(series["sink_threshold"], color="tab:red", linestyle="--",
                      label=f"sink ratio {series['sink_threshold']:g}")
    sinks.axhline(1.0, color="grey", linestyle=":", linewidth=1)  # perfectly balanced
    sinks.set(title="busiest expert load / fair share, per row", ylabel="max / fair")
    sinks.set_ylim(bottom=0)

    for ax in axes.flat:
        ax.set_xlabel("characters seen")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", ncol=2 if len(ax.get_legend_handles_labels()[0]) > 6 else 1)
    fig.savefig(out_path, dpi=DPI)
    plt.close(fig)
    return FIG_INCHES[0] * DPI, FIG_INCHES[1] * DPI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a run folder (or its history.jsonl)")
    p.add_argument("--out", metavar="DIR", help=f"folder for {HISTORY_PNG} (default: the run folder)")
    args = p.parse_args(argv)
    try:
        series = load_series(args.run)
    except (HistoryError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(MATPLOTLIB_MISSING, file=sys.stderr)
        return 2
    run = Path(args.run)
    run_dir = run if run.is_dir() else run.parent
    out_dir = Path(args.out) if args.out else run_dir
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"error: --out {out_dir}: cannot create it ({e.strerror})", file=sys.stderr)
        return 2
    out_path = out_dir / HISTORY_PNG
    width, height = plot(series, out_path, f"{run_dir.name}: {len(series['chars'])} records, "
                                           f"step {series['steps'][-1]}")
    print(f"wrote {out_path} ({width}x{height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
