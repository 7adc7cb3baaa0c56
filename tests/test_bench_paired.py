"""tools/bench_paired.py times variants of one profile in one process, their steps alternating."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_paired  # noqa: E402

TINY = ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
        "pool.top_k=2", "pool.d_expert=32", "train.batch_size=4"]


def test_each_variant_gets_a_block_every_round_and_is_paired_against_the_first(tmp_path, capsys, monkeypatch):
    order = []
    run = bench_paired.Variant.run
    monkeypatch.setattr(bench_paired.Variant, "run", lambda self, steps: (order.append((self.name, steps)),
                                                                          run(self, steps))[1])
    out = tmp_path / "paired.json"
    args = ["--device", "cpu", "--profile", "cpu_tiny", "--rounds", "3", "--block", "2", "--warmup", "1",
            "--json", str(out), "--variant", "", "--variant", "pool.dispatch=loop train.batch_size=2"]
    assert bench_paired.main(args + [a for item in TINY for a in ("--set", item)]) == 0
    report = json.loads(out.read_text())
    first, second = report["results"]
    assert report["meta"]["recompiles_in_rounds"] == 0
    assert first["variant"] == "(as the profile)" and first["paired_speed"] == 1.0
    assert second["variant"] == "pool.dispatch=loop train.batch_size=2" and len(second["times_ms"]) == 3
    # the warm-ups, then rounds whose order rotates: a slow spell of the host falls on both
    assert order == [("(as the profile)", 1), (second["variant"], 1), ("(as the profile)", 2), (second["variant"], 2),
                     (second["variant"], 2), ("(as the profile)", 2), ("(as the profile)", 2), (second["variant"], 2)]
    assert second["chars_per_s"] == 2 * 16 / second["median_step_ms"] * 1e3  # its own batch of 2 x 16
    assert "| pool.dispatch=loop train.batch_size=2 |" in capsys.readouterr().out


def test_a_bad_setting_is_one_line_and_exit_2(capsys):
    assert bench_paired.main(["--device", "cpu", "--profile", "cpu_tiny", "--variant", "train.compile=sometimes"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_paired: ") and "train.compile" in err and err.count("\n") == 1


def test_graphs_compiled_during_the_rounds_are_reported(capsys):
    import torch
    torch._dynamo.reset()
    args = ["--device", "cpu", "--profile", "cpu_tiny", "--rounds", "1", "--block", "1", "--warmup", "0",
            "--variant", "train.compile=rows"]
    assert bench_paired.main(args + [a for item in TINY for a in ("--set", item)]) == 0
    torch._dynamo.reset()
    err = capsys.readouterr().err
    assert err.startswith("bench_paired: 1 graph(s) compiled during the timed rounds") and err.count("\n") == 1  # a row's one


def test_a_variant_at_a_revision_trains_with_that_revisions_code_beside_this_one(tmp_path, capsys):
    out = tmp_path / "paired.json"
    args = ["--device", "cpu", "--profile", "cpu_tiny", "--rounds", "1", "--block", "1", "--warmup", "1",
            "--json", str(out), "--variant", "", "--variant", "@HEAD pool.dispatch=loop"]
    assert bench_paired.main(args + [a for item in TINY for a in ("--set", item)]) == 0
    first, second = json.loads(out.read_text())["results"]
    assert second["variant"] == "@HEAD pool.dispatch=loop" and len(second["times_ms"]) == 1
    assert "minagi_HEAD.trainer" in sys.modules and "minagi_HEAD.config" in sys.modules  # the revision's own package
    assert sys.modules["minagi_HEAD.trainer"].train_step is not bench_paired.train_step


def test_an_unknown_revision_is_one_line_and_exit_2(capsys):
    assert bench_paired.main(["--device", "cpu", "--profile", "cpu_tiny", "--variant", "@no-such-revision"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_paired: @no-such-revision: git archive failed") and err.count("\n") == 1


def test_a_revision_unpacked_beforehand_trains_where_git_is_not(tmp_path, capsys, monkeypatch):
    trees = tmp_path / "trees"
    base = ["--device", "cpu", "--profile", "cpu_tiny", "--trees", str(trees)]
    assert bench_paired.main(base + ["--unpack", "--variant", "@HEAD~0", "--variant", "pool.dispatch=loop"]) == 0
    assert (trees / "minagi_HEAD_x7e_0" / "minagi_HEAD_x7e_0" / "trainer.py").exists()
    said = capsys.readouterr().out
    assert said.startswith("bench_paired: @HEAD~0 unpacked in ") and said.count("\n") == 1  # the @REV variants only
    monkeypatch.setattr(bench_paired, "REPO", tmp_path / "no-repository")  # git archive would fail now
    out = tmp_path / "paired.json"
    args = base + ["--rounds", "1", "--block", "1", "--warmup", "1", "--json", str(out), "--variant", "",
                   "--variant", "@HEAD~0 pool.dispatch=loop"]
    assert bench_paired.main(args + [a for item in TINY for a in ("--set", item)]) == 0
    assert json.loads(out.read_text())["results"][1]["variant"] == "@HEAD~0 pool.dispatch=loop"
    assert "minagi_HEAD_x7e_0.trainer" in sys.modules
    assert bench_paired.main(base + ["--variant", "@HEAD~1"]) == 2  # not unpacked, and no git: one line
    assert capsys.readouterr().err.startswith("bench_paired: @HEAD~1: git archive failed")


def test_every_revision_gets_a_package_of_its_own():
    names = [bench_paired.package_name(rev) for rev in ("HEAD~1", "HEAD^1", "HEAD_1", "v1.0", "v1_0", "main/x")]
    assert len(set(names)) == len(names) and all(n.isidentifier() for n in names)
    assert bench_paired.package_name("3cccc1c") == "minagi_3cccc1c"


def test_unpack_without_trees_is_one_line_and_exit_2(capsys):
    assert bench_paired.main(["--device", "cpu", "--profile", "cpu_tiny", "--unpack", "--variant", "@HEAD"]) == 2
    assert capsys.readouterr().err == "bench_paired: --unpack needs --trees DIR (where the revisions' code is kept)\n"


def test_a_kept_tree_is_unpacked_again_when_its_revision_moved_and_never_left_half_made(tmp_path, monkeypatch, capsys):
    import subprocess
    head = subprocess.run(["git", "-C", str(bench_paired.REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    tree = bench_paired.unpack_revision("HEAD", tmp_path)
    assert (tree / "COMMIT").read_text() == head
    (tree / "COMMIT").write_text("an older commit")  # as if HEAD had moved since it was unpacked
    assert (bench_paired.unpack_revision("HEAD", tmp_path) / "COMMIT").read_text() == head

    def broken(rev, work, name):  # an unpack that stops half-way
        (work / name).mkdir()
        (work / name / "config.py").write_text("")
        raise KeyboardInterrupt
    monkeypatch.setattr(bench_paired, "_unpack_into", broken)
    with pytest.raises(KeyboardInterrupt):
        bench_paired.unpack_revision("HEAD~0", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [tree.name]  # no tree, no leftovers
    assert bench_paired.main(["--device", "cpu", "--profile", "cpu_tiny", "--trees", str(tmp_path), "--unpack",
                              "--variant", "pool.dispatch=loop"]) == 2
    assert capsys.readouterr().err == "bench_paired: --unpack: no variant names a revision (@REV)\n"
