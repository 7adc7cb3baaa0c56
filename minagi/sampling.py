"""Writing text with a trained model: the fast path (`write`: B streams, the static cache of
minagi/decode.py, CUDA graphs) and the readable reference it is tested against (`generate`: the
model's whole forward over the window for every character, no cache). The growing KV cache and the
cached `generate` that ran beside them were removed: the decoder replaced them.

The model only ever sees the last `window` characters (default: the context it was trained on). When
the window is full and another character must go in, writing *slides*: the stream restarts on the
last `keep` characters written (default 7/8 of the window), prefilled again, and decoding goes on
one position at a time from there. So every character is predicted from at least `keep` and at most
`window` characters, and the re-prefill costs one forward of `keep` positions per `window - keep + 1`
characters. `keep = window` gives nanoGPT's "crop to the last context characters every step" exactly
(a full prefill per character); `keep = window - 1` slides by one character every other step.

`generate` recomputes the whole conditioning sequence each step, sliding at the same points: the
reference the fast path is tested against (same seed -> same characters). `write` prefills a
window's characters but the last and feeds that one to the step (minagi/decode.py), which is the
same function; streams slide independently.

Every path picks with `gumbel.pick` on the device the logits are on: greedy argmax at temperature 0,
else Gumbel-max with noise hashed from (seed, character index), so a seed names the same text
whichever path writes it and on any device (up to how the device rounds the logits), and a stream
written among others equals writing it alone with its seed. (Before the fast path, sampling drew
from a CPU torch.Generator: texts for a given seed at temperature > 0 differ from that version's.)

Shape legend: T positions fed in one call, B streams, V vocabulary.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from . import devices
from .data import Vocab, VocabError
from .compile_cache import CompileCache, PrecompiledPieces, aot_available, decode_key, record_compile_imports
from .decode import EXPERT_PATHS, PIECES, Decoder, compiled_pieces, default_keep, inference, resolve_products
from .gumbel import gumbel_noise, pick, stream_keys
from .experts import ExpertStack
from .model import CharLM

__all__ = ["GRAPHS", "OFFLOAD_READS", "Ready", "SamplingError", "default_keep", "default_prompt", "generate",
           "resolve_graphs", "resolve_offload_read", "write"]

GRAPHS = ("auto", "on", "off")
OFFLOAD_READS = ("auto", "experts", "rows")
_NOISE_CHUNK = 64  # characters of noise made at once by `generate`


class SamplingError(ValueError):
    """A bad sampling argument; one line naming it."""


def default_prompt(vocab: Vocab) -> str:
    """A newline when the vocabulary has one (text starts after a line break), else its first character."""
    return "\n" if "\n" in vocab.chars else vocab.chars[0]


def _offloaded(model: CharLM | None) -> bool:
    """Whether the model's frozen stacks are homed on the CPU and staged (an offload stager)."""
    return model is not None and model.stager is not None


def resolve_offload_read(choice: str, model: CharLM | None, streams: int = 1) -> str | None:
    """How writing reads offloaded frozen experts (None: none are offloaded). `experts`: each step's
    chosen experts read in place from their pinned homes (only their bytes cross the bus);
    `rows`: every row staged whole, as training does. `auto` = experts while a step chooses fewer
    experts a row than the row holds (streams x top_k < n_experts), else rows (docs/benchmarks.md §12)."""
    if choice not in OFFLOAD_READS:
        raise SamplingError(f"offload_read must be one of {', '.join(OFFLOAD_READS)}; got {choice!r}")
    if not _offloaded(model):
        return None
    if choice != "auto":
        return choice
    pool = model.pool_cfg
    return "experts" if streams * pool.top_k < pool.n_experts else "rows"


def resolve_graphs(choice: str, device: torch.device, model: CharLM | None = None, offload_read: str | None = None
                   ) -> bool:
    """`auto` = CUDA graphs where they run (a CUDA device, offloaded experts not staged by rows); `on`
    where they do not is an error, never a fallback. offload_read: `resolve_offload_read`'s answer."""
    if choice not in GRAPHS:
        raise SamplingError(f"graphs must be one of {', '.join(GRAPHS)}; got {choice!r}")
    if choice == "on" and device.type != "cuda":
        raise SamplingError(f"graphs 'on' needs a CUDA device (CUDA graphs); writing runs on {device.type} "
                            f"here: use 'auto' or 'off'")
    staged = offload_read == "rows" or (offload_read is None and _offloaded(model))
    if choice == "on" and staged:
        raise SamplingError("graphs 'on': this model's frozen experts are offloaded and staged a row at a time "
                            "from the CPU, which a CUDA graph cannot replay: read the chosen experts in place "
                            "(offload read 'experts') or use graphs 'auto' or 'off'")
    return (choice == "on" or (choice == "auto" and device.type == "cuda")) and not staged


