"""tools/bench_decode.py runs end to end on the CPU (a tiny model, few characters) and says what it measured."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_decode  # noqa: E402

TINY = ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
        "pool.top_k=2", "pool.d_expert=32"]


def test_bench_reports_every_path_its_bound_and_its_checks(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--profile", "cpu_tiny", "--device", "cpu", "--chars", "24", "--reference-chars", "12", "--streams", "3",
            "--copy-mib", "4", "--vocab", "40", "--threads", "1", "--json", str(out)]
    for item in TINY:
        args += ["--set", item]
    assert bench_decode.main(args) == 0
    data = json.loads(out.read_text())
    rows = {(r["path"], r["graphs"], r["streams"]): r for r in data["results"]}
    assert set(rows) == {("reference (generate, uncached)", "-", 1), ("static", "off", 1), ("static", "off", 3)}
    for r in rows.values():
        assert r["char_per_s"] > 0 and r["bound_char_per_s"] > r["char_per_s"]
    # bf16 bytes of one character: qkv + proj, router, two experts of 3 x 32 x 32, head, embedding row
    assert data["weight_bytes_per_char"] == 2 * (4 * 32 * 32 + 4 * 32 + 2 * 3 * 32 * 32 + 40 * 32 + 32)
    assert data["checks"]["greedy_first_difference"] is None  # greedy: the same text as the reference
    assert data["checks"]["stream_first_difference"] == {"0": None, "1": None}
    assert data["slide_ms"]["keep"] == 14 and data["slide_ms"]["ms"] > 0 and not data["slide_ms"]["graphed"]
    table = capsys.readouterr().out
    assert "| path | graphs | streams | char/s |" in table and "the same as the uncached reference's" in table


def test_bench_of_offloaded_experts_runs_both_ways_of_reading_them(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--profile", "cpu_tiny", "--device", "cpu", "--chars", "16", "--streams", "3", "--vocab", "40",
            "--threads", "1", "--json", str(out)]
    for item in TINY + ["experts.frozen=true", "experts.blocksize=32", "experts.offload=cpu"]:
        args += ["--set", item]
    assert bench_decode.main(args) == 0
    data = json.loads(out.read_text())
    rows = {(r["path"], r["streams"]): r for r in data["results"]}
    assert set(rows) == {(f"offloaded, read {read}", s) for read in ("experts", "rows") for s in (1, 3)}
    assert all(r["char_per_s"] > 0 for r in rows.values())
    expert = 3 * 32 * 32 // 2 + 3 * 32 * 32 // 32 * 4  # an expert's NF4 codes and absmax, both stacks
    assert rows[("offloaded, read rows", 1)]["h2d_bytes_per_step"] == expert * 4  # the row: 4 experts
    assert rows[("offloaded, read experts", 3)]["h2d_bytes_per_step"] == expert * 3 * 2  # 3 streams x top_k
    assert data["greedy_experts_equals_rows"]
    assert "| offloaded experts read by |" in capsys.readouterr().out


def test_steady_steps_leave_out_those_written_before_the_first_read():
    import torch
    data = bench_decode.timed(lambda: iter([["a"]] * 40), torch.device("cpu"), every=16)
    assert data["steps"] == 24  # steps 17..40: the first read came after 16 were queued
    # Reading every step, the first read comes after 2 (a read leaves the step queued last running).
    assert bench_decode.timed(lambda: iter([["a"]] * 40), torch.device("cpu"))["steps"] == 38


def test_the_default_json_is_a_name_git_ignores(tmp_path):
    # Run from the repository root, the benchmark writes its default file there: never a change to commit.
    repo = Path(__file__).resolve().parent.parent
    default = bench_decode.parse_args([]).json
    done = subprocess.run(["git", "check-ignore", "--quiet", "--no-index", default], cwd=repo)
    if done.returncode == 128:
        pytest.skip("not a git checkout")
    assert done.returncode == 0, f"{default} is not ignored by .gitignore"
