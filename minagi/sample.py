"""Write text with a trained minagi model, streaming each character to stdout as it is sampled.

    python sample.py runs/cpu_tiny-20250101-120000              # the run's best.pt (else last.pt)
    python sample.py runs/my-run/last.pt --prompt "def " --chars 2000 --temperature 0.6 --top-k 20
    python sample.py runs/my-run --temperature 1.0 --top-p 0.9       # nucleus sampling
    python sample.py runs/my-run --temperature 0 --no-echo > greedy.txt
    python sample.py runs/my-run --streams 64 --chars 1000          # 64 continuations at once, seeds 1337..1400
    python sample.py runs/my-run --prompts prompts.txt              # one stream per line of the file
    python sample.py out/                                           # a folder minagi-export wrote

stdout: the prompt (unless --no-echo), then exactly --chars characters. With several streams, each
stream once all are written: a header line `--- stream I (seed S) ---`, its prompt and text, a newline.
stderr: one line about the model before; "ready in T s: load L s, capture C s" (with --compile "load
and compiler imports L s" -- the compiler is imported while the checkpoint loads -- then compile and
capture, and what the compile cache did) once writing is set up; and "wrote N chars in S s
(X char/s)" after (writing only, from the prefill: not loading, capturing or compiling; with several
streams "wrote B streams x N chars ... (X char/s in all)").
Exit codes: 0 done (also when a reader such as `head` closes the pipe), 2 bad argument / checkpoint /
prompt, 130 Ctrl-C (the speed line is still printed for what was written).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
import warnings
from pathlib import Path

from minagi.cli import OneLineParser, non_negative_int, one_line_warnings, positive_int, seed, utf8_stdout

class UsageError(ValueError):
    """A bad argument found after parsing; one line."""


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text}")
    return value


def _top_p(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= 1):
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1] (1 = off), got {text}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a .pt file, a run folder (its best.pt, else last.pt), or a folder "
                                      "minagi-export wrote")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="text to continue (default: a newline if the vocabulary has one, "
                                         "else its first character); echoed to stdout unless --no-echo")
    prompt.add_argument("--prompts", metavar="FILE",
                        help="a UTF-8 file of prompts, one per line: one stream each (a line's \\r\\n or \\n "
                             "ends it and is not part of the prompt)")
    p.add_argument("--streams", type=positive_int,
                   help="continuations written at once (default 1, or one per line of --prompts); "
                        "stream i uses seed + i and writes what it would alone with that seed (on a GPU, up to "
                        "bf16 rounding)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto",
                   help="capture the one-character step in a CUDA graph: auto = on a CUDA device (default)")
    p.add_argument("--offload-read", choices=("auto", "experts", "rows"), default="auto",
                   help="offloaded frozen experts: read only each step's chosen experts from CPU memory "
                        "(experts), or stage whole rows (rows); auto = experts while streams x top_k < "
                        "n_experts (default)")
    p.add_argument("--compile", action="store_true",
                   help="run the one-character step through torch.compile (CUDA, trainable experts): faster "
                        "per character, but the first run of a model shape and stream count compiles first "
                        "(ready in 6.6-9.3 s on the H200 with torch 2.11); its compile is kept in "
                        "~/.cache/minagi/compile, so later runs of that shape load it instead (ready in 2.8-4.0 s "
                        "there; docs/sampling.md)")
    p.add_argument("--products", choices=("auto", "on", "off"), default="auto",
                   help="with --compile: write the step's products as sums (fused by inductor); auto = with "
                        "at most 8 streams (default; faster on the h200 and cuda_small profiles on an H200: "
                        "docs/sampling.md)")
    p.add_argument("--chars", type=non_negative_int, default=500, help="characters to write (default 500)")
    p.add_argument("--temperature", type=_temperature, default=0.8, help="0 = greedy argmax (default 0.8)")
    p.add_argument("--top-k", type=non_negative_int, default=0,
                   help="sample only among the k likeliest characters (default 0 = off)")
    p.add_argument("--top-p", type=_top_p, default=1.0, metavar="P",
                   help="sample only among the likeliest characters whose probabilities first add up to P "
                        "(nucleus sampling; after --top-k; default 1 = off)")
    p.add_argument("--seed", type=seed, default=1337, help="sampling seed, 0 <= S < 2**63 as train.seed "
                                                          "(default 1337)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = CUDA when present (bf16 autocast there), else CPU")
    p.add_argument("--window", type=positive_int,
                   help="most characters the model sees (default and maximum: its trained context)")
    p.add_argument("--keep", type=positive_int,
                   help="characters re-prefilled when the window is full (default: 7/8 of the window)")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the text")
    return p.parse_args(argv)


def resolve_checkpoint(path: str) -> Path:
    """A file as is; a run folder -> its best.pt, else its last.pt; an exported folder as is."""
    from minagi.loading import resolve_model_path
    return resolve_model_path(path)


def read_prompts(path: str) -> list[str]:
    """The prompts of a --prompts file, one per line (its line end not included)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--prompts {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--prompts {path}: cannot read it as UTF-8 text ({e})") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the file's last line end
        lines.pop()
    prompts = [line[:-1] if line.endswith("\r") else line for line in lines]
    if not prompts:
        raise UsageError(f"--prompts {path}: the file holds no prompts")
    for number, prompt in enumerate(prompts, 1):
        if not prompt:
            raise UsageError(f"--prompts {path}: line {number} is empty (every line is a prompt)")
    return prompts


def choose_prompts(args: argparse.Namespace, vocab) -> list[str]:
    """One prompt per stream; a character outside the vocabulary names its line (VocabError)."""
    from minagi.data import VocabError
    from minagi.sampling import default_prompt
    if args.prompts is None:
        prompt = default_prompt(vocab) if args.prompt is None else args.prompt
        return [prompt] * (args.streams or 1)
    prompts = read_prompts(args.prompts)
    if args.streams is not None and args.streams != len(prompts):
        raise UsageError(f"--streams {args.streams} but {args.prompts} holds {len(prompts)} prompts "
                         f"(one stream per line; leave --streams out)")
    for number, prompt in enumerate(prompts, 1):
        try:
            vocab.encode(prompt)
        except VocabError as e:
            raise UsageError(f"--prompts {args.prompts}: line {number}: {e}") from None
    return prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    utf8_stdout()
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warnings()  # minagi's (the grouped-GEMM probe's): one line each
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    out, err = sys.stdout, sys.stderr
    from minagi.checkpoint import CheckpointError
    from minagi.data import VocabError
    from minagi.devices import DeviceError, choose_device
    from minagi.sampling import SamplingError, resolve_graphs, resolve_offload_read, write
    try:
        if args.products != "auto" and not args.compile:
            raise UsageError(f"--products {args.products} shapes the compiled step: add --compile")
        path = resolve_checkpoint(args.checkpoint)
        device = choose_device(args.device, option="--device")
        if args.graphs == "on" and device.type != "cuda":
            raise UsageError(f"--graphs on needs a CUDA device (CUDA graphs); this run is on {device.type}: "
                             f"use --graphs auto or off")
        model, vocab, ckpt, clock = _load(path, device, args.compile and device.type == "cuda", err)
        step = "?" if ckpt.step is None else ckpt.step
        del ckpt  # the optimizer state in it is twice the model's size; writing needs none of it
        prompts = choose_prompts(args, vocab)
        try:
            chars = write(model, vocab, prompts, args.chars, args.temperature, args.top_k, args.seed, device,
                          window=args.window, keep=args.keep, graphs=args.graphs, offload_read=args.offload_read,
                          compiled=args.compile, products={"auto": None, "on": True, "off": False}[args.products],
                          sync_every=1 if len(prompts) == 1 else 16, top_p=args.top_p, on_ready=clock.ready)
        except VocabError as e:
            raise UsageError(f"--prompt: {e}") from None
    except (UsageError, SamplingError, CheckpointError, DeviceError) as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=err)
        return 2
    except KeyboardInterrupt:
        print("interrupted before writing began", file=err)
        return 130

    mlp = f"{model.pool_cfg.n_experts} experts" if model.cfg.mlp == "pooled" else "dense"
    streams = f", {len(prompts)} streams" if len(prompts) > 1 else ""
    read = resolve_offload_read(args.offload_read, model, len(prompts))
    graphs = "on" if resolve_graphs(args.graphs, device, model, read) else "off"
    offload = f", offloaded experts read by {read}" if read else ""
    print(f"{path}: step {step}, {model.cfg.n_rows} rows x {mlp}, {vocab.size} characters, context "
          f"{model.cfg.context}, on {device.type}, graphs {graphs}{streams}{offload}", file=err, flush=True)
    if len(prompts) == 1:
        return _stream_one(chars, prompts[0], args, out, err, clock)
    return _write_many(chars, prompts, args, out, err, clock)


