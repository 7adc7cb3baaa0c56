"""minagi.offload: frozen stacks homed on the CPU and staged per row give the resident model's bits,
keep one row (two with prefetch) in their slots, load and save both ways."""
import re

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from minagi.config import ConfigError, ExpertsConfig, ModelConfig, PoolConfig, load_config
from minagi.frozen import dequant_summary, frozen_stacks
from minagi.model import build_model

CFG = ModelConfig(n_rows=3, d_model=32, n_heads=2, context=16)
POOL = PoolConfig(n_experts=4, top_k=2, d_expert=32)
RESIDENT = ExpertsConfig(frozen=True, blocksize=32, lora_rank=8)
OFFLOADED = ExpertsConfig(frozen=True, blocksize=32, lora_rank=8, offload="cpu")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build(experts, device="cpu", path="grouped", prefetch=True, checkpoint_rows=False, n_rows=CFG.n_rows):
    torch.manual_seed(0)
    experts = ExpertsConfig(**{**experts.__dict__, "prefetch": prefetch})
    cfg, pool = ModelConfig(**{**CFG.__dict__, "n_rows": n_rows}), PoolConfig(**{**POOL.__dict__, "dispatch": path})
    model = build_model(cfg, pool, 11, device, experts=experts, checkpoint_rows=checkpoint_rows)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    assert (model.stager is not None) == (experts.offload == "cpu")
    return model, model.stager


