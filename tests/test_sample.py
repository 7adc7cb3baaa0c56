"""Sampling: the fast path (`write`) against the uncached reference (`generate`) on a saved
checkpoint, the reference's sliding, seeds, and the sample.py entry point (which writes through the
static decode path: tests/test_decode.py holds its equalities for every kind of row).

The checkpoint is a tiny 2-row CPU model (context 16) built and saved with the trainer's payload keys,
its attention and output weights scaled up so that positions matter and the next-character
distribution is peaked: a cache that put a key at the wrong position, or a slide that kept the
wrong characters, changes the logits well beyond rounding.
"""
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi import sample as sample_py
from minagi import decode, sampling
from minagi.checkpoint import capture_rng_state, save_checkpoint
from minagi.config import config_to_dict, load_config
from minagi.data import Vocab, VocabError
from minagi.loading import load_trained
from minagi.model import CharLM, build_model
from minagi.gumbel import gumbel_noise, pick, stream_keys
from minagi.sampling import SamplingError, default_keep, default_prompt, generate, write

REPO = Path(__file__).resolve().parent.parent
CONTEXT = 16
TEXT = "the quick brown fox jumps over the lazy dog.\nTHE END; 0123456789!\n"
TINY = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", f"model.context={CONTEXT}",
        "pool.n_experts=4", "pool.top_k=2", "pool.d_expert=32", "train.device=cpu"]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One CPU thread: a one-position forward is ~3 ms alone but ~100 ms when two threads spin
    against the other test processes on a busy 2-core machine. Restored for the rest of the suite."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _payload(model: CharLM, cfg, vocab: Vocab) -> dict:
    """What minagi.trainer saves (trainer.payload), for a model that never trained."""
    optimizer = torch.optim.AdamW(model.parameters())
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": {},
            "rng": capture_rng_state(), "config": config_to_dict(cfg), "vocab": vocab.chars, "step": 0,
            "best_heldout_loss": float("inf"), "run_name": "tiny"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    cfg = load_config(None, TINY)
    vocab = Vocab.from_text(TEXT)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.pool, vocab.size, "cpu")
    with torch.no_grad():
        for row in model.rows:
            row.attn.qkv.weight.mul_(25)   # sharp attention: positions (RoPE, cache slots) matter
        model.head.weight.mul_(30)         # logits with a spread of a few nats
    save_checkpoint(run_dir / "last.pt", _payload(model, cfg, vocab))
    return run_dir


@pytest.fixture(scope="module")
def trained(run_dir):
    return load_trained(run_dir / "last.pt")[:2]


def _write(model, vocab, prompt="the ", n=40, **kwargs) -> str:
    kwargs = {"temperature": 1.0, "top_k": 0, "seed": 7, **kwargs}
    return "".join(generate(model, vocab, prompt, n, **kwargs))


def _logits_seen(monkeypatch, model, vocab, **kwargs) -> tuple[str, list[torch.Tensor]]:
    """The text, and the logits each character was sampled from."""
    seen = []
    real_pick = sampling._pick

    def pick(logits_V, *args):
        seen.append(logits_V.clone())
        return real_pick(logits_V, *args)
    monkeypatch.setattr(sampling, "_pick", pick)
    return _write(model, vocab, **kwargs), seen


# ------------------------------------------------------------------------------ write == the reference

@pytest.mark.parametrize("n, keep", [(12, None), (60, None), (60, CONTEXT - 1), (45, 1)],
                         ids=["inside-window", "sliding-default-keep", "sliding-keep-window-minus-1",
                              "sliding-keep-1"])
