"""The routing study's tables and plots, from the folder tools/routing_study.py wrote.

    python tools/routing_report.py OUT              # OUT/tables.md (also printed) and OUT/<comparison>.png

Per run, from its history's last record and its full pass (tools/evaluate.py): held-out bits/char of
the full pass and of the history, MaxVio (the last interval's, mean over rows and worst row), dead
experts and sinks (summed over rows), characters (an upcycled run counts its twin's). Per recipe: the
mean over seeds of the full pass, its seed spread (max - min), the difference from today's recipe and
whether it exceeds the larger of the two recipes' spreads, and char/s measured alone (the speed stage;
"-" without it). Then one table per comparison of issue 24's study, each with a PNG of held-out bits
(history) and MaxVio against characters, one line per run (needs matplotlib; without it the tables
alone, and a note). Exit status: 0 written, 2 no plan.json in OUT.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from minagi.diagnostics import max_vio, mean_max_vio
from minagi.runlog import read_history

BASELINE = "moe"
COMPARISONS = [  # (file stem, title, recipes)
    ("shared", "1. Shared expert (1 shared + top-(k-1), the same active compute), balance off and on",
     ["moe", "nobalance", "shared_nobalance", "shared"]),
    ("sigmoid", "2. Sigmoid scores + aux-free bias (no balance term) against softmax + balance term",
     ["moe", "sigmoid_auxfree"]),
    ("scope", "3. Balance scope: today's (the default), batch, sequence", ["moe", "scope_batch", "scope_sequence"]),
    ("scope_accum", "3b. Balance scope with accumulation (the step as 4 micro-batches): the step's counts against "
     "each micro-batch's", ["moe", "accum_step", "accum_batch"]),
    ("upcycle", "4. Upcycled from the dense twin against from scratch, equal total characters (the twin's counted)",
     ["moe", "dense_half", "upcycled"]),
    ("dense", "5. Every recipe against the dense twin, at equal characters and at equal wall-clock",
     ["moe", "nobalance", "shared_nobalance", "shared", "sigmoid_auxfree", "scope_batch", "scope_sequence",
      "accum_step", "accum_batch", "upcycled", "dense", "dense_wallclock"]),
]


def run_row(out: Path, run: dict) -> dict | None:
    """One run's figures; None when it has no history yet."""
    path = out / "histories" / f"{run['name']}.jsonl"
    if not path.is_file():
        return None
    records = read_history(path)
    last = records[-1]
    sinks = last["sinks"]
    evaluation = out / "eval" / f"{run['name']}.json"
    full = json.loads(evaluation.read_text())["overall"]["bits_per_char"] if evaluation.is_file() else None
    return {"run": run["name"], "recipe": run["recipe"], "seed": run["seed"], "steps": last["step"],
            "chars": run["chars_before"] + last["chars_seen"], "full_bits": full, "history_bits": last["heldout_bpc"],
            "max_vio": mean_max_vio(sinks), "worst_max_vio": max((max_vio(r["load"]) for r in sinks), default=None),
            "dead": sum(r["dead"] for r in sinks) if sinks else None,
            "sinks": sum(r["sinks"] for r in sinks) if sinks else None,
            "curve": [(run["chars_before"] + r["chars_seen"], r["heldout_bpc"], mean_max_vio(r["sinks"]))
                      for r in records]}


def speeds(out: Path) -> dict[str, float]:
    path = out / "speed" / "speed.json"
    if not path.is_file():
        return {}
    results = json.loads(path.read_text())["results"]
    return {Path(r["profile"]).stem: r["chars_per_s"] for r in results if r.get("chars_per_s")}


