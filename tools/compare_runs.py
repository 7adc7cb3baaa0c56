"""Compare runs: held-out bits/char over characters seen and over training time, and a table of the best.

    python tools/compare_runs.py runs/a runs/b runs/c                 # table, and compare.png
    python tools/compare_runs.py runs/a runs/b --labels small,large --out plots/ab.png
    python tools/compare_runs.py runs/a runs/b --no-png               # the table alone

Prints a markdown table, one line per run: the best held-out loss (nats and bits/char) and the
step, characters seen and training seconds at which it was reached, the final held-out loss, and
the mean training throughput (characters seen / training seconds). Then writes one PNG of two
panels (FIG_INCHES at DPI = 1600 x 600 pixels), one line per run: held-out bits/char against
characters seen, and against training wall time. A step logged twice (a run resumed from an
earlier checkpoint) counts once, with its latest record.
The PNG needs matplotlib (an optional extra); without it the table is still printed.
A run without an evaluation yet is left out, said in one warning line.
Exit status: 0 done, 2 no run / no history at all / bad --labels / no matplotlib for the PNG.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from plot_history import EmptyHistory, HistoryError, _num, read_run_history  # noqa: E402  (the history plots' own rules)

COMPARE_PNG = "compare.png"
FIG_INCHES = (16, 6)
DPI = 100
LN2 = math.log(2.0)
FIELDS = ("step", "chars_seen", "heldout_loss", "wall_s")
MATPLOTLIB_MISSING = "compare_runs needs matplotlib for the PNG: pip install matplotlib (or --no-png)"


def load_run(run: str | Path) -> list[dict]:
    """The run's records sorted by step, one per step (the latest of a repeated step).

    run: a run folder or a history.jsonl path."""
    _, path, records = read_run_history(run)
    missing = [k for k in FIELDS if any(k not in r for r in records)]
    if missing:
        raise HistoryError(f"{path}: records lack {', '.join(missing)} (not a minagi history)")
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def summarize(label: str, records: list[dict]) -> dict:
    """One table line: best and final held-out (nats, bits/char), where the best was reached, mean char/s."""
    scored = [r for r in records if r["heldout_loss"] is not None]
    best = min(scored, key=lambda r: (r["heldout_loss"], r["step"])) if scored else dict.fromkeys(FIELDS)
    last = records[-1]
    return {"run": label, "records": len(records), "last_step": last["step"],
            "best_nats": best["heldout_loss"], "best_bpc": _bits(best["heldout_loss"]),
            "best_step": best["step"], "best_chars": best["chars_seen"], "best_wall_s": best["wall_s"],
            "final_nats": last["heldout_loss"], "final_bpc": _bits(last["heldout_loss"]),
            "mean_chars_per_s": last["chars_seen"] / last["wall_s"] if last["wall_s"] else None}


def _bits(nats: float | None) -> float | None:
    return None if nats is None else nats / LN2


def format_table(rows: list[dict]) -> str:
    """A markdown table of summarize()'s lines; a figure the history lacks is '-'."""
    def cell(value, fmt):
        return "-" if value is None else format(value, fmt)

    head = ["run", "best nats", "best bits/char", "at step", "at characters", "at wall s",
            "final nats", "final bits/char", "mean char/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        cells = [r["run"], cell(r["best_nats"], ".4f"), cell(r["best_bpc"], ".4f"), cell(r["best_step"], "d"),
                 cell(r["best_chars"], ",d"), cell(r["best_wall_s"], ",.1f"), cell(r["final_nats"], ".4f"),
                 cell(r["final_bpc"], ".4f"), cell(r["mean_chars_per_s"], ",.0f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out_path: Path) -> tuple[int, int]:
    """Two panels, held-out bits/char over characters seen and over wall seconds; (width, height) in pixels."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, and no GUI toolkit is imported
    import matplotlib.pyplot as plt

    fig, (by_chars, by_time) = plt.subplots(1, 2, figsize=FIG_INCHES, dpi=DPI, layout="constrained")
    fig.suptitle(f"held-out loss of {len(runs)} run(s)")
    for label, records in runs.items():
        bpc = [_num(r["heldout_loss"]) / LN2 for r in records]
        marker = "o" if len(records) <= 30 else None  # a few records: show where they are
        by_chars.plot([_num(r["chars_seen"]) for r in records], bpc, marker=marker, label=label)
        by_time.plot([_num(r["wall_s"]) for r in records], bpc, marker=marker, label=label)
    by_chars.set(title="against characters seen", xlabel="characters seen", ylabel="held-out bits/char")
    by_time.set(title="against training time", xlabel="training wall time (s)", ylabel="held-out bits/char")
    for ax in (by_chars, by_time):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(out_path, dpi=DPI)
    plt.close(fig)
    return FIG_INCHES[0] * DPI, FIG_INCHES[1] * DPI


def labels_for(runs: list[str], given: str | None) -> list[str]:
    """--labels split at commas, or each run folder's name (the path as given where names repeat)."""
    if given is not None:
        labels = [s.strip() for s in given.split(",")]
        if len(labels) != len(runs):
            raise HistoryError(f"--labels gives {len(labels)} label(s) for {len(runs)} run(s)")
        if len(set(labels)) != len(labels):
            raise HistoryError(f"--labels repeats a label: {given}")
        return labels
    names = [Path(r).name if Path(r).name != "history.jsonl" else Path(r).parent.name for r in runs]
    return names if len(set(names)) == len(names) else list(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (or their history.jsonl)")
    p.add_argument("--out", metavar="PNG", default=COMPARE_PNG, help=f"the figure (default {COMPARE_PNG})")
    p.add_argument("--labels", help="comma-separated names for the runs, in order (default: folder names)")
    p.add_argument("--no-png", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    try:
        labels = labels_for(args.runs, args.labels)
        runs, left_out = {}, []
        for label, run in zip(labels, args.runs):
            try:
                runs[label] = load_run(run)
            except EmptyHistory as e:  # a run just started, or stopped before its first evaluation
                left_out.append(e)
        if not runs:
            raise left_out[0] if len(left_out) == 1 else HistoryError(
                f"none of the {len(left_out)} runs has an evaluation yet: nothing to compare")
        for e in left_out:
            print(f"warning: {e}: left out", file=sys.stderr)
    except (HistoryError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table([summarize(label, records) for label, records in runs.items()]))
    if args.no_png:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(MATPLOTLIB_MISSING, file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        width, height = plot(runs, out)
    except OSError as e:
        print(f"error: --out {out}: cannot write it ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"wrote {out} ({width}x{height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
