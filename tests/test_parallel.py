"""FSDP2 and expert parallelism (minagi/parallel.py, minagi/exchange.py) on gloo ranks of the CPU: N ranks
train the run one process would, and save the checkpoint one process saves.

Two kinds of launch. train.py under torchrun (as tests/test_ddp.py: its Setup, a worker that keeps each
rank's losses) for the run folder, the checkpoint and resumes on another number of ranks; and
tests/parallel_ranks.py, which builds one process's training and a layout's side by side in every rank
and steps both (gradients, losses, balance term, bias, routing counts, the gathered state), several
layouts per launch. About 30 s on 2 cores in all.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample as sample_py
import train as train_py
from minagi import parallel, trainer
from minagi.assemble import build_training
from minagi.checkpoint import load_checkpoint
from minagi.config import ConfigError, load_config
from minagi.experts import ExpertStack, LocalExpertStack
from minagi.runlog import read_history
from test_ddp import RTOL, Setup

REPO = Path(__file__).resolve().parent.parent

WORKER = '''
"""torchrun worker for tests/test_parallel.py: train.py's main(), then this rank's losses."""
import os, sys
sys.path.insert(0, os.getcwd())
import torch
import train as train_py
from minagi import trainer

out_dir, argv = sys.argv[1], sys.argv[3:]
seen = {}
real_train = trainer.train

def train(*args, **kwargs):
    seen["result"] = result = real_train(*args, **kwargs)
    return result

trainer.train = train
code = train_py.main(argv)
if "result" in seen:
    r = seen["result"]
    torch.save({"run_dir": str(r.run_dir), "losses": r.losses, "heldout": r.heldout_loss},
               os.path.join(out_dir, f"rank{os.environ['RANK']}.pt"))
from minagi.train import _leave_as_rank
_leave_as_rank(code)  # as train.py's own rank does: no interpreter finalisation (its docstring)
'''


class Ranks(Setup):
    """tests/test_ddp.py's Setup with a worker that saves losses only (a sharded model's own state is
    DTensors and slices: the run's last.pt is what holds the whole model)."""

    def __init__(self, root: Path):
        super().__init__(root)
        self.worker.write_text(WORKER)

    def sets(self, *items: str) -> list[str]:
        return ["--profile", str(self.profile), "--data", str(self.data), *[a for i in items for a in ("--set", i)]]

    def resume_here(self, run_dir: Path, *sets: str):
        """Resume `run_dir` in this process: one rank."""
        cfg, profile = trainer.resume_config(run_dir, list(sets))
        return trainer.train(cfg, profile, run_dir, progress=False, log=lambda msg: None, argv=["test"])


def _layouts(nproc: int, names: list[str], out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(REPO / "tests" / "parallel_ranks.py"), str(out), *names],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return torch.load(out, weights_only=True)


TWO_RANKS = ["ep_grouped", "ep_loop", "ep_native", "ep_rectangle_fsdp", "sink_loop", "sink_grouped_fsdp",
             "fsdp_frozen_pin", "fsdp_dense"]
# 2 x 2: expert slices reduced over their replicas too; the sink leaves ranks 1 and 3 without rows.
FOUR_RANKS = ["sink_grouped_fsdp"]


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return _layouts(2, TWO_RANKS, tmp_path_factory.mktemp("layouts") / "two.pt")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return _layouts(4, FOUR_RANKS, tmp_path_factory.mktemp("layouts") / "four.pt")


def _same_steps(records: list[dict]) -> None:
    for r in records:
        for key in ("ce", "aux", "norm"):
            assert r[key][1] == pytest.approx(r[key][0], rel=RTOL), key
        if "loads" in r:
            assert r["loads"][0] == r["loads"][1] and r["chars"][0] == r["chars"][1]
            assert r["bias"] <= 1e-7


# ------------------------------------------------------------------------------ layouts against one process

