"""minagi.frozen: frozen NF4 experts behind the expert-weights seam, LoRA on them, row checkpointing
with and without the replay pin (the same bits, 3 or 2 dequants per stack per row), --init, resume,
writing."""
import math

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from minagi import recompute
from minagi.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from minagi.config import ExpertsConfig, ModelConfig, PoolConfig
from minagi.experts import StackServices
from minagi.frozen import FrozenStack, dequant_summary, frozen_stacks
from minagi.loading import init_from_checkpoint, load_trained
from minagi.model import CharLM, build_model
from minagi.nf4 import dequantize_nf4, quantize_nf4
from minagi.recompute import PinPolicy, clear_stale_slots
from minagi.runlog import read_history
from minagi.sampling import write
from minagi.trainer import resume_config, train
from tiny import interrupt_at, run_tiny

PATHS = ["loop", "grouped", "rectangle", "native"]
CFG = ModelConfig(n_rows=2, d_model=32, n_heads=2, context=16)
FROZEN = ExpertsConfig(frozen=True, lora_rank=8, blocksize=32)


POOL = PoolConfig(n_experts=4, top_k=2, d_expert=32, z_loss_coef=1e-3)


def frozen_model(path="grouped", experts=FROZEN, seed=0, pin: PinPolicy | str | None = None):
    """A frozen model; `pin` (a policy, or a replay_pin mode with no floor) builds its rows checkpointed."""
    torch.manual_seed(seed)
    pool = PoolConfig(**{**POOL.__dict__, "dispatch": path})
    if pin is None:
        model = build_model(CFG, pool, 11, "cpu", experts=experts)
    elif isinstance(pin, str):
        experts = ExpertsConfig(**{**experts.__dict__, "replay_pin": pin, "pin_floor_mib": 0.0})
        model = build_model(CFG, pool, 11, "cpu", experts=experts, checkpoint_rows=True)
    else:
        model = CharLM(CFG, pool, 11, path, stacks=StackServices(experts, torch.device("cpu"), pin=pin),
                       checkpoint_rows=True)
    with torch.no_grad():  # adapters that are not zero, so their gradients and outputs matter
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    return model


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 11, (3, 16), generator=g), torch.randint(0, 11, (3, 16), generator=g)


