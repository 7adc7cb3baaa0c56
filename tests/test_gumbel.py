"""The device sampler: counter-based Gumbel noise and pick (minagi/gumbel.py)."""
import math
import random

import pytest
import torch

from minagi.gumbel import _fmix32, _mul32, gumbel_noise, pick, stream_keys


def _fmix32_python(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_32_bit_hash_equals_python_integer_arithmetic_without_leaving_int64():
    rng = random.Random(0)
    xs = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + [rng.getrandbits(32) for _ in range(5000)]
    t = torch.tensor(xs, dtype=torch.int64)
    for c in (0x85EBCA6B, 0xC2B2AE35, 0x12345679):
        assert _mul32(t, c).tolist() == [(x * c) & 0xFFFFFFFF for x in xs]
    assert _fmix32(t).tolist() == [_fmix32_python(x) for x in xs]


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.5, 0), (2.0, 3)])
def test_gumbel_max_samples_the_softmax_of_the_logits_over_the_temperature(temperature, top_k):
    logits_V = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 2.5])
    n = 100_000
    noise_NV = gumbel_noise(stream_keys([42]), torch.arange(n), 7)[:, 0]
    chosen = pick(logits_V.expand(n, 7), temperature, top_k, noise_NV)
    freq = torch.bincount(chosen, minlength=7).double() / n
    scores = logits_V.double() / temperature
    if top_k:
        scores = scores.masked_fill(scores < scores.topk(top_k).values[-1], -math.inf)
    probs = scores.softmax(-1)
    assert (freq[probs == 0] == 0).all()  # never outside the top k
    tolerance = 5 * (probs * (1 - probs) / n).sqrt() + 1e-4  # 5 standard errors
    assert ((freq - probs).abs() <= tolerance).all(), (freq, probs)


def test_noise_is_a_pure_function_of_the_seed_and_the_character_index():
    seeds = [1337, 1338, -5, 2**70 + 3]
    both = gumbel_noise(stream_keys(seeds), torch.arange(10, 40), 11)  # [30, 4, 11]
    for b, seed in enumerate(seeds):  # a stream alone, and a later window of its indices
        torch.testing.assert_close(gumbel_noise(stream_keys([seed]), torch.arange(25, 40), 11)[:, 0], both[15:, b],
                                   rtol=0, atol=0)
    flat = both.flatten()
    assert flat.unique().numel() == flat.numel()  # no two entries share noise
    assert abs(flat.mean().item() - 0.5772) < 0.1 and abs(flat.std().item() - math.pi / math.sqrt(6)) < 0.1


def test_noise_reads_all_64_bits_of_a_streams_key_and_of_the_character_index():
    """Two seeds whose keys share one 32-bit half, or two indices 2^32 apart, name different noise:
    the hash takes both halves of each."""
    keys_B2 = torch.tensor([[12345, 678], [12345, 679], [12346, 678]])  # [B, 2] (low, high): 1 differs high, 2 low
    noise_CBV = gumbel_noise(keys_B2, torch.arange(4), 16)
    assert not noise_CBV[:, 0].equal(noise_CBV[:, 1]) and not noise_CBV[:, 0].equal(noise_CBV[:, 2])
    far_CBV = gumbel_noise(keys_B2, torch.tensor([5, 5 + 2**32]), 16)
    assert not far_CBV[0].equal(far_CBV[1])


def test_greedy_is_argmax_taking_the_first_of_equal_maxima_and_needs_no_noise():
    logits_BV = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    assert pick(logits_BV, 0.0, 0).tolist() == [1, 0]
    assert pick(logits_BV, 0.0, 2).tolist() == [1, 0]  # top_k does not matter then


def _nucleus_reference(scores: list[float], top_p: float) -> set[int]:
    """The readable top-p: the likeliest characters, one at a time, until their probability reaches
    top_p; then every character tied with the last one taken."""
    peak = max(scores)
    weights = [math.exp(s - peak) for s in scores]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    kept, mass = [], 0.0
    for i in order:
        if kept and mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    return {i for i, s in enumerate(scores) if s >= scores[kept[-1]]}


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.5, 0.62, 0.9, 0.999])
def test_the_nucleus_keeps_what_the_readable_top_p_keeps(top_p):
    from minagi.gumbel import nucleus
    gen = torch.Generator().manual_seed(3)
    scores_BV = torch.randn(64, 11, generator=gen) * 2
    scores_BV[5] = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, -1.0, 2.0, 2.0, -3.0, 0.5, 0.5])  # ties
    kept_BV = nucleus(scores_BV, top_p) > -math.inf
    for b in range(scores_BV.shape[0]):
        want = _nucleus_reference(scores_BV[b].double().tolist(), top_p)
        assert set(kept_BV[b].nonzero()[:, 0].tolist()) == want, b
        assert nucleus(scores_BV, top_p)[b][kept_BV[b]].equal(scores_BV[b][kept_BV[b]])  # kept scores unchanged


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.7), (2.0, 5, 0.8), (0.5, 0, 0.95)])
def test_top_p_samples_the_renormalised_nucleus_after_top_k(temperature, top_k, top_p):
    logits_V = torch.tensor([1.0, 2.0, 0.5, -1.0, 3.0, 0.0, 2.5])
    n = 100_000
    noise_NV = gumbel_noise(stream_keys([42]), torch.arange(n), 7)[:, 0]
    chosen = pick(logits_V.expand(n, 7), temperature, top_k, noise_NV, top_p)
    freq = torch.bincount(chosen, minlength=7).double() / n
    scores = (logits_V.double() / temperature).tolist()
    if top_k:  # top-k first, then the nucleus of the top-k's softmax
        kth = sorted(scores, reverse=True)[top_k - 1]
        scores = [s if s >= kth else -math.inf for s in scores]
    kept = _nucleus_reference(scores, top_p)
    probs = torch.tensor([math.exp(s) if i in kept else 0.0 for i, s in enumerate(scores)], dtype=torch.float64)
    probs /= probs.sum()
    assert (freq[probs == 0] == 0).all() and len(kept) < 7
    tolerance = 5 * (probs * (1 - probs) / n).sqrt() + 1e-4
    assert ((freq - probs).abs() <= tolerance).all(), (freq, probs)


def test_top_p_one_changes_nothing_and_greedy_ignores_it():
    logits_BV = torch.randn(8, 9, generator=torch.Generator().manual_seed(1))
    noise_BV = gumbel_noise(stream_keys([7]), torch.arange(8), 9)[:, 0]
    assert pick(logits_BV, 0.9, 0, noise_BV, 1.0).equal(pick(logits_BV, 0.9, 0, noise_BV))
    assert pick(logits_BV, 0.0, 0, None, 0.1).equal(logits_BV.argmax(-1))
