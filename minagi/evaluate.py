"""Held-out loss of a checkpoint on any text: each character scored once, with as much context as allowed.

    minagi-eval runs/<name>/best.pt --data book.txt other.txt       # or python -m minagi.evaluate, tools/evaluate.py
    python tools/evaluate.py runs/<name>/best.pt --data book.txt other.txt
    python tools/evaluate.py runs/<name>/best.pt --data a.txt --stride 32 --batch 64 --json eval.json
    python tools/evaluate.py out/ --data book.txt        # a folder minagi-export wrote

Windows of the model's trained context T (model.context) slide over each text with a stride
(default T // 2): the first window scores all its positions, each later one only its last
`stride` (the last window ends at the text's end and scores what is left), so every scored
character is predicted from at least T - stride characters before it, except in the first window.

Characters outside the checkpoint's vocabulary cannot be scored. The text is split at each of
them: the pieces are scored as separate texts (no context crosses an unknown character), the
unknown characters are counted and listed, and the first character of each piece is not scored
(nothing precedes it), like the first character of the text.

Texts are read as UTF-8 (BOM dropped, CRLF -> LF), as training reads them. bf16 autocast on
CUDA, fp32 on the CPU. Exit status: 0 done, 2 bad checkpoint / device / file / empty text.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from . import devices
from .checkpoint import CheckpointError
from .cli import OneLineParser, positive_int, utf8_stdout
from .config import ConfigError
from .data import Vocab, why_not_text
from .gutenberg import MarkersMissing, strip_gutenberg
from .loading import load_trained, resolve_model_path

LN2 = math.log(2.0)
OOV_POLICY = ("not scored: the text is split at each, and each piece is scored as a text of its own "
              "(its first character has no context and is not scored)")
_LISTED = 10  # unknown characters named in the report


class EvalError(ValueError):
    """A file that cannot be evaluated (missing, not UTF-8, empty); one line naming it."""


def plan_windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows over a piece of n characters: (start, length, first) = inputs [start, start + length),
    targets one further on, of which target indices first..length-1 are scored.

    Target j of a window is character start + j + 1: characters 1..n-1 are each scored once.
    """
    if n < 2:
        return []
    if n - 1 <= context:
        return [(0, n - 1, 0)]
    windows, done = [(0, context, 0)], context  # done: characters 1..done are scored
    while done < n - 1:
        start = min(done + stride - context, n - 1 - context)
        windows.append((start, context, done - start))
        done = start + context
    return windows


def split_at_oov(text: str, vocab: Vocab) -> tuple[np.ndarray, list[tuple[int, int]], dict[str, int]]:
    """(ids int64 [len(text)] with -1 outside the vocabulary, pieces (begin, end) of known
    characters, {unknown character: count})."""
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    known = np.frombuffer(vocab.chars.encode("utf-32-le"), dtype=np.uint32)  # sorted: Vocab's rule
    ids = np.searchsorted(known, cps).astype(np.int64)
    valid = known[np.minimum(ids, len(known) - 1)] == cps
    ids[~valid] = -1
    bad = np.flatnonzero(~valid)
    begins, ends = np.r_[0, bad + 1], np.r_[bad, len(cps)]
    pieces = [(int(b), int(e)) for b, e in zip(begins, ends) if e > b]
    values, counts = np.unique(cps[bad], return_counts=True)
    return ids, pieces, {chr(int(v)): int(c) for v, c in zip(values, counts)}