def step(model, checkpointed=False):
    x, y = batch()
    model.zero_grad()
    with set_checkpoint_early_stop(False):
        out = model(x, y)
        (out.loss + out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


@pytest.mark.parametrize("path", PATHS)
def test_pin_and_recompute_give_the_plain_models_bits_with_3_then_2_dequants_per_stack_and_row(path):
    plain = frozen_model(path)
    want_loss, want = step(plain)
    counts = {"plain": dequant_summary(plain, 1)}
    for mode in ("off", "on"):
        model = frozen_model(path, pin=mode)
        loss, grads = step(model)
        assert torch.equal(loss, want_loss), mode
        assert grads.keys() == want.keys() and any("lora_" in k for k in grads) and any("router" in k for k in grads)
        for name in want:
            assert torch.equal(grads[name], want[name]), (mode, name)
        counts[mode] = dequant_summary(model, 1)
        assert not any(memo.slots for memo in list(recompute._LIVE)), "a slot outlived its backward"
    stacks = 2 * CFG.n_rows
    assert counts["plain"] == {"forward": stacks, "replay": 0, "backward": stacks, "pinned": 0, "stacks": stacks}
    assert counts["off"] == {"forward": stacks, "replay": stacks, "backward": stacks, "pinned": 0, "stacks": stacks}
    assert counts["on"] == {"forward": stacks, "replay": stacks, "backward": 0, "pinned": stacks, "stacks": stacks}


def test_frozen_stacks_are_buffers_with_no_gradient_and_no_optimizer_state():
    model = frozen_model()
    loss, grads = step(model)
    assert not any(".gate_up." in n and "lora" not in n or ".down." in n and "lora" not in n for n in grads)
    assert frozen_stacks(model) and all(not any(True for _ in s.parameters()) for s in frozen_stacks(model).values())
    decay, no_decay = model.param_groups(0.1)
    lora = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert lora and lora <= {id(p) for p in no_decay["params"]} and not lora & {id(p) for p in decay["params"]}


@pytest.mark.parametrize("path", PATHS)
def test_a_frozen_stack_computes_what_a_trainable_stack_of_its_dequantized_weights_computes(path):
    frozen = frozen_model(path, ExpertsConfig(frozen=True, blocksize=32))
    torch.manual_seed(0)
    plain = build_model(CFG, PoolConfig(n_experts=4, top_k=2, d_expert=32, dispatch=path, z_loss_coef=1e-3), 11, "cpu")
    state = {k: v for k, v in frozen.state_dict().items() if ".experts." not in k}
    for i, pool in enumerate(frozen.pools()):
        state[f"rows.{i}.mlp.experts.gate_up"] = pool.experts.gate_up.dequantize(torch.float32)
        state[f"rows.{i}.mlp.experts.down"] = pool.experts.down.dequantize(torch.float32)
    plain.load_state_dict(state)
    x, y = batch()
    torch.testing.assert_close(frozen(x, y).logits, plain(x, y).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", [p for p in PATHS if p != "loop"])
def test_every_path_gives_the_loop_paths_outputs_and_adapter_gradients_with_lora(path):
    """The adapters' scale (lora_alpha / lora_rank = 2 here) and products on each path's own code."""
    (loss, grads), (want_loss, want) = step(frozen_model(path)), step(frozen_model("loop"))
    torch.testing.assert_close(loss, want_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == want.keys() and any("lora_" in k for k in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_chosen_experts_are_dequantized_alone_with_their_adapters():
    experts = frozen_model().pools()[0].experts
    ids = torch.tensor([3, 1, 3])
    gate_up, down = experts.weights(torch.float32, experts=ids)
    full = experts.gate_up.dequantize(torch.float32)
    want = full[ids] + experts.scale * experts.lora_gate_up_a[ids] @ experts.lora_gate_up_b[ids]
    torch.testing.assert_close(gate_up, want)
    assert down.shape == (3, 32, 32)


def test_stored_bytes_are_half_a_byte_per_weight_plus_the_absmax():
    stack = FrozenStack((4, 32, 64), ExpertsConfig(frozen=True, blocksize=64), "cpu")
    assert stack.stored_bytes() == 4 * 32 * 64 // 2 + 4 * 32 * 64 // 64 * 4  # 4.5 bits a weight
    w = torch.randn(4, 32, 64)
    stack.load_weights(w)
    assert torch.equal(stack.dequantize(torch.float32), dequantize_nf4(quantize_nf4(w, 64), torch.float32))
    double = FrozenStack((4, 32, 64), ExpertsConfig(frozen=True, blocksize=64, double_quant=True), "cpu")
    double.load_weights(w)
    assert torch.equal(double.dequantize(torch.float32), dequantize_nf4(quantize_nf4(w, 64, True), torch.float32))


def test_auto_pins_a_stack_from_the_floor_up_and_only_when_it_fits():
    room = {"bytes": 10 * 2**20}
    queries = []

    def headroom(device):
        queries.append(device)
        return room["bytes"]
    policy = PinPolicy("auto", floor_bytes=2**20, headroom=headroom, cache_s=60.0)
    cpu = torch.device("cpu")
    assert not policy.decide("small", 2**20 - 1, cpu) and queries == []   # under the floor: no query
    assert policy.decide("big", 4 * 2**20, cpu)                            # 10 MiB >= 2 x 4 MiB
    assert not policy.decide("bigger", 6 * 2**20, cpu)                     # 10 MiB < 2 x 6 MiB
    room["bytes"] = 100 * 2**20
    assert not policy.decide("bigger", 6 * 2**20, cpu) and len(queries) == 1  # the query is cached
    policy.cache_s = 0.0
    assert policy.decide("bigger", 6 * 2**20, cpu) and len(queries) == 2
    assert PinPolicy("on").decide("tiny", 1, cpu) and not PinPolicy("off").decide("huge", 2**40, cpu)
    logged = []
    noisy = PinPolicy("on", log=logged.append)
    noisy.decide("rows.0", 2**20, cpu)
    noisy.decide("rows.0", 2**20, cpu)
    assert len(logged) == 1 and "rows.0" in logged[0] and "pinned" in logged[0]  # logged once


def test_a_slot_no_backward_took_is_cleared_at_the_next_step():
    model = frozen_model(pin="on")
    x, y = batch()
    with set_checkpoint_early_stop(False):
        out = model(x, y)
        # The router's gradient replays the last row but needs no gradient through its gate_up stack:
        # that stack's pinned slot is never taken.
        grads = torch.autograd.grad(out.loss, [model.pools()[-1].router.weight])
    assert grads[0].abs().sum() > 0
    assert sum(len(m.slots) for m in list(recompute._LIVE)) == 1
    assert clear_stale_slots() > 0 and clear_stale_slots() == 0


def test_the_lora_scale_is_alpha_over_rank():
    for alpha, rank in ((16.0, 8), (8.0, 16)):
        experts = ExpertsConfig(frozen=True, lora_rank=rank, lora_alpha=alpha, blocksize=32)
        assert frozen_model(experts=experts).pools()[0].experts.scale == alpha / rank  # 2.0, then 0.5


def test_fresh_adapters_leave_the_frozen_models_logits_exactly_as_without_lora():
    """B starts at zero (A does not): a new adapter changes nothing until it trains."""
    torch.manual_seed(0)
    lora = build_model(CFG, POOL, 11, "cpu", experts=FROZEN)  # the adapters as initialised
    plain = build_model(CFG, POOL, 11, "cpu", experts=ExpertsConfig(frozen=True, blocksize=32))
    plain.load_state_dict({k: v for k, v in lora.state_dict().items() if "lora_" not in k})
    adapters = {n: p for n, p in lora.named_parameters() if "lora_" in n}
    assert adapters and all(p.abs().sum() > 0 for n, p in adapters.items() if n.endswith("_a"))
    x, _ = batch()
    with torch.no_grad():
        assert torch.equal(lora(x).logits, plain(x).logits)


def test_a_frozen_models_param_groups_have_no_empty_expert_group():
    """Nothing of frozen experts decays (stacks are buffers, adapters never decay): no group of them,
    which an optimizer would keep as an empty group, so the two groups of older checkpoints' states."""
    groups = frozen_model().param_groups(0.1, 0.5)
    assert len(groups) == 2 and all(g["params"] for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]


# ------------------------------------------------------------------------------ runs

FROZEN_SETTINGS = ["experts.frozen=true", "experts.blocksize=32", "experts.lora_rank=8", "train.lr=1e-2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny trainable run, then a frozen-NF4 run with LoRA started from its best.pt."""
    tmp = tmp_path_factory.mktemp("frozen")
    base = run_tiny(tmp, None, "train.steps=12", "train.eval_every=6", run_name="base")
    frozen = train(_frozen_cfg(tmp, "lora"), "tiny", progress=False, log=lambda m: None, argv=["test"],
                   init=base.run_dir / "best.pt")
    return tmp, base, frozen


def _frozen_cfg(tmp, name, *extra):
    from tiny import tiny_cfg
    return tiny_cfg(tmp, None, *FROZEN_SETTINGS, "train.steps=12", "train.eval_every=6", *extra, run_name=name)


def test_init_into_a_frozen_model_never_draws_random_stacks_it_then_overwrites(tmp_path, monkeypatch):
    """--init loads every stack: drawing them first would waste the time and shift the random stream."""
    base = run_tiny(tmp_path, None, "train.steps=2", "train.eval_every=2", run_name="base")
    drawn = []
    monkeypatch.setattr(FrozenStack, "init_random", lambda self, std, generator: drawn.append(self.name))
    result = train(_frozen_cfg(tmp_path, "lora", "train.steps=2", "train.eval_every=2"), "tiny", progress=False,
                   log=lambda m: None, argv=["test"], init=base.run_dir)
    assert result.step == 2 and drawn == []


def test_init_quantizes_a_trained_runs_stacks_and_lora_lowers_the_held_out_loss(trained):
    from minagi.data import heldout_batches, load_corpus
    from minagi.runlog import read_history
    from minagi.trainer import evaluate
    tmp, base, frozen = trained
    last = load_checkpoint(frozen.run_dir / "last.pt")
    assert "rows.0.mlp.experts.gate_up.packed" in last["model"] and "rows.0.mlp.experts.gate_up" not in last["model"]
    # Only trainable tensors have optimizer state: the frozen stacks are buffers.
    model = load_trained(frozen.run_dir / "last.pt")[0]
    trainable = list(model.parameters())
    assert sum(len(g["params"]) for g in last["optimizer"]["param_groups"]) == len(trainable)
    assert sum(s["exp_avg"].numel() for s in last["optimizer"]["state"].values()) == sum(p.numel() for p in trainable)
    # The held-out loss of the freshly quantized model, then after training (LoRA and the rest).
    cfg = _frozen_cfg(tmp, "probe")
    start = build_model(cfg.model, cfg.pool, model.vocab_size, "cpu", experts=cfg.experts, init_frozen=False)
    init_from_checkpoint(start, Checkpoint.load(base.run_dir / "best.pt"), "best.pt")
    corpus = load_corpus(cfg.data.path, cfg.data.heldout_fraction, cfg.data.cache_dir)
    batches = heldout_batches(corpus.heldout_ids, cfg.train.batch_size, cfg.model.context, cfg.train.eval_batches,
                              cfg.train.seed)
    quantized = evaluate(start, batches, torch.device("cpu"), 1)
    history = read_history(frozen.run_dir / "history.jsonl")
    assert history[-1]["heldout_loss"] < quantized
    assert history[-1]["dequants"] == {"forward": 2, "replay": 0, "backward": 2, "pinned": 0, "stacks": 2}


def test_a_frozen_run_resumes_exactly_and_writes(trained, monkeypatch):
    tmp, base, frozen = trained
    with monkeypatch.context() as m:
        interrupt_at(m, 8)
        cut = train(_frozen_cfg(tmp, "cut"), "tiny", progress=False, log=lambda msg: None, argv=["test"],
                    init=base.run_dir / "best.pt")
    assert cut.interrupted and cut.step == 8
    cfg, profile = resume_config(cut.run_dir)
    rest = train(cfg, profile, cut.run_dir, progress=False, log=lambda msg: None, argv=["test"])
    assert cut.losses + rest.losses == frozen.losses and rest.heldout_loss == frozen.heldout_loss
    # Dequants per step of the record that straddles the resume: over the steps this process trained.
    assert read_history(cut.run_dir / "history.jsonl")[-1]["dequants"] == \
        read_history(frozen.run_dir / "history.jsonl")[-1]["dequants"]
    model, vocab, _ = load_trained(cut.run_dir / "last.pt")
    seen = []
    real = FrozenStack.dequantize

    def spy(self, dtype, experts=None, phase=None, in_place=False):
        seen.append(None if experts is None else experts.numel())
        return real(self, dtype, experts, phase, in_place)
    monkeypatch.setattr(FrozenStack, "dequantize", spy)
    text = "".join(c for (c,) in write(model, vocab, ["the "], 5, seed=1))
    assert len(text) == 5
    # After the prompt's prefill, each character's step dequantizes only its top_k experts of each stack.
    per_char = 2 * model.cfg.n_rows  # two stacks a row
    assert seen[-4 * per_char:] == [2] * (4 * per_char)  # 4 one-character steps, top_k = 2 experts each
    assert math.isfinite(rest.heldout_loss)


def test_init_from_a_checkpoint_of_another_shape_is_one_line_naming_the_tensor(trained):
    tmp, base, _ = trained
    model = build_model(ModelConfig(n_rows=1, d_model=32, n_heads=2, context=16),
                        PoolConfig(n_experts=4, top_k=2, d_expert=64), 30, "cpu",
                        experts=ExpertsConfig(frozen=True, blocksize=32), init_frozen=False)
    ckpt = Checkpoint.load(base.run_dir / "best.pt")
    with pytest.raises(Exception) as err:
        init_from_checkpoint(model, ckpt, base.run_dir / "best.pt")
    message = str(err.value)
    assert "\n" not in message and "best.pt: " in message and ("embed.weight" in message or "experts" in message)


@pytest.mark.parametrize("experts,says", [
    (ExpertsConfig(), r"its run's experts are frozen \(experts.frozen = true, experts.quant = 'nf4'\) and this "
                      r"profile's are not: .*set experts.frozen = true and experts.quant = 'nf4'"),
    (ExpertsConfig(frozen=True, quant="none", lora_rank=8), r"its run's frozen stacks are stored as experts.quant = "
                                                            r"'nf4', this profile's as 'none': set experts.quant = 'nf4'"),
], ids=["into-trainable", "into-bf16-frozen"])
def test_init_from_a_frozen_run_into_a_model_frozen_otherwise_names_the_cause(trained, experts, says):
    """Not the first tensor that had no place (a LoRA adapter, a packed stack): the setting that differs."""
    _, _, frozen = trained
    model = build_model(ModelConfig(n_rows=1, d_model=32, n_heads=2, context=16),
                        PoolConfig(n_experts=4, top_k=2, d_expert=32), 30, "cpu", experts=experts, init_frozen=False)
    with pytest.raises(CheckpointError, match=says) as err:
        init_from_checkpoint(model, Checkpoint.load(frozen.run_dir / "best.pt"), frozen.run_dir / "best.pt")
    assert "\n" not in str(err.value)


def test_a_blocksize_experts_cannot_fill_is_a_one_line_config_error():
    from minagi.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"--set experts.blocksize: experts.blocksize = 4096 is impossible: an "
                                          r"expert's 32 x 32 weights must fill whole NF4 blocks"):
        load_config(None, ["model.d_model=32", "pool.d_expert=32", "experts.frozen=true", "experts.blocksize=4096"])
    # 32 x 48 = 1,536 weights hold 3 blocks of 512 but not whole pairs of them: the stack's own rule
    # (frozen.py), which the config must say first, as a config error and not a ValueError at build.
    with pytest.raises(ConfigError, match=r"experts.blocksize = 512 is impossible: .*\(a multiple of 2 x blocksize = 1024\)"):
        load_config(None, ["model.d_model=32", "pool.d_expert=48", "experts.frozen=true", "experts.blocksize=512"])


# ------------------------------------------------------------------------------ the pin's rules

class RecordingPolicy(PinPolicy):
    """A pin policy that records what it is asked: (name, bytes) per decision."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked = []

    def decide(self, name, nbytes, device):
        self.asked.append((name, nbytes))
        return super().decide(name, nbytes, device)


def test_auto_off_cuda_measures_the_hosts_memory_and_pins_without_crashing():
    # The seed's bug: a stack at or over the floor asked the CUDA driver for headroom on the CPU.
    model = frozen_model(pin="auto")  # floor 0: every stack is over it
    loss, grads = step(model)
    want_loss, want = step(frozen_model())
    assert torch.equal(loss, want_loss) and all(torch.equal(grads[k], want[k]) for k in want)
    assert dequant_summary(model, 1)["pinned"] == 2 * CFG.n_rows
    assert recompute.device_headroom(torch.device("cpu")) > 0


def test_on_drops_the_floor_but_keeps_the_fit_check():
    cpu = torch.device("cpu")
    assert PinPolicy("on", floor_bytes=2**40, headroom=lambda d: 3 * 2**20).decide("s", 2**20, cpu)  # fits
    assert not PinPolicy("on", headroom=lambda d: 2**20).decide("s", 2**20, cpu)  # 1 MiB < 2 x 1 MiB
    assert PinPolicy("on", headroom=lambda d: None).decide("s", 2**40, cpu)  # unknown headroom: fits
    assert not PinPolicy("auto", floor_bytes=2**21, headroom=lambda d: 2**40).decide("s", 2**20, cpu)  # floor
    with pytest.raises(ValueError, match="auto, on or off"):
        PinPolicy("sometimes")


@pytest.mark.parametrize("path", PATHS)
def test_the_floor_and_fit_see_whole_stacks_one_decision_a_row_where_both_are_held_together(path):
    policy = RecordingPolicy("auto", floor_bytes=0)
    step(frozen_model(path, pin=policy))
    gate_up, down = 4 * 32 * 64 * 4, 4 * 32 * 32 * 4  # whole stacks in fp32 (the CPU's compute dtype)
    rows = [f"rows.{i}.mlp.experts" for i in reversed(range(CFG.n_rows))]  # replayed last row first
    if path == "native":  # each projection decides alone, on its own whole stack
        assert policy.asked == [(f"{r}.{w}", n) for r in rows for w, n in (("gate_up", gate_up), ("down", down))]
    else:  # grouped, loop, rectangle: the row decides once, on gate_up's whole stack
        assert policy.asked == [(r, gate_up) for r in rows]


@pytest.mark.parametrize("path", PATHS)
def test_auto_gives_offs_bits_with_one_stack_pinned_and_another_recomputed_in_the_same_model(path):
    queries = []

    def headroom(device):  # room for the first decision only
        queries.append(device)
        return 2**40 if len(queries) == 1 else 0
    want_loss, want = step(frozen_model(path, pin="off"))
    model = frozen_model(path, pin=PinPolicy("auto", floor_bytes=0, headroom=headroom, cache_s=0.0))
    loss, grads = step(model)
    assert torch.equal(loss, want_loss) and grads.keys() == want.keys()
    for name in want:
        assert torch.equal(grads[name], want[name]), name
    counts = dequant_summary(model, 1)
    pinned = 2 if path != "native" else 1  # the first row replayed: both stacks together, or gate_up alone
    assert counts["pinned"] == pinned and counts["backward"] == 2 * CFG.n_rows - pinned
    assert not any(memo.slots for memo in list(recompute._LIVE))


def test_a_set_replay_pin_beats_the_environment_variable(monkeypatch):
    from minagi import train as train_py
    monkeypatch.setenv("MINAGI_REPLAY_PIN", "1")
    cfg, _ = train_py.resolve(train_py.parse_args(["--profile", "cpu_tiny"]))
    assert cfg.experts.replay_pin == "on"
    cfg, _ = train_py.resolve(train_py.parse_args(["--profile", "cpu_tiny", "--set", "experts.replay_pin=off"]))
    assert cfg.experts.replay_pin == "off"
