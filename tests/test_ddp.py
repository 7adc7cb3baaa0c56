"""Multi-process training (DDP over gloo on the CPU): N ranks train the run one process would.

Two ranks are launched the way a user does (`python -m torch.distributed.run --nproc_per_node=2`)
through a small worker that calls train.py's main() and then saves what its rank ended with (its
model state, losses and run folder) beside the run, since rank 1 itself writes nothing. The
reference is one in-process train() with the whole batch. Tiny model, tiny text in tmp_path: the
three launches take ~20 s on 2 cores.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi import train as train_py
from minagi import assemble, distributed, trainer
from minagi.checkpoint import load_checkpoint
from minagi.config import load_config
from minagi.runlog import read_history
from tiny import tiny_text

REPO = Path(__file__).resolve().parent.parent
RTOL = 1e-5  # 2 ranks vs 1 process: the same sums in another order

# Flat lr after warmup (min_lr_ratio 1): "3 steps, extended to 6 on resume" is then the same run as
# "6 steps". eval_every 3: records (and last.pt) at steps 3 and 6, each over 3 steps, so the sink
# diagnostics must sum every step's counts of both ranks.
PROFILE = """
[model]
n_rows = 1
d_model = 32
n_heads = 2
context = 16
[pool]
n_experts = 4
top_k = 2
d_expert = 32
aux_free_bias = true
bias_update_rate = 0.01
[train]
steps = 6
batch_size = 4
warmup_steps = 2
min_lr_ratio = 1.0
eval_every = 3
eval_batches = 2
device = "cpu"
"""

WORKER = '''
"""torchrun worker for tests/test_ddp.py: train.py's main(), then what this rank ended with."""
import os, sys, time, types
sys.path.insert(0, os.getcwd())
import torch
from minagi import train as train_py
from minagi import assemble, start, trainer

out_dir, freeze, argv = sys.argv[1], sys.argv[2] == "freeze", sys.argv[3:]
rank = int(os.environ["RANK"])
seen = {}
real_build, real_train = assemble.build_model, trainer.train

def build_model(*args, **kwargs):
    model = real_build(*args, **kwargs)
    if freeze:
        model.rows[0].mlp.experts.gate_up.requires_grad_(False)
    seen["model"] = model
    return model

def train(*args, **kwargs):
    seen["result"] = result = real_train(*args, **kwargs)
    return result

assemble.build_model, trainer.train = build_model, train
if rank == 1:  # rank 1's clock says another second: its own name would be another folder
    start.time = types.SimpleNamespace(perf_counter=time.perf_counter, strftime=lambda fmt: "19990101-000000")
code = train_py.main(argv)
if "result" in seen:
    result = seen["result"]
    torch.save({"run_dir": str(result.run_dir), "losses": result.losses, "heldout": result.heldout_loss,
                "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), "master_port": os.environ["MASTER_PORT"],
                "state": {k: v.clone() for k, v in seen["model"].state_dict().items()}},
               os.path.join(out_dir, f"rank{rank}.pt"))
