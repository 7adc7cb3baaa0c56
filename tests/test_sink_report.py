"""tools/sink_report.py: the load table of a real tiny checkpoint (numbers, and the text that prints
them), the table's arithmetic on known loads, the heatmap, and the one-line errors."""
import math
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from minagi.data import heldout_batches, load_corpus
from minagi.loading import load_trained

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import sink_report  # noqa: E402
from tiny import run_tiny, tiny_text

E, K, ROWS, BATCH, CONTEXT, EVAL_BATCHES = 4, 2, 2, 4, 16, 2
TINY = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", f"model.context={CONTEXT}",
        f"pool.n_experts={E}", f"pool.top_k={K}", "pool.d_expert=32",
        "train.steps=4", f"train.batch_size={BATCH}", "train.warmup_steps=2", "train.eval_every=4",
        f"train.eval_batches={EVAL_BATCHES}", "train.device=cpu"]




@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return run_tiny(tmp_path_factory.mktemp("sink"), None, settings=TINY).run_dir / "best.pt"


def _table(ckpt: Path, n_batches: int = EVAL_BATCHES, top: int = 5) -> tuple[dict, list[dict]]:
    """The report's data the way main builds it: the run's own held-out batches."""
    model, vocab, loaded = load_trained(ckpt)
    data = loaded.config.data
    corpus = load_corpus(data.path, data.heldout_fraction, data.cache_dir, vocab=vocab)
    batches = heldout_batches(corpus.heldout_ids, BATCH, CONTEXT, n_batches, loaded.config.train.seed)
    diagnostics = sink_report.route_heldout(model, batches, "cpu")
    return sink_report.sink_table(diagnostics, K, model.pool_cfg.sink_ratio, top), diagnostics


def test_per_row_loads_sum_to_characters_times_top_k(ckpt):
    table, diagnostics = _table(ckpt)
    n = EVAL_BATCHES * BATCH * CONTEXT
    assert (table["characters"], table["top_k"], table["routed"], table["n_experts"]) == (n, K, n * K, E)
    assert len(table["rows"]) == ROWS
    for row, d in zip(table["rows"], diagnostics):
        assert sum(row["load"]) == row["routed"] == n * K and row["characters"] == n
        assert sum(b["load"] for b in row["busiest"]) == n * K  # E = 4 <= top 5: every expert listed
        loads = [b["load"] for b in row["busiest"]]
        assert loads == sorted(loads, reverse=True)
        assert row["fair_share"] == n * K / E
        for b in row["busiest"]:
            assert b["share"] == b["load"] / n and b["ratio"] == b["load"] / (n * K / E)
            assert b["share"] <= 1.0  # an expert is picked at most once per character
        # The same counts as the pool's own diagnostic, with the pool's threshold.
        assert (row["sinks"], row["dead"], row["path"]) == (d["sinks"], d["dead"], d["path"])
        assert max(b["ratio"] for b in row["busiest"]) == pytest.approx(d["max_over_fair"])
        assert 0.0 < row["entropy_bits"] <= math.log2(E) + 1e-12
        assert row["entropy_fraction"] == pytest.approx(row["entropy_bits"] / 2)
        assert row["dropped_fraction"] == 0.0  # capacity_factor 0: dropless
        assert row["max_vio"] == pytest.approx(d["max_over_fair"] - 1) == pytest.approx(d["max_vio"])
    assert table["max_vio"] == pytest.approx(sum(r["max_vio"] for r in table["rows"]) / ROWS)


