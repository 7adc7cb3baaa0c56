"""Writing text with a trained model: prefill the prompt once, then one position per step on the KV cache.

The model only ever sees the last `window` characters (default: the context it was trained on). When
the cache is full and another character must go in, generation *slides*: a fresh cache is
prefilled with the last `keep` characters written (default 7/8 of the window) and decoding goes on
one position at a time from there. So every character is predicted from at least `keep` and at most
`window` characters, and the re-prefill costs one forward of `keep` positions per `window - keep + 1`
characters. `keep = window` gives nanoGPT's "crop to the last context characters every step" exactly
(a full prefill per character); `keep = window - 1` slides by one character every other step.

`use_cache=False` recomputes the whole conditioning sequence each step, sliding at the same points:
the readable reference the cached path is tested against (same seed -> same characters).

Sampling happens on the CPU with a `torch.Generator` seeded from `seed`, so a seed names the same
text whatever the device (up to the device's rounding of the logits). Temperature 0 is greedy argmax.

Shape legend: T positions fed in one call, V vocabulary.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import Tensor

from .data import Vocab, VocabError
from .devices import autocast
from .model import CharLM

__all__ = ["SamplingError", "default_keep", "default_prompt", "generate"]


class SamplingError(ValueError):
    """A bad sampling argument; one line naming it."""


def default_prompt(vocab: Vocab) -> str:
    """A newline when the vocabulary has one (text starts after a line break), else its first character."""
    return "\n" if "\n" in vocab.chars else vocab.chars[0]


def default_keep(window: int) -> int:
    """Characters re-prefilled on a slide: 7/8 of the window (at least 1)."""
    return max(1, window - window // 8)


@contextlib.contextmanager
def _inference(model: CharLM, device: torch.device):
    """One forward call's settings: eval mode, no autograd, bf16 autocast on CUDA, dropless experts.

    Entered per call, never across a `yield`: thread-local grad mode and module attributes would
    otherwise leak into the caller's code between two characters.
    Dropless: with capacity_factor > 0 a character's output would depend on which other characters
    share the call (a prefill of 60 may drop, a step of 1 never does), so the cache and the
    recomputation would disagree. Capacity is a training-throughput knob; writing uses none.
    """
    pools = model.pools()
    saved = [pool.capacity_factor for pool in pools]
    was_training = model.training
    if was_training:  # .eval() walks every module: skip it when there is nothing to change
        model.eval()
    for pool in pools:
        pool.capacity_factor = 0.0
    try:
        with torch.inference_mode(), autocast(device):
            yield
    finally:
        for pool, c in zip(pools, saved):
            pool.capacity_factor = c
        if was_training:
            model.train()


def _last_logits(model: CharLM, ids: list[int], device: torch.device, cache=None) -> Tensor:
    """Logits [V] (fp32, on `device`) for the character after `ids`; appends `ids` to `cache`."""
    idx_1T = torch.tensor([ids], dtype=torch.long, device=device)
    with _inference(model, device):
        logits_1TV = model(idx_1T, cache=cache).logits
    return logits_1TV[0, -1].float()


def _pick(logits_V: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits_V.argmax())
    logits_V = logits_V.cpu() / temperature
    if 0 < top_k < logits_V.shape[0]:
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, -math.inf)
    probs_V = torch.softmax(logits_V, dim=-1)
    return int(torch.multinomial(probs_V, 1, generator=generator))


def generate(model: CharLM, vocab: Vocab, prompt: str, n_chars: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 1337, device: torch.device | str | None = None, *,
             use_cache: bool = True, window: int | None = None, keep: int | None = None) -> Iterator[str]:
    """Yield `n_chars` characters written after `prompt`, one at a time, as each is sampled.

    device: where the model's parameters are (default: there). window: most characters the model
    sees (default and maximum: its trained context). keep: characters re-prefilled on a slide
    (default `default_keep(window)`, 1..window). The prompt is not yielded; a prompt longer than
    the window conditions on its last `window` characters.
    Arguments are checked here, before the first character is asked for: SamplingError for a bad
    number, VocabError naming prompt characters outside the vocabulary.
    """
    context = model.cfg.context
    window = context if window is None else window
    if not 1 <= window <= context:
        raise SamplingError(f"window must be 1..{context} (the model's trained context); got {window}")
    keep = default_keep(window) if keep is None else keep
    if not 1 <= keep <= window:
        raise SamplingError(f"keep must be 1..{window} (the window); got {keep}")
    if n_chars < 0:
        raise SamplingError(f"the number of characters must be >= 0; got {n_chars}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature}")
    if top_k < 0:
        raise SamplingError(f"top_k must be >= 0 (0 = off); got {top_k}")
    if not prompt:
        raise SamplingError("the prompt is empty; give at least one character")
    ids = [int(i) for i in vocab.encode(prompt)]  # VocabError names the characters outside it
    if model.vocab_size != vocab.size:
        raise VocabError(f"the vocabulary has {vocab.size} characters but the model writes {model.vocab_size}")
    device = next(model.parameters()).device if device is None else torch.device(device)
    return _stream(model, vocab, ids, n_chars, temperature, top_k, seed, device, use_cache, window, keep)


def _stream(model: CharLM, vocab: Vocab, ids: list[int], n_chars: int, temperature: float, top_k: int,
            seed: int, device: torch.device, use_cache: bool, window: int, keep: int) -> Iterator[str]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    start = max(0, len(ids) - window)  # the model sees ids[start:], never more than `window` of them

    def restart() -> tuple[object, Tensor]:
        cache = model.new_cache(1, window) if use_cache else None
        return cache, _last_logits(model, ids[start:], device, cache)

    cache, logits_V = restart() if n_chars else (None, None)
    for written in range(1, n_chars + 1):
        char_id = _pick(logits_V, temperature, top_k, generator)
        ids.append(char_id)
        yield vocab.chars[char_id]
        if written == n_chars:
            break  # the last character needs no forward
        if len(ids) - start > window:  # the new character does not fit: slide
            start = len(ids) - keep
            cache, logits_V = restart()
        elif use_cache:
            logits_V = _last_logits(model, [char_id], device, cache)  # one position
        else:
            logits_V = _last_logits(model, ids[start:], device)       # the reference: recompute all
