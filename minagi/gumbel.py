"""Choosing the next character on any device: greedy argmax, or Gumbel-max with counter-based noise.

Shape legend: B streams, V vocabulary, C character indices (counts) of one noise table.

Sampling from softmax(logits / T) is `argmax(logits / T + g)` with g_v ~ Gumbel(0, 1) independent
per vocabulary entry (the Gumbel-max trick; torch.multinomial draws one sample the same way, with
exponentials). Here g is not drawn from a generator's state but computed from a counter:
g[stream, t, v] = -log(-log(u)), u a 24-bit uniform hashed from (the stream's seed, t, v), t the
index of the character in the stream (0 for the first written). So

- a character's noise is a pure function of its seed and index: a stream written alone or as one of
  64 at once reads the same noise; the step that samples needs no generator state (a CUDA graph
  replays it unchanged), and the noise for many steps can be made in one call ahead of time;
- the hash is integer arithmetic, exact on every device, so a seed names the same text on the CPU
  and the GPU up to how each rounds the logits.

The hash is murmur3's 32-bit finalizer (`fmix32`) on int64 tensors holding 32-bit values; its
multiplications are split so that no product leaves int64 (signed overflow is not relied on).
u has 24 bits, so g is cut off beyond ~17 (probabilities are exact to about 2^-24).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["gumbel_noise", "nucleus", "pick", "stream_keys"]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for 32-bit x and c, exactly in int64: x * 2^31 mod 2^32 is (x & 1) << 31."""
    y = x * (c & 0x7FFFFFFF)  # < 2^63
    if c >> 31:
        y = y + ((x & 1) << 31)
    return y & _M32


def _fmix32(x: Tensor) -> Tensor:
    """murmur3's finalizer: a bijection of 32-bit values in which every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _splitmix64(seed: int) -> int:
    z = (seed + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_keys(seeds: list[int], device: torch.device | str = "cpu") -> Tensor:
    """int64 [B, 2]: two 32-bit keys per stream, from its seed (any Python int) through splitmix64."""
    mixed = [_splitmix64(seed & _M64) for seed in seeds]
    return torch.tensor([[z & _M32, z >> 32] for z in mixed], dtype=torch.int64, device=device)


def gumbel_noise(keys_B2: Tensor, counts_C: Tensor, vocab_size: int) -> Tensor:
    """fp32 [C, B, V]: the Gumbel noise of character indices `counts_C` (int64 >= 0) of B streams."""
    c_lo, c_hi = (counts_C & _M32)[:, None], (counts_C >> 32)[:, None]  # [C, 1]
    s_CB = _fmix32(_fmix32(keys_B2[None, :, 0] ^ c_lo) ^ keys_B2[None, :, 1] ^ c_hi)
    entry_V = _fmix32(torch.arange(vocab_size, dtype=torch.int64, device=keys_B2.device) ^ 0x9E3779B9)
    bits_CBV = _fmix32(s_CB[:, :, None] ^ entry_V)
    u = ((bits_CBV >> 8).double() + 0.5) * 2.0 ** -24  # (0, 1), exact in float64
    return (-torch.log(-torch.log(u))).float()


def pick(logits_BV: Tensor, temperature: float, top_k: int, gumbel_BV: Tensor | None = None,
         top_p: float = 1.0) -> Tensor:
    """int64 [B]: the next character of each stream. Temperature 0 is greedy (the first of equal
    maxima, as argmax); else a sample of softmax(logits / T) restricted to the top_k likeliest
    (0 = all; ties with the k-th are kept), then to the top_p nucleus of those (`nucleus`; 1 = all),
    drawn with `gumbel_BV`. No host sync, no branch on data."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    scores_BV = logits_BV / temperature
    if 0 < top_k < scores_BV.shape[-1]:
        kth_B1 = scores_BV.topk(top_k, dim=-1).values[:, -1:]
        scores_BV = scores_BV.masked_fill(scores_BV < kth_B1, -math.inf)
    if top_p < 1:
        scores_BV = nucleus(scores_BV, top_p)
    return (scores_BV + gumbel_BV).argmax(-1)


def nucleus(scores_BV: Tensor, top_p: float) -> Tensor:
    """Scores outside the top_p nucleus set to -inf: the likeliest characters of softmax(scores) whose
    probabilities, taken from the likeliest down, first reach top_p (Holtzman et al. 2019, "The Curious
    Case of Neural Text Degeneration"); ties with the last one kept are kept, and the likeliest always
    is. Sort, softmax, cumsum and a mask on the device: fixed shapes, no host sync (a CUDA graph
    captures it)."""
    sorted_BV = scores_BV.sort(dim=-1, descending=True).values
    probs_BV = sorted_BV.softmax(-1)
    before_BV = probs_BV.cumsum(-1) - probs_BV  # the mass of the likelier characters
    kept_BV = before_BV < top_p  # a prefix: before_BV never decreases
    last_B1 = sorted_BV.masked_fill(~kept_BV, math.inf).amin(-1, keepdim=True)  # the least score kept
    return scores_BV.masked_fill(scores_BV < last_B1, -math.inf)