def _check(model: CharLM, vocab: Vocab, prompts: list[str], n_chars: int, temperature: float, top_k: int,
           window: int | None, keep: int | None, top_p: float = 1.0) -> tuple[list[list[int]], int, int]:
    """(prompt ids, window, keep), or SamplingError / VocabError naming what is wrong."""
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
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise SamplingError(f"top_p must be a number in (0, 1] (1 = off); got {top_p}")
    if not prompts:
        raise SamplingError("no prompts: give one per stream")
    ids = []
    for i, prompt in enumerate(prompts):
        where = f"prompt {i + 1}: " if len(prompts) > 1 else ""
        if not prompt:
            raise SamplingError(f"{where}the prompt is empty; give at least one character")
        try:
            ids.append([int(c) for c in vocab.encode(prompt)])
        except VocabError as e:
            raise VocabError(f"{where}{e}") from None
    if model.vocab_size != vocab.size:
        raise VocabError(f"the vocabulary has {vocab.size} characters but the model writes {model.vocab_size}")
    return ids, window, keep


def _model_device(model: CharLM, device: torch.device | str | None) -> torch.device:
    return next(model.parameters()).device if device is None else torch.device(device)


# ------------------------------------------------------------------------------ the fast path

def write(model: CharLM, vocab: Vocab, prompts: list[str], n_chars: int, temperature: float = 0.8,
          top_k: int = 0, seed: int = 1337, device: torch.device | str | None = None, *,
          window: int | None = None, keep: int | None = None, graphs: str = "auto",
          offload_read: str = "auto", sync_every: int = 1, expert_path: str = "auto",
          compiled: bool = False, products: bool | None = None, top_p: float = 1.0,
          on_ready: Callable[[Ready], None] | None = None) -> Iterator[list[str]]:
    """Yield, for each of `n_chars` positions, one character of every stream: stream i continues
    `prompts[i]` with seed `seed + i`, and equals `generate(..., prompts[i], seed=seed + i)` (on a GPU
    up to bf16 rounding, which kernels for a batch may do differently from kernels for one stream).

    top_p: after top_k, sample only within the nucleus of this probability mass (`gumbel.nucleus`;
    1 = off). graphs: `auto` (CUDA graphs on a CUDA device), `on` (an error elsewhere) or `off`.
    offload_read: how offloaded frozen experts are read (`resolve_offload_read`).
    expert_path: how a step runs its experts (`decode.Decoder`; `auto` unless measuring).
    compiled: the step's pieces through torch.compile (CUDA, resident experts): compiled once per model
    shape and number of streams on a machine, the compile's artifacts kept under ~/.cache/minagi/compile
    (minagi/compile_cache.py) for the next process of that shape.
    on_ready: called once the decoder is set up (its graphs captured, its step compiled), before the
    prompts' prefill, with what that fixed cost was (`Ready`); the writing rate is from there on.
    products: the step's products written as sums (`decode.Decoder`; None, its rule, unless measuring).
    sync_every: steps written between two reads of the characters (the host sync); 1 streams each
    character as it is written, more lets the host queue steps ahead. Other arguments as `generate`,
    checked here, before the first character is asked for.
    """
    ids, window, keep = _check(model, vocab, prompts, n_chars, temperature, top_k, window, keep, top_p)
    if sync_every < 1:
        raise SamplingError(f"sync_every must be >= 1; got {sync_every}")
    device = _model_device(model, device)
    read = resolve_offload_read(offload_read, model, len(ids))
    use_graphs = resolve_graphs(graphs, device, model, read)
    if expert_path not in EXPERT_PATHS:
        raise SamplingError(f"expert_path must be one of {', '.join(EXPERT_PATHS)}; got {expert_path!r}")
    if compiled and device.type != "cuda":
        raise SamplingError(f"a compiled step needs a CUDA device (Triton); writing runs on {device.type} here")
    if compiled and not devices.has_triton():
        raise SamplingError(f"a compiled step writes its kernels {devices.NO_TRITON}; leave --compile out")
    if compiled and any(not isinstance(pool.experts, ExpertStack) for pool in model.pools()):
        raise SamplingError("a compiled step runs resident trainable experts; this model's experts are frozen")
    return _write(model, vocab, ids, n_chars, (temperature, top_k, top_p), seed, window, keep, use_graphs,
                  sync_every, read, (expert_path, compiled, products), on_ready)