def test_writing_equals_the_uncached_reference_in_characters_and_logits(trained, monkeypatch, n, keep):
    model, vocab = trained
    written_logits, real_pick = [], decode.pick

    def pick(logits_BV, *args):
        written_logits.append(logits_BV[0].clone())
        return real_pick(logits_BV, *args)
    monkeypatch.setattr(decode, "pick", pick)
    written = "".join(c for (c,) in write(model, vocab, ["the "], n, 1.0, 0, 7, keep=keep))
    full, full_logits = _logits_seen(monkeypatch, model, vocab, n=n, keep=keep)
    assert len(written) == n and written == full
    for step, (a, b) in enumerate(zip(written_logits, full_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"character {step}")
    # The model does depend on where it is: the same character later in the window reads differently.
    assert not torch.allclose(written_logits[0], written_logits[-1], atol=1e-2)


def test_keep_equal_to_window_is_nanogpt_cropping_to_the_last_context_characters(trained):
    model, vocab = trained
    prompt, n = "the quick", 40
    ids = list(vocab.encode(prompt))
    noise_NV = gumbel_noise(stream_keys([3]), torch.arange(n), vocab.size)[:, 0]
    with torch.no_grad():
        for i in range(n):  # nanoGPT's sample loop: crop, full forward, sample the last position
            logits = model(torch.tensor([ids[-CONTEXT:]], dtype=torch.long)).logits[0, -1]
            ids.append(int(pick(logits[None], 1.0, 0, noise_NV[i][None])))  # its multinomial, our noise
    expected = vocab.decode(ids[len(prompt):])
    assert _write(model, vocab, prompt, n, seed=3, keep=CONTEXT) == expected
    assert "".join(c for (c,) in write(model, vocab, [prompt], n, 1.0, 0, 3, keep=CONTEXT)) == expected


def test_the_reference_recomputes_the_whole_window_each_character_and_slides_to_the_last_keep(
        trained, monkeypatch):
    model, vocab = trained
    fed = []
    real_forward = CharLM.forward

    def forward(self, idx_BT, *args, **kwargs):
        fed.append(idx_BT[0].tolist())
        return real_forward(self, idx_BT, *args, **kwargs)
    monkeypatch.setattr(CharLM, "forward", forward)
    window, keep, n = 8, 5, 14
    text = _write(model, vocab, "abc", n, window=window, keep=keep)
    # prompt 3 -> fills to 8 after 5 characters; the 6th slides: the last 5, then 3 more fill it
    # again; the 10th slides; ... The last character needs no forward.
    assert [len(ids) for ids in fed] == [3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]
    stream = [int(c) for c in vocab.encode("abc" + text)]
    ends = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # each forward ends at the newest character
    assert fed == [stream[end - len(ids):end] for ids, end in zip(fed, ends)]


def test_prompt_longer_than_the_window_conditions_on_its_last_window_characters(trained):
    model, vocab = trained
    long_prompt = "the quick brown fox jumps over"
    assert _write(model, vocab, long_prompt, 30) == _write(model, vocab, long_prompt[-CONTEXT:], 30)


def test_writing_is_dropless_and_leaves_the_model_as_it_found_it(trained, monkeypatch):
    model, vocab = trained
    real_pick = sampling._pick
    uncapped, uncapped_logits = _logits_seen(monkeypatch, model, vocab, prompt="the lazy dog.", n=20, seed=1337)
    capped_logits = []

    def recording(logits_V, *args):
        capped_logits.append(logits_V.clone())
        return real_pick(logits_V, *args)
    monkeypatch.setattr(sampling, "_pick", recording)
    for pool in model.pools():  # a window of 13..16 characters would drop rows at capacity 0.5
        monkeypatch.setattr(pool, "cfg", dataclasses.replace(pool.cfg, capacity_factor=0.5))
    model.train()
    try:
        chars = generate(model, vocab, "the lazy dog.", 20, temperature=1.0)
        first = next(chars)  # between two characters the caller's own state is in force
        assert torch.is_grad_enabled() and model.training
        assert all(pool.capacity(64) > 0 for pool in model.pools())
        capped = first + "".join(chars)
        assert model.training and all(pool.capacity(64) > 0 for pool in model.pools())
    finally:
        model.eval()
    assert capped == uncapped  # dropless: what an uncapped pool computes
    for step, (a, b) in enumerate(zip(capped_logits, uncapped_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"character {step}")


# ------------------------------------------------------------------------------ seeds and temperature

def test_greedy_is_deterministic_ignores_the_seed_and_equals_top_k_1(trained):
    model, vocab = trained
    greedy = _write(model, vocab, n=50, temperature=0.0, seed=1)
    assert greedy == _write(model, vocab, n=50, temperature=0.0, seed=1)
    assert greedy == _write(model, vocab, n=50, temperature=0.0, seed=2)
    assert greedy == _write(model, vocab, n=50, temperature=1.0, top_k=1, seed=3)


def test_same_seed_writes_the_same_text_and_another_seed_another(trained):
    model, vocab = trained
    first = _write(model, vocab, n=50, seed=11)
    assert first == _write(model, vocab, n=50, seed=11)
    assert first != _write(model, vocab, n=50, seed=12)


def test_top_k_only_ever_writes_one_of_the_k_likeliest_characters(trained, monkeypatch):
    model, vocab = trained
    text, logits = _logits_seen(monkeypatch, model, vocab, n=40, top_k=3, temperature=2.0)
    for char, logits_V in zip(text, logits):
        assert vocab.chars.index(char) in torch.topk(logits_V, 3).indices.tolist()


def test_sample_py_top_p_writes_what_the_reference_writes_with_that_nucleus(run_dir, trained, capsys):
    assert sample_py.main([str(run_dir / "last.pt"), "--prompt", "the ", "--chars", "40", "--seed", "5",
                           "--temperature", "1.5", "--top-k", "6", "--top-p", "0.6", "--no-echo"]) == 0
    model, vocab = trained
    expected = "".join(generate(model, vocab, "the ", 40, 1.5, 6, 5, "cpu", top_p=0.6))
    assert capsys.readouterr().out == expected
    assert expected != "".join(generate(model, vocab, "the ", 40, 1.5, 6, 5, "cpu"))


def test_zero_characters_yields_nothing_and_the_default_prompt_is_a_newline(trained):
    model, vocab = trained
    assert list(generate(model, vocab, "a", 0, 0.8, 0, 1337, "cpu")) == []
    assert default_prompt(vocab) == "\n" and default_prompt(Vocab("xyz")) == "x"
    assert default_keep(16) == 14 and default_keep(512) == 448 and default_keep(1) == 1


def test_bad_arguments_fail_when_generate_is_called_not_at_the_first_character(trained):
    model, vocab = trained
    with pytest.raises(VocabError, match="'☃' x2"):
        generate(model, vocab, "☃ the ☃", 5)
    for kwargs, match in [({"n_chars": -1}, "characters must be >= 0"),
                          ({"temperature": -0.5}, "temperature must be"),
                          ({"temperature": float("nan")}, "temperature must be"),
                          ({"top_k": -2}, "top_k must be >= 0"),
                          ({"top_p": 0.0}, r"top_p must be a number in \(0, 1\]"),
                          ({"top_p": 1.5}, r"top_p must be a number in \(0, 1\]"),
                          ({"window": CONTEXT + 1}, r"window must be 1\.\.16"),
                          ({"window": 8, "keep": 9}, r"keep must be 1\.\.8"),
                          ({"prompt": ""}, "prompt is empty")]:
        args = {"prompt": "the", "n_chars": 5, **kwargs}
        with pytest.raises(SamplingError, match=match):
            generate(model, vocab, **args)


# ------------------------------------------------------------------------------ sample.py

def _sample_py(*args, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "sample.py", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, encoding="utf-8", timeout=timeout, env=env)


def test_sample_py_end_to_end_echoes_the_prompt_then_exactly_chars_characters(run_dir, trained):
    done = _sample_py(run_dir / "last.pt", "--prompt", "the ", "--chars", 70, "--seed", 5, "--top-k", 5)
    assert done.returncode == 0, done.stderr
    model, vocab = trained
    expected = "".join(generate(model, vocab, "the ", 70, 0.8, 5, 5, "cpu"))
    assert done.stdout == "the " + expected
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("wrote 70 chars in ")
    # The fixed cost on its own line, apart from the writing rate: load, then the decoder's set-up.
    assert re.fullmatch(r"ready in \d+\.\d\d s: load \d+\.\d\d s, set-up \d+\.\d\d s", lines[-2]), lines
    assert "char/s)" in done.stderr


def test_sample_py_reads_a_run_folder_as_its_best_pt_else_last_pt(run_dir, tmp_path, capsys):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "last.pt").write_bytes((run_dir / "last.pt").read_bytes())
    assert sample_py.resolve_checkpoint(str(folder)) == folder / "last.pt"
    (folder / "best.pt").write_bytes((run_dir / "last.pt").read_bytes())
    assert sample_py.resolve_checkpoint(str(folder)) == folder / "best.pt"
    assert sample_py.main([str(folder), "--chars", "9", "--no-echo", "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert len(out.out) == 9 and f"{folder / 'best.pt'}: step 0" in out.err
    assert sample_py.main([str(tmp_path)]) == 2  # a folder without either
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path}: no best.pt or last.pt in this folder, nor an exported model "
                   "(model.safetensors and config.json)"]


def test_sample_py_flushes_every_character_as_it_is_written(run_dir, monkeypatch, capsys):
    class Recorder:
        def __init__(self):
            self.events = []

        def write(self, text):
            self.events.append(("write", text))

        def flush(self):
            self.events.append(("flush", None))

        def isatty(self):
            return False
    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    assert sample_py.main([str(run_dir / "last.pt"), "--chars", "20", "--prompt", "the"]) == 0
    writes = [i for i, (kind, _) in enumerate(out.events) if kind == "write"]
    assert out.events[0] == ("write", "the")
    assert len(writes) == 21 and all(out.events[i + 1][0] == "flush" for i in writes)
    assert "wrote 20 chars" in capsys.readouterr().err


def _half_file(run_dir, tmp_path):
    data = (run_dir / "last.pt").read_bytes()
    path = tmp_path / "half.pt"
    path.write_bytes(data[:len(data) // 2])
    return path


def _text_file(run_dir, tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("just some notes, not a checkpoint\n")
    return path


def _tensor_file(run_dir, tmp_path):
    path = tmp_path / "tensor.pt"
    torch.save(torch.arange(10), path)
    return path


@pytest.mark.parametrize("make, says", [
    (lambda run_dir, tmp_path: tmp_path / "missing.pt", "no such checkpoint file"),
    (_half_file, "not a torch checkpoint (not a zip archive, or truncated before its end"),
    (_text_file, "not a torch checkpoint (not a zip archive"),
    (_tensor_file, "not a minagi checkpoint"),
], ids=["missing", "truncated", "text-file", "plain-tensor"])
def test_sample_py_bad_checkpoint_is_one_stderr_line_naming_the_file_and_exit_2(run_dir, tmp_path, make, says):
    path = make(run_dir, tmp_path)
    done = _sample_py(path, "--chars", 5)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and says in lines[0], done.stderr
    assert done.stdout == ""


def test_sample_py_prompt_outside_the_vocabulary_is_one_line_naming_the_characters_and_exit_2(run_dir):
    done = _sample_py(run_dir / "last.pt", "--prompt", "the ☃ and é")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --prompt:"), done.stderr
    assert "'☃' x1" in lines[0] and "'é' x1" in lines[0] and done.stdout == ""


@pytest.mark.parametrize("args, says", [(["--chars", "-3"], "--chars: must be >= 0"),
                                        (["--temperature", "-0.1"], "--temperature: must be a finite"),
                                        (["--top-k", "-1"], "--top-k: must be >= 0"),
                                        (["--top-p", "0"], "--top-p: must be a number in (0, 1]"),
                                        (["--top-p", "1.2"], "--top-p: must be a number in (0, 1]"),
                                        (["--chars", "many"], "--chars: expected a whole number")])
def test_sample_py_negative_or_malformed_numbers_exit_2_naming_the_option(run_dir, capsys, args, says):
    with pytest.raises(SystemExit) as exit_:
        sample_py.main([str(run_dir / "last.pt"), *args])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_sample_py_products_without_compile_is_one_line_and_exit_2(run_dir, capsys):
    assert sample_py.main([str(run_dir / "last.pt"), "--products", "off"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --products off shapes the compiled step: add --compile"]


def test_sample_py_window_larger_than_the_context_is_one_line_and_exit_2(run_dir, capsys):
    assert sample_py.main([str(run_dir / "last.pt"), "--window", str(CONTEXT + 1)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: window must be 1..{CONTEXT} (the model's trained context); got {CONTEXT + 1}"]


# ------------------------------------------------------------------------------ sample.py: streams, graphs

def _streams_of(stdout: str, n_streams: int, seed: int) -> list[str]:
    """The texts of sample.py's several-stream output, checking its headers."""
    texts, rest = [], stdout
    for i in range(n_streams):
        header = f"--- stream {i} (seed {seed + i}) ---\n"
        assert rest.startswith(header), rest[:80]
        rest = rest[len(header):]
        end = rest.find("\n--- stream ") if i + 1 < n_streams else len(rest) - 1
        texts.append(rest[:end])
        rest = rest[end + 1:]
    assert rest == ""
    return texts


def test_sample_py_streams_each_equal_writing_alone_with_seed_plus_i(run_dir, trained, capsys):
    model, vocab = trained
    assert sample_py.main([str(run_dir / "last.pt"), "--prompt", "the ", "--chars", "30", "--streams", "3",
                           "--seed", "5", "--top-k", "5"]) == 0
    out = capsys.readouterr()
    for i, text in enumerate(_streams_of(out.out, 3, 5)):
        assert text == "the " + "".join(generate(model, vocab, "the ", 30, 0.8, 5, 5 + i))
    assert out.err.strip().splitlines()[-1].startswith("wrote 3 streams x 30 chars in ")
    assert "char/s in all)" in out.err and ", 3 streams" in out.err and "graphs off" in out.err


def test_sample_py_prompts_file_is_one_stream_per_line(run_dir, trained, tmp_path, capsys):
    model, vocab = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the \r\nTHE END\n0\n", encoding="utf-8")  # \r\n or \n ends a line
    assert sample_py.main([str(run_dir / "last.pt"), "--prompts", str(prompts), "--chars", "25",
                           "--temperature", "0", "--no-echo"]) == 0
    texts = _streams_of(capsys.readouterr().out, 3, 1337)
    for prompt, text in zip(["the ", "THE END", "0"], texts):
        assert text == "".join(generate(model, vocab, prompt, 25, 0.0))


@pytest.mark.parametrize("lines, says", [
    (None, "no such file"),
    ("the\n\nend\n", "line 2 is empty"),
    ("", "holds no prompts"),
    ("the\nthe ☃ and é\n", "line 2: "),
], ids=["missing", "empty-line", "empty-file", "outside-the-vocabulary"])
def test_sample_py_bad_prompts_file_is_one_line_naming_the_file_and_the_line(run_dir, tmp_path, capsys, lines, says):
    path = tmp_path / "prompts.txt"
    if lines is not None:
        path.write_text(lines, encoding="utf-8")
    assert sample_py.main([str(run_dir / "last.pt"), "--prompts", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --prompts {path}: ") and says in err[0], err
    if lines and "☃" in lines:
        assert "'☃' x1" in err[0] and "'é' x1" in err[0]


@pytest.mark.parametrize("args, says", [
    (["--streams", "0"], "argument --streams: must be >= 1, got 0"),
    (["--graphs", "on"], "--graphs on needs a CUDA device (CUDA graphs); this run is on cpu"),
    (["--graphs", "maybe"], "argument --graphs: invalid choice"),
    (["--prompt", "a", "--prompts", "p.txt"], "not allowed with argument"),
], ids=["streams-0", "graphs-on-cpu", "graphs-unknown", "prompt-and-prompts"])
def test_sample_py_bad_stream_or_graph_options_are_one_line_and_exit_2(run_dir, capsys, args, says):
    try:
        code = sample_py.main([str(run_dir / "last.pt"), "--device", "cpu", *args])
    except SystemExit as e:  # argparse's errors
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err


def test_sample_py_streams_must_match_the_prompts_file(run_dir, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_text("a\nb\n", encoding="utf-8")
    assert sample_py.main([str(run_dir / "last.pt"), "--prompts", str(path), "--streams", "3"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: --streams 3 but {path} holds 2 prompts "
                                              f"(one stream per line; leave --streams out)")


def test_sample_py_writes_a_model_with_shared_experts_and_sigmoid_scores(tmp_path, capsys):
    # The static decode step routes by the pool's router_score and adds its shared experts: such a
    # model writes (its text held to the model's own forward in tests/test_decode.py).
    from tiny import run_tiny
    run = run_tiny(tmp_path, None, "pool.shared_experts=1", "pool.router_score=sigmoid", "train.steps=2",
                   "train.eval_every=2", "train.warmup_steps=1")
    assert sample_py.main([str(run.run_dir / "best.pt"), "--chars", "5", "--no-echo"]) == 0
    assert len(capsys.readouterr().out) == 5



def test_sample_py_waits_for_the_compilers_imports_before_it_goes_on_and_says_it_timed_them(run_dir, monkeypatch):
    # sample.py --compile on CUDA loads with the compiler's imports running beside it; it joins them
    # before it compiles (never two threads importing the compiler), and the wait is in the time said.
    import threading
    import time

    from minagi import compile_cache
    done = threading.Event()

    def slow_imports():
        thread = threading.Thread(target=lambda: (time.sleep(0.3), done.set()), daemon=True)
        thread.start()
        return thread

    monkeypatch.setattr(compile_cache, "warm_compiler", slow_imports)
    *_, clock = sample_py._load(run_dir / "last.pt", torch.device("cpu"), True, None)
    assert done.is_set() and clock.load_s >= 0.3 and clock.what == "load and compiler imports"

    def slow_start():  # what warm_compiler does on the caller's thread (dynamo's import) is counted too
        time.sleep(0.4)
        done.set()
        thread = threading.Thread(target=lambda: None)
        thread.start()
        return thread
    monkeypatch.setattr(compile_cache, "warm_compiler", slow_start)
    done.clear()
    *_, clock = sample_py._load(run_dir / "last.pt", torch.device("cpu"), True, None)
    assert done.is_set() and clock.load_s >= 0.4
    done.clear()
    *_, clock = sample_py._load(run_dir / "last.pt", torch.device("cpu"), False, None)
    assert not done.is_set() and clock.what == "load"
