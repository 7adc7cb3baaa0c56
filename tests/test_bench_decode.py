"""tools/bench_decode.py runs end to end on the CPU (a tiny model, few characters) and says what it measured."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_decode  # noqa: E402

TINY = ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
        "pool.top_k=2", "pool.d_expert=32"]


def test_bench_reports_every_path_its_bound_and_its_checks(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--profile", "cpu_tiny", "--device", "cpu", "--chars", "24", "--today-chars", "12", "--streams", "3",
            "--copy-mib", "4", "--vocab", "40", "--threads", "1", "--json", str(out)]
    for item in TINY:
        args += ["--set", item]
    assert bench_decode.main(args) == 0
    data = json.loads(out.read_text())
    rows = {(r["path"], r["graphs"], r["streams"]): r for r in data["results"]}
    assert set(rows) == {("today (generate, cached)", "-", 1), ("static", "off", 1), ("static", "off", 3)}
    for r in rows.values():
        assert r["char_per_s"] > 0 and r["bound_char_per_s"] > r["char_per_s"]
    # bf16 bytes of one character: qkv + proj, router, two experts of 3 x 32 x 32, head, embedding row
    assert data["weight_bytes_per_char"] == 2 * (4 * 32 * 32 + 4 * 32 + 2 * 3 * 32 * 32 + 40 * 32 + 32)
    assert data["checks"]["greedy_first_difference"] is None  # greedy: the same text as today's path
    assert data["checks"]["stream_first_difference"] == {"0": None, "1": None}
    table = capsys.readouterr().out
    assert "| path | graphs | streams | char/s |" in table and "the same as today's path" in table