@dataclass(frozen=True)
class Ready:
    """What setting up the decoder cost, before the first character: `seconds` of it, whether it
    captured CUDA graphs and compiled the step, and the compile cache's `CompileCache.status` and file."""
    seconds: float
    graphs: bool
    compiled: bool
    cache: str | None = None
    cache_path: str | None = None

    def describe(self) -> str:
        """e.g. `compile and capture 1.52 s (compile cache hit: ~/.cache/minagi/compile/….bin)`."""
        what = " and ".join(w for w, on in (("compile", self.compiled), ("capture", self.graphs)) if on) or "set-up"
        cache = {"precompiled hit": "hit, the pieces loaded whole", "precompiled miss": "miss, the pieces written whole",
                 "hit": "hit", "miss": "miss, written for the next run", "unreadable": "unreadable, written again",
                 "unsaved": "miss, not written (nothing to save, or the folder is not writable)",
                 "unavailable": "not in this torch"}.get(self.cache or "")
        return f"{what} {self.seconds:.2f} s" + (f" (compile cache {cache}: {self.cache_path})" if cache else "")


def _write(model: CharLM, vocab: Vocab, ids: list[list[int]], n_chars: int, sampler: tuple, seed: int,
           window: int, keep: int, graphs: bool, sync_every: int, read: str | None, step: tuple,
           on_ready: Callable[[Ready], None] | None) -> Iterator[list[str]]:
    if n_chars == 0:
        return
    B = len(ids)
    windows = [stream[-window:] for stream in ids]  # what each stream's model sees, the newest included
    slides = _Slides([len(w) for w in windows], window, keep)
    decoder, ready = _set_up(model, [seed + i for i in range(B)], window, keep, sampler, graphs, read, step,
                             slides.copy().sizes(n_chars - 1))
    if on_ready is not None:
        on_ready(ready)
    decoder.prefill(list(range(B)), windows)
    for written in range(1, n_chars + 1):
        decoder.advance()
        sliding = slides.tick() if written < n_chars else []
        if sliding:  # the newest character does not fit: restart on the last `keep`, on the device
            decoder.slide(sliding)
        if written % sync_every == 0 or written == n_chars:
            # The step just queued runs on while the host reads the ones before it (all at the end).
            for row in decoder.read(lag=0 if written == n_chars else 1):
                yield [vocab.chars[c] for c in row]


def _set_up(model: CharLM, seeds: list[int], window: int, keep: int, sampler: tuple, graphs: bool,
            read: str | None, step: tuple, slide_sizes: set[int]) -> tuple[Decoder, Ready]:
    """The decoder, its graphs captured and step compiled (minagi/compile_cache.py: the pieces loaded
    whole where they were compiled before, else torch's compile caches loaded first and written after
    a compile), and what that took."""
    (temperature, top_k, top_p), (expert_path, compiled, products) = sampler, step
    start = time.perf_counter()
    device = model.embed.weight.device
    cache = pieces = None
    before = set(sys.modules) if compiled else None  # what the compile imports: for the next warm-up
    if compiled:
        key = decode_key(model, len(seeds), window, resolve_products(products, compiled, len(seeds)), expert_path,
                         device)
        if aot_available():
            pieces = PrecompiledPieces(key, PIECES, dict(zip(PIECES, compiled_pieces())))
        if pieces is None or not pieces.complete():  # torch's caches serve what is compiled the old way
            cache = CompileCache(key)
            cache.load()
    compiling = (cache if cache is not None else pieces).compiling() if compiled else contextlib.nullcontext()
    with compiling:
        decoder = Decoder(model, seeds, window, keep=keep, temperature=temperature, top_k=top_k, top_p=top_p,
                          graphs=graphs, expert_path=expert_path, compiled=compiled, products=products,
                          read_in_place=read == "experts", pieces=pieces and pieces.calls())
        decoder.prepare_slides(slide_sizes)
    if cache is None and pieces is not None and pieces.status == "fallback":  # a piece's file did not load:
        cache = CompileCache(key)  # its torch.compile ran without torch's caches: they are written for the next run
        cache.status = "miss"
    if compiled:
        record_compile_imports(before)
    status, where = _cache_status(cache, pieces)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the set-up's time, not the writing's
    return decoder, Ready(time.perf_counter() - start, graphs, compiled, status, where)


