"""tools/bench_nf4.py runs end to end on the CPU (tiny sizes) and reports what it measured."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_nf4  # noqa: E402


@pytest.mark.parametrize("double_quant", [False, True])
def test_bench_reports_copy_and_reference_for_full_and_subset_with_their_byte_counts(tmp_path, capsys, double_quant):
    out = tmp_path / "bench.json"
    argv = ["--device", "cpu", "--small", "--repeat", "2", "--impls", "torch", "triton", "--json", str(out)]
    assert bench_nf4.main(argv + (["--double-quant"] if double_quant else [])) == 0
    data = json.loads(out.read_text())
    rows = {(r["case"], r["impl"]): r for r in data["results"]}
    assert set(rows) == {(c, i) for c in ("full", "subset") for i in ("copy", "torch")}  # no Triton on a CPU
    E, M, N = data["shape"]
    n_full, n_sub = E * M * N, data["subset"] * M * N
    per_element = (4 + (8 + 32 / 256 if double_quant else 32) / data["blocksize"]) / 8  # packed + absmax
    assert rows["full", "torch"]["bytes"] == pytest.approx(n_full * (per_element + 2), rel=1e-3)  # + bf16 out
    assert rows["subset", "torch"]["bytes"] == pytest.approx(n_sub * (per_element + 2), rel=1e-3)
    assert rows["full", "copy"]["bytes"] == 2 * 2 * n_full and rows["subset", "copy"]["bytes"] == 2 * 2 * n_sub
    for r in rows.values():
        assert r["ms"] > 0 and r["gbps"] > 0 and r["equal"] in (None, True)
    assert "| case | impl | ms | GB/s | vs copy | equal |" in capsys.readouterr().out