@torch.inference_mode()
def score_positions(model, ids: np.ndarray, pieces: list[tuple[int, int]], context: int, stride: int,
                    batch_size: int, device: torch.device, desc: str = "") -> np.ndarray:
    """Nats of each character given the text before it within its piece: float64 [len(ids)],
    NaN where a character is not scored. `model(x_BT, dropless=True).logits` is [B, T, V]: dropless,
    so that a score does not depend on --batch (a capacity would drop rows by what shares the call)."""
    by_length: dict[int, list[tuple[int, int]]] = {}
    for begin, end in pieces:
        for start, length, first in plan_windows(end - begin, context, stride):
            by_length.setdefault(length, []).append((begin + start, first))
    nats = np.full(len(ids), np.nan)
    bar = tqdm(total=sum(map(len, by_length.values())), desc=desc, unit="window", file=sys.stderr,
               disable=None, leave=False)
    for length, windows in sorted(by_length.items(), reverse=True):
        offsets = np.arange(length)
        for i in range(0, len(windows), batch_size):
            starts, firsts = map(np.array, zip(*windows[i:i + batch_size]))
            rows = torch.from_numpy(ids[starts[:, None] + np.arange(length + 1)]).to(device)  # [B, L+1]
            with devices.autocast(device):
                logits = model(rows[:, :-1], dropless=True).logits                         # [B, L, V]
            logp = torch.log_softmax(logits.float(), dim=-1)
            nll = -logp.gather(-1, rows[:, 1:, None]).squeeze(-1).double().cpu().numpy()   # [B, L]
            keep = offsets[None, :] >= firsts[:, None]
            where = (starts[:, None] + offsets[None, :] + 1)[keep]
            assert np.isnan(nats[where]).all(), "a character was scored twice"
            nats[where] = nll[keep]
            bar.update(len(starts))
    bar.close()
    return nats


def read_text(path: str, strip: bool = False) -> str:
    """A file as training reads it (UTF-8, BOM dropped, CRLF -> LF); EvalError naming it."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"{path}: no such file")
    if not p.is_file():
        raise EvalError(f"{path}: not a file")
    try:
        raw = p.read_bytes()
        text = raw.decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError as e:
        raise EvalError(f"{path}: not text ({why_not_text(raw, e)})") from None  # as training says it
    except OSError as e:
        raise EvalError(f"{path}: cannot read it ({e.strerror or e})") from None
    if strip:
        try:
            text = strip_gutenberg(text)
        except MarkersMissing as e:
            raise EvalError(f"{path}: --strip-gutenberg but the file has {e}") from None
    if not text:
        raise EvalError(f"{path}: empty text" + (" between its Project Gutenberg markers" if strip else ""))
    return text


def figures(name: str, text: str, nats: np.ndarray, oov: dict[str, int], n_pieces: int) -> dict:
    """One file's figures: characters, scored, oov (count and {char: count}), pieces (runs of known
    characters; the first of each is not scored), nats_sum, nats and bits per char."""
    scored = np.isfinite(nats)
    n = int(scored.sum())
    total = float(nats[scored].sum())
    return {"file": name, "characters": len(text), "scored": n, "oov": sum(oov.values()), "oov_chars": oov,
            "pieces": n_pieces, "nats_sum": total,
            "nats_per_char": total / n if n else None, "bits_per_char": total / n / LN2 if n else None}


def overall(files: list[dict]) -> dict:
    """The files' figures added up (nats per char weighted by characters scored)."""
    oov: dict[str, int] = {}
    for f in files:
        for c, k in f["oov_chars"].items():
            oov[c] = oov.get(c, 0) + k
    out = {"file": "all", **{k: sum(f[k] for f in files) for k in
                            ("characters", "scored", "oov", "pieces", "nats_sum")}}
    n = out["scored"]
    return {**out, "oov_chars": oov, "nats_per_char": out["nats_sum"] / n if n else None,
            "bits_per_char": out["nats_sum"] / n / LN2 if n else None}


