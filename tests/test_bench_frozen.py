"""tools/bench_frozen.py runs every mode on a tiny CPU model and prints one row per mode."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_bench_frozen_runs_each_mode_and_counts_dequants(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "tools/bench_frozen.py", "--device", "cpu", "--small", "--steps", "1",
                           "--warmup", "1", "--modes", "recompute", "pin", "offload-sync", "trainable",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    stacks = results["pin"]["dequants_per_step"]["stacks"]
    assert results["recompute"]["dequants_per_step"]["replay"] == stacks == results["recompute"]["dequants_per_step"]["backward"]
    assert results["pin"]["dequants_per_step"]["backward"] == 0 and results["pin"]["dequants_per_step"]["pinned"] == stacks
    assert results["offload-sync"]["h2d_bytes_per_step"] > 0
    assert results["trainable"]["dequants_per_step"] is None and results["trainable"]["frozen_stored_bytes"] == 0
    assert done.stdout.count("\n| ") >= 4
