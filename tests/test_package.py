"""minagi as a package: pyproject.toml's dependencies are requirements.txt's, `python -m minagi.*` runs from a
clone, and `pip install .` into a fresh venv gives console commands that train from another directory,
profiles found inside the installed package."""
import importlib
import importlib.util
import json
import os
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from tiny import TINY

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
COMMANDS = {"minagi-train": "minagi.train", "minagi-sample": "minagi.sample", "minagi-eval": "minagi.evaluate",
            "minagi-export": "minagi.export"}


def test_the_packages_dependencies_are_requirements_txts_and_pytest_is_the_dev_extra():
    lines = [line.split("#")[0].strip() for line in (REPO / "requirements.txt").read_text().splitlines()]
    required = {line.replace('"', "'") for line in lines if line}
    project = PYPROJECT["project"]
    assert set(project["dependencies"]) | {"pytest"} == required
    assert project["optional-dependencies"] == {"plot": ["matplotlib"], "tensorboard": ["tensorboard"],
                                                "safetensors": ["safetensors"], "dev": ["pytest"]}


def test_each_console_command_names_a_main_of_the_package():
    assert {name: target.split(":")[0] for name, target in PYPROJECT["project"]["scripts"].items()} == COMMANDS
    for target in PYPROJECT["project"]["scripts"].values():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target


def test_every_shipped_profile_is_package_data():
    data = PYPROJECT["tool"]["setuptools"]
    assert data["package-dir"] == {"minagi.profiles": "profiles"} and "minagi.profiles" in data["packages"]
    assert data["package-data"] == {"minagi.profiles": ["*.toml"]} and list((REPO / "profiles").glob("*.toml"))


POSIX_ONLY = ("resource", "fcntl", "pwd", "grp", "termios", "tty", "posix")


def test_every_module_imports_and_trains_where_windows_lacks_posix_modules(tmp_path, data_path):
    """Windows (the Radeon 8060S's ROCm) has no `resource`, `fcntl`, ...: hidden, every minagi module
    imports, and a short run trains (its history records the resident memory)."""
    hide = "; ".join(f"sys.modules[{name!r}] = None" for name in POSIX_ONLY)
    # The standard library's own modules take their POSIX branch on this machine (shutil imports
    # posix where os.name is "posix"): imported first, as Windows imports them on its branch.
    script = (f"import sys, shutil, tempfile; {hide}\n"
              "import importlib, importlib.util, pkgutil, minagi\n"
              "triton = importlib.util.find_spec('triton') is not None\n"
              "for m in pkgutil.iter_modules(minagi.__path__):\n"
              "    if triton or not m.name.endswith('_triton'):  # Triton's kernels: imported where it is\n"
              "        importlib.import_module('minagi.' + m.name)\n"
              "del sys.modules['fcntl']  # run.lock takes the platform's own branch (msvcrt on Windows)\n"
              "from minagi import train\n"
              f"sys.exit(train.main(['--profile', 'cpu_tiny', '--data', {str(data_path)!r}, '--set', 'train.steps=2', "
              f"'--set', 'train.eval_every=2', '--set', 'train.warmup_steps=1', '--set', 'train.eval_batches=1', "
              f"'--set', 'train.out_dir={tmp_path.as_posix()}', '--set', 'train.run_name=win']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "win" / "history.jsonl").read_text().splitlines()[-1])
    assert record["rss_bytes"] > 0


@pytest.mark.parametrize("module", ["minagi.train", "minagi.sample", "minagi.evaluate", "minagi.export"])
def test_python_m_runs_each_main_from_a_clone(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage: ") and done.stderr == "", done.stderr


def test_python_m_minagi_train_launches_its_ranks_as_the_module_and_train_py_as_its_script(tmp_path, data_path,
                                                                                              monkeypatch):
    """--nproc-per-node: `python -m minagi.train` / minagi-train launch torchrun's -m minagi.train; train.py
    itself (tests/test_ddp.py trains two ranks so)."""
    from minagi import distributed
    from minagi import train as train_py
    launched = []
    monkeypatch.setattr(distributed, "launch_local", lambda *args, **kwargs: launched.append((args, kwargs)) or 0)
    argv = ["--nproc-per-node", "2", "--data", str(data_path), *[a for s in TINY for a in ("--set", s)]]
    assert train_py.main(argv) == 0 and train_py.main(argv, entry=str(REPO / "train.py")) == 0
    assert launched == [((2, "minagi.train", argv), {"module": True}), ((2, str(REPO / "train.py"), argv), {})]


def test_launching_a_module_hands_torchrun_its_m(monkeypatch):
    from torch.distributed import run as torchrun

    from minagi import distributed
    seen = []
    monkeypatch.setattr(torchrun, "run", seen.append)
    assert distributed.launch_local(2, "minagi.train", ["--profile", "cpu_tiny"], module=True) == 0
    assert distributed.launch_local(2, "train.py", ["--profile", "cpu_tiny"]) == 0
    (as_module, as_script) = seen
    assert as_module.module and as_module.training_script == "minagi.train"
    assert as_module.training_script_args == ["--profile", "cpu_tiny"] and as_module.nproc_per_node == "2"
    assert not as_script.module and as_script.training_script == "train.py"


# ------------------------------------------------------------------------------ the install


def _outer_site_packages() -> list[str]:
    """Where this Python finds torch, numpy, tqdm (and setuptools): the new venv reads them from there
    (a .pth file), so the install test does not download or copy 750 MB of torch."""
    dirs = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]  # .pth-added ones too
    dirs += list(site.getsitepackages()) + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


# What pip says when this machine, not minagi, is why the install cannot run: no index to fetch the build
# backend from, or a pip older than 22.3 (no --python). Any other failure fails the test.
_CANNOT_INSTALL_HERE = ("No matching distribution found", "Could not find a version", "NewConnectionError",
                        "no such option: --python", "Network is unreachable")


def _pip_install(python: Path, source: Path) -> subprocess.CompletedProcess:
    # Built offline with this Python's setuptools where it can build a wheel by itself (70.1 and later
    # have bdist_wheel), else in pip's isolated build environment, which fetches setuptools from the index.
    offline = importlib.util.find_spec("setuptools") is not None and \
        importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
    flags = ["--no-deps", *(["--no-build-isolation", "--no-index"] if offline else [])]
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                           "--disable-pip-version-check", *flags, str(source)], capture_output=True, text=True,
                          timeout=300)


