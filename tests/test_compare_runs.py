"""tools/compare_runs.py: the table of best / final held-out loss from synthetic histories (and a real
tiny run's), a repeated step counted once, labels, the PNG, and the one-line errors.

The PNG test needs matplotlib (an optional extra) and is skipped without it.
"""
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import compare_runs  # noqa: E402
from tiny import run_tiny

LN2 = math.log(2)


def _record(step: int, heldout: float | None, wall: float, chars_per_step: int = 1000) -> dict:
    return {"step": step, "chars_seen": step * chars_per_step, "train_loss": 3.0, "heldout_loss": heldout,
            "heldout_bpc": None if heldout is None else heldout / LN2, "wall_s": wall,
            "chars_per_s": chars_per_step / 0.5}


def _run(root: Path, name: str, records: list[dict]) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    """fast: best 2.0 nats at step 20 then worse; slow: keeps improving, best last."""
    fast = _run(tmp_path, "fast", [_record(10, 3.0, 5.0), _record(20, 2.0, 10.0), _record(30, 2.5, 15.0)])
    slow = _run(tmp_path, "slow", [_record(10, 3.5, 20.0, 500), _record(20, 2.2, 40.0, 500)])
    return [fast, slow]


def test_table_holds_best_and_final_heldout_and_where_the_best_was_reached(two_runs):
    fast, slow = (compare_runs.summarize(p.name, compare_runs.load_run(p)) for p in two_runs)
    assert (fast["best_nats"], fast["best_step"], fast["best_chars"], fast["best_wall_s"]) == (2.0, 20, 20_000, 10.0)
    assert fast["best_bpc"] == pytest.approx(2.0 / LN2) and fast["final_nats"] == 2.5
    assert fast["final_bpc"] == pytest.approx(2.5 / LN2)
    assert fast["mean_chars_per_s"] == 30_000 / 15.0  # characters seen over training seconds
    assert (slow["best_nats"], slow["best_step"], slow["final_nats"]) == (2.2, 20, 2.2)
    table = compare_runs.format_table([fast, slow]).splitlines()
    assert table[0] == ("| run | best nats | best bits/char | at step | at characters | at wall s | "
                        "final nats | final bits/char | mean char/s |")
    assert table[1] == "|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    assert table[2] == f"| fast | 2.0000 | {2 / LN2:.4f} | 20 | 20,000 | 10.0 | 2.5000 | {2.5 / LN2:.4f} | 2,000 |"
    assert table[3] == f"| slow | 2.2000 | {2.2 / LN2:.4f} | 20 | 10,000 | 40.0 | 2.2000 | {2.2 / LN2:.4f} | 250 |"


def test_a_step_logged_twice_counts_once_with_its_latest_record(tmp_path):
    # Resumed from the step-10 checkpoint after step 20 was logged: step 20 is logged again.
    run = _run(tmp_path, "resumed", [_record(10, 3.0, 5.0), _record(20, 1.0, 10.0),
                                     _record(20, 2.0, 10.5), _record(30, 1.9, 16.0)])
    records = compare_runs.load_run(run)
    assert [r["step"] for r in records] == [10, 20, 30] and records[1]["heldout_loss"] == 2.0
    assert compare_runs.summarize("r", records)["best_nats"] == 1.9


def test_with_equal_heldout_losses_the_best_is_the_earliest_step():
    """best.pt keeps the first minimum (the trainer saves only on a strictly lower loss): the table names
    the step whose checkpoint best.pt holds, not a later tie."""
    run = [_record(10, 3.0, 5.0), _record(20, 2.0, 10.0), _record(30, 2.0, 15.0), _record(40, 2.5, 20.0)]
    best = compare_runs.summarize("tie", run)
    assert (best["best_nats"], best["best_step"], best["best_chars"], best["best_wall_s"]) == (2.0, 20, 20_000, 10.0)


def test_missing_figures_are_dashes_not_zeros(tmp_path):
    run = _run(tmp_path, "odd", [_record(0, None, 0.0)])
    row = compare_runs.summarize("odd", compare_runs.load_run(run))
    assert compare_runs.format_table([row]).splitlines()[2] == "| odd | - | - | - | - | - | - | - | - |"