@pytest.mark.parametrize("name", TWO_RANKS)
def test_a_layout_on_two_ranks_gives_one_process_gradients_losses_balance_term_bias_and_state(two, name):
    result = two[name]
    assert result["grad_diff"] < 1e-5  # every parameter's whole gradient (expert slices, FSDP shards gathered)
    _same_steps(result["steps"])  # ce, aux (the balance term), gradient norm, global loads, selection bias
    assert all(d < 1e-4 for d in result["state_diff"])  # the gathered model and optimizer state
    _same_steps(result["resumed"])  # the gathered state split again over the ranks trains on alike


@pytest.mark.parametrize("name", FOUR_RANKS)
def test_expert_parallel_two_by_two_on_four_ranks_gives_one_process_training(four, name):
    result = four[name]
    assert result["grad_diff"] < 1e-5
    _same_steps(result["steps"])
    assert all(d < 1e-4 for d in result["state_diff"])
    _same_steps(result["resumed"])


def test_a_sink_on_one_ranks_experts_trains_and_counts_as_one_process(two):
    for name in ("sink_loop", "sink_grouped_fsdp"):
        for r in two[name]["steps"]:
            one, ranks = r["loads"]
            # Every routed row on experts 0 and 1 (rank 0's): rank 1 received none, and the loads are
            # the whole batch's, summed over the ranks, as one process counts them.
            assert ranks == one and all(row[2:] == [0, 0] and sum(row) == 4 * 16 * 2 for row in ranks)
            assert r["padded"] == [4 * 16 * 2] * 2  # dropless: every routed row computed once, nothing padded


def test_frozen_stacks_under_fsdp_are_replicated_and_the_replay_pin_still_keeps_its_dequant(two):
    assert len(two["fsdp_frozen_pin"]["frozen_whole"]) == 2 * 2 * 2  # rows x stacks x (packed, absmax)
    assert all(two["fsdp_frozen_pin"]["frozen_whole"])  # on each rank, not sharded
    dequants = two["fsdp_frozen_pin"]["dequants"]
    # 2 rows x (gate_up, down): under row checkpointing, forward + replay, the backward reads the pin.
    assert dequants["stacks"] == 4 and dequants["forward"] == dequants["replay"] == dequants["pinned"] == 4
    assert dequants["backward"] == 0


# ------------------------------------------------------------------------------ train.py under torchrun

@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    """One process for 6 steps; two fsdp ranks for 3, resumed in one process to 6."""
    s = Ranks(tmp_path_factory.mktemp("fsdp"))
    ref = s.one_process(run_name="one")
    r0, r1, out = s.torchrun("fsdp", *s.sets("train.parallel=fsdp", "train.steps=3"), "--run-name", "two")
    run_dir = Path(r0["run_dir"])
    first = {"last": load_checkpoint(run_dir / "last.pt"), "files": sorted(p.name for p in run_dir.iterdir()),
             "runs": [p.name for p in (s.root / "runs").iterdir()]}
    resumed = s.resume_here(run_dir, "train.steps=6")
    return dict(setup=s, ref=ref, ranks=(r0, r1), stdout=out, run_dir=run_dir, first=first, resumed=resumed)


def test_fsdp_on_two_ranks_gives_one_process_losses_and_weights_through_a_resume_on_one_process(fsdp):
    (r0, r1), ref, resumed = fsdp["ranks"], fsdp["ref"], fsdp["resumed"]
    assert r0["losses"] == r1["losses"] and len(r0["losses"]) == 3
    assert r0["losses"] + resumed.losses == pytest.approx(ref.losses, rel=RTOL)
    assert resumed.heldout_loss == pytest.approx(ref.heldout_loss, rel=RTOL)
    for a, b in zip(read_history(fsdp["run_dir"] / "history.jsonl"), read_history(ref.run_dir / "history.jsonl")):
        for key in ("train_loss", "aux_loss", "grad_norm", "heldout_loss"):
            assert a[key] == pytest.approx(b[key], rel=RTOL), (a["step"], key)
        assert [row["load"] for row in a["sinks"]] == [row["load"] for row in b["sinks"]]
    one, two = load_checkpoint(ref.run_dir / "last.pt"), load_checkpoint(fsdp["run_dir"] / "last.pt")
    for key, value in one["model"].items():
        assert torch.allclose(two["model"][key], value, rtol=1e-4, atol=1e-6), key


