"""tools/bench_dispatch.py runs end to end (tiny sizes on the CPU) and reports what it measured."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_dispatch  # noqa: E402


def test_bench_reports_every_path_and_skew_with_consistent_padding(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_dispatch.main(["--device", "cpu", "--chars", "1", "48", "--experts", "8", "--top-k", "2",
                                "--width", "16", "--repeat", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    paths = {r["path"] for r in rows}
    assert {"grouped", "rectangle", "loop"} <= paths
    assert {(r["chars"], r["skew"]) for r in rows} == {(n, s) for n in (1, 48) for s in bench_dispatch.SKEWS}
    by = {(r["chars"], r["skew"], r["path"]): r for r in rows}
    for (n, skew, path), r in by.items():
        assert r["ms"] > 0 and r["vs_dense"] > 0
        if path in ("loop", "native"):
            assert r["padding_ratio"] == pytest.approx(1.0)
        # the rectangle pads every expert to the busiest; the grouped path's card is at most that load
        # rounded up (12.5% at most), or smaller with the busiest experts overflowing
        grouped, rectangle = by[(n, skew, "grouped")]["padding_ratio"], by[(n, skew, "rectangle")]["padding_ratio"]
        assert 1.0 - 1e-9 <= grouped <= 1.125 * rectangle + 1e-9
    collapse = by[(48, "collapse", "rectangle")]
    assert collapse["padding_ratio"] == pytest.approx(8 / 2)  # E/K: every expert padded to the full load
    assert "| chars | skew | path |" in capsys.readouterr().out


def test_routing_skews_do_what_they_say():
    import torch
    gen = torch.Generator().manual_seed(0)
    ids, gates = bench_dispatch.make_routing("sink94", 1000, 16, 4, gen)
    assert (ids == 0).any(-1).float().mean().item() == pytest.approx(0.94, abs=0.01)
    ids, _ = bench_dispatch.make_routing("collapse", 100, 16, 4, gen)
    assert set(ids.flatten().tolist()) == {0, 1, 2, 3}
    torch.testing.assert_close(gates.sum(-1), torch.ones(1000))