def test_printed_table_shows_the_same_numbers_as_the_data(ckpt, capsys):
    table, _ = _table(ckpt)
    assert sink_report.main([str(ckpt.parent)]) == 0  # a run folder: its best.pt, as sample.py reads one
    out = capsys.readouterr().out
    assert out.startswith(f"checkpoint {ckpt.parent / 'best.pt'} (step")
    n = table["characters"]
    assert f"characters {n}, top_k {K}, routed {n * K}" in out
    assert f"MaxVio (busiest over fair share - 1), mean over rows {table['max_vio']:.3f}\n" in out
    blocks = re.split(r"\n(?=row \d+:)", out)[1:]
    assert len(blocks) == ROWS
    for block, row in zip(blocks, table["rows"]):
        head = block.splitlines()[0]
        assert head.startswith(f"row {row['row']}: path {row['path']}, sinks {row['sinks']}, "
                               f"dead {row['dead']}, entropy {row['entropy_bits']:.3f} bits")
        assert head.endswith(f", max_vio {row['max_vio']:.3f}")
        printed = [tuple(line.split()) for line in block.splitlines()[2:] if line.strip()]
        assert [(int(e), int(load)) for e, load, _, _ in printed] == \
            [(b["expert"], b["load"]) for b in row["busiest"]]
        assert sum(int(load) for _, load, _, _ in printed) == n * K
        # Printed to 2 decimals: equal to the data within half a unit of the last digit.
        assert [float(share.rstrip("%")) for _, _, share, _ in printed] == \
            pytest.approx([100 * b["share"] for b in row["busiest"]], abs=0.00501)
        assert [float(ratio) for *_, ratio in printed] == \
            pytest.approx([b["ratio"] for b in row["busiest"]], abs=0.00501)


def test_top_limits_the_listed_experts_and_the_rest_line_keeps_the_sum(ckpt, capsys):
    assert sink_report.main([str(ckpt), "--top", "2", "--batches", "1"]) == 0
    out = capsys.readouterr().out
    n = BATCH * CONTEXT
    assert f"characters {n}, top_k {K}, routed {n * K}" in out
    for block in re.split(r"\n(?=row \d+:)", out)[1:]:
        lines = [line.split() for line in block.splitlines()[2:] if line.strip()]
        assert len(lines) == 3 and lines[2][0] == "rest" and lines[2][2:] == ["(2", "experts)"]
        assert sum(int(line[1]) for line in lines) == n * K


def test_table_arithmetic_on_known_loads():
    # 8 characters, top_k 2, 4 experts: fair share 4 routed rows each.
    sink = {"row": 0, "path": "loop", "chars": 8, "load": [8, 8, 0, 0], "dropped_fraction": 0.25,
            "padding_ratio": 1.0}
    even = {**sink, "row": 1, "load": [4, 4, 4, 4], "dropped_fraction": 0.0}
    table = sink_report.sink_table([sink, even], top_k=2, sink_ratio=1.5, top=1)
    assert (table["characters"], table["routed"], table["n_experts"]) == (8, 16, 4)
    a, b = table["rows"]
    assert a["busiest"] == [{"expert": 0, "load": 8, "share": 1.0, "ratio": 2.0}]  # ties: lower id first
    assert (a["sinks"], a["dead"], a["entropy_bits"], a["entropy_fraction"]) == (2, 2, 1.0, 0.5)
    assert a["dropped_fraction"] == 0.25
    assert (b["sinks"], b["dead"], b["entropy_bits"], b["entropy_fraction"]) == (0, 0, 2.0, 1.0)
    assert (a["max_vio"], b["max_vio"], table["max_vio"]) == (1.0, 0.0, 0.5)  # busiest / fair - 1, then the mean
    assert sink_report.entropy_bits([0, 0]) == 0.0


def test_one_expert_has_an_entropy_fraction_of_one_not_a_division_by_log2_1():
    """With E = 1 every routed row goes to the one expert: as even as E = 1 allows, so the fraction is 1.0
    (log2 1 = 0 would divide by zero)."""
    row = {"row": 0, "path": "loop", "chars": 8, "load": [8], "dropped_fraction": 0.0, "padding_ratio": 1.0}
    (only,) = sink_report.sink_table([row], top_k=1, sink_ratio=1.5)["rows"]
    assert (only["entropy_bits"], only["entropy_fraction"], only["sinks"], only["dead"]) == (0.0, 1.0, 0, 0)