def test_an_fsdp_run_is_written_by_rank_zero_alone_as_the_whole_unwrapped_model(fsdp):
    first, ref = fsdp["first"], load_checkpoint(fsdp["ref"].run_dir / "last.pt")
    assert first["runs"] == ["two"]
    assert first["files"] == ["best.pt", "history.jsonl", "last.pt", "run.json", "run.lock"]
    assert fsdp["stdout"].count("run folder: ") == 1 and fsdp["stdout"].count("final held-out") == 1
    model = first["last"]["model"]
    assert model.keys() == ref["model"].keys()
    assert all(type(v) is torch.Tensor and v.shape == ref["model"][k].shape for k, v in model.items())
    optimizer = first["last"]["optimizer"]
    assert optimizer["param_groups"] == ref["optimizer"]["param_groups"]  # one process's own format
    assert all(type(t) is torch.Tensor and t.shape == ref["optimizer"]["state"][i][k].shape
               for i, s in optimizer["state"].items() for k, t in s.items())
    info = json.loads((fsdp["run_dir"] / "run.json").read_text())
    assert info["world_size"] == 2 and [(r["step"], r["world_size"]) for r in info["resumes"]] == [(3, 1)]
    assert info["config"]["train"]["parallel"] == "fsdp"


def test_a_run_under_fsdp_and_expert_parallelism_resumes_in_one_process_and_samples(fsdp, tmp_path, capsys):
    s, ref = fsdp["setup"], fsdp["ref"]
    r0, r1, _ = s.torchrun("ep", *s.sets("train.parallel=fsdp", "train.expert_parallel=2", "train.steps=3"),
                           "--run-name", "ep")
    run_dir = Path(r0["run_dir"])
    assert r0["losses"] == r1["losses"] == pytest.approx(ref.losses[:3], rel=RTOL)
    assert sample_py.main([str(run_dir / "last.pt"), "--chars", "40", "--device", "cpu", "--prompt", "the"]) == 0
    written = capsys.readouterr().out
    assert written.startswith("the") and len(written) == 3 + 40
    resumed = s.resume_here(run_dir, "train.steps=6", "train.expert_parallel=1")  # one process: no slices
    assert resumed.losses == pytest.approx(ref.losses[3:], rel=RTOL)


# ------------------------------------------------------------------------------ in one process

def test_layouts_that_cannot_run_are_one_line_errors(tmp_path, monkeypatch, capsys):
    refused = {("train.expert_parallel=3",): "must divide pool.n_experts = 8",
               ("train.expert_parallel=2", "model.mlp=dense"): "needs pooled rows",
               ("train.expert_parallel=2", "experts.frozen=true"): "frozen stacks",
               ("train.expert_parallel=2", "pool.capacity_factor=1.25"): "dropless",
               ("train.parallel=fsdp", "experts.frozen=true", "experts.offload=cpu"): "offloaded frozen stacks",
               ("train.parallel=fsdp", "train.optimizer_states=bf16"): "bf16.*is not built",
               ("train.parallel=fsdp", "train.precision=fp16"): "fp16.*is not built"}
    for sets, why in refused.items():
        with pytest.raises(ConfigError, match=why) as e:
            load_config(None, list(sets))
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"must divide the 3 rank.*--set train.expert_parallel=1 turns it off"):
        parallel.check_layout(load_config(None, ["train.expert_parallel=2"]), 3)
    odd = load_config(None, ["train.batch_size=15"])
    with pytest.raises(ConfigError, match=r"use e\.g\. 16$"):  # a new run may change its batch
        trainer.check_world_size(odd, 2)
    with pytest.raises(ConfigError, match=r"^train\.batch_size = 15 is the run's global batch, which 2 ranks cannot "
                                          r"split evenly; resume it on 1, 3, 5, 15 rank\(s\)$"):
        trainer.check_world_size(odd, 2, resuming=True)  # a resumed run may not: train.batch_size is its own
    s = Ranks(tmp_path)  # train.py refuses before joining the process group, rank 0 saying why
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert train_py.main(s.sets("train.expert_parallel=4", "pool.n_experts=4")) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ([] if rank else [err[0]]) and (rank or "must divide the 2 rank(s)" in err[0]), err


