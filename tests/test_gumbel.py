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


def test_greedy_is_argmax_taking_the_first_of_equal_maxima_and_needs_no_noise():
    logits_BV = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    assert pick(logits_BV, 0.0, 0).tolist() == [1, 0]
    assert pick(logits_BV, 0.0, 2).tolist() == [1, 0]  # top_k does not matter then
