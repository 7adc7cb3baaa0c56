"""Will it fit (minagi/plan.py, train.py --plan): every shipped profile planned on every target in
seconds, its parts adding up to its peak; the weights it counts and the tensors it says a row saves
for backward against the model built on the CPU and autograd's own saved tensors."""
import json
import time

import pytest
import torch

import train as train_py
from minagi import assemble
from minagi.config import available_profiles, load_config
from minagi.frozen import frozen_stacks
from minagi.model import build_model
from minagi.plan import TARGETS, _resolve, plan_memory, row_saved, weight_copies, weight_counts

CPU = torch.device("cpu")


def test_every_shipped_profile_is_planned_on_every_target_in_seconds_and_its_parts_add_up():
    start = time.perf_counter()
    for profile in available_profiles():
        cfg = load_config(profile)
        for target in TARGETS:
            plan = plan_memory(cfg, target)
            assert plan.parts and all(p.bytes > 0 for p in plan.parts), (profile, target)
            assert sum(p.bytes for p in plan.parts) == plan.peak_allocated, (profile, target)
            assert plan.peak_reserved == plan.peak_allocated + plan.slack.bytes
            names = [p.name for p in plan.parts]
            assert "weights" in names and "optimizer states" in names and "activations" in names
            assert ("NF4 stacks" in names) == (cfg.experts.frozen and cfg.experts.quant == "nf4")
    assert time.perf_counter() - start < 20


