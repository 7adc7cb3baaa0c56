"""minagi/cli.py: every command line reports a bad argument the same way (one line, exit 2), and a
value one command takes the other takes by the same rule (seeds as train.seed)."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minagi import sample as sample_py
from minagi import train as train_py
from minagi.config import RESUMABLE_KEYS, ConfigError, load_config

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command, args", [
    ("train.py", ["--no-such-flag"]),
    ("sample.py", ["x.pt", "--chars", "many"]),
    ("tools/evaluate.py", []),                              # the checkpoint and --data are required
    ("tools/evaluate.py", ["x.pt", "--data", "a.txt", "--batch", "0"]),
    ("tools/sink_report.py", ["x.pt", "--top", "x"]),
    ("tools/sink_report.py", ["x.pt", "--batches", "0"]),
])
def test_a_bad_argument_is_one_stderr_line_and_exit_2(command, args):
    done = subprocess.run([sys.executable, str(REPO / command), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert lines[0].endswith("(see --help)") and done.stdout == ""


def _train_takes(seed: int) -> bool:
    try:
        load_config("cpu_tiny", [f"train.seed={seed}"])
    except ConfigError:
        return False
    return True


def _sample_takes(seed: int, capsys) -> bool:
    try:
        sample_py.parse_args(["x.pt", "--seed", str(seed)])
    except SystemExit as e:
        assert e.code == 2 and "--seed: must be >= 0 and < 2**63" in capsys.readouterr().err
        return False
    return True


@pytest.mark.parametrize("seed", [-1, 0, 1337, 2**63 - 1, 2**63, 2**64])
def test_sample_py_takes_exactly_the_seeds_train_seed_takes(seed, capsys):
    assert _sample_takes(seed, capsys) == _train_takes(seed) == (0 <= seed < 2**63)


def test_the_set_help_names_every_key_a_resume_may_change(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "10000")  # argparse wraps help to the terminal (and at hyphens)
    with pytest.raises(SystemExit):
        train_py.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"on --resume only {', '.join(RESUMABLE_KEYS)}" in help_text


def test_written_text_goes_out_as_utf8_where_windows_would_write_its_code_page(monkeypatch, tmp_path):
    """A redirected stdout on Windows is cp1252: a written character outside it would stop sample.py."""
    import io

    from minagi import cli
    from minagi import evaluate as evaluate_py
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="cp1252")
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(sys, "platform", "win32")
    cli.utf8_stdout()
    print("→ ü", end="")
    stream.flush()
    assert raw.getvalue() == "→ ü".encode("utf-8")
    called = []
    for module in (sample_py, evaluate_py, train_py):
        monkeypatch.setattr(module, "utf8_stdout", lambda name=module.__name__: called.append(name))
    sample_py.main([str(tmp_path / "missing.pt")])
    evaluate_py.main([str(tmp_path / "missing.pt"), "--data", str(tmp_path / "none.txt")])
    train_py.main(["--resume", str(tmp_path / "missing")])
    assert called == ["minagi.sample", "minagi.evaluate", "minagi.train"]


def test_the_readme_names_the_keys_a_resume_may_change_and_no_other():
    """Both ways: a key dropped from RESUMABLE_KEYS (a resume the README promises, refused) fails too."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    sentence = readme[readme.index("On `--resume`\nonly what changes no weight may be set"):]
    sentence = sentence[:sentence.index(".\n")]
    assert re.findall(r"`([a-z_]+\.[a-z_]+)`", sentence) == list(RESUMABLE_KEYS)


def test_after_an_interrupted_run_says_so_the_process_lets_a_second_ctrl_c_go(monkeypatch, capsys):
    """A second Ctrl-C after the save broke torch's exit handlers with a traceback; when main() owns the
    process (its command line, argv None) it ignores SIGINT on its way out, and only then."""
    import signal

    def interrupted(args, argv, entry):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_py, "_main", interrupted)
    monkeypatch.setattr(sys, "argv", ["train.py", "--profile", "cpu_tiny"])
    before = signal.getsignal(signal.SIGINT)
    try:
        assert train_py.main(["--profile", "cpu_tiny"]) == 130  # in-process (tests, a library): left alone
        assert signal.getsignal(signal.SIGINT) is before
        assert train_py.main() == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert "interrupted before training began" in capsys.readouterr().err


def test_a_data_error_of_the_profiles_path_names_the_profile(tmp_path, capsys):
    """A first try with someone's profile: its data.path matches nothing here, and the message says the
    path came from the profile (the user never typed it), not from --data."""
    profile = tmp_path / "theirs.toml"
    profile.write_text('[data]\npath = "nowhere/*.txt"\n[train]\nsteps = 5\nwarmup_steps = 1\n')
    assert train_py.main(["--profile", str(profile), "--set", f"train.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matched no files" in err
    assert err.rstrip().endswith(f"(data.path of the profile {profile}; --data PATH trains on another)")
    assert train_py.main(["--profile", str(profile), "--data", str(tmp_path / "none*.txt"),
                          "--set", f"train.out_dir={tmp_path}"]) == 2
    assert "data.path of the profile" not in capsys.readouterr().err  # --data: the user's own path
    assert train_py.main(["--profile", str(profile), "--set", f"data.path = {tmp_path / 'none*.txt'}",
                          "--set", f"train.out_dir={tmp_path}"]) == 2
    assert "data.path of the profile" not in capsys.readouterr().err  # --set, spaced as --set allows


_HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, "tools")  # as `python tools/X.py` has it: a tool may import its neighbour
out = {}
for tool in sys.argv[1:]:
    buffer, code = io.StringIO(), 0
    sys.argv = [f"tools/{tool}", "--help"]
    with contextlib.redirect_stdout(buffer):
        try:
            runpy.run_path(f"tools/{tool}", run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out[tool] = [code, buffer.getvalue()]
print(json.dumps(out))
"""


def test_every_tool_answers_help_with_its_whole_first_paragraph():
    """--help exits 0 and says what the tool is in whole sentences (four cut theirs at the first line;
    without_triton ran "--help" as a script; routing_report exited 2). One process for all of them."""
    import json
    repo = Path(__file__).resolve().parent.parent
    tools = sorted(p.name for p in (repo / "tools").glob("*.py"))
    done = subprocess.run([sys.executable, "-c", _HELP_OF_EACH, *tools], cwd=repo, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    for tool in tools:
        code, text = answers[tool]
        assert code == 0, (tool, text[-300:])
        doc = ast.get_docstring(ast.parse((repo / "tools" / tool).read_text(encoding="utf-8"))) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        if "entry point of" not in first:  # a thin entry point (tools/evaluate.py) shows its module's text
            assert first and first in " ".join(text.split()), (tool, first)