def _load(path, device, warm: bool, err):
    """(model, vocabulary, checkpoint, the clock started with the load's time). `warm`: the compiler's
    imports run on a thread meanwhile (`compile_cache.warm_compiler`), finished before this returns:
    this thread then touches the compiler alone (two threads importing the same modules in a cycle
    could leave one of them half made), and the wait counts in the time said."""
    from minagi.compile_cache import warm_compiler
    from minagi.loading import load_trained
    loading = time.perf_counter()
    warming = warm_compiler() if warm else None  # dynamo imported here, on this thread: in the time said
    try:
        model, vocab, ckpt = load_trained(path, device)  # a bad vocabulary string is its CheckpointError
    finally:
        if warming is not None:
            warming.join()
    return model, vocab, ckpt, _Clock(time.perf_counter() - loading, err, "load and compiler imports" if warm else "load")


class _Clock:
    """The fixed cost, said on its own stderr line once writing is ready (`sampling.Ready`): loading the
    checkpoint, then capturing the step's graphs and compiling it; the writing rate counts from there."""

    def __init__(self, load_s: float, err, what: str = "load"):
        self.load_s, self.err, self.what, self.ready_at = load_s, err, what, None

    def ready(self, ready) -> None:
        self.ready_at = time.perf_counter()
        print(f"ready in {self.load_s + ready.seconds:.2f} s: {self.what} {self.load_s:.2f} s, {ready.describe()}",
              file=self.err, flush=True)

    def start(self) -> float:
        return self.ready_at if self.ready_at is not None else time.perf_counter()