def test_reads_a_real_tiny_run(tmp_path, capsys):
    run = run_tiny(tmp_path, None, "train.steps=4", "train.eval_every=2").run_dir
    assert compare_runs.main([str(run), str(run / "history.jsonl"), "--labels", "a,b", "--no-png"]) == 0
    lines = capsys.readouterr().out.splitlines()
    a, b = (line.split(" | ") for line in lines[2:])
    assert len(lines) == 4 and (a[0], b[0]) == ("| a", "| b") and a[1:] == b[1:]  # the same run twice
    history = [json.loads(line) for line in (run / "history.jsonl").read_text().splitlines()]
    best = min(history, key=lambda r: r["heldout_loss"])
    assert f"| {best['heldout_loss']:.4f} | {best['heldout_bpc']:.4f} | {best['step']} |" in lines[2]


def test_default_labels_are_folder_names_or_the_paths_where_names_repeat(tmp_path):
    assert compare_runs.labels_for(["runs/a", "runs/b/history.jsonl"], None) == ["a", "b"]
    assert compare_runs.labels_for(["x/run", "y/run"], None) == ["x/run", "y/run"]
    assert compare_runs.labels_for(["x/run", "y/run"], "one, two") == ["one", "two"]


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_writes_a_png_of_two_panels_of_the_stated_size(two_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib", exc_type=ImportError)  # a broken install skips too
    out = tmp_path / "plots" / "cmp.png"
    assert compare_runs.main([*map(str, two_runs), "--out", str(out)]) == 0
    assert png_size(out) == (1600, 600) and out.stat().st_size > 20_000  # drawn, not a blank canvas
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out} (1600x600)"


def test_without_matplotlib_the_table_prints_then_one_line_and_exit_2(two_runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    out = tmp_path / "cmp.png"
    assert compare_runs.main([*map(str, two_runs), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out.startswith("| run |") and len(captured.out.splitlines()) == 4
    assert captured.err == compare_runs.MATPLOTLIB_MISSING + "\n" and not out.exists()
    assert compare_runs.main([*map(str, two_runs), "--no-png"]) == 0  # the table alone needs nothing
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("case, expected", [
    ("no folder", "no such run folder"), ("not a history", "records lack chars_seen, heldout_loss, wall_s"),
    ("labels", "--labels gives 1 label(s) for 2 run(s)"),
])
def test_bad_runs_or_labels_are_one_line_and_exit_2(two_runs, tmp_path, capsys, case, expected):
    target = tmp_path / "bad"
    if case != "no folder":
        target.mkdir()
    if case == "not a history":
        (target / "history.jsonl").write_text('{"step": 1}\n')
    runs = [str(two_runs[0]), str(two_runs[1] if case == "labels" else target)]
    assert compare_runs.main([*runs, "--no-png", *(["--labels", "only"] if case == "labels" else [])]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: ") and expected in captured.err


@pytest.mark.parametrize("case", ["no history", "empty history"])
def test_a_run_without_an_evaluation_yet_is_left_out_in_one_warning_line(two_runs, tmp_path, capsys, case):
    """A run just started (or stopped before its first evaluation) beside finished ones: the table of the others."""
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    if case == "empty history":
        (fresh / "history.jsonl").write_text("")
    assert compare_runs.main([str(two_runs[0]), str(fresh), "--no-png"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("| run |") and len(captured.out.splitlines()) == 3  # header, rule, one run
    assert captured.err.count("\n") == 1 and captured.err.startswith("warning: ") and "left out" in captured.err
    assert compare_runs.main([str(fresh), "--no-png"]) == 2  # nothing at all to compare: the run's own reason
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {fresh}") and "no evaluation has run yet" in err
    assert compare_runs.main([str(fresh), str(fresh), "--no-png", "--labels", "a,b"]) == 2
    assert capsys.readouterr().err == "error: none of the 2 runs has an evaluation yet: nothing to compare\n"


def test_command_line_exit_status_2_for_a_missing_run(tmp_path):
    done = subprocess.run([sys.executable, "tools/compare_runs.py", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such run folder"]
