"""tools/bench_train.py runs end to end on the CPU and reports what it measured, on random characters or
after training on a corpus."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_train  # noqa: E402

TINY = ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
        "pool.top_k=2", "pool.d_expert=32", "train.batch_size=4"]


def test_bench_reports_throughput_flops_and_the_busiest_expert_on_random_and_corpus_batches(tmp_path, capsys):
    corpus = tmp_path / "text.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog.\n" * 40)
    for data, vocab in ((None, bench_train.VOCAB), (str(corpus), len(set(corpus.read_text())))):
        out = tmp_path / "bench.json"
        args = ["--device", "cpu", "--profiles", "cpu_tiny", "--steps", "2", "--warmup", "2", "--json", str(out)]
        args += [a for item in TINY for a in ("--set", item)] + (["--data", data] if data else [])
        assert bench_train.main(args) == 0
        (r,) = json.loads(out.read_text())["results"]
        assert r["data"] == data and r["vocab"] == vocab and r["chars_per_s"] > 0
        # 6 x (attention 4 D^2 + router D E + top_k experts 3 D F + head D V) + 12 x rows x D x context
        assert r["gflop_per_char"] * 1e9 == 6 * (4 * 32 ** 2 + 32 * 4 + 2 * 3 * 32 * 32 + 32 * vocab) + 12 * 32 * 16
        assert r["busiest_expert"] >= 1.0  # the last step's busiest expert over its fair share
    assert "| cpu_tiny | off |" in capsys.readouterr().out


def test_a_corpus_that_is_not_there_is_one_line_and_exit_2(tmp_path, capsys):
    assert bench_train.main(["--device", "cpu", "--profiles", "cpu_tiny", "--data", str(tmp_path / "none.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bench_train: data path") and "none.txt" in err and err.count("\n") == 1


def test_flops_per_char_count_the_shared_experts_and_match_the_twins_at_equal_active_width():
    def per_char(cfg):
        return bench_train.flops_per_char(cfg, bench_train.VOCAB)
    from minagi.config import load_config
    base = ["model.n_rows=2", "model.d_model=64", "model.n_heads=4", "model.context=32", "pool.n_experts=8",
            "pool.d_expert=16"]
    top4 = load_config(None, [*base, "pool.top_k=4"])
    shared = load_config(None, [*base, "pool.top_k=3", "pool.shared_experts=1"])
    twin = load_config(None, [*base, "pool.top_k=3", "pool.shared_experts=1", "model.mlp=dense"])
    assert per_char(shared) == per_char(top4)  # 1 + 3 experts = 4
    router = 6 * 2 * 64 * 8  # what the twin does not compute: 6 x rows x D x E
    assert per_char(twin) == per_char(shared) - router
    one_more = load_config(None, [*base, "pool.top_k=3", "pool.shared_experts=2"])
    assert per_char(one_more) - per_char(shared) == 6 * 2 * 3 * 64 * 16


def test_bench_measures_fsdp_in_one_process_on_a_one_rank_group_it_then_leaves(tmp_path, capsys):
    import torch.distributed as dist
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--profiles", "cpu_tiny", "--steps", "2", "--warmup", "1", "--json", str(out),
            *[a for item in TINY + ["train.parallel=fsdp"] for a in ("--set", item)]]
    assert bench_train.main(args) == 0
    (r,) = json.loads(out.read_text())["results"]
    assert r["parallel"] == "fsdp" and r["sharded"] and r["chars_per_s"] > 0 and r["syncs_per_step"] == 0
    assert "| cpu_tiny (fsdp) | off |" in capsys.readouterr().out
    assert not dist.is_initialized()  # the 1-rank group was the measurement's alone
