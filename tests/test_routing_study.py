"""tools/routing_study.py and tools/routing_report.py: the plan has every comparison of issue 24's study
with two seeds; a tiny study runs end to end on the CPU (speed stage, upcycling from its twin, the
full passes, the tables) and a second call goes on where the first stopped; the report's arithmetic
on known histories."""
import dataclasses
import json
import sys
from pathlib import Path

import pytest

from minagi.config import PoolConfig
from tiny import TINY, write_tiny_text

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import routing_report  # noqa: E402
import routing_study  # noqa: E402

HAS_SCOPE = "balance_scope" in {f.name for f in dataclasses.fields(PoolConfig)}


def test_the_plan_has_every_comparison_with_two_seeds_at_the_scale_asked(tmp_path, capsys):
    out = tmp_path / "out"
    assert routing_study.main([str(out), "--steps", "200", "--dry-run", "--runs", str(tmp_path / "runs")]) == 0
    plan = json.loads((out / "plan.json").read_text())
    runs = {r["name"]: r for r in plan["runs"]}
    recipes = ["moe", "nobalance", "shared_nobalance", "shared", "sigmoid_auxfree",
               *(["scope_batch", "scope_sequence", "accum_step", "accum_batch"] if HAS_SCOPE else []),
               "dense_half", "upcycled", "dense", "dense_wallclock"]
    assert list(runs) == [f"{r}-{s}" for s in (1337, 1338) for r in recipes]
    assert plan["skipped_recipes"] == ([] if HAS_SCOPE else ["scope_batch", "scope_sequence", "accum_step",
                                                              "accum_batch"])
    step_chars = 64 * 512
    steps = {r: runs[f"{r}-1337"]["steps"] for r in recipes}
    assert steps["moe"] == steps["shared"] == steps["dense"] == 200
    assert (steps["dense_half"], steps["upcycled"], steps["dense_wallclock"]) == (100, 100, 296)  # R = 1.48
    up = runs["upcycled-1338"]
    assert up["chars_before"] == 100 * step_chars  # equal total characters, the twin's counted
    assert up["train"][-2:] == ["--init", f"{tmp_path}/runs/dense_half-1338/best.pt"]
    sets = lambda name: [a for a in runs[name]["train"] if "=" in a]  # noqa: E731
    assert {"pool.shared_experts=1", "pool.top_k=3", "pool.balance_coef=0"} <= set(sets("shared_nobalance-1337"))
    assert {"pool.router_score=sigmoid", "pool.aux_free_bias=true", "pool.balance_coef=0"} <= set(
        sets("sigmoid_auxfree-1337"))
    if HAS_SCOPE:  # the same 64 sequences a step as 4 micro-batches of 16, the term over the step or each
        assert {"train.accum_steps=4", "train.batch_size=16", "pool.balance_scope=step"} <= set(sets("accum_step-1337"))
        assert {"train.accum_steps=4", "train.batch_size=16", "pool.balance_scope=batch"} <= set(
            sets("accum_batch-1338"))
        assert steps["accum_step"] == steps["accum_batch"] == 200
    assert "model.mlp=dense" in sets("dense_wallclock-1337") and "train.steps=296" in sets("dense_wallclock-1337")
    assert runs["dense-1337"]["train"][2:4] == ["--profile", "h200_gutenberg_dense"]
    assert {"train.seed=1338", "train.compile=false", "train.eval_every=50", "train.warmup_steps=20"} <= set(
        sets("moe-1338"))
    evaluate = runs["moe-1337"]["evaluate"]
    assert "--strip-gutenberg" in evaluate and evaluate[evaluate.index("--data") + 1].endswith(
        "gutenberg/pg11_alice_in_wonderland.txt")
    assert "moe-1337: 200 steps" in capsys.readouterr().out


def test_the_accumulation_recipes_need_a_batch_that_splits_in_four(tmp_path):
    """A step of 6 sequences cannot be 4 equal micro-batches: no accum_* runs are planned (and none asked for
    by name exists); 2 x 16 sequences can, as 4 x 8."""
    assert routing_study.main([str(tmp_path / "a"), "--steps", "8", "--dry-run", "--set", "train.batch_size=6"]) == 0
    names = [r["name"] for r in json.loads((tmp_path / "a" / "plan.json").read_text())["runs"]]
    assert names and not any(n.startswith("accum_") for n in names)
    assert routing_study.main([str(tmp_path / "b"), "--steps", "8", "--dry-run", "--recipes", "accum_batch",
                               "--set", "train.batch_size=16", "--set", "train.accum_steps=2"]) == 0
    run, = json.loads((tmp_path / "b" / "plan.json").read_text())["runs"][:1]
    assert run["name"] == "accum_batch-1337"
    train = run["train"]  # the recipe's sets come after --set's, and win
    assert train.index("train.accum_steps=4") > train.index("train.accum_steps=2")
    assert train.index("train.batch_size=8") > train.index("train.batch_size=16")


