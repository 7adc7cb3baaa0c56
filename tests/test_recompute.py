"""minagi.recompute: rows recomputed in backward count their routing once, choose the experts the
forward chose, reduce their counts over ranks once, and give the gradients of the plain model."""
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.utils.checkpoint import set_checkpoint_early_stop

from minagi import distributed
from minagi.config import ModelConfig, PoolConfig
from minagi.diagnostics import RoutingMeter, step_counts
from minagi.model import build_model
from minagi.recompute import remember

CFG = ModelConfig(n_rows=3, d_model=32, n_heads=2, context=16)
POOL = PoolConfig(n_experts=6, top_k=2, d_expert=24, aux_free_bias=True, z_loss_coef=1e-3)
PATHS = ["loop", "grouped", "rectangle", "native"]


def model_pair(path: str = "grouped", pool: PoolConfig = POOL):
    """The same weights twice: plain, and with every row checkpointed."""
    torch.manual_seed(0)
    plain = build_model(CFG, PoolConfig(**{**pool.__dict__, "dispatch": path}), 13, "cpu")
    torch.manual_seed(0)
    checkpointed = build_model(CFG, PoolConfig(**{**pool.__dict__, "dispatch": path}), 13, "cpu", checkpoint_rows=True)
    assert all(row.checkpointed for row in checkpointed.rows) and not any(row.checkpointed for row in plain.rows)
    return plain, checkpointed


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 13, (4, 16), generator=g), torch.randint(0, 13, (4, 16), generator=g)


def train_forward_backward(model, x, y):
    out = model(x, y)
    (out.loss + out.aux_loss).backward()
    return out


@pytest.mark.parametrize("path", PATHS)
def test_checkpointed_rows_give_the_plain_models_loss_and_gradients(path):
    plain, checkpointed = model_pair(path)
    x, y = batch()
    a = train_forward_backward(plain, x, y)
    with set_checkpoint_early_stop(False):
        b = train_forward_backward(checkpointed, x, y)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.aux_loss, b.aux_loss)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("early_stop", [True, False])
def test_a_full_replay_counts_each_character_once(early_stop):
    plain, checkpointed = model_pair()
    x, y = batch()
    with set_checkpoint_early_stop(early_stop):
        out = train_forward_backward(checkpointed, x, y)
    meter, ref = RoutingMeter(), RoutingMeter()
    meter.add(step_counts(out.routing))
    ref.add(step_counts(plain(x, y).routing))
    got, want = meter.read(4.0), ref.read(4.0)
    assert got == want
    assert [d["chars"] for d in got] == [4 * 16] * CFG.n_rows
    assert [d["routed"] for d in got] == [4 * 16 * POOL.top_k] * CFG.n_rows
    # The aux-free bias step sees one forward's loads.
    checkpointed.step_router_bias(step_counts(out.routing).load_LE)
    plain.step_router_bias(step_counts(plain(x, y).routing).load_LE)
    for p, q in zip(plain.pools(), checkpointed.pools()):
        assert torch.equal(p.router.selection_bias, q.router.selection_bias)


def test_the_replay_chooses_the_experts_the_forward_chose():
    # Moving the selection bias between forward and backward would re-route the replay; it must not.
    plain, checkpointed = model_pair()
    x, y = batch()
    a = train_forward_backward(plain, x, y)
    with set_checkpoint_early_stop(False):
        out = checkpointed(x, y)
        for pool in checkpointed.pools():
            pool.router.selection_bias.add_(torch.linspace(-5, 5, POOL.n_experts))
        (out.loss + out.aux_loss).backward()
    assert torch.equal(a.loss, out.loss)
    for p, q in zip(plain.parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_remember_computes_outside_a_checkpointed_row():
    calls = []
    assert remember("k", lambda: calls.append(1) or 5) == 5 == remember("k", lambda: calls.append(1) or 5)
    assert len(calls) == 2


def test_evaluation_and_writing_change_no_state_and_count_nothing():
    from minagi.data import Vocab
    from minagi.sampling import generate
    from minagi.trainer import evaluate
    _, model = model_pair()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch()
    evaluate(model, [(x, y)], torch.device("cpu"), world_size=1)
    vocab = Vocab("".join(chr(ord("a") + i) for i in range(13)))
    assert len("".join(generate(model, vocab, "abc", 20, seed=1))) == 20
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ---------------------------------------------------------------------------- the replay pin

def test_the_replay_pin_takes_a_stack_of_exactly_the_floor_and_exactly_half_the_headroom():
    """Both bounds are inclusive: auto pins a stack at least `floor_bytes`, and a stack fits when the
    headroom is at least twice its bytes."""
    from minagi.recompute import PinPolicy
    cpu, mib = torch.device("cpu"), 2**20
    assert PinPolicy("auto", floor_bytes=mib, headroom=lambda d: 2**40).decide("s", mib, cpu)
    assert not PinPolicy("auto", floor_bytes=mib, headroom=lambda d: 2**40).decide("s", mib - 1, cpu)
    assert PinPolicy("on", headroom=lambda d: 2 * mib).decide("s", mib, cpu)
    assert not PinPolicy("on", headroom=lambda d: 2 * mib - 1).decide("s", mib, cpu)


# ---------------------------------------------------------------------------- two gloo ranks

def _rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world_size)
    try:
        calls = []

        def counting_reducer(t):
            calls.append(t.shape)
            return distributed.all_reduce_sum(t)

        torch.manual_seed(0)
        model = build_model(CFG, POOL, 13, "cpu", checkpoint_rows=True, count_reducer=counting_reducer)
        x, y = batch(seed=10 + rank)
        with set_checkpoint_early_stop(False):
            forwards = 2
            for _ in range(forwards):
                train_forward_backward(model, x, y)
        torch.save({"calls": len(calls), "expected": forwards * CFG.n_rows},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_the_count_reducer_runs_once_per_forward_on_two_gloo_ranks(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the spawned ranks import this file
    mp.spawn(_rank_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert seen["calls"] == seen["expected"] == 2 * CFG.n_rows


def test_shared_experts_and_sigmoid_scores_recompute_to_the_plain_gradients_and_the_forwards_choice():
    from dataclasses import replace
    pool = replace(POOL, shared_experts=1, router_score="sigmoid")
    plain, checkpointed = model_pair("grouped", pool)
    x, y = batch()
    a = train_forward_backward(plain, x, y)
    with set_checkpoint_early_stop(False):
        out = checkpointed(x, y)
        for p in checkpointed.pools():  # a replay that re-chose would see this bias
            p.router.selection_bias.add_(torch.linspace(-5, 5, pool.n_experts))
        (out.loss + out.aux_loss).backward()
    assert torch.equal(a.loss, out.loss) and torch.equal(a.aux_loss, out.aux_loss)
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert any(".shared." in name for name, _ in plain.named_parameters())