def _stream_one(chars, prompt: str, args: argparse.Namespace, out, err, clock: _Clock) -> int:
    """One stream: each character to stdout as it is written."""
    written, code = 0, 0
    rows = iter(chars)
    start = time.perf_counter()
    try:
        first = next(rows, None)  # the set-up (its line on stderr), the prefill and the first character
        start = clock.start()  # writing only: the prefill onwards
        if not args.no_echo:
            out.write(prompt)
            out.flush()
        for (char,) in itertools.chain([first] if first is not None else [], rows):
            out.write(char)
            out.flush()  # stream: each character appears as it is written
            written += 1
    except KeyboardInterrupt:
        code = 130
    except BrokenPipeError:  # `| head`: the reader left. Point stdout at devnull so exit's flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    seconds = time.perf_counter() - start
    if out.isatty():  # end the text's line on the terminal without adding a character to stdout
        print(file=err)
    rate = written / seconds if seconds > 0 else 0.0
    print(f"wrote {written} chars in {seconds:.2f} s ({rate:.1f} char/s)", file=err)
    return code


def _write_many(chars, prompts: list[str], args: argparse.Namespace, out, err, clock: _Clock) -> int:
    """Several streams: written side by side, then printed one after another under a header line."""
    texts = [[] for _ in prompts]
    written, code = 0, 0
    rows = iter(chars)
    start = time.perf_counter()
    try:
        first = next(rows, None)  # the set-up (its line on stderr), the prefill and the first characters
        start = clock.start()
        for row in itertools.chain([first] if first is not None else [], rows):
            for text, char in zip(texts, row):
                text.append(char)
            written += 1
    except KeyboardInterrupt:  # print what was written
        code = 130
    seconds = time.perf_counter() - start
    try:
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            echo = "" if args.no_echo else prompt
            out.write(f"--- stream {i} (seed {args.seed + i}) ---\n{echo}{''.join(text)}\n")
        out.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    rate = written * len(prompts) / seconds if seconds > 0 else 0.0
    print(f"wrote {len(prompts)} streams x {written} chars in {seconds:.2f} s ({rate:.1f} char/s in all)", file=err)
    return code


if __name__ == "__main__":
    sys.exit(main())