def _cache_status(cache: CompileCache | None, pieces: PrecompiledPieces | None) -> tuple[str | None, str | None]:
    """What the compile caches did (`Ready.cache`) and where they are, once the pieces have run."""
    if pieces is not None and pieces.status in ("hit", "miss"):
        return ("precompiled hit" if pieces.status == "hit" else "precompiled miss"), str(pieces.folder)
    if cache is None:
        return None, None
    status = cache.status if cache.save() or cache.status in ("hit", "unavailable") else "unsaved"
    return status, str(cache.path)


class _Slides:
    """When streams slide, counted on the host (no read-back): the characters in each stream's window,
    the pending input included; a stream whose count passes the window restarts at `keep`."""

    def __init__(self, filled: list[int], window: int, keep: int):
        self.filled, self.window, self.keep = list(filled), window, keep

    def copy(self) -> "_Slides":
        return _Slides(self.filled, self.window, self.keep)

    def tick(self) -> list[int]:
        """One character written to every stream: the streams that must slide now."""
        self.filled = [n + 1 for n in self.filled]
        sliding = [b for b, n in enumerate(self.filled) if n > self.window]
        for b in sliding:
            self.filled[b] = self.keep
        return sliding

    def sizes(self, n_chars: int) -> set[int]:
        """How many streams slide at once over the next n_chars characters. After every stream's first
        slide the pattern repeats every window - keep + 1 characters, so that far is enough to look."""
        horizon = min(n_chars, self.window + self.window - self.keep + 1)
        return {len(s) for s in (self.tick() for _ in range(horizon)) if s}


# ------------------------------------------------------------------------------ the reference

def _last_logits(model: CharLM, ids: list[int], device: torch.device) -> Tensor:
    """Logits [V] (fp32, on `device`) for the character after `ids`: the model's whole forward."""
    idx_1T = torch.tensor([ids], dtype=torch.long, device=device)
    with inference(model, device):
        logits_1TV = model(idx_1T, dropless=True).logits
    return logits_1TV[0, -1].float()


def _pick(logits_V: Tensor, temperature: float, top_k: int, noise_V: Tensor | None, top_p: float = 1.0) -> int:
    """`gumbel.pick` for one stream; the host sync that brings the character back."""
    chosen = pick(logits_V[None], temperature, top_k, None if noise_V is None else noise_V[None], top_p)
    return int(chosen[0])


def generate(model: CharLM, vocab: Vocab, prompt: str, n_chars: int, temperature: float = 0.8,
             top_k: int = 0, seed: int = 1337, device: torch.device | str | None = None, *,
             window: int | None = None, keep: int | None = None, top_p: float = 1.0) -> Iterator[str]:
    """Yield `n_chars` characters written after `prompt`, one at a time, as each is sampled: the
    readable reference, which runs the model's whole forward over the window for every character
    (slow: `write` is the fast path, tested equal to this).

    device: where the model's parameters are (default: there). window: most characters the model
    sees (default and maximum: its trained context). keep: characters kept on a slide (default
    `default_keep(window)`, 1..window). top_p: as `write`. The prompt is not yielded; a prompt longer than the window
    conditions on its last `window` characters.
    Arguments are checked here, before the first character is asked for: SamplingError for a bad
    number, VocabError naming prompt characters outside the vocabulary.
    """
    (ids,), window, keep = _check(model, vocab, [prompt], n_chars, temperature, top_k, window, keep, top_p)
    device = _model_device(model, device)
    return _stream(model, vocab, ids, n_chars, (temperature, top_k, top_p), seed, device, window, keep)


def _stream(model: CharLM, vocab: Vocab, ids: list[int], n_chars: int, sampler: tuple, seed: int,
            device: torch.device, window: int, keep: int) -> Iterator[str]:
    temperature, top_k, top_p = sampler
    keys_12 = stream_keys([seed], device)
    start = max(0, len(ids) - window)  # the model sees ids[start:], never more than `window` of them
    noise_CV = None
    for written in range(1, n_chars + 1):
        index = written - 1  # of this character in the stream: its noise
        if temperature > 0 and index % _NOISE_CHUNK == 0:
            with torch.inference_mode():
                counts_C = torch.arange(index, index + _NOISE_CHUNK, device=device)
                noise_CV = gumbel_noise(keys_12, counts_C, model.vocab_size)[:, 0]
        noise_V = None if noise_CV is None else noise_CV[index % _NOISE_CHUNK]
        char_id = _pick(_last_logits(model, ids[start:], device), temperature, top_k, noise_V, top_p)
        ids.append(char_id)
        yield vocab.chars[char_id]
        if len(ids) - start > window:  # the next character does not fit: slide to the last `keep`
            start = len(ids) - keep