def describe_oov(oov: dict[str, int]) -> str:
    """Most frequent first, as repr so invisible characters show: 'é' x3, '\\t' x1, ... (+N more)."""
    ranked = sorted(oov.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{c!r} x{k}" for c, k in ranked[:_LISTED])
    return text + (f", ... (+{len(ranked) - _LISTED} more)" if len(ranked) > _LISTED else "")


def format_report(report: dict) -> str:
    """The printed table: one line per file and the total, then how unknown characters were handled."""
    rows = report["files"] + ([report["overall"]] if len(report["files"]) > 1 else [])
    width = max(4, *(len(r["file"]) for r in rows))
    num = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    lines = [f"{'file':<{width}} {'characters':>11} {'scored':>11} {'oov':>7} {'nats/char':>9} {'bits/char':>9}"]
    lines += [f"{r['file']:<{width}} {r['characters']:>11,} {r['scored']:>11,} {r['oov']:>7,} "
              f"{num(r['nats_per_char']):>9} {num(r['bits_per_char']):>9}" for r in rows]
    total = report["overall"]
    if total["oov"]:
        lines += [f"{total['oov']:,} occurrence(s) of {len(total['oov_chars']):,} character(s) outside the vocabulary: "
                  f"{describe_oov(total['oov_chars'])}",
                  f"  {OOV_POLICY}; {total['pieces']:,} piece(s)"]
    else:
        lines.append(f"no character outside the vocabulary; unscored: the first character of each text "
                     f"({total['pieces']:,}), which has no context")
    return "\n".join(lines)


def evaluate(model, vocab: Vocab, texts: dict[str, str], context: int, stride: int, batch_size: int,
             device: torch.device) -> dict:
    """{"files": [figures per text], "overall": their sum} for {name: text}."""
    files = []
    for name, text in texts.items():
        ids, pieces, oov = split_at_oov(text, vocab)
        nats = score_positions(model, ids, pieces, context, stride, batch_size, device, desc=name)
        files.append(figures(name, text, nats, oov, len(pieces)))
    return {"files": files, "overall": overall(files)}


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    return [_json_safe(v) for v in value] if isinstance(value, list) else value


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", help="a minagi checkpoint (last.pt / best.pt), a run folder (its best.pt, else "
                                      "last.pt) or a folder minagi-export wrote")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE", help="text files to score")
    p.add_argument("--stride", type=int, help="characters scored per window after the first (default T // 2)")
    p.add_argument("--batch", type=positive_int, default=32, help="windows per forward pass (default 32)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="default auto")
    p.add_argument("--strip-gutenberg", action="store_true", help="score only the book of Project Gutenberg files")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    utf8_stdout()  # the report names characters outside the vocabulary
    try:
        if args.json and not Path(args.json).resolve().parent.is_dir():  # before the scoring, not after it
            raise EvalError(f"--json {args.json}: no folder {Path(args.json).resolve().parent} to write it in")
        device = devices.choose_device(args.device, "--device")
        source = resolve_model_path(args.checkpoint)  # a run folder: its best.pt, else last.pt
        model, vocab, ckpt = load_trained(source, device)
        context = ckpt.config.model.context
        stride = max(1, context // 2) if args.stride is None else args.stride
        if not 1 <= stride <= context:
            raise EvalError(f"--stride must be in 1..{context} (the checkpoint's model.context), got {stride}")
        texts = {name: read_text(name, args.strip_gutenberg) for name in dict.fromkeys(args.data)}
    except (CheckpointError, ConfigError, devices.DeviceError, EvalError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted before scoring began", file=sys.stderr)
        return 130
    try:
        report = evaluate(model, vocab, texts, context, stride, args.batch, device)
    except KeyboardInterrupt:  # Ctrl-C: nothing is written before the end, so nothing is lost
        print("\ninterrupted: nothing scored is kept (evaluate.py writes at the end)", file=sys.stderr)
        return 130
    if not report["overall"]["scored"]:
        print(f"error: no character could be scored in {', '.join(texts)} (every piece between "
              "characters outside the vocabulary is shorter than 2)", file=sys.stderr)
        return 2
    print(f"checkpoint {source} (step {'?' if ckpt.step is None else ckpt.step}): context {context}, stride "
          f"{stride}, vocabulary {vocab.size} characters, device {device.type}")
    print(format_report(report))
    if args.json:
        meta = {"checkpoint": str(source), "step": ckpt.step, "context": context,
                "stride": stride, "vocab_size": vocab.size, "device": device.type,
                "strip_gutenberg": args.strip_gutenberg, "oov_policy": OOV_POLICY}
        try:
            Path(args.json).write_text(json.dumps(_json_safe({**meta, **report}), indent=2) + "\n")
        except OSError as e:
            print(f"error: --json {args.json}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
