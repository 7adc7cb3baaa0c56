"""tools/plot_history.py: the series it reads from a real tiny run's history, the PNG it writes, its errors.

The PNG tests need matplotlib (an optional extra) and are skipped without it.
"""
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from minagi.runlog import read_history

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import plot_history  # noqa: E402
from tiny import run_tiny

TINY = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", "model.context=16",
        "pool.n_experts=4", "pool.top_k=2", "pool.d_expert=32",
        "train.steps=6", "train.batch_size=4", "train.warmup_steps=2", "train.eval_every=2",
        "train.eval_batches=2", "train.device=cpu"]




@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A finished tiny CPU run with 3 history records (steps 2, 4, 6) and 2 rows."""
    return run_tiny(tmp_path_factory.mktemp("plot"), None, settings=TINY).run_dir


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, which a PNG must start with: no PIL needed."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def test_series_are_the_history_in_bits_per_char_and_per_row_sink_ratios(run_dir):
    records = read_history(run_dir / "history.jsonl")
    series = plot_history.load_series(run_dir)
    assert series["steps"] == [2, 4, 6]
    assert series["chars"] == [r["chars_seen"] for r in records] == [2 * 64, 4 * 64, 6 * 64]
    assert series["train_bpc"] == pytest.approx([r["train_loss"] / math.log(2) for r in records])
    assert series["heldout_bpc"] == pytest.approx([r["heldout_loss"] / math.log(2) for r in records])
    assert all(v > 0 for v in series["chars_per_s"])
    # A CPU run has no allocator figures: resident memory instead, in GiB.
    assert series["memory_source"] == "rss"
    assert series["memory"]["resident (rss)"] == pytest.approx([r["rss_bytes"] / 2**30 for r in records])
    assert set(series["sink_ratio"]) == {0, 1}
    for row in (0, 1):
        assert series["sink_ratio"][row] == [r["sinks"][row]["max_over_fair"] for r in records]
        assert all(1.0 <= v <= 4 / 2 for v in series["sink_ratio"][row])  # fair share <= max <= E/K x fair
    assert series["sink_threshold"] == 4.0


def test_allocator_fields_replace_resident_memory_when_present(run_dir, tmp_path):
    records = read_history(run_dir / "history.jsonl")
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    with open(gpu / "history.jsonl", "w") as f:
        for i, r in enumerate(records):
            f.write(json.dumps({**r, "mem_allocated": (i + 1) * 2**30, "mem_reserved": 2 * 2**30,
                                "mem_peak_allocated": 3 * 2**30, "mem_peak_reserved": 4 * 2**30,
                                "chars_per_s": None}) + "\n")
    series = plot_history.load_series(gpu / "history.jsonl")  # a history file works as well as its folder
    assert series["memory_source"] == "allocator"
    assert series["memory"] == {"allocated": [1.0, 2.0, 3.0], "reserved": [2.0] * 3,
                                "peak allocated": [3.0] * 3, "peak reserved": [4.0] * 3}
    assert all(math.isnan(v) for v in series["chars_per_s"])  # None: a gap, not a zero
    assert series["sink_threshold"] is None                    # no run.json beside it


def test_writes_a_non_empty_png_of_the_stated_pixel_size(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", exc_type=ImportError)  # a broken install skips too
    out = tmp_path / "plots"
    assert plot_history.main([str(run_dir), "--out", str(out)]) == 0
    png = out / plot_history.HISTORY_PNG
    w, h = plot_history.FIG_INCHES[0] * plot_history.DPI, plot_history.FIG_INCHES[1] * plot_history.DPI
    assert png_size(png) == (w, h) == (1600, 1000)
    assert png.stat().st_size > 20_000  # four drawn panels, not a blank canvas
    assert capsys.readouterr().out.strip() == f"wrote {png} (1600x1000)"


def test_default_output_is_history_png_in_the_run_folder(run_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib", exc_type=ImportError)  # a broken install skips too
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("*.pt"))
    assert plot_history.main([str(copy)]) == 0
    assert png_size(copy / "history.png") == (1600, 1000)


def test_missing_matplotlib_is_one_line_and_exit_2(run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert plot_history.main([str(run_dir), "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == "plot_history needs matplotlib: pip install matplotlib\n"
    assert not (tmp_path / "history.png").exists()


@pytest.mark.parametrize("case", ["no folder", "no history", "empty history"])
def test_missing_run_or_empty_history_is_one_line_naming_it_and_exit_2(tmp_path, capsys, case):
    target = tmp_path / "run"
    if case != "no folder":
        target.mkdir()
    if case == "empty history":
        (target / "history.jsonl").write_text("")
    assert plot_history.main([str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(target) in err
    assert {"no folder": "no such run folder", "no history": "no history.jsonl",
            "empty history": "empty history"}[case] in err


def test_command_line_exit_status_2_for_a_missing_run(tmp_path):
    done = subprocess.run([sys.executable, "tools/plot_history.py", str(tmp_path / "nope")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'}: no such run folder"]