def test_a_row_that_routed_nothing_counts_no_dead_experts():
    """Dead means never picked while others were: with nothing routed (every row dropped) no expert is
    singled out, as minagi.diagnostics.summarise counts it."""
    row = {"row": 0, "path": "loop", "chars": 8, "load": [0, 0, 0, 0], "dropped_fraction": 1.0, "padding_ratio": 0.0}
    (empty,) = sink_report.sink_table([row], top_k=2, sink_ratio=1.5)["rows"]
    assert (empty["routed"], empty["dead"], empty["sinks"], empty["entropy_bits"]) == (0, 0, 0, 0.0)


def test_heatmap_is_a_png_of_the_reported_size(ckpt, tmp_path, capsys):
    pytest.importorskip("matplotlib", exc_type=ImportError)  # a broken install skips too
    png = tmp_path / "load.png"
    assert sink_report.main([str(ckpt), "--batches", "1", "--heatmap", str(png)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    w, h = map(int, re.fullmatch(rf"wrote {re.escape(str(png))} \((\d+)x(\d+)\)", last).groups())
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24]) == (w, h) == (800, 300)


def test_heatmap_without_matplotlib_is_one_line_and_exit_2_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert sink_report.main([str(tmp_path / "missing.pt"), "--heatmap", str(tmp_path / "h.png")]) == 2
    assert capsys.readouterr().err == "sink_report needs matplotlib for --heatmap: pip install matplotlib\n"


def test_data_outside_the_vocabulary_is_one_line_naming_the_character(ckpt, tmp_path, capsys):
    other = tmp_path / "other.txt"
    other.write_text("zebra \u00e9clair " * 40, encoding="utf-8")
    assert sink_report.main([str(ckpt), "--data", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "\u00e9" in err


def test_a_too_short_text_names_it_and_a_skipped_file_is_one_warning_line(ckpt, tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("ab" * 20, encoding="utf-8")
    assert sink_report.main([str(ckpt), "--data", str(short)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {short}: its held-out split has ")
    assert "the checkpoint's model.context" in err and "pass --data with a longer text" in err
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text(tiny_text(), encoding="utf-8")
    (folder / "b.txt").write_bytes("caf\xe9".encode("latin-1"))  # skipped, said
    assert sink_report.main([str(ckpt), "--data", str(folder), "--batches", "1"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(warned) == 1 and warned[0].startswith("warning: ") and "b.txt" in warned[0]


def test_missing_checkpoint_is_one_stderr_line_and_exit_2(tmp_path):
    missing = tmp_path / "nope.pt"
    done = subprocess.run([sys.executable, "tools/sink_report.py", str(missing)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0]


def test_a_negative_top_is_refused_in_one_line_not_read_as_all(ckpt, capsys):
    # 0 lists every expert; a negative count is a slip, not another way to say all.
    with pytest.raises(SystemExit) as exit_:
        sink_report.main([str(ckpt), "--top", "-1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: argument --top: must be >= 0, got -1 (see --help)\n"


def test_top_0_lists_every_expert_and_no_rest_line(ckpt, capsys):
    """--help says 0 = all: accepted, and each row lists all E experts with nothing left for a "rest" line."""
    assert sink_report.main([str(ckpt), "--top", "0", "--batches", "1"]) == 0
    blocks = re.split(r"\n(?=row \d+:)", capsys.readouterr().out)[1:]
    assert len(blocks) == ROWS
    for block in blocks:
        lines = [line.split() for line in block.splitlines()[2:] if line.strip()]
        assert sorted(int(line[0]) for line in lines) == list(range(E))
    loads = [8, 0, 1, 3, 2, 5, 4, 7]  # more experts than the default 5
    row = {"row": 0, "path": "loop", "chars": 15, "load": loads, "dropped_fraction": 0.0, "padding_ratio": 1.0}
    busiest = sink_report.sink_table([row], top_k=2, sink_ratio=1.5, top=0)["rows"][0]["busiest"]
    assert [b["expert"] for b in busiest] == [0, 7, 5, 6, 3, 4, 2, 1]