def test_unknown_recipes_and_profiles_without_whole_held_out_files_are_one_line_errors(tmp_path, capsys):
    assert routing_study.main([str(tmp_path), "--recipes", "moe", "topk9", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --recipes: no recipe topk9 (the recipes: moe, ") and err.count("\n") == 1
    assert routing_study.main([str(tmp_path), "--profile", "cpu_tiny", "--dry-run"]) == 2
    assert "holds out no whole files" in capsys.readouterr().err


SIZE = [s for s in TINY if not s.startswith(("train.steps", "train.eval_every", "train.warmup_steps"))]


def test_a_tiny_study_runs_end_to_end_and_a_second_call_goes_on_from_what_is_done(tmp_path, capsys):
    text = write_tiny_text(tmp_path)
    out, runs = tmp_path / "out", tmp_path / "runs"
    args = [str(out), "--profile", "cpu_tiny", "--data", str(text), "--heldout", str(text), "--steps", "4",
            "--seeds", "3", "--recipes", "moe", "upcycled", "--parallel", "2", "--evals", "2",
            "--speed-steps", "1", "--speed-warmup", "1", "--runs", str(runs), "--device", "cpu",
            *[a for s in SIZE for a in ("--set", s)]]
    assert routing_study.main(args) == 0
    plan = json.loads((out / "plan.json").read_text())
    names = [r["name"] for r in plan["runs"]]
    assert names == ["moe-3", "dense_half-3", "upcycled-3"]  # upcycled brings its twin
    assert plan["wallclock_ratio_source"] == "speed stage" and plan["wallclock_ratio"] > 0
    for name in names:
        assert json.loads((out / "status" / f"{name}.json").read_text())["ok"]
        assert json.loads((out / "eval" / f"{name}.json").read_text())["overall"]["scored"] > 0
        assert (out / "histories" / f"{name}.jsonl").is_file() and (out / "runs" / f"{name}.json").is_file()
        assert not list((runs / name).glob("*.pt"))  # read, then removed
    upcycled = json.loads((out / "runs" / "upcycled-3.json").read_text())
    assert "--init" in upcycled["command"]
    tables = (out / "tables.md").read_text()
    assert "| upcycled-3 | 2 | 256 |" in tables  # 2 steps of 64 characters after the twin's 2
    assert "## 4. Upcycled from the dense twin" in tables and "| today's recipe (softmax, balance term) (`moe`) | 1 |" in tables
    capsys.readouterr()
    assert routing_study.main([*args, "--stages", "train", "report"]) == 0  # nothing left to run
    assert capsys.readouterr().out.count("'done_before': True") == 3


def history_line(step: int, chars: int, bpc: float, loads: list[list[int]]) -> str:
    sinks = [{"row": i, "load": load, "dead": load.count(0), "sinks": 0} for i, load in enumerate(loads)]
    return json.dumps({"step": step, "chars_seen": chars, "heldout_bpc": bpc, "sinks": sinks})


def test_the_report_gives_means_spreads_differences_and_maxvio_from_known_runs(tmp_path):
    runs = [{"name": f"{r}-{s}", "recipe": r, "label": r, "seed": s, "chars_before": 0}
            for r in ("moe", "shared") for s in (1, 2)]
    (tmp_path / "plan.json").write_text(json.dumps({
        "profile": "p", "dense_profile": "p_dense", "steps": 2, "seeds": [1, 2], "parallel": 2, "compile": "off",
        "wallclock_ratio": 1.5, "wallclock_ratio_source": "--wallclock-ratio", "skipped_recipes": [], "runs": runs}))
    for sub in ("histories", "eval"):
        (tmp_path / sub).mkdir()
    full = {"moe-1": 1.70, "moe-2": 1.72, "shared-1": 1.60, "shared-2": 1.61}
    loads = {"moe": [[4, 4, 4, 4], [8, 8, 0, 0]], "shared": [[6, 2, 4, 4], [4, 4, 4, 4]]}
    for r in runs:
        lines = [history_line(1, 64, 2.0, loads[r["recipe"]]), history_line(2, 128, 1.9, loads[r["recipe"]])]
        (tmp_path / "histories" / f"{r['name']}.jsonl").write_text("\n".join(lines) + "\n")
        (tmp_path / "eval" / f"{r['name']}.json").write_text(json.dumps({"overall": {"bits_per_char": full[r["name"]]}}))
    assert routing_report.main([str(tmp_path)]) == 0
    rows = [routing_report.run_row(tmp_path, r) for r in runs]
    assert rows[0]["max_vio"] == pytest.approx((0.0 + 1.0) / 2) and rows[0]["worst_max_vio"] == 1.0
    assert rows[0]["dead"] == 2 and rows[2]["max_vio"] == pytest.approx((0.5 + 0.0) / 2)
    by = routing_report.recipe_rows(rows, {}, {})
    assert by["moe"]["full"] == pytest.approx(1.71) and by["moe"]["spread"] == pytest.approx(0.02)
    assert by["shared"]["delta"] == pytest.approx(1.605 - 1.71) and by["shared"]["beyond"] is True
    table = (tmp_path / "tables.md").read_text()
    assert "| shared (`shared`) | 2 | 128 | 1.6050 | 0.0100 | -0.1050 | yes | 0.250 | 0.0 | - | - |" in table


def recipe_row(recipe: str, full_bits: float | None, chars: int = 128) -> dict:
    """A run_row as the report's per-recipe arithmetic reads it."""
    return {"recipe": recipe, "full_bits": full_bits, "chars": chars, "max_vio": None, "dead": None}


def test_a_difference_inside_the_larger_of_the_two_seed_spreads_is_not_beyond_them():
    """The difference must exceed both recipes' spreads: 0.06 is past today's 0.02 but inside the recipe's 0.10."""
    rows = [recipe_row("moe", 1.70), recipe_row("moe", 1.72), recipe_row("shared", 1.60), recipe_row("shared", 1.70)]
    by = routing_report.recipe_rows(rows, {}, {})
    assert by["shared"]["delta"] == pytest.approx(-0.06) and by["shared"]["spread"] == pytest.approx(0.10)
    assert by["shared"]["beyond"] is False


def test_the_baseline_row_compares_nothing_and_says_so_with_a_dash():
    """Today's recipe against itself is no finding: "-", neither yes nor no."""
    rows = [recipe_row("moe", 1.70), recipe_row("moe", 1.72), recipe_row("shared", 1.50), recipe_row("shared", 1.51)]
    by = routing_report.recipe_rows(rows, {}, {})
    assert by["moe"]["beyond"] is None and by["shared"]["beyond"] is True
    moe = routing_report.recipes_table(by, ["moe"], None)[2]
    assert moe == "| moe (`moe`) | 2 | 128 | 1.7100 | 0.0200 | +0.0000 | - | - | - | - | - |"


def test_a_recipe_with_one_seed_has_no_spread_rather_than_a_spread_of_zero():
    """One seed says nothing of the seed noise: the spread is "-", and with no spread on either side no
    difference can be called beyond it (a spread of 0.0 would make every difference "yes")."""
    rows = [recipe_row("moe", 1.70), recipe_row("shared", 1.60)]
    by = routing_report.recipe_rows(rows, {}, {})
    assert by["moe"]["spread"] is None and by["shared"]["spread"] is None and by["shared"]["beyond"] is None
    shared = routing_report.recipes_table(by, ["shared"], None)[2]
    assert shared == "| shared (`shared`) | 1 | 128 | 1.6000 | - | -0.1000 | - | - | - | - | - |"


def test_a_recipe_counts_the_characters_of_its_longest_seed():
    """A seed cut short does not shrink the recipe's characters (the column is the recipe's budget)."""
    rows = [recipe_row("moe", 1.70, chars=256), recipe_row("moe", 1.72, chars=128)]
    assert routing_report.recipe_rows(rows, {}, {})["moe"]["chars"] == 256


def test_the_upcycled_recipe_is_timed_at_todays_moe_rate_and_the_dense_ones_at_the_twins():
    """The speed stage times only full-length recipes: the upcycled MoE is today's MoE, so its char/s (and
    its ratio to the twin's) is moe's; dense_half and dense_wallclock are the twin."""
    rows = [recipe_row(r, 1.7) for r in ("moe", "upcycled", "dense_half", "dense_wallclock")]
    by = routing_report.recipe_rows(rows, {}, {"moe": 1000.0, "dense": 1500.0})
    assert [by[r]["chars_per_s"] for r in by] == [1000.0, 1000.0, 1500.0, 1500.0]
    upcycled = routing_report.recipes_table(by, ["upcycled"], 1500.0)[2]
    assert upcycled.endswith("| 1,000 | 0.67 |")
