"""minagi/evaluate.py (tools/evaluate.py, minagi-eval): the sliding windows score each character once, the nats equal a brute-force
forward per position, unknown characters are counted and split the text, and the CLI's errors."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minagi import evaluate
from minagi.loading import load_trained
from tiny import run_tiny, tiny_text

REPO = Path(__file__).resolve().parent.parent

CONTEXT = 16
TINY = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", f"model.context={CONTEXT}",
        "pool.n_experts=4", "pool.top_k=2", "pool.d_expert=32",
        "train.steps=6", "train.batch_size=4", "train.warmup_steps=2", "train.eval_every=6",
        "train.eval_batches=2", "train.device=cpu"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return run_tiny(tmp_path_factory.mktemp("evaluate"), None, settings=TINY).run_dir / "best.pt"


@pytest.fixture(scope="module")
def trained(ckpt):
    return load_trained(ckpt)[:2]  # (model, vocab)


def _window_of(p: int, n: int, context: int, stride: int) -> tuple[int, int]:
    """The rule, written per character: (start, length) of the window that scores character p.

    The first window covers characters 1..T; window k >= 1 ends at k * stride + T, the last one at n - 1."""
    if n - 1 <= context or p <= context:
        return 0, min(context, n - 1)
    k = math.ceil((p - context) / stride)
    return min(k * stride, n - 1 - context), context


@pytest.mark.parametrize("stride", [1, 5, 8, 16])
@pytest.mark.parametrize("n", [0, 1, 2, 10, 16, 17, 18, 25, 33, 100, 101])
def test_windows_score_every_character_once_with_at_least_T_minus_stride_context(n, stride):
    windows = evaluate.plan_windows(n, CONTEXT, stride)
    scored = np.zeros(n, dtype=int)
    for i, (start, length, first) in enumerate(windows):
        assert 1 <= length <= CONTEXT and start >= 0 and start + length <= n - 1
        if i == 0:
            assert (start, first) == (0, 0)
        else:
            assert length == CONTEXT and first >= CONTEXT - stride  # context of a scored character: first + 1
        for j in range(first, length):
            p = start + j + 1
            scored[p] += 1
            assert _window_of(p, n, CONTEXT, stride) == (start, length)
    assert scored[1:].tolist() == [1] * (n - 1) and (n == 0 or scored[0] == 0)


@pytest.mark.parametrize("stride, batch", [(8, 32), (5, 3), (16, 1), (1, 64)])
def test_nats_equal_a_brute_force_forward_per_position(trained, stride, batch):
    model, vocab = trained
    text = tiny_text()[:203]
    ids, pieces, oov = evaluate.split_at_oov(text, vocab)
    assert pieces == [(0, len(text))] and oov == {}
    nats = evaluate.score_positions(model, ids, pieces, CONTEXT, stride, batch, CPU)
    assert math.isnan(nats[0]) and np.isfinite(nats[1:]).all()
    with torch.inference_mode():
        for p in range(1, len(text)):
            start, length = _window_of(p, len(text), CONTEXT, stride)
            logits = model(torch.from_numpy(ids[start:start + length])[None]).logits[0, p - start - 1].double()
            expected = float(torch.logsumexp(logits, 0) - logits[ids[p]])
            assert nats[p] == pytest.approx(expected, abs=1e-4), p


def with_capacity(model, factor: float):
    """The same model, its pools capped at `factor` x the fair share (a training-throughput setting)."""
    import copy
    import dataclasses
    capped = copy.deepcopy(model)
    for pool in capped.pools():
        pool.cfg = dataclasses.replace(pool.cfg, capacity_factor=factor)
    return capped


def test_a_capacity_does_not_change_a_score_whatever_the_batch(trained):
    """Scoring is dropless, as writing is: with the capacity applied, a window's characters would be
    dropped or not by which windows share its call, so --batch would change the figures."""
    model, vocab = trained
    ids, pieces, _ = evaluate.split_at_oov(tiny_text()[:203], vocab)
    want = evaluate.score_positions(model, ids, pieces, CONTEXT, 5, 64, CPU)
    capped = with_capacity(model, 0.5)
    assert capped.pools()[0].capacity(64) > 0
    for batch in (1, 64):
        np.testing.assert_array_equal(evaluate.score_positions(capped, ids, pieces, CONTEXT, 5, batch, CPU), want)


def test_a_files_figures_are_per_scored_character_and_the_overall_weighs_files_by_them():
    """By hand: nats over the characters scored (not the text's length, which counts the unscored
    first character and unknown ones), and the overall as all nats over all scored characters."""
    short = evaluate.figures("a", "abcd", np.array([np.nan, 1.0, 2.0, 3.0]), {}, 1)
    long_nats = np.full(101, 0.5)
    long_nats[[0, 50, 51]] = np.nan  # the first character, an unknown one and the next piece's first
    long = evaluate.figures("b", "x" * 101, long_nats, {"é": 1}, 2)
    assert (short["scored"], short["nats_per_char"]) == (3, 2.0)
    assert (long["scored"], long["nats_per_char"], long["oov"]) == (98, 0.5, 1)
    total = evaluate.overall([short, long])
    assert total["scored"] == 101 and total["nats_sum"] == pytest.approx(6 + 49)
    assert total["nats_per_char"] == pytest.approx(55 / 101)  # not (2.0 + 0.5) / 2
    assert total["bits_per_char"] == pytest.approx(55 / 101 / math.log(2))


def test_characters_outside_the_vocabulary_split_the_text_and_are_counted(trained):
    model, vocab = trained
    assert not {"é", "Q", "\t"} & set(vocab.chars)
    a, b, c = "the quick brown fox", " jumps over the ", "lazy dog.\n"
    text = a + "é" + b + "QQ" + "\t" + c
    ids, pieces, oov = evaluate.split_at_oov(text, vocab)
    assert oov == {"é": 1, "Q": 2, "\t": 1}
    assert [text[x:y] for x, y in pieces] == [a, b, c]
    assert (ids[[len(a), len(a) + 1 + len(b)]] == -1).all()
    report = evaluate.evaluate(model, vocab, {"t": text}, CONTEXT, 8, 4, CPU)
    got = report["files"][0]
    assert (got["characters"], got["oov"], got["pieces"]) == (len(text), 4, 3)
    assert got["scored"] == len(a) + len(b) + len(c) - 3  # each piece's first character has no context
    # Each piece is scored as a text of its own: no context crosses an unknown character.
    alone = evaluate.evaluate(model, vocab, {p: p for p in (a, b, c)}, CONTEXT, 8, 4, CPU)["overall"]
    assert got["nats_sum"] == pytest.approx(alone["nats_sum"], rel=1e-6) and got["scored"] == alone["scored"]
    printed = evaluate.format_report(report)
    assert "4 occurrence(s) of 3 character(s) outside the vocabulary: 'Q' x2, '\\t' x1, 'é' x1" in printed
    assert evaluate.OOV_POLICY in printed and "3 piece(s)" in printed


def test_cli_prints_the_table_and_writes_the_figures(ckpt, trained, tmp_path, capsys):
    model, vocab = trained
    one, two = tmp_path / "one.txt", tmp_path / "two.txt"
    one.write_bytes(tiny_text()[:500].replace("\n", "\r\n").encode())  # CRLF read as training reads it
    two.write_text("the lazy dog sleeps é over the moon.\n", encoding="utf-8")
    out = tmp_path / "eval.json"
    assert evaluate.main([str(ckpt), "--data", str(one), str(two), "--device", "cpu", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["context"], figures["stride"], figures["vocab_size"]) == (CONTEXT, CONTEXT // 2, vocab.size)
    expected = evaluate.evaluate(model, vocab, {str(one): tiny_text()[:500], str(two): two.read_text()},
                                 CONTEXT, CONTEXT // 2, 32, CPU)
    for got, want in zip(figures["files"] + [figures["overall"]], expected["files"] + [expected["overall"]]):
        assert {k: got[k] for k in ("file", "characters", "scored", "oov", "oov_chars", "pieces")} == \
               {k: want[k] for k in ("file", "characters", "scored", "oov", "oov_chars", "pieces")}
        assert got["nats_per_char"] == pytest.approx(want["nats_per_char"], rel=1e-6)
        assert got["bits_per_char"] == pytest.approx(want["nats_per_char"] / math.log(2), rel=1e-6)
    assert figures["overall"]["scored"] == 499 + (37 - 1 - 2) and figures["overall"]["oov_chars"] == {"é": 1}
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"checkpoint {ckpt} (step 6): context {CONTEXT}, stride {CONTEXT // 2}")
    assert printed[1].split() == ["file", "characters", "scored", "oov", "nats/char", "bits/char"]
    assert printed[2].split()[:4] == [str(one), "500", "499", "0"]
    assert printed[4].split()[:4] == ["all", "537", "533", "1"]
    assert printed[-1] == f"wrote {out}"
    assert evaluate.main([str(ckpt.parent), "--data", str(one), "--device", "cpu", "--json", str(out)]) == 0
    said = capsys.readouterr().out.splitlines()[0]  # a run folder: the file it scored, best.pt or last.pt
    resolved = evaluate.resolve_model_path(ckpt.parent)
    assert said.startswith(f"checkpoint {resolved} (step") and json.loads(out.read_text())["checkpoint"] == str(resolved)


def test_strip_gutenberg_scores_the_book_alone(ckpt, trained, tmp_path, capsys):
    model, vocab = trained
    book = "".join(tiny_text().splitlines(keepends=True)[:8])  # whole lines: the book ends in a newline
    pg = tmp_path / "pg.txt"
    pg.write_text(f"Header of Project Gutenberg\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n{book}\n"
                  "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nlicence\n", encoding="utf-8")
    out = tmp_path / "e.json"
    args = [str(ckpt), "--data", str(pg), "--device", "cpu", "--strip-gutenberg", "--json", str(out)]
    assert evaluate.main(args) == 0
    got = json.loads(out.read_text())["overall"]
    want = evaluate.evaluate(model, vocab, {"b": book}, CONTEXT, CONTEXT // 2, 32, CPU)["overall"]
    assert (got["characters"], got["scored"]) == (len(book), len(book) - 1)
    assert got["nats_sum"] == pytest.approx(want["nats_sum"], rel=1e-6)


@pytest.mark.parametrize("case, expected", [
    ("missing checkpoint", "no such checkpoint file"),
    ("not a checkpoint", "bogus.pt"),
    ("missing file", "nope.txt: no such file"),
    ("directory", ": not a file"),
    ("empty file", "empty.txt: empty text"),
    ("not UTF-8", "latin1.txt: not text (byte 0xe9 at offset 3 is not UTF-8)"),  # as training says it
    ("no markers", "plain.txt: --strip-gutenberg but the file has no Project Gutenberg START line"),
    ("stride 0", f"--stride must be in 1..{CONTEXT}"),
    ("stride past T", f"--stride must be in 1..{CONTEXT} (the checkpoint's model.context), got {CONTEXT + 1}"),
    ("nothing known", "no character could be scored"),
    ("json folder missing", "x.json: no folder"),  # said before the scoring (captured.out stays empty)
])
def test_errors_are_one_line_and_exit_2(ckpt, tmp_path, capsys, case, expected):
    good = tmp_path / "good.txt"
    good.write_text(tiny_text()[:100], encoding="utf-8")
    bogus = tmp_path / "bogus.pt"
    bogus.write_bytes(b"not a checkpoint at all")
    (tmp_path / "empty.txt").write_bytes(b"\xef\xbb\xbf")  # a BOM alone: empty once read
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "plain.txt").write_text("plain text\n")
    (tmp_path / "unknown.txt").write_text("QZ\tQ")
    (tmp_path / "folder").mkdir()
    checkpoint = {"missing checkpoint": str(tmp_path / "none.pt"), "not a checkpoint": str(bogus)}.get(case, str(ckpt))
    data = {"missing file": "nope.txt", "directory": "folder", "empty file": "empty.txt", "not UTF-8": "latin1.txt",
            "no markers": "plain.txt", "nothing known": "unknown.txt"}.get(case, "good.txt")
    extra = {"stride 0": ["--stride", "0"], "stride past T": ["--stride", str(CONTEXT + 1)],
             "no markers": ["--strip-gutenberg"],
             "json folder missing": ["--json", str(tmp_path / "nodir" / "x.json")]}.get(case, [])
    files = [str(tmp_path / data)] if case in ("nothing known", "no markers") else [str(good), str(tmp_path / data)]
    assert evaluate.main([checkpoint, "--data", *files, "--device", "cpu", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("error: ") and expected in captured.err


def test_command_line_exit_status_2_for_a_missing_text(ckpt, tmp_path):
    done = subprocess.run([sys.executable, "tools/evaluate.py", str(ckpt), "--data", str(tmp_path / "nope.txt"),
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.txt'}: no such file"]


def test_ctrl_c_while_scoring_exits_130_with_one_line_and_writes_nothing(ckpt, tmp_path, capsys, monkeypatch):
    good = tmp_path / "good.txt"
    good.write_text(tiny_text()[:100], encoding="utf-8")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(evaluate, "evaluate", interrupted)
    out = tmp_path / "figures.json"
    assert evaluate.main([str(ckpt), "--data", str(good), "--device", "cpu", "--json", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "interrupted: nothing scored is kept (evaluate.py writes at the end)"
    assert not out.exists()