train_py._leave_as_rank(code)  # as train.py's own rank does: no interpreter finalisation (its docstring)
'''




class Setup:
    def __init__(self, root: Path):
        self.root = root
        self.data = root / "text.txt"
        self.data.write_text(tiny_text(), encoding="utf-8")
        self.profile = root / "tiny.toml"
        self.profile.write_text(PROFILE + f'out_dir = "{(root / "runs").as_posix()}"\n[data]\n'
                                f'cache_dir = "{(root / "cache").as_posix()}"\n')
        self.worker = root / "worker.py"
        self.worker.write_text(WORKER)

    def torchrun(self, name: str, *args: str, freeze: bool = False) -> tuple[dict, dict, str]:
        """Two ranks of train.py; (rank 0's dump, rank 1's dump, the launcher's stdout)."""
        out = self.root / f"dumps-{name}"
        out.mkdir()
        # --standalone: the rendezvous store binds localhost:0 and keeps it; the agent then starts one
        # shared TCPStore on port 0 too, held for the job, and hands the workers its port as MASTER_PORT
        # with TORCHELASTIC_USE_AGENT_STORE=True, so init_process_group connects to it as a client and
        # binds nothing (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py next_rendezvous,
        # torch/distributed/rendezvous.py _create_c10d_store). No port is picked, released and raced
        # for -- unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, whose fallback is get_free_port(): kept off.
        env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
             str(self.worker), str(out), "freeze" if freeze else "-", *args],
            cwd=REPO, capture_output=True, text=True, timeout=240, env={**env, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
        return (torch.load(out / "rank0.pt", weights_only=True), torch.load(out / "rank1.pt", weights_only=True),
                done.stdout)

    def one_process(self, *sets: str, run_name: str):
        cfg = load_config(str(self.profile), [f"data.path={self.data}", f"train.out_dir={self.root / 'ref'}",
                                              f"train.run_name={run_name}", *sets])
        return trainer.train(cfg, "tiny", progress=False, log=lambda msg: None, argv=["test"])


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    """One process for 6 steps; two ranks for 3 steps under the default (timestamped) name, then
    resumed on two ranks from last.pt to 6 steps."""
    s = Setup(tmp_path_factory.mktemp("ddp"))
    ref = s.one_process(run_name="one")
    a0, a1, a_out = s.torchrun("fresh", "--profile", str(s.profile), "--data", str(s.data),
                               "--set", "train.steps=3")
    run_dir = Path(a0["run_dir"])
    b0, b1, b_out = s.torchrun("resumed", "--resume", str(run_dir), "--set", "train.steps=6")
    return dict(setup=s, ref=ref, fresh=(a0, a1), resumed=(b0, b1), stdout=(a_out, b_out), run_dir=run_dir)


# ------------------------------------------------------------------------------ two ranks == one process

def test_two_ranks_give_the_single_process_losses_through_a_resume(ddp):
    (a0, a1), (b0, b1) = ddp["fresh"], ddp["resumed"]
    assert a0["losses"] == a1["losses"] and b0["losses"] == b1["losses"]  # the mean over ranks, on both
    assert len(a0["losses"]) == len(b0["losses"]) == 3
    assert a0["losses"] + b0["losses"] == pytest.approx(ddp["ref"].losses, rel=RTOL)
    assert b0["heldout"] == b1["heldout"] == pytest.approx(ddp["ref"].heldout_loss, rel=RTOL)
    two = read_history(ddp["run_dir"] / "history.jsonl")
    one = read_history(ddp["ref"].run_dir / "history.jsonl")
    assert [r["step"] for r in two] == [r["step"] for r in one] == [3, 6]
    for a, b in zip(two, one):
        for key in ("train_loss", "aux_loss", "grad_norm", "heldout_loss", "lr", "chars_seen"):
            assert a[key] == pytest.approx(b[key], rel=RTOL), (a["step"], key)
        # Sink diagnostics summed over ranks: the global batch's routing, load by load.
        assert [row["load"] for row in a["sinks"]] == [row["load"] for row in b["sinks"]]
        assert a["sinks"][0]["routed"] == 3 * 4 * 16 * 2 and a["sinks"][0]["chars"] == 3 * 4 * 16


def test_ranks_end_with_identical_weights_and_selection_bias_equal_to_one_process(ddp):
    ref = load_checkpoint(ddp["ref"].run_dir / "last.pt")["model"]
    for (r0, r1) in (ddp["fresh"], ddp["resumed"]):
        assert r0["state"].keys() == r1["state"].keys()
        for key in r0["state"]:
            assert torch.equal(r0["state"][key], r1["state"][key]), key
    bias = ddp["resumed"][0]["state"]["rows.0.mlp.router.selection_bias"]
    assert bias.abs().sum() > 0  # the aux-free bias did move
    assert torch.allclose(bias, ref["rows.0.mlp.router.selection_bias"], rtol=0, atol=1e-7)
    for key, value in ref.items():
        assert torch.allclose(ddp["resumed"][0]["state"][key], value, rtol=1e-4, atol=1e-6), key


def test_only_rank_zero_writes_the_run_folder_once_per_record(ddp):
    runs = ddp["setup"].root / "runs"
    assert [p.name for p in runs.iterdir()] == [ddp["run_dir"].name]
    assert sorted(p.name for p in ddp["run_dir"].iterdir()) == ["best.pt", "history.jsonl", "last.pt", "run.json",
                                                              "run.lock"]
    lines = (ddp["run_dir"] / "history.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [3, 6]
    info = json.loads((ddp["run_dir"] / "run.json").read_text())
    assert info["world_size"] == 2 and [r["step"] for r in info["resumes"]] == [3]
    last = load_checkpoint(ddp["run_dir"] / "last.pt")
    assert last["step"] == 6 and not any(k.startswith(("module.", "_orig_mod.")) for k in last["model"])
    for out in ddp["stdout"]:
        assert out.count("run folder: ") == 1 and out.count("final held-out") == 1, out


def test_the_ranks_join_the_launchers_store_as_clients_so_no_port_is_raced_for(ddp):
    # The agent's TCPStore was bound (port 0, the system's choice) before the workers started and is
    # held for the job; the workers only connect to MASTER_PORT (see Setup.torchrun).
    for r0, r1 in (ddp["fresh"], ddp["resumed"]):
        assert r0["agent_store"] == r1["agent_store"] == "True"
        assert r0["master_port"] == r1["master_port"]


def test_the_default_run_name_is_rank_zeros_on_every_rank(ddp):
    a0, a1 = ddp["fresh"]
    assert a0["run_dir"] == a1["run_dir"] and Path(a0["run_dir"]).name.startswith("tiny-")
    assert "19990101" not in a0["run_dir"]  # rank 1's own clock was not used
    assert ddp["resumed"][0]["run_dir"] == ddp["resumed"][1]["run_dir"] == a0["run_dir"]


def test_two_ranks_accumulating_micro_batches_give_the_single_process_run(tmp_path):
    # Gradients all-reduced in the last micro-batch only (no_sync before), the routing pre-pass's counts
    # summed over ranks for the balance term over the whole step, the aux-free bias from the step's loads.
    s = Setup(tmp_path)
    sets = ("train.accum_steps=3", "train.steps=3", "train.eval_every=3", "model.n_rows=2")
    ref = s.one_process(*sets, run_name="one")
    r0, r1, _ = s.torchrun("accum", "--profile", str(s.profile), "--data", str(s.data), "--run-name", "two",
                           *[arg for item in sets for arg in ("--set", item)])
    assert r0["losses"] == r1["losses"] and r0["losses"] == pytest.approx(ref.losses, rel=RTOL)
    final = load_checkpoint(ref.run_dir / "last.pt")["model"]
    for key, value in final.items():
        assert torch.equal(r0["state"][key], r1["state"][key]), key
        assert torch.allclose(r0["state"][key], value, rtol=1e-4, atol=1e-6), key
    (two,) = read_history(tmp_path / "runs" / "two" / "history.jsonl")
    (one,) = read_history(ref.run_dir / "history.jsonl")
    assert [row["load"] for row in two["sinks"]] == [row["load"] for row in one["sinks"]]
    assert two["chars_seen"] == 3 * 3 * 4 * 16 and two["aux_loss"] == pytest.approx(one["aux_loss"], rel=RTOL)


def test_two_ranks_train_with_a_frozen_expert_stack_and_loop_dispatch(tmp_path, monkeypatch):
    # Loop dispatch skips idle experts, and a frozen parameter has no gradient at all: neither may
    # upset DDP (no find_unused_parameters), and the frozen stack must stay as initialised.
    s = Setup(tmp_path)
    sets = ("model.n_rows=2", "pool.dispatch=loop", "train.steps=3", "train.eval_every=3")
    real_build = assemble.build_model

    def frozen_build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        model.rows[0].mlp.experts.gate_up.requires_grad_(False)
        return model
    monkeypatch.setattr(assemble, "build_model", frozen_build)
    ref = s.one_process(*sets, run_name="one")
    r0, r1, _ = s.torchrun("frozen", "--profile", str(s.profile), "--data", str(s.data), "--run-name", "two",
                           *[arg for item in sets for arg in ("--set", item)], freeze=True)
    assert r0["losses"] == r1["losses"] and r0["losses"] == pytest.approx(ref.losses, rel=RTOL)
    torch.manual_seed(1337)  # train.seed: the initial weights
    vocab_size = len(load_checkpoint(ref.run_dir / "last.pt")["vocab"])
    cfg = load_config(str(s.profile), sets)
    initial = real_build(cfg.model, cfg.pool, vocab_size, "cpu").state_dict()
    key = "rows.0.mlp.experts.gate_up"
    assert initial[key].shape == r0["state"][key].shape
    assert torch.equal(r0["state"][key], initial[key]) and torch.equal(r1["state"][key], initial[key])
    key = "rows.1.mlp.experts.gate_up"
    assert not torch.equal(r0["state"][key], initial[key])
    assert torch.equal(r0["state"][key], r1["state"][key])


# ------------------------------------------------------------------------------ in-process pieces

def test_rank_info_reads_torchrun_variables_and_is_one_process_without_them():
    assert distributed.rank_info({}) == distributed.RankInfo(0, 1, 0)
    info = distributed.rank_info({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (info.rank, info.world_size, info.local_rank, info.is_main, info.distributed) == (3, 4, 1, False, True)
    with pytest.raises(distributed.LaunchError, match="RANK=4 WORLD_SIZE=4"):
        distributed.rank_info({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0"})
    with pytest.raises(distributed.LaunchError, match="must be integers"):
        distributed.rank_info({"RANK": "x", "WORLD_SIZE": "2"})


def test_a_batch_that_does_not_split_over_the_ranks_is_one_line_from_rank_zero(tmp_path, monkeypatch, capsys):
    s = Setup(tmp_path)
    argv = ["--profile", str(s.profile), "--data", str(s.data), "--set", "train.batch_size=3"]
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        assert train_py.main(argv) == 2  # refused before joining any process group
        err = capsys.readouterr().err.strip().splitlines()
        if rank == 0:
            assert len(err) == 1 and "train.batch_size = 3" in err[0] and "2 ranks" in err[0], err
        else:
            assert err == []
    assert not (tmp_path / "runs").exists()


def test_train_refuses_several_ranks_without_a_process_group(tmp_path):
    s = Setup(tmp_path)
    cfg = load_config(str(s.profile), [f"data.path={s.data}"])
    with pytest.raises(distributed.LaunchError, match="launch with torchrun"):
        trainer.train(cfg, "tiny", rank=0, world_size=2, progress=False, log=lambda msg: None)


def test_two_ranks_with_offloaded_frozen_experts_and_row_checkpointing_give_the_one_process_losses(tmp_path):
    # Frozen NF4 stacks homed on the CPU, staged per row, LoRA on them, every row recomputed in
    # backward with the replay pin: the frozen buffers are left out of DDP (each rank has its own copy).
    s = Setup(tmp_path)
    sets = ("experts.frozen=true", "experts.blocksize=32", "experts.lora_rank=8", "experts.offload=cpu",
            "experts.replay_pin=on", "train.checkpoint_rows=true", "train.steps=3", "train.eval_every=3")
    ref = s.one_process(*sets, run_name="one")
    r0, r1, _ = s.torchrun("offload", "--profile", str(s.profile), "--data", str(s.data), "--run-name", "two",
                           *[arg for item in sets for arg in ("--set", item)])
    assert r0["losses"] == r1["losses"] and r0["losses"] == pytest.approx(ref.losses, rel=RTOL)
    lora = "rows.0.mlp.experts.lora_gate_up_b"
    assert torch.equal(r0["state"][lora], r1["state"][lora]) and r0["state"][lora].abs().sum() > 0
    assert torch.equal(r0["state"]["rows.0.mlp.experts.gate_up.packed"], r1["state"]["rows.0.mlp.experts.gate_up.packed"])


# ------------------------------------------------------------------------------ train.py --nproc-per-node
# torchrun reports any worker's non-zero exit with a ChildFailedError traceback and exits 1
# (torch/distributed/launcher/api.py launch_agent); train.py --nproc-per-node launches the ranks itself.

def _train_py(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_nproc_per_node_refuses_a_batch_that_does_not_split_before_any_rank_starts(tmp_path):
    s = Setup(tmp_path)
    done = _train_py("--nproc-per-node", "2", "--profile", str(s.profile), "--data", str(s.data),
                     "--set", "train.batch_size=3")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert "train.batch_size = 3" in err[0] and "2 ranks" in err[0]
    assert not (tmp_path / "runs").exists()


def test_nproc_per_node_reports_a_ranks_error_as_its_one_line_and_exit_code(tmp_path):
    # The corpus is read on the ranks (rank 0 first): two gloo ranks start, rank 0 says why, both exit 2.
    s = Setup(tmp_path)
    done = _train_py("--nproc-per-node", "2", "--profile", str(s.profile), "--data", str(tmp_path / "none.txt"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: data path {str(tmp_path / 'none.txt')!r} does not exist (expected a text file, a directory "
        "or a glob)"], done.stderr


def test_a_rank_that_owns_its_process_leaves_without_the_interpreters_finalisation(monkeypatch, capsys):
    """About one two-rank gloo run in 30 aborted in finalisation after finishing (SIGABRT, "terminate
    called without an active exception"): a rank whose command line main() runs ends with os._exit,
    flushed; one process, and a main() called with arguments, return as before."""
    left = []

    def exit_(code):
        left.append(code)
        raise SystemExit(code)
    monkeypatch.setattr(train_py.os, "_exit", exit_)
    monkeypatch.setattr(sys, "argv", ["train.py", "--profile", "cpu_tiny", "--plan", "cpu"])
    assert train_py.main() == 0 and left == []  # one process
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert train_py.main(["--profile", "cpu_tiny", "--plan", "cpu"]) == 0 and left == []  # called with arguments
    with pytest.raises(SystemExit):
        train_py.main()
    assert left == [0]


def test_nproc_per_node_trains_on_two_ranks(tmp_path):
    s = Setup(tmp_path)  # one step under the profile's warm-up of 2: the fitting note, said once (not by the launcher too)
    done = _train_py("--nproc-per-node", "2", "--profile", str(s.profile), "--data", str(s.data),
                     "--run-name", "two", "--set", "train.steps=1", "--set", "train.eval_every=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("final held-out") == 1
    assert done.stderr.splitlines() == ["warning: train.warmup_steps = 2 exceeds train.steps = 1: warming up over 1 "
                                        "step (a tenth of them, at least one) instead; --set train.warmup_steps to choose"]
    assert json.loads((tmp_path / "runs" / "two" / "run.json").read_text())["world_size"] == 2


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")
def test_launch_local_names_a_rank_killed_by_a_signal_and_exits_128_plus_it(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text("import os, signal, time\n"
                      "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                      "time.sleep(30)\n")
    done = subprocess.run([sys.executable, "-c", "import sys; from minagi import distributed; "
                           f"sys.exit(distributed.launch_local(2, {str(script)!r}, []))"],
                          cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # else torchrun's notice of setting it
    assert done.returncode == 128 + 9, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: rank 1 (pid ") and "signal 9 (SIGKILL)" in err[0], err


def test_nproc_per_node_under_torchrun_must_match_its_ranks(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert train_py.main(["--nproc-per-node", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --nproc-per-node 3, but torchrun started 2 ranks: leave --nproc-per-node out under torchrun"]


@pytest.mark.parametrize("nccl, backend", [(True, "nccl"), (False, "gloo")], ids=["linux", "windows"])
def test_a_gpu_rank_joins_through_nccl_where_torch_has_it_and_gloo_where_it_does_not(monkeypatch, nccl, backend):
    """Windows builds of torch have no NCCL; a GPU rank there must still join (gloo)."""
    import torch.distributed as dist

    from minagi import distributed
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: calls.append((name, kw)))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    info = distributed.RankInfo(rank=1, local_rank=1, world_size=2)
    assert distributed.init_process_group(info, torch.device("cuda")) == torch.device("cuda", 1)
    assert [name for name, _ in calls] == [backend] and ("device_id" in calls[0][1]) == nccl


@pytest.mark.parametrize("platform, preset, expected", [("win32", None, "0"), ("win32", "1", "1"), ("linux", None, None)])
def test_ranks_on_windows_join_a_store_without_libuv_unless_told_otherwise(monkeypatch, platform, preset, expected):
    """torch 2.4-2.6 asked for a libuv TCPStore, which Windows builds lack (pytorch#139990)."""
    import torch.distributed as dist

    from minagi import distributed
    monkeypatch.setattr(sys, "platform", platform)
    if preset is None:
        monkeypatch.delenv("USE_LIBUV", raising=False)
    else:
        monkeypatch.setenv("USE_LIBUV", preset)
    seen = []
    monkeypatch.setattr(dist, "init_process_group", lambda name, **kw: seen.append(os.environ.get("USE_LIBUV")))
    distributed.init_process_group(distributed.RankInfo(rank=0, local_rank=0, world_size=2), torch.device("cpu"))
    assert seen == [expected]