def recipe_rows(rows: list[dict], labels: dict[str, str], rate: dict[str, float]) -> dict[str, dict]:
    """Per recipe: seeds, mean full pass, spread, MaxVio and dead means, char/s; then the difference
    from the baseline and whether it exceeds the spreads."""
    out = {}
    for recipe in dict.fromkeys(r["recipe"] for r in rows):
        mine = [r for r in rows if r["recipe"] == recipe]
        full = [r["full_bits"] for r in mine if r["full_bits"] is not None]
        out[recipe] = {"recipe": recipe, "label": labels.get(recipe, recipe), "seeds": len(mine),
                       "chars": max(r["chars"] for r in mine),
                       "full": sum(full) / len(full) if full else None,
                       "spread": max(full) - min(full) if len(full) > 1 else None,
                       "max_vio": _mean([r["max_vio"] for r in mine]), "dead": _mean([r["dead"] for r in mine]),
                       "chars_per_s": rate.get("dense" if recipe.startswith("dense") else
                                               "moe" if recipe == "upcycled" else recipe)}
    base = out.get(BASELINE)
    for r in out.values():
        r["delta"] = r["full"] - base["full"] if base and base["full"] is not None and r["full"] is not None else None
        spreads = [s for s in (r["spread"], base["spread"] if base else None) if s is not None]
        r["beyond"] = (abs(r["delta"]) > max(spreads)) if r["delta"] is not None and spreads and r is not base else None
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _f(value, fmt: str = ".4f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def runs_table(rows: list[dict]) -> list[str]:
    lines = ["| run | steps | characters | full pass, bits/char | history, bits/char | MaxVio (mean over rows) "
             "| worst row | dead | sinks |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['run']} | {r['steps']} | {r['chars']:,} | {_f(r['full_bits'])} | {_f(r['history_bits'])} | "
              f"{_f(r['max_vio'], '.3f')} | {_f(r['worst_max_vio'], '.3f')} | {_f(r['dead'], 'd')} | "
              f"{_f(r['sinks'], 'd')} |" for r in rows]
    return lines


def recipes_table(by_recipe: dict[str, dict], keys: list[str], dense_rate: float | None) -> list[str]:
    lines = ["| recipe | seeds | characters | full pass, mean bits/char | seed spread | vs today's recipe | "
             "beyond the spreads | MaxVio | dead | char/s alone | / twin's |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for key in keys:
        r = by_recipe.get(key)
        if r is None:
            continue
        rate = r["chars_per_s"]
        beyond = "-" if r["beyond"] is None else ("yes" if r["beyond"] else "no")
        lines.append(f"| {r['label']} (`{key}`) | {r['seeds']} | {r['chars']:,} | {_f(r['full'])} | "
                     f"{_f(r['spread'])} | {_f(r['delta'], '+.4f')} | {beyond} | {_f(r['max_vio'], '.3f')} | "
                     f"{_f(r['dead'], '.1f')} | {_f(rate, ',.0f')} | "
                     f"{_f(rate / dense_rate if rate and dense_rate else None, '.2f')} |")
    return lines


def plot(path: Path, title: str, rows: list[dict]) -> bool:
    """Held-out bits (history) and MaxVio against characters, one line per run; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (bits, vio) = plt.subplots(1, 2, figsize=(16, 6), dpi=100, layout="constrained")
    colours = {recipe: f"C{i}" for i, recipe in enumerate(dict.fromkeys(r["recipe"] for r in rows))}
    for i, r in enumerate(rows):
        chars = [c / 1e6 for c, _, _ in r["curve"]]
        style = dict(color=colours[r["recipe"]], linestyle="-" if i % 2 == 0 else "--", marker="o", label=r["run"])
        bits.plot(chars, [b for _, b, _ in r["curve"]], **style)
        if any(v is not None for _, _, v in r["curve"]):
            vio.plot(chars, [math.nan if v is None else v for _, _, v in r["curve"]], **style)
    bits.set(xlabel="characters seen (M; an upcycled run counts its twin's)", ylabel="held-out bits/char (history)",
             title=title[:90])
    vio.set(xlabel="characters seen (M)", ylabel="MaxVio, mean over rows (interval)", title="MaxVio")
    bits.legend(fontsize="small")
    fig.savefig(path)
    plt.close(fig)
    return True


def report(out: Path) -> str:
    plan = json.loads((out / "plan.json").read_text())
    rows = [row for run in plan["runs"] if (row := run_row(out, run)) is not None]
    labels = {run["recipe"]: run["label"] for run in plan["runs"]}
    rate = speeds(out)
    by_recipe = recipe_rows(rows, labels, rate)
    lines = [f"Routing study: {plan['profile']} (twin {plan['dense_profile']}), {plan['steps']} steps, seeds "
             f"{', '.join(map(str, plan['seeds']))}, {plan['parallel']} runs at once, compile {plan['compile']}; "
             f"equal wall-clock ratio R = {plan['wallclock_ratio']:.3f} ({plan['wallclock_ratio_source']})"
             + (f"; not run (not in this config): {', '.join(plan['skipped_recipes'])}" if plan["skipped_recipes"]
                else ""), "", "## Every run", "", *runs_table(rows), "", "## By recipe", "",
             *recipes_table(by_recipe, list(by_recipe), rate.get("dense"))]
    pngs = []
    for stem, title, keys in COMPARISONS:
        chosen = [r for r in rows if r["recipe"] in keys]
        if not any(r["recipe"] != BASELINE for r in chosen):
            continue
        lines += ["", f"## {title}", "", *recipes_table(by_recipe, keys, rate.get("dense"))]
        if plot(out / f"{stem}.png", title, chosen):
            pngs.append(f"{stem}.png")
            lines += ["", f"![{title}]({stem}.png)"]
    if not pngs:
        lines += ["", "(no PNG: matplotlib is not installed)"]
    text = "\n".join(lines) + "\n"
    (out / "tables.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python tools/routing_report.py OUT (the folder tools/routing_study.py wrote)", file=sys.stderr)
        return 2
    out = Path(argv[0])
    if not (out / "plan.json").is_file():
        print(f"error: {out}: no plan.json (not a tools/routing_study.py folder)", file=sys.stderr)
        return 2
    print(report(out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