def steps(model, n=2, checkpointed=False, device="cpu"):
    """Losses and gradients of `n` forward + backward passes on fixed batches."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        x, y = (torch.randint(0, 11, (2, 16), generator=g).to(device) for _ in range(2))
        model.zero_grad()
        with set_checkpoint_early_stop(False):
            res = model(x, y)
            (res.loss + res.aux_loss).backward()
        out.append((res.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


def assert_same(a, b):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b):
        assert torch.equal(loss_a, loss_b)
        assert grads_a.keys() == grads_b.keys()
        for name in grads_a:
            assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("path", ["loop", "grouped", "native"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_offloaded_stacks_give_the_resident_losses_and_gradients(path, prefetch):
    resident, _ = build(RESIDENT, path=path)
    offloaded, stager = build(OFFLOADED, path=path, prefetch=prefetch)
    assert all(s.packed.device.type == "cpu" for s in frozen_stacks(offloaded).values())
    assert_same(steps(offloaded), steps(resident))
    stats = stager.take_stats()
    row_bytes = sum(s.stored_bytes() for s in frozen_stacks(offloaded).values()) // CFG.n_rows
    assert stats["resident_bytes"] == (2 if prefetch else 1) * row_bytes
    assert stats["h2d_bytes"] >= 2 * 2 * CFG.n_rows * row_bytes // 2  # every row staged forward and backward


def test_the_h2d_figures_are_per_call_so_two_alike_steps_report_the_same_bytes():
    """take_stats counts since its last call (the history divides by the steps between): a count
    that kept growing would read as more traffic every step."""
    model, stager = build(OFFLOADED)
    steps(model, 1)  # from empty slots; after it, every step starts with the same rows staged
    stager.take_stats()
    figures = []
    for _ in range(2):
        steps(model, 1)
        figures.append(stager.take_stats()["h2d_bytes"])
    assert figures[0] == figures[1] > 0


@pytest.mark.parametrize("n_rows", [3, 4, 5])
def test_forwards_without_backward_and_writing_by_rows_give_the_resident_bits(n_rows):
    """Forward after forward (evaluation), and a writer staging rows: each fetch prefetches the next row.
    With 4 rows, rows 3 and 2 staged and row 0 fetched into row 3's slot, the prefetch of row 1 was as
    far from rows 0 and 2, and the tie evicted row 0 before it was read (its output off by up to 0.17)."""
    from minagi.decode import Decoder
    (resident, _), (offloaded, _) = build(RESIDENT, n_rows=n_rows), build(OFFLOADED, n_rows=n_rows)
    x = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(offloaded.eval()(x).logits, resident.eval()(x).logits)
    logits = []
    for model in (resident, offloaded):
        decoder = Decoder(model, [0], 16, temperature=0.0, read_in_place=False)
        decoder.prefill([0], [[1, 2, 3]])
        for _ in range(2 * n_rows):
            decoder.advance()
            logits.append(decoder.logits_BV.clone())
    assert all(torch.equal(a, b) for a, b in zip(logits[:2 * n_rows], logits[2 * n_rows:]))


def test_under_row_checkpointing_with_the_pin_offload_keeps_the_bits():
    pinned = {"replay_pin": "on"}
    resident, _ = build(ExpertsConfig(**{**RESIDENT.__dict__, **pinned}), checkpoint_rows=True)
    offloaded, _ = build(ExpertsConfig(**{**OFFLOADED.__dict__, **pinned}), checkpoint_rows=True)
    assert_same(steps(offloaded), steps(resident))
    assert dequant_summary(offloaded, 2)["pinned"] > 0


def test_after_a_forward_one_row_is_resident_and_the_next_is_prefetched():
    model, stager = build(OFFLOADED)
    single, one_slot = build(OFFLOADED, prefetch=False)
    x = torch.zeros(1, 16, dtype=torch.long)
    with torch.no_grad():
        model(x)
        single(x)
    assert stager.slot_row.count(None) == 0 and CFG.n_rows - 1 in stager.slot_row  # the last row and one other
    assert one_slot.slot_row == [CFG.n_rows - 1]


def test_state_dicts_hold_the_cpu_homes_and_load_both_ways():
    offloaded, _ = build(OFFLOADED)
    state = offloaded.state_dict()
    packed = state["rows.0.mlp.experts.gate_up.packed"]
    assert packed.device.type == "cpu" and packed.numel() == 4 * 32 * 64 // 2 and packed.any()
    resident, _ = build(RESIDENT)
    with torch.no_grad():
        for p in resident.parameters():
            p.zero_()
    resident.load_state_dict(state)   # offloaded -> resident
    back, _ = build(OFFLOADED)
    back.load_state_dict(resident.state_dict())  # resident -> offloaded
    x = torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = offloaded(x).logits
        assert torch.equal(resident(x).logits, want) and torch.equal(back(x).logits, want)


def test_offload_without_frozen_experts_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"experts\.offload = \"cpu\" is impossible: only frozen experts can be "
                                          r"offloaded: set experts\.frozen = true"):
        load_config(None, ["experts.offload=cpu"])
    assert build_model(CFG, POOL, 11, "cpu").stager is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prefetch", [True, False])
def test_on_the_gpu_offload_matches_resident_and_allocates_no_more_over_steps(prefetch):
    resident, _ = build(RESIDENT, "cuda", path="native")
    offloaded, stager = build(OFFLOADED, "cuda", path="native", prefetch=prefetch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = steps(resident, 2, device="cuda")
        got = steps(offloaded, 2, device="cuda")
        assert_same(got, want)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        steps(offloaded, 3, device="cuda")
        torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    assert stager.take_stats()["h2d_bytes"] > 0


def test_writing_reads_chosen_experts_in_place_or_stages_rows_and_either_way_writes_the_resident_text():
    from minagi.data import Vocab
    from minagi.sampling import write
    offloaded, stager = build(OFFLOADED)
    resident, _ = build(RESIDENT)
    vocab = Vocab("abcdefghijk")
    row_bytes = sum(s.stored_bytes() for s in frozen_stacks(offloaded).values()) // CFG.n_rows

    def text(model, **kw):
        if stager is not None:
            stager.take_stats()
        out = "".join(c[0] for c in write(model, vocab, ["abc"], 20, temperature=0, graphs="off", **kw))
        return out, stager.take_stats()["h2d_bytes"]

    want, _ = text(resident)
    by_experts, experts_bytes = text(offloaded, offload_read="experts")
    by_rows, rows_bytes = text(offloaded, offload_read="rows")
    assert by_experts == want == by_rows and len(want) == 20
    assert experts_bytes <= CFG.n_rows * row_bytes  # at most the prefill's rows: the steps read in place
    assert rows_bytes > 10 * CFG.n_rows * row_bytes  # every step stages its rows again
    # How a writer reads is its own argument, never a flag on the stager: training between two
    # characters of a paused writer stages whole rows.
    chars = write(offloaded, vocab, ["abc"], 20, temperature=0, graphs="off", offload_read="experts")
    next(chars)
    stager.take_stats()
    steps(offloaded, 1)
    assert stager.take_stats()["h2d_bytes"] >= CFG.n_rows * row_bytes


def test_how_writing_reads_offloaded_experts_decides_whether_graphs_can_run():
    from minagi.sampling import SamplingError, resolve_graphs, resolve_offload_read
    offloaded, _ = build(OFFLOADED)
    resident, _ = build(RESIDENT)
    cuda = torch.device("cuda")
    assert resolve_offload_read("auto", resident) is None
    assert resolve_offload_read("auto", offloaded, streams=1) == "experts"  # 1 x top_k 2 < 4 experts
    assert resolve_offload_read("auto", offloaded, streams=2) == "rows"     # 2 x 2 reads the whole row
    assert resolve_offload_read("rows", offloaded, streams=1) == "rows"
    assert resolve_graphs("auto", cuda, offloaded, "experts")
    assert not resolve_graphs("auto", cuda, offloaded, "rows")
    assert not resolve_graphs("auto", cuda, offloaded)  # asked without saying how: staged, no graph
    with pytest.raises(SamplingError, match="staged a row at a time"):
        resolve_graphs("on", cuda, offloaded, "rows")
    with pytest.raises(SamplingError, match="offload_read must be one of auto, experts, rows; got 'all'"):
        resolve_offload_read("all", offloaded)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_chosen_experts_read_from_pinned_memory_write_the_resident_text_in_a_graph():
    from minagi.data import Vocab
    from minagi.offload import host_alias
    from minagi.sampling import write
    home = torch.arange(1000, dtype=torch.float32).pin_memory()
    alias = host_alias(home, torch.device("cuda"))
    assert alias.device.type == "cuda" and alias.data_ptr() == home.data_ptr()  # the same bytes, not a copy
    assert torch.equal(alias.index_select(0, torch.tensor([3, 999], device="cuda")).cpu(), torch.tensor([3.0, 999.0]))
    offloaded, stager = build(OFFLOADED, "cuda", path="native")
    resident, _ = build(RESIDENT, "cuda", path="native")
    vocab = Vocab("abcdefghijk")
    texts = ["".join(c[0] for c in write(m, vocab, ["abc"], 30, temperature=0, graphs="on", **kw))
             for m, kw in ((resident, {}), (offloaded, {"offload_read": "experts"}))]
    assert texts[0] == texts[1] and len(texts[0]) == 30


class RecordingCopies:
    """A stand-in for the CUDA streams (minagi.offload.Copies): runs each copy at once and records the
    order of releases, copies and waits, as the compute and copy streams would see them."""

    timing = False

    def __init__(self):
        self.log = []

    def released(self, slot):
        self.log.append(("release", slot))

    def copy(self, slot, row, fill):
        self.log.append(("copy", slot, row))
        fill()

    def wait(self, slot):
        self.log.append(("wait", slot))

    def take_ms(self):
        return 0.0, None


def _recording_model(checkpoint_rows=False):
    from minagi.experts import StackServices
    from minagi.model import CharLM
    from minagi.offload import OffloadStager
    copies = RecordingCopies()
    stager = OffloadStager("cpu", prefetch=True, copies=copies)
    fetch = stager.fetch

    def logged_fetch(row, index, phase):
        copies.log.append(("fetch", row, phase))
        return fetch(row, index, phase)
    stager.fetch = logged_fetch
    torch.manual_seed(0)
    model = CharLM(ModelConfig(n_rows=4, d_model=32, n_heads=2, context=16), POOL, 11, "grouped",
                   stacks=StackServices(OFFLOADED, torch.device("cpu"), stager=stager), checkpoint_rows=checkpoint_rows)
    return model, copies


def _copies_after_fetches(log):
    """(row copied, row of the fetch that issued it) for each copy."""
    pairs, fetched = [], None
    for event in log:
        if event[0] == "fetch":
            fetched = event[1]
        elif event[0] == "copy":
            pairs.append((event[2], fetched))
    return pairs


@pytest.mark.parametrize("checkpoint_rows", [False, True], ids=["plain", "checkpointed"])
def test_the_stager_prefetches_the_next_row_forward_and_the_previous_backward_and_orders_every_copy(checkpoint_rows):
    model, copies = _recording_model(checkpoint_rows)
    x, y = (torch.randint(0, 11, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    with set_checkpoint_early_stop(False):
        out = model(x, y)
        forward_log, copies.log = copies.log, []
        (out.loss + out.aux_loss).backward()
    backward_log = copies.log
    # Forward: row 0 staged by its own fetch, then each row's fetch prefetches the row after it.
    assert _copies_after_fetches(forward_log) == [(0, 0), (1, 0), (2, 1), (3, 2)]
    # Backward (the replays too) runs the rows in reverse: each fetch prefetches the row before it,
    # so no row is staged by its own fetch.
    pairs = _copies_after_fetches(backward_log)
    assert pairs and all(copied == fetched - 1 for copied, fetched in pairs), pairs
    assert {phase for e in backward_log if e[0] == "fetch" for phase in [e[2]]} == (
        {"replay", "backward"} if checkpoint_rows else {"backward"})
    for log in (forward_log, backward_log):
        for i, event in enumerate(log):
            if event[0] == "copy":  # a copy overwrites a slot only once compute has released it
                assert log[i - 1] == ("release", event[1]), log
        # every fetch makes compute wait on its slot's copy before it reads the slot
        fetches = sum(e[0] == "fetch" for e in log)
        assert [e[0] for e in log if e[0] in ("fetch", "wait")] == ["fetch", "wait"] * fetches


def test_a_writer_staging_rows_prefetches_the_next_row_as_a_forward_does():
    """Writing fetches with no phase (not training): its rows run in order, so the prefetch goes ahead."""
    from minagi.decode import Decoder
    model, copies = _recording_model()
    decoder = Decoder(model.eval(), [0], 16, temperature=0.0, read_in_place=False)
    decoder.prefill([0], [[1, 2, 3]])
    for _ in range(2):
        copies.log = []
        decoder.advance()
        assert {e[2] for e in copies.log if e[0] == "fetch"} == {None}
        pairs = _copies_after_fetches(copies.log)
        assert pairs and all(copied in (fetched, fetched + 1) for copied, fetched in pairs), pairs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_an_offloaded_model_holds_its_stacks_in_pinned_host_memory_not_on_the_device():
    pool = PoolConfig(n_experts=16, top_k=2, d_expert=512)  # stacks large beside the rest of the model

    def allocated_by(experts):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model = build_model(CFG, pool, 11, "cuda", experts=experts)
        torch.cuda.synchronize()
        return model, torch.cuda.memory_allocated() - before
    offloaded, on_device = allocated_by(OFFLOADED)
    stacks = frozen_stacks(offloaded)
    assert all(t.device.type == "cpu" and t.is_pinned() for s in stacks.values() for t in s.stored().values())
    homed = sum(s.stored_bytes() for s in stacks.values())
    row = homed // CFG.n_rows
    resident, resident_bytes = allocated_by(RESIDENT)
    # Resident: every stack on the device. Offloaded: the two staging slots of one row each, not the homes.
    assert resident_bytes - on_device == pytest.approx(homed - 2 * row, rel=0.05)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("experts", [ExpertsConfig(), RESIDENT, OFFLOADED], ids=["trainable", "nf4", "nf4-offloaded"])
def test_a_model_built_on_its_device_to_be_loaded_takes_the_weights_as_one_built_on_the_cpu(device, experts):
    """`weights_loaded` (writing, evaluation) makes the modules on the device; loaded, the model is the
    one a CPU build and a copy give: every tensor, the RoPE tables (not saved) included, and offloaded
    homes still in (pinned) CPU memory."""
    from minagi.loading import load_weights
    source = build_model(CFG, POOL, 11, "cpu", experts=experts)
    state = source.state_dict()
    plain = build_model(CFG, POOL, 11, device, experts=experts, init_frozen=False)
    direct = build_model(CFG, POOL, 11, device, experts=experts, init_frozen=False, weights_loaded=True)
    for model in (plain, direct):
        load_weights(model, state, "test")
    for (name, a), (_, b) in zip(plain.state_dict(keep_vars=True).items(), direct.state_dict(keep_vars=True).items()):
        assert a.device == b.device and torch.equal(a, b), name
    for (name, a), (_, b) in zip(plain.named_buffers(), direct.named_buffers()):
        assert a.device == b.device and a.is_pinned() == b.is_pinned() and torch.equal(a, b), name
    assert direct.rows[0].attn.rope_cos.device.type == device
    ids = torch.randint(0, 11, (2, 8), device=device)
    with torch.no_grad():
        assert torch.equal(plain.eval()(ids).logits, direct.eval()(ids).logits)


def test_the_offload_line_says_the_homed_bytes_in_a_readable_unit():
    said = []
    build_model(CFG, POOL, 11, "cpu", experts=OFFLOADED, log=said.append)
    line = next(m for m in said if m.startswith("offload: "))
    assert re.search(r"CPU memory \(\d+\.\d MiB\), staged to cpu with prefetch", line), line  # not "0.00 GiB"
