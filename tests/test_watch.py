"""minagi/watch.py: `train.tensorboard = true` mirrors every history record to TensorBoard in the run folder
(skipped without the optional extra); without the package such a run stops at its start, in one line."""
import math
import sys

import pytest

from minagi import train as train_py
from minagi import watch
from minagi.config import ConfigError
from minagi.runlog import read_history
from tiny import run_tiny, tiny_argv


def test_without_tensorboard_a_run_asking_for_it_stops_at_its_start_in_one_line(tmp_path, data_path, monkeypatch,
                                                                                 capsys):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # makes `import tensorboard` raise ImportError
    assert train_py.main(tiny_argv(tmp_path, data_path, "train.tensorboard=true")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: train.tensorboard = true needs the tensorboard package")
    assert "pip install tensorboard" in err[0]
    assert not (tmp_path / "runs" / "run").exists()  # refused before the run folder is made
    with pytest.raises(ConfigError, match="pip install tensorboard"):  # the library says the same
        run_tiny(tmp_path, data_path, "train.tensorboard=true", run_name="library")
    assert not (tmp_path / "runs" / "library").exists()


def test_every_number_of_a_record_has_a_tag_new_row_measures_included():
    record = {"step": 30, "train_loss": 2.0, "heldout_loss": 1.5, "heldout_bpc": 1.5 / math.log(2), "lr": 1e-3,
              "chars_per_s": 100.0, "mfu": None, "mem_allocated": None, "rss_bytes": 7, "new_field": 3,
              "sinks": [{"row": 2, "path": "grouped", "load": [3, 1], "max_over_fair": 1.5, "sinks": 0,
                         "top_expert": 0, "max_vio": 0.5, "dead": 0}],
              "dequants": {"forward": 2.0, "replay": None}, "offload": None, "dropped_fraction": float("nan")}
    tags = dict(watch.scalars(record))
    assert tags == {"loss/train": 2.0, "bits_per_char/train": pytest.approx(2.0 / math.log(2)),
                    "loss/heldout": 1.5, "bits_per_char/heldout": pytest.approx(1.5 / math.log(2)),
                    "train/lr": 1e-3, "speed/chars_per_s": 100.0, "memory/rss_bytes": 7, "other/new_field": 3,
                    "routing/max_over_fair/row2": 1.5, "routing/sinks/row2": 0, "routing/max_vio/row2": 0.5,
                    "routing/dead/row2": 0, "dequants/forward": 2.0}


def test_the_load_histogram_has_every_field_of_tensorboards_histogram_by_hand():
    """The raw histogram's samples are expert ids, each repeated by its load: [3, 1, 2] is 0, 0, 0, 1, 2, 2,
    so min 0, max 2, num 6, sum 5, sum of squares 9, and bucket i (ending at i + 0.5) counts expert i."""
    assert watch._load_histogram([3, 1, 2]) == {
        "min": 0.0, "max": 2.0, "num": 6.0, "sum": 5.0, "sum_squares": 9.0,
        "bucket_limits": [0.5, 1.5, 2.5], "bucket_counts": [3.0, 1.0, 2.0]}
    assert watch._load_histogram([3, 1]) == {
        "min": 0.0, "max": 1.0, "num": 4.0, "sum": 1.0, "sum_squares": 1.0,
        "bucket_limits": [0.5, 1.5], "bucket_counts": [3.0, 1.0]}
    # Dead experts at both ends: the samples run from expert 1 to 2 (min and max are theirs, not 0 and 3).
    edges = watch._load_histogram([0, 4, 1, 0])
    assert (edges["min"], edges["max"], edges["num"], edges["sum"]) == (1.0, 2.0, 5.0, 6.0)
    assert watch._load_histogram([0, 0])["num"] == 0.0  # nothing routed: no error


def test_the_mirror_holds_each_records_scalars_and_a_load_histogram_a_row(tmp_path, data_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    result = run_tiny(tmp_path, data_path, "train.tensorboard=true")
    history = read_history(result.run_dir / "history.jsonl")
    events = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    tags = events.Tags()

    def series(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]
    steps = [r["step"] for r in history]
    assert steps == [3, 6]
    for tag, field in (("loss/heldout", "heldout_loss"), ("loss/train", "train_loss"), ("train/lr", "lr"),
                       ("speed/chars_per_s", "chars_per_s"), ("memory/rss_bytes", "rss_bytes")):
        assert series(tag) == [(r["step"], pytest.approx(r[field], rel=1e-6)) for r in history], tag
    assert series("bits_per_char/heldout") == [(r["step"], pytest.approx(r["heldout_bpc"], rel=1e-6)) for r in history]
    for name in ("max_over_fair", "sinks", "dead", "top_share", "padding_ratio"):
        assert f"routing/{name}/row0" in tags["scalars"], name
    assert "speed/mfu" not in tags["scalars"]  # null on the CPU: left out, not a zero
    (histogram, *_), last = events.Histograms("routing/load/row0"), history[-1]["sinks"][0]["load"]
    assert histogram.step == 3 and events.Histograms("routing/load/row0")[-1].histogram_value.bucket == last
    assert sum(history[0]["sinks"][0]["load"]) == histogram.histogram_value.num