def _copy_source(to: Path) -> Path:
    """What an sdist holds (so the build writes build/ and *.egg-info there, not in the clone)."""
    import shutil
    to.mkdir()
    for name in ("minagi", "profiles"):
        shutil.copytree(REPO / name, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, to / name)
    return to


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv (no minagi, the outer packages readable) with `pip install .` done: its bin folder."""
    root = tmp_path_factory.mktemp("install")
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "outer_site_packages.pth").write_text("\n".join(_outer_site_packages()) + "\n")
    done = _pip_install(python, _copy_source(root / "source"))
    if done.returncode != 0 and any(sign in done.stderr for sign in _CANNOT_INSTALL_HERE):
        pytest.skip(f"pip cannot build here without the network or a newer pip: {done.stderr.strip()[-200:]}")
    assert done.returncode == 0, done.stderr
    return python.parent


def _run(bin_dir: Path, command: list[str], cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(OMP_NUM_THREADS="2", PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run([str(bin_dir / command[0]), *command[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_pip_install_then_minagi_train_from_another_directory(installed, tmp_path, data_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = _run(installed, ["python", "-c", "import minagi, minagi.config as c; print(minagi.__file__); "
                                             "print(c.PROFILES_DIR)"], elsewhere)
    package, profiles = map(Path, where.stdout.split())
    assert installed.parent in package.parents and profiles == package.parent / "profiles", where.stdout
    assert (profiles / "cpu_tiny.toml").is_file()
    done = _run(installed, ["minagi-train", "--profile", "cpu_tiny", "--set", "train.steps=20", "--data",
                            str(data_path), "--set", f"data.cache_dir={tmp_path / 'cache'}", "--run-name", "pkg"],
                elsewhere)
    assert done.returncode == 0, done.stderr
    assert "final held-out:" in done.stdout and "run folder runs/pkg" in done.stdout
    info = json.loads((elsewhere / "runs" / "pkg" / "run.json").read_text())
    assert info["profile"] == "cpu_tiny" and info["config"]["train"]["steps"] == 20
    assert info["git_commit"] is None and info["minagi"] == importlib.import_module("minagi").__version__
    assert info["command"][1].endswith("minagi-train")
    wrote = _run(installed, ["minagi-sample", "runs/pkg", "--chars", "30", "--no-echo"], elsewhere)
    assert wrote.returncode == 0 and len(wrote.stdout) == 30, wrote.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [[name, "--help"] for name in COMMANDS] +
                         [["python", "-m", "minagi.train", "--help"], ["python", "-m", "minagi.sample", "--help"]],
                         ids=[*COMMANDS, "python-m-minagi.train", "python-m-minagi.sample"])
def test_the_installed_commands_answer_help_from_another_directory(installed, tmp_path, command):
    done = _run(installed, command, tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("usage: "), done.stderr
