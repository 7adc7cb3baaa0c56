"""Write text with a trained minagi model, streaming each character to stdout as it is sampled.

    python sample.py runs/cpu_tiny-20250101-120000              # the run's best.pt (else last.pt)
    python sample.py runs/my-run/last.pt --prompt "def " --chars 2000 --temperature 0.6 --top-k 20
    python sample.py runs/my-run --temperature 0 --no-echo > greedy.txt

stdout: the prompt (unless --no-echo), then exactly --chars characters. stderr: one line about the
model before, and "wrote N chars in S s (X char/s)" after (generation only, not loading).
Exit codes: 0 done (also when a reader such as `head` closes the pipe), 2 bad argument / checkpoint /
prompt, 130 Ctrl-C (the speed line is still printed for what was written).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

CHECKPOINT_NAMES = ("best.pt", "last.pt")  # what a run folder is read as, in order


class UsageError(ValueError):
    """A bad argument found after parsing; one line."""


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0 = greedy), got {text}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a .pt file, or a run folder (its best.pt, else last.pt)")
    p.add_argument("--prompt", help="text to continue (default: a newline if the vocabulary has one, "
                                    "else its first character); echoed to stdout unless --no-echo")
    p.add_argument("--chars", type=_non_negative_int, default=500, help="characters to write (default 500)")
    p.add_argument("--temperature", type=_temperature, default=0.8, help="0 = greedy argmax (default 0.8)")
    p.add_argument("--top-k", type=_non_negative_int, default=0,
                   help="sample only among the k likeliest characters (default 0 = off)")
    p.add_argument("--seed", type=int, default=1337, help="sampling seed (default 1337)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = CUDA when present (bf16 autocast there), else CPU")
    p.add_argument("--window", type=_positive_int,
                   help="most characters the model sees (default and maximum: its trained context)")
    p.add_argument("--keep", type=_positive_int,
                   help="characters re-prefilled when the window is full (default: 7/8 of the window)")
    p.add_argument("--no-echo", action="store_true", help="do not print the prompt before the text")
    return p.parse_args(argv)


def resolve_checkpoint(path: str) -> Path:
    """A file as is; a folder -> its best.pt, else its last.pt."""
    p = Path(path)
    if p.is_dir():
        for name in CHECKPOINT_NAMES:
            if (p / name).is_file():
                return p / name
        raise UsageError(f"{p}: no {' or '.join(CHECKPOINT_NAMES)} in this folder")
    return p  # a missing file is load_checkpoint's one-line error, naming it


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out, err = sys.stdout, sys.stderr
    from minagi.checkpoint import CheckpointError
    from minagi.data import VocabError
    from minagi.devices import DeviceError, choose_device
    from minagi.loading import load_trained
    from minagi.sampling import SamplingError, default_prompt, generate
    try:
        path = resolve_checkpoint(args.checkpoint)
        device = choose_device(args.device, option="--device")
        try:
            model, vocab, payload = load_trained(path, device)
        except VocabError as e:  # a vocabulary string that is not sorted / unique / empty
            raise CheckpointError(f"{path}: not a usable vocabulary ({e})") from None
        step = payload.get("step", "?")
        del payload  # the optimizer state in it is twice the model's size; writing needs none of it
        prompt = default_prompt(vocab) if args.prompt is None else args.prompt
        try:
            chars = generate(model, vocab, prompt, args.chars, args.temperature, args.top_k, args.seed,
                             device, window=args.window, keep=args.keep)
        except VocabError as e:
            raise UsageError(f"--prompt: {e}") from None
    except (UsageError, SamplingError, CheckpointError, DeviceError) as e:
        print(f"error: {' '.join(str(e).splitlines())}", file=err)
        return 2
    except KeyboardInterrupt:
        print("interrupted before writing began", file=err)
        return 130

    mlp = f"{model.pool_cfg.n_experts} experts" if model.cfg.mlp == "pooled" else "dense"
    print(f"{path}: step {step}, {model.cfg.n_rows} rows x {mlp}, "
          f"{vocab.size} characters, context {model.cfg.context}, on {device.type}", file=err, flush=True)
    written, code = 0, 0
    start = time.perf_counter()  # reset below, after the echo
    try:
        if not args.no_echo:
            out.write(prompt)
            out.flush()
        start = time.perf_counter()  # generation only: the prefill onwards
        for char in chars:
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


if __name__ == "__main__":
    sys.exit(main())
