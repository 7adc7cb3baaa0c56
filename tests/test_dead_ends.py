"""Dead ends of train.py and the trainer: each refusal is one line that says what to do (moved out
of tests/test_train.py, which holds the training loop, its run folder and its failures)."""
import contextlib
import io
import json
import re
import time
import types
from pathlib import Path

import pytest
import torch

from minagi import train as train_py
from minagi import flops, runlog, trainer
from minagi.checkpoint import load_checkpoint
from minagi.config import load_config
from minagi.trainer import train
from test_train import _nan_at_training_call
from tiny import run_tiny, tiny_argv, tiny_cfg, tiny_text, write_tiny_text

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------ dead ends: each refusal says what to do

def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_resume_of_a_run_stopped_before_its_first_checkpoint_says_to_start_it_again(tmp_path, data_path,
                                                                                       monkeypatch, capsys):
    argv = tiny_argv(tmp_path, data_path, run_name="early")
    with monkeypatch.context() as m:
        _nan_at_training_call(m, 2)  # as a kill or a full disk before step 3 would: run.json, no last.pt
        assert train_py.main(argv) == 3
    capsys.readouterr()
    run_dir = tmp_path / "runs" / "early"
    for extra in ([], ["--set", "train.steps=2"]):  # the run's first checkpoint, whatever steps are asked now
        assert train_py.main(["--resume", str(run_dir), *extra]) == 2
        line = _one_error_line(capsys)
        assert line.startswith(f"error: {run_dir / 'last.pt'}: no such checkpoint file: the run stopped before its "
                               "first checkpoint (step 3), so there is nothing to resume; start it again with its "
                               "settings and --run-name early"), line
    assert train_py.main(argv) == 0  # and so it does, in the same folder
    assert load_checkpoint(run_dir / "last.pt")["step"] == 6

    stopped = tmp_path / "runs" / "before"  # a kill while the corpus loaded: only the lock was made
    runlog.RunFolder(stopped).claim()
    assert train_py.main(["--resume", str(stopped)]) == 2
    assert "the run stopped before it began, so there is nothing to resume; start it again with its settings " \
           "and --run-name before" in _one_error_line(capsys)