def test_train_py_plan_prints_the_parts_and_exits_0_building_nothing(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("--plan built the model")
    monkeypatch.setattr(assemble, "build_model", refuse)
    assert train_py.main(["--profile", "strix_large", "--plan", "rocm"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "optimizer states", "gradients", "activations", "dispatch padding", "weight copies",
                 "peak allocated", "allocator slack", "peak reserved", "without row checkpointing", "sink_ratio"):
        assert part in out, part
    assert train_py.main(["--profile", "cpu_tiny", "--plan"]) == 0  # this machine
    assert "planned for cpu (this machine)" in capsys.readouterr().out


def test_a_resumed_or_started_from_runs_plan_uses_its_vocabulary(tmp_path, capsys):
    from tiny import run_tiny
    done = run_tiny(tmp_path, None, "train.steps=2", "train.warmup_steps=1")
    vocab = json.loads((done.run_dir / "run.json").read_text())["corpus"]["vocab_size"]
    assert vocab != 256
    for given in (["--resume", str(done.run_dir)], ["--init", str(done.run_dir)],
                  ["--profile", "cpu_tiny", "--init", str(done.run_dir / "last.pt")]):
        assert train_py.main([*given, "--plan", "cpu"]) == 0
        out = capsys.readouterr().out
        assert f"(1 rank, vocabulary of {vocab})" in out and "assumed" not in out, given
    loose = tmp_path / "loose.pt"  # a checkpoint outside its run folder: no run.json to read
    loose.write_bytes((done.run_dir / "last.pt").read_bytes())
    assert train_py.main(["--profile", "cpu_tiny", "--init", str(loose), "--plan", "cpu"]) == 0
    assert "vocabulary of 256 assumed" in capsys.readouterr().out


def test_on_a_gpu_the_plan_says_whether_it_fits_the_card_or_its_cap(monkeypatch):
    from minagi import plan_report as report_module
    monkeypatch.setattr(report_module, "local_target", lambda: (TARGETS["sm90"], 24 * 2 ** 30))  # a 24 GiB card
    assert "does NOT fit: peak reserved" in report_module.plan_report(load_config("h200"), "h200")
    assert "fits: peak reserved" in report_module.plan_report(load_config("strix_large"), "strix_large")
    capped = report_module.plan_report(load_config("h200_offload"), "h200_offload", "sm90")
    assert "(memory.gpu_cap_gib)" in capped and "planned for sm90 (this machine)" in capped
    other = report_module.plan_report(load_config("h200"), "h200", "rocm")  # another kind: no verdict for this card
    assert not any(line.startswith(("fits:", "does NOT fit:")) for line in other.splitlines())
    assert "planned for rocm;" in other


def test_a_sharded_layouts_plan_holds_a_ranks_share_as_the_layouts_formula_counts_it():
    """--plan with --nproc-per-node planned the whole unsharded model under FSDP and expert parallelism."""
    from minagi import plan_report as report_module
    from minagi.parallel import model_bytes_per_rank
    cfg, GiB = load_config("h200x8_fsdp"), 2 ** 30  # fsdp, 9.7B parameters
    parts = {p.name: p.bytes for p in plan_memory(cfg, "sm90", world_size=8, weight_shards=8, expert_shards=8).parts}
    formula = model_bytes_per_rank(cfg, 8, vocab=256)
    states = parts["weights"] + parts["optimizer states"] + parts["gradients"]
    assert states == pytest.approx(formula["states"], rel=1e-3) and states < 20 * GiB
    assert parts["gathered rows"] == pytest.approx(formula["gathered"], rel=1e-3)
    report = report_module.plan_report(cfg, "h200x8_fsdp", "sm90", world_size=8)
    assert "(8 ranks, weights sharded 8 ways, experts 8 ways," in report
    assert "16,384 characters a forward on this rank (32 sequences of 512)" in report  # the rank's, not 256
    ep = load_config("h200x8_fsdp", ["train.parallel=ddp", "train.expert_parallel=8"])
    assert report_module.layout_shards(ep, 8) == (1, 8)
    parts = {p.name: p.bytes for p in plan_memory(ep, "sm90", world_size=8, weight_shards=1, expert_shards=8).parts}
    ep_states = parts["weights"] + parts["optimizer states"] + parts["gradients"]
    assert ep_states == pytest.approx(model_bytes_per_rank(ep, 8, vocab=256)["states"], rel=1e-2)
    assert "gathered rows" not in parts
    assert report_module.layout_shards(load_config("h200"), 8) == (1, 1)  # ddp: every rank holds it all
    both = load_config("h200x8_fsdp", ["train.expert_parallel=8"])  # fsdp with expert slices: never gathered
    parts = {p.name: p.bytes for p in plan_memory(both, "sm90", world_size=8, weight_shards=8, expert_shards=8).parts}
    assert parts["gathered rows"] == pytest.approx(model_bytes_per_rank(both, 8, vocab=256)["gathered"], rel=1e-3)
    frozen = load_config("h200_frozen", ["train.parallel=fsdp"])  # frozen stacks are buffers: whole on every rank
    parts = {p.name: p.bytes for p in plan_memory(frozen, "sm90", world_size=8, weight_shards=8, expert_shards=8).parts}
    assert parts["NF4 stacks"] == {p.name: p.bytes for p in plan_memory(frozen, "sm90").parts}["NF4 stacks"]


def test_the_plan_says_what_each_setting_saves():
    h200 = load_config("h200")
    base = plan_memory(h200)
    parts = lambda plan: {p.name: p.bytes for p in plan.parts}  # noqa: E731
    lean = plan_memory(load_config("h200", ["train.optimizer_states=bf16"]))
    assert parts(lean)["optimizer states"] * 2 == parts(base)["optimizer states"]
    # The bf16 update holds a chunk's fp32 temporaries in its foreach form (the CPU, a GPU without
    # minagi's kernels), none through its Triton kernel (NVIDIA with Triton), like torch's fused AdamW.
    # At batch 1 the foreach form's update is the peak: 20 bytes a weight of the largest stack (gate_up: 64 x 512 x 2 x 512).
    one = load_config("h200", ["train.optimizer_states=bf16", "train.batch_size=1"])
    foreach, fused = plan_memory(one, "sm75"), plan_memory(one, "sm90")
    assert foreach.phase == "optimizer step" and parts(foreach)["optimizer transients"] == 20 * 64 * 512 * 2 * 512
    assert fused.phase != "optimizer step" and "optimizer transients" not in parts(fused)
    assert fused.peak_allocated < foreach.peak_allocated
    eager = plan_memory(load_config("h200", ["train.compile=false"]))  # row checkpointing is not compiled whole
    checkpointed = plan_memory(load_config("h200", ["train.checkpoint_rows=true", "train.compile=false"]))
    assert checkpointed.peak_allocated < eager.peak_allocated / 3
    accumulated = plan_memory(load_config("strix_large_accum"))  # h200's step as 16 x 16
    assert accumulated.peak_allocated < base.peak_allocated / 3
    assert parts(accumulated)["gradients"] == 4 * weight_counts(h200, 256)["trainable"]  # whole all step
    two_ranks = plan_memory(h200, world_size=2)
    assert parts(two_ranks)["activations"] < parts(base)["activations"] * 0.55
    sharded = plan_memory(h200, expert_shards=8)  # the seam a sharded run fills in
    assert parts(sharded)["optimizer states"] < parts(base)["optimizer states"] / 4


@pytest.mark.parametrize("extra", [
    [], ["experts.frozen=true", "experts.lora_rank=8", "experts.blocksize=32"],
    ["experts.frozen=true", "experts.blocksize=32", "experts.double_quant=true"],
    ["experts.frozen=true", "experts.quant=none"], ["model.mlp=dense"]])
def test_the_weights_it_counts_are_the_models(extra):
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=4", "pool.n_experts=8", "pool.d_expert=32", *extra])
    model = build_model(cfg.model, cfg.pool, 50, CPU, dense_width=cfg.dense_width, experts=cfg.experts)
    counts = weight_counts(cfg, 50)
    assert counts["trainable"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counts["stored"] == sum(s.stored_bytes() for s in frozen_stacks(model).values())


def _saved_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes autograd saves for backward in one forward of `cfg` (weights excluded)."""
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.pool, 96, CPU, dense_width=cfg.dense_width, experts=cfg.experts, dtype=dtype)
    model.train()
    x, y = (torch.randint(0, 96, (cfg.train.batch_size, cfg.model.context)) for _ in range(2))
    weights = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        model(x, y)
    return sum(seen.values())


@pytest.mark.parametrize("precision,extra", [
    ("bf16", ["pool.dispatch=native"]), ("fp32", ["pool.dispatch=native"]), ("bf16", ["pool.dispatch=loop"]),
    ("bf16", ["pool.dispatch=native", "pool.top_k=1", "pool.z_loss_coef=0.001", "pool.expert_dropout=0.1"]),
    ("bf16", ["pool.dispatch=native", "pool.z_loss_coef=0.001"]),  # the gates' gather and logsumexp keep one logits
    ("bf16", ["pool.dispatch=native", "pool.router_score=sigmoid"]),
    ("bf16", ["pool.dispatch=native", "model.dropout=0.1"]), ("bf16", ["model.mlp=dense"]),
    ("bf16", ["pool.dispatch=native", "experts.frozen=true", "experts.lora_rank=8", "experts.blocksize=32"]),
    ("bf16", ["pool.dispatch=native", "experts.frozen=true", "experts.blocksize=32"])])
def test_a_rows_saved_tensors_are_what_autograd_saves_on_the_cpu(precision, extra):
    # A row's share: two rows' saved bytes less one row's (the embedding and head cancel out).
    sets = ["model.d_model=64", "model.n_heads=4", "model.context=32", "pool.n_experts=8", "pool.top_k=2",
            "pool.d_expert=32", "train.batch_size=2", f"train.precision={precision}", *extra]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    measured = (_saved_bytes(load_config(None, [*sets, "model.n_rows=2"]), dtype)
                - _saved_bytes(load_config(None, [*sets, "model.n_rows=1"]), dtype))
    s = _resolve(load_config(None, sets), TARGETS["cpu"], 1, 96)
    planned = sum(row_saved(s).values()) + weight_copies(s)
    assert planned == pytest.approx(measured, rel=0.003), (planned, measured)  # within 1 byte a character


def test_the_swiglu_kernels_setting_decides_whether_the_plan_counts_the_eager_ops_products():
    """Triton (auto on NVIDIA) and the jiterator (asked for) keep h and the gate only; "auto" on ROCm
    counts the eager ops' two [rows, F] products, since its jiterator kernels are probed at run time."""
    shape = lambda sets, target: _resolve(load_config("strix_large", sets), TARGETS[target], 1, 96)  # noqa: E731
    assert not shape([], "sm80").eager_swiglu
    assert shape([], "rocm").eager_swiglu
    assert not shape(["pool.swiglu=jiterator"], "rocm").eager_swiglu
    assert shape(["pool.swiglu=eager"], "sm80").eager_swiglu
    assert shape(["pool.swiglu=jiterator"], "cpu").eager_swiglu  # no GPU: torch ops
    rocm = plan_memory(load_config("strix_large"), target=TARGETS["rocm"])
    fused = plan_memory(load_config("strix_large", ["pool.swiglu=jiterator"]), target=TARGETS["rocm"])
    assert fused.peak_allocated < rocm.peak_allocated


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_heads_saved_tensors_are_what_autograd_saves_for_the_head_alone(precision):
    """The rows' test takes two rows less one: the head cancels out there, so its terms are checked here."""
    import torch.nn.functional as F

    from minagi import rowmath
    from minagi.plan import head_copy, head_saved
    sets = ["model.d_model=64", "model.n_heads=4", "model.context=40", "train.batch_size=2",
            f"train.precision={precision}"]  # N = 80 characters: no saved tensor shaped as the head's weight
    s = _resolve(load_config(None, sets), TARGETS["cpu"], 1, 96)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    torch.manual_seed(0)
    x = torch.randn(2, 40, 64, requires_grad=True)  # the last row's output: counted as the row's, not here
    norm_w, head_w = torch.ones(64, requires_grad=True), torch.randn(96, 64, requires_grad=True)
    y = torch.randint(0, 96, (2, 40))
    skip = {t.untyped_storage().data_ptr() for t in (x, norm_w, head_w)}
    seen, weight_cast = {}, {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:  # the weight's cast is the plan's weight copies, not N's
            into = weight_cast if t.shape in (head_w.shape, head_w.t().shape) else seen
            into[storage.data_ptr()] = storage.nbytes()
        return t
    autocast = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else torch.autocast("cpu", enabled=False)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:  # as CharLM.forward's head
        logits = rowmath.head(x, norm_w, 1e-5, head_w)
        F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    seen[logits.untyped_storage().data_ptr()] = logits.untyped_storage().nbytes()  # returned: alive too
    assert head_saved(s) == pytest.approx(sum(seen.values()), abs=16 * s.N)  # within 16 bytes a character
    assert head_copy(s) == sum(weight_cast.values())  # none in fp32: the weight itself is saved


def test_offloads_prefetch_holds_a_second_rows_stacks():
    """The stager's slots: one row's stored stacks, and the next row's beside them while it prefetches."""
    parts = lambda plan: {p.name: p.bytes for p in plan.parts}  # noqa: E731
    cfg = load_config("h200_offload")
    one_row = weight_counts(cfg, 256)["stored"] // cfg.model.n_rows
    assert cfg.experts.prefetch and one_row > 0
    assert parts(plan_memory(cfg))["NF4 stacks"] == 2 * one_row
    assert parts(plan_memory(load_config("h200_offload", ["experts.prefetch=false"])))["NF4 stacks"] == one_row


@pytest.mark.parametrize("dispatch", ["native", "grouped"])
def test_the_replay_pin_keeps_a_stack_from_its_floor_up(dispatch):
    """experts.pin_floor_mib: a stack of exactly the floor is pinned, one a byte smaller is not; a bucketed
    path's two stacks follow gate_up's decision, a packed path decides each (down is half gate_up)."""
    from minagi.plan import _pins
    sets = ["model.d_model=1024", "model.n_heads=8", "pool.n_experts=8", "pool.d_expert=1024", "experts.frozen=true",
            "train.checkpoint_rows=true", "train.precision=bf16", f"pool.dispatch={dispatch}"]

    def pins(floor_mib: float) -> tuple[bool, bool]:
        cfg = load_config(None, [*sets, f"experts.pin_floor_mib={floor_mib!r}"])
        return _pins(cfg, _resolve(cfg, TARGETS["sm90"], 1, 256))
    gate_up, down, byte = 32, 16, 1 / 2 ** 20  # MiB of each bf16 stack: 8 x 1024 x 2048 x 2, 8 x 1024 x 1024 x 2
    assert pins(gate_up) == (True, dispatch == "grouped")
    assert pins(gate_up + byte) == (False, False)
    if dispatch == "native":
        assert pins(down) == (True, True) and pins(down + byte) == (True, False)
    assert pins(0) == (True, True)


def test_a_compiled_row_saves_less_than_an_eager_one():
    """Inductor recomputes casts and norm outputs: a compiled plan's rows keep ~1.2 D bytes a character less
    than the eager count (3.2 fitted on the H200 when that count held the projection input's bf16 copy)."""
    eager, compiled = (load_config("h200", [f"train.compile={c}"]) for c in ("false", "true"))
    assert plan_memory(compiled).peak_allocated < plan_memory(eager).peak_allocated
    rows = [row_saved(_resolve(cfg, TARGETS["sm90"], 1, 256))["attention"] for cfg in (eager, compiled)]
    s = _resolve(eager, TARGETS["sm90"], 1, 256)
    assert rows[0] - rows[1] == pytest.approx(1.2 * s.D * s.N, abs=1)
    assert plan_memory(compiled, "cpu").peak_allocated == plan_memory(eager, "cpu").peak_allocated  # not on the CPU


def test_the_allocator_slack_is_2_percent_with_expandable_segments_and_15_without():
    for alloc_conf, share in (("expandable_segments:True", 0.02), ("", 0.15)):
        plan = plan_memory(load_config("h200", [f"memory.alloc_conf={alloc_conf}"]))
        assert plan.slack.bytes == int(plan.peak_allocated * share), alloc_conf
        assert plan_memory(load_config("h200", [f"memory.alloc_conf={alloc_conf}"]), "cpu").slack.bytes == 0


def test_under_expert_parallelism_a_rank_casts_its_slice_of_the_stacks():
    """model_bytes_per_rank's casts: each rank multiplies its own experts only, 1/N of the card's."""
    from minagi.parallel import model_bytes_per_rank
    casts = {ep: model_bytes_per_rank(load_config("h200x8_fsdp", ["train.parallel=ddp", f"train.expert_parallel={ep}"]),
                                      8, vocab=256)["casts"] for ep in (1, 8)}
    assert casts[1] > 0 and casts[8] * 8 == casts[1]