def test_one_process_trains_unwrapped_whatever_train_parallel_says():
    cfg = load_config(None, ["train.parallel=fsdp", "train.device=cpu", "model.n_rows=1", "model.d_model=32",
                             "model.n_heads=2", "pool.n_experts=4", "pool.d_expert=32"])
    training = build_training(cfg, 20, torch.device("cpu"), 1)  # no process group joined: nothing to shard over
    assert training.forward is training.model and not training.parallel.sharded


def test_an_expert_slice_draws_the_whole_card_and_keeps_its_experts():
    torch.manual_seed(3)
    whole = ExpertStack(4, 8, 6)
    whole.reset_parameters(0.02, 0.01)
    after_whole = torch.rand(())
    for first in (0, 2):
        torch.manual_seed(3)
        part = LocalExpertStack(4, first, 2, 8, 6)
        part.reset_parameters(0.02, 0.01)
        assert part.n_experts == 2 and torch.rand(()) == after_whole  # the same random numbers used
        assert torch.equal(part.gate_up, whole.gate_up[first:first + 2])
        assert torch.equal(part.down, whole.down[first:first + 2])


# ------------------------------------------------------------------------------ memory per rank, by formula

H200_GIB = 139  # what one H200 lends a process (of its 141 GB)


@pytest.mark.parametrize("sets", [[], ["model.mlp=dense"], ["experts.frozen=true", "experts.lora_rank=8"]])
def test_the_memory_formula_counts_the_parameters_a_model_has(sets):
    cfg = load_config(None, ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", "pool.n_experts=4",
                             "pool.d_expert=32", "experts.blocksize=32", *sets])
    from minagi.model import build_model
    model = build_model(cfg.model, cfg.pool, 96, "cpu", dense_width=cfg.dense_width, experts=cfg.experts)
    counted = parallel.model_bytes_per_rank(cfg, 1)
    trainable = sum(p.numel() for p in model.parameters())
    assert counted["params"] == trainable
    stored = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n)
    assert counted["states"] == 16 * trainable + stored  # frozen stacks: their NF4 bytes, replicated


@pytest.mark.parametrize("name", ["ep_grouped", "ep_rectangle_fsdp", "fsdp_dense"])
def test_the_memory_formula_gives_the_states_a_rank_of_the_layout_holds(two, name):
    from parallel_ranks import BASE, SCENARIOS, VOCAB
    cfg = load_config(None, BASE + SCENARIOS[name])
    assert parallel.model_bytes_per_rank(cfg, 2, vocab=VOCAB)["states"] == 16 * two[name]["local_numel"]


def test_h200x8_fsdp_does_not_fit_one_h200_and_fits_eight_under_fsdp_or_expert_parallelism():
    one = parallel.model_bytes_per_rank(load_config("h200x8_fsdp"), 1)
    assert one["params"] > 9.7e9 and one["states"] / 2**30 > H200_GIB  # the state alone, before any activation
    for ep in (1, 8):
        eight = parallel.model_bytes_per_rank(load_config("h200x8_fsdp", [f"train.expert_parallel={ep}"]), 8)
        assert eight["total"] / 2**30 < H200_GIB / 3  # room to spare for activations and the allocator
        assert (eight["gathered"] > 10 * 2**30) == (ep == 1)  # fsdp gathers rows; expert slices never are