def test_a_resume_whose_corpus_moved_or_gained_characters_says_to_point_data_at_the_runs_corpus(tmp_path, capsys):
    corpus = write_tiny_text(tmp_path)
    assert train_py.main(tiny_argv(tmp_path, corpus, run_name="moved")) == 0
    run_dir = tmp_path / "runs" / "moved"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    corpus.rename(elsewhere / corpus.name)
    capsys.readouterr()
    assert train_py.main(["--resume", str(run_dir), "--set", "train.steps=8"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: data path '{corpus}' does not exist") and line.endswith(
        f"; the run in {run_dir} trained on it: if its corpus moved, resume with --data pointing at where it is now")

    grown = tmp_path / "grown.txt"
    grown.write_text(tiny_text() + "Zébra\n")
    assert train_py.main(["--resume", str(run_dir), "--data", str(grown), "--set", "train.steps=8"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {grown}: 2 character(s) not in the vocabulary (") and line.endswith(
        f"; the run in {run_dir} knows only the {len(set(tiny_text()))} characters of its corpus: resume with "
        "--data pointing at the run's corpus (text with new characters is a new run)"), line
    # A new run from the run's weights keeps its vocabulary too.
    assert train_py.main(tiny_argv(tmp_path, grown, run_name="from") + ["--init", str(run_dir / "last.pt")]) == 2
    assert _one_error_line(capsys).endswith(f"; --init {run_dir / 'last.pt'}: a run started from a checkpoint "
                                            f"keeps its vocabulary ({len(set(tiny_text()))} characters)")
    assert train_py.main(["--resume", str(run_dir), "--data", str(elsewhere / corpus.name),
                          "--set", "train.steps=8"]) == 0


@pytest.mark.parametrize("change", ["missing", "unexpected"])
def test_a_checkpoint_whose_tensors_do_not_fit_names_them_on_resume_and_on_load(tmp_path, data_path, capsys,
                                                                                change):
    from minagi.checkpoint import CheckpointError, save_checkpoint
    from minagi.loading import load_trained
    done = run_tiny(tmp_path, data_path, "train.steps=2", "train.warmup_steps=1")
    payload = load_checkpoint(done.run_dir / "last.pt")
    if change == "missing":
        del payload["model"]["rows.0.attn.qkv.weight"]
        expected = "the weights do not fit the model its config describes: it lacks rows.0.attn.qkv.weight"
    else:
        payload["model"]["rows.0.attn.extra"] = torch.zeros(2)
        expected = ("the weights do not fit the model its config describes: it has rows.0.attn.extra, which the "
                    "model has no place for")
    save_checkpoint(done.run_dir / "last.pt", {k: v for k, v in payload.items() if k != "format_version"})
    assert train_py.main(["--resume", str(done.run_dir), "--set", "train.steps=4"]) == 2
    assert _one_error_line(capsys) == f"error: {done.run_dir / 'last.pt'}: {expected}"
    with pytest.raises(CheckpointError) as err:
        load_trained(done.run_dir / "last.pt")
    assert str(err.value) == f"{done.run_dir / 'last.pt'}: {expected}"


@pytest.fixture(scope="module")
def first_try(tmp_path_factory):
    """`train.py --set train.steps=20` on cpu_tiny without a terminal (stdout and stderr to files),
    on a folder of one text and one image."""
    tmp = tmp_path_factory.mktemp("first")
    corpus = tmp / "corpus"
    corpus.mkdir()
    (corpus / "text.txt").write_text(tiny_text())
    (corpus / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    argv = ["--profile", "cpu_tiny", "--data", str(corpus), "--run-name", "first", "--set", "train.steps=20",
            "--set", f"train.out_dir={tmp / 'runs'}", "--set", f"data.cache_dir={tmp / 'cache'}"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_py.main(argv)
    return dict(code=code, out=out.getvalue(), err=err.getvalue(), run_dir=tmp / "runs" / "first", corpus=corpus)


def test_a_short_first_try_of_a_long_profile_fits_its_warmup_and_says_so(first_try):
    assert first_try["code"] == 0, first_try["err"]
    train_cfg = json.loads((first_try["run_dir"] / "run.json").read_text())["config"]["train"]
    assert (train_cfg["steps"], train_cfg["warmup_steps"]) == (20, 2)  # cpu_tiny's 50, fitted
    assert ("warning: train.warmup_steps = 50 exceeds train.steps = 20: warming up over 2 steps (a tenth of "
            "them, at least one) instead; --set train.warmup_steps to choose") in first_try["err"].splitlines()


def test_minagi_warnings_are_one_stderr_line_each(first_try):
    lines = first_try["err"].splitlines()
    assert len(lines) == 2 and all(line.startswith("warning: ") for line in lines), lines
    assert (f"warning: skipped 1 binary / non-UTF-8 file(s) in {first_try['corpus']}: "
            f"'{first_try['corpus'] / 'logo.png'}' (byte 0x89 at offset 0 is not UTF-8)") in lines


def test_a_run_says_what_it_trains_on_at_start(first_try):
    corpus = json.loads((first_try["run_dir"] / "run.json").read_text())["corpus"]
    text = tiny_text()
    assert (corpus["files"], corpus["vocab_size"], corpus["train_chars"] + corpus["heldout_chars"]) == \
        (1, len(set(text)), len(text))
    assert (f"data: {first_try['corpus']}: 1 file(s), {corpus['train_chars']:,} training characters, vocabulary "
            f"{corpus['vocab_size']}; held out: the end of the text, {corpus['heldout_chars']:,} characters"
            ) in first_try["out"].splitlines()


def test_without_a_terminal_a_run_prints_a_progress_line_ten_times_an_interval(first_try):
    # cpu_tiny evaluates every 200 steps; a 20-step run is one interval of 20: a line every 2 steps.
    steps = [int(m.group(1)) for m in re.finditer(r"^step (\d+)/20: loss \d+\.\d{4} \| [\d,]+ char/s \| "
                                                   r"rss \d+\.\d\dGiB$", first_try["out"], re.M)]
    assert steps == list(range(2, 21, 2))


def test_the_progress_lines_rate_is_the_last_steps_not_a_mean_holding_the_compile(tmp_path, monkeypatch):
    """A first step of 100 s (a compile), then 0.5 s steps of 64 characters: once 16 steps have passed
    the line says 128 char/s; history.jsonl keeps the interval's mean, compile included."""
    clock = {"now": 0.0, "calls": 0}

    def perf_counter():  # _step reads it twice a step: before and after
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:
            clock["now"] += 100.0 if clock["calls"] == 2 else 0.5
        return clock["now"]

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=perf_counter,
                                                                       strftime=time.strftime))
    lines = []
    cfg = tiny_cfg(tmp_path, None, "train.steps=40", "train.eval_every=40")
    train(cfg, "tiny", progress=True, log=lines.append, argv=["test"])
    rates = {int(m.group(1)): int(m.group(2).replace(",", "")) for m in
             (re.match(r"step (\d+)/40: loss \S+ \| ([\d,]+) char/s", line) for line in lines) if m}
    assert sorted(rates) == list(range(4, 41, 4))
    assert rates[4] == round(4 * 64 / 101.5) and all(rates[s] == 128 for s in range(20, 41, 4))
    history = [json.loads(line) for line in (tmp_path / "runs" / "run" / "history.jsonl").read_text().splitlines()]
    assert history[-1]["chars_per_s"] == pytest.approx(40 * 64 / (100 + 39 * 0.5))


def test_with_a_matmul_rate_the_progress_line_and_every_record_give_the_mfu(tmp_path, monkeypatch):
    """MFU = FLOPs a character (minagi/flops.py) x char/s / the device's matmul rate: a rate faked here
    (the CPU has none: null there) that makes the lines' 128 char/s 25%."""
    clock = {"now": 0.0, "calls": 0}

    def perf_counter():
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:
            clock["now"] += 0.5  # 64 characters a step: 128 char/s
        return clock["now"]
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(perf_counter=perf_counter, strftime=time.strftime))
    cfg = tiny_cfg(tmp_path, None, "train.steps=40", "train.eval_every=20")
    per_char = flops.flops_per_char(cfg, len(set(tiny_text())))
    rate = per_char * 128 / 0.25 / 1e12  # TFLOP/s
    monkeypatch.setattr(flops, "matmul_tflops", lambda device: rate)
    lines = []
    train(cfg, "tiny", progress=True, log=lines.append, argv=["test"])
    shown = [line for line in lines if re.match(r"step \d+/40: loss \S+ \| 128 char/s \| MFU 25\.0% \| rss ", line)]
    assert len(shown) >= 5, lines
    history = [json.loads(line) for line in (tmp_path / "runs" / "run" / "history.jsonl").read_text().splitlines()]
    assert [r["mfu"] for r in history] == [pytest.approx(0.25)] * 2
    assert history[0]["mfu"] == pytest.approx(per_char * history[0]["chars_per_s"] / (rate * 1e12))


def test_the_flops_of_a_character_and_the_mfu_of_a_rate():
    cfg = load_config(None, ["model.n_rows=2", "model.d_model=32", "model.context=16", "pool.n_experts=4",
                             "pool.top_k=2", "pool.d_expert=8"])
    # 6 x (attention 4 D^2 + router D E + top_k experts 3 D F, a row; head D V) + 12 x rows x D x context
    assert flops.flops_per_char(cfg, 10) == 6 * (2 * (4 * 32**2 + 32 * 4 + 2 * 3 * 32 * 8) + 32 * 10) + 12 * 2 * 32 * 16
    dense = load_config(None, ["model.mlp=dense", "model.d_model=32", "pool.top_k=2", "pool.d_expert=8"])
    assert flops.flops_per_char(dense, 10) == 6 * (2 * (4 * 32**2 + 3 * 32 * 16) + 32 * 10) + 12 * 2 * 32 * 64
    wider = load_config(None, ["model.mlp=dense", "model.d_dense=40", "model.d_model=32", "pool.top_k=2",
                               "pool.d_expert=8"])  # model.d_dense, not the pool's active width
    assert flops.flops_per_char(wider, 10) == 6 * (2 * (4 * 32**2 + 3 * 32 * 40) + 32 * 10) + 12 * 2 * 32 * 64
    assert flops.mfu(1e6, 1e6, 4.0, ranks=2) == pytest.approx(0.125)  # 1e12 FLOP/s of 2 x 4e12
    assert flops.mfu(1e6, None, 4.0) is None and flops.mfu(1e6, 1e6, None) is None
    assert flops.matmul_tflops(torch.device("cpu")) is None


def test_a_text_too_small_for_the_context_is_one_line_naming_the_file_and_what_to_change(tmp_path, capsys):
    """A first try on one's own small file: the error names it and the settings that fit it."""
    from tiny import tiny_argv
    small = tmp_path / "a.py"
    small.write_text("print('hello world')\n" * 2)
    assert train_py.main(tiny_argv(tmp_path, small)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {small}: its held-out split has 5 characters")
    assert "model.context = 16 needs at least 17" in err[0] and "data.heldout_fraction" in err[0]
    assert not (tmp_path / "runs").exists()  # neither the run's folder nor the out_dir made for it
