"""minagi/runlog.py: a run owns its folder (the lock), a kill leaves nothing that a later run trips on
(stale temporary files, a history record cut off after its checkpoint), a full disk is one line.

Most of it goes through train.py's main(), as a user would meet it; the processes that hold or die
holding a folder are real ones (a forked child, a subprocess killed with SIGKILL).
"""
import errno
import io
import json
import multiprocessing
import os
import platform
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minagi import train as train_py
from minagi import checkpoint, runlog
from minagi.checkpoint import load_checkpoint
from minagi.runlog import HISTORY_FIELDS, History, RunFolder, read_history
from tiny import run_tiny, tiny_argv

REPO = Path(__file__).resolve().parent.parent


def _temp_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp-" in p.name) if folder.exists() else []


# ------------------------------------------------------------------------------ the lock

def _hold(folder: Path, ready) -> None:
    """A forked child: claim the folder, leave what a kill in the middle of writing run.json leaves,
    then wait to be killed."""
    RunFolder(folder).claim()
    (folder / f"run.json.tmp-{os.getpid()}-0badc0de").write_text('{"profile": ')
    ready.set()
    signal.pause()


def test_a_second_run_of_a_folder_is_one_line_naming_it_and_its_process_until_a_kill_frees_it(
        tmp_path, data_path, capsys):
    folder = tmp_path / "runs" / "same"
    argv = tiny_argv(tmp_path, data_path, run_name="same")
    fork = multiprocessing.get_context("fork")  # the child only takes a lock: no torch work after the fork
    ready = fork.Event()
    holder = fork.Process(target=_hold, args=(folder, ready), daemon=True)
    holder.start()
    try:
        assert ready.wait(60)
        assert train_py.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"error: {folder}: another run is training in this folder (pid {holder.pid} on "
                       f"{platform.node()}); wait for it to end, or choose another --run-name"]
        assert sorted(p.name for p in folder.iterdir()) == ["run.json.tmp-%d-0badc0de" % holder.pid, "run.lock"]
    finally:
        holder.kill()  # SIGKILL: no chance to let go of anything itself
        holder.join()
    assert holder.exitcode == -signal.SIGKILL
    # The system released the dead process's lock; this run removes what it left at start.
    assert train_py.main(argv) == 0
    out = capsys.readouterr().out
    assert f"removed 1 temporary file(s) that a stopped run left: run.json.tmp-{holder.pid}-0badc0de" in out
    assert _temp_files(folder) == [] and [r["step"] for r in read_history(folder / "history.jsonl")] == [3, 6]


def test_a_run_claims_its_folder_before_reading_it_and_lets_go_when_it_ends_or_fails(tmp_path, data_path,
                                                                                     monkeypatch):
    from minagi import trainer
    from minagi.config import ConfigError
    done = run_tiny(tmp_path, data_path)
    extended, profile = trainer.resume_config(done.run_dir, ["train.steps=8"])
    reads = []
    real_load = checkpoint.load_checkpoint
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: reads.append(a) or real_load(*a, **k))
    held = RunFolder(done.run_dir)
    held.claim()  # as another process would: flock locks an open file, whoever opened it
    try:
        with pytest.raises(runlog.RunFolderError, match="another run is training in this folder"):
            run_tiny(tmp_path, data_path, run_name="run")  # a fresh run of the same name
        with pytest.raises(runlog.RunFolderError, match="another run is training in this folder"):
            trainer.train(extended, profile, done.run_dir, progress=False, log=lambda m: None)
        assert reads == []  # last.pt was not read under another process's feet
    finally:
        held.close()
    with pytest.raises(ConfigError, match="already at step 6"):  # a failed start lets go too
        trainer.train(trainer.resume_config(done.run_dir)[0], profile, done.run_dir, progress=False,
                      log=lambda m: None)
    assert trainer.train(extended, profile, done.run_dir, progress=False, log=lambda m: None).step == 8
    again = RunFolder(done.run_dir)
    again.claim()  # the run let go of its folder when it ended
    again.close()


def test_a_start_that_fails_before_writing_leaves_no_empty_run_folder(tmp_path, capsys):
    argv = tiny_argv(tmp_path, tmp_path / "no-such.txt", run_name="typo")
    assert train_py.main(argv) == 2
    assert "no-such.txt" in capsys.readouterr().err and not (tmp_path / "runs" / "typo").exists()


# ------------------------------------------------------------------------------ a kill mid-evaluation

KILLED = '''
import os, signal, sys
from pathlib import Path
sys.path[:0] = [{repo!r}, {tests!r}]
from tiny import run_tiny
real_replace = os.replace

def replace(src, dst):
    if str(dst).endswith("best.pt"):  # last.pt (with its record) is in place; best.pt and the history line are not
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)

os.replace = replace
run_tiny(Path(sys.argv[1]), Path(sys.argv[2]), "train.eval_every=2", run_name="killed")
'''


def test_after_a_kill_between_checkpoint_and_history_a_resume_restores_the_record_and_removes_the_temp_file(
        tmp_path, data_path, capsys):
    full = run_tiny(tmp_path, data_path, "train.eval_every=2", run_name="full")
    script = KILLED.format(repo=str(REPO), tests=str(REPO / "tests"))
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(data_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    folder = tmp_path / "runs" / "killed"
    assert load_checkpoint(folder / "last.pt")["record"]["step"] == 2
    assert read_history(folder / "history.jsonl") == []            # the record was cut off
    assert [n.split(".tmp-")[0] for n in _temp_files(folder)] == ["best.pt"]  # and best.pt half made

    assert train_py.main(["--resume", str(folder)]) == 0  # the dead process's lock is no obstacle
    out = capsys.readouterr().out
    assert "removed 1 temporary file(s) that a stopped run left: best.pt.tmp-" in out
    assert "history: appended the record of step 2 that a stop had cut off" in out
    assert _temp_files(folder) == []
    cut, ref = read_history(folder / "history.jsonl"), read_history(full.run_dir / "history.jsonl")
    assert [r["step"] for r in cut] == [r["step"] for r in ref] == [2, 4, 6]
    for a, b in zip(cut, ref):
        for key in ("train_loss", "aux_loss", "grad_norm", "heldout_loss", "lr", "chars_seen"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)
        assert [row["load"] for row in a["sinks"]] == [row["load"] for row in b["sinks"]]
    assert load_checkpoint(folder / "best.pt")["step"] == load_checkpoint(full.run_dir / "best.pt")["step"]


# ------------------------------------------------------------------------------ a full disk

class _FullDisk(io.FileIO):
    """A file on a disk with `room` bytes left: a write past them fails as the kernel's would."""

    def __init__(self, path, mode: str, room: int):
        super().__init__(path, mode)
        self.room = room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return super().write(data)


def _fill_disk(monkeypatch, module, name: str, room: int, after: int = 0) -> None:
    """From the `after`+1-th file `module` opens for writing whose name starts with `name`, the disk is full."""
    opened = [0]

    def opening(file, mode="r", *args, **kwargs):
        if Path(file).name.startswith(name) and mode[0] in "wa":
            opened[0] += 1
            if opened[0] > after:
                raw = io.BufferedWriter(_FullDisk(file, mode[0], room))
                return raw if "b" in mode else io.TextIOWrapper(raw, encoding=kwargs.get("encoding"))
        return open(file, mode, *args, **kwargs)
    monkeypatch.setattr(module, "open", opening, raising=False)


@pytest.mark.parametrize("where, module, name, room, after", [
    ("run.json", runlog, "run.json", 0, 0),               # at start: nothing written yet
    ("last.pt", checkpoint, "last.pt", 0, 1),             # the second checkpoint: torch.save's own OSError
    ("last.pt", checkpoint, "last.pt", 5000, 1),          # ... or its RuntimeError, raised while handling it
    ("history.jsonl", runlog, "history.jsonl", 0, 0),     # the first record
])
def test_a_full_disk_is_one_line_naming_the_file_exit_2_and_leaves_the_last_good_checkpoint_and_no_temp_file(
        tmp_path, data_path, monkeypatch, capsys, where, module, name, room, after):
    argv = tiny_argv(tmp_path, data_path, "train.eval_every=2", run_name="full")
    folder = tmp_path / "runs" / "full"
    with monkeypatch.context() as m:
        _fill_disk(m, module, name, room, after)
        assert train_py.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {folder / where}: cannot write: no space left on device"), err
    assert _temp_files(folder) == []
    if where == "run.json":  # nothing was written: the folder it made is gone again
        assert not folder.exists()
    if where == "last.pt":
        assert err[0].endswith(f"{folder / 'last.pt'} keeps the last good checkpoint (step 2)")
        assert load_checkpoint(folder / "last.pt")["step"] == 2
    if where == "history.jsonl":  # last.pt carries the record the disk refused: the resume writes it
        assert load_checkpoint(folder / "last.pt")["step"] == 2 and read_history(folder / "history.jsonl") == []
        assert train_py.main(["--resume", str(folder)]) == 0
        assert [r["step"] for r in read_history(folder / "history.jsonl")] == [2, 4, 6]


class _OsOfAFullDisk:
    """runlog's `os`, on a disk with no room left: os.write fails (the lock's pid) as the kernel's would."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_at_the_lock_write_is_one_line_and_leaves_no_folder_behind(tmp_path, data_path, monkeypatch,
                                                                               capsys):
    argv = tiny_argv(tmp_path, data_path, run_name="full")
    folder = tmp_path / "runs" / "full"
    with monkeypatch.context() as m:
        m.setattr(runlog, "os", _OsOfAFullDisk())
        assert train_py.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {folder / 'run.lock'}: cannot write: no space left on device"]
    assert not (tmp_path / "runs").exists()  # neither the run folder nor the out_dir it made
    assert train_py.main(argv) == 0
    before = sorted(p.name for p in folder.iterdir())
    with monkeypatch.context() as m:  # a resume on a full disk: the run's folder and its run.lock stay
        m.setattr(runlog, "os", _OsOfAFullDisk())
        assert train_py.main(["--resume", str(folder), "--set", "train.steps=8"]) == 2
    assert sorted(p.name for p in folder.iterdir()) == before and "run.lock" in before


# ------------------------------------------------------------------------------ the directory fsync

def test_a_checkpoint_write_fsyncs_its_directory_after_the_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync dir" if stat.S_ISDIR(st.st_mode) else "fsync file", st.st_ino))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", Path(dst).name))
        return real_replace(src, dst)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    checkpoint.save_checkpoint(tmp_path / "last.pt", {"step": 1, "w": torch.ones(2)})
    renamed = events.index(("rename", "last.pt"))
    assert ("fsync dir", tmp_path.stat().st_ino) in events[renamed + 1:], events
    assert [e[0] for e in events[:renamed]] == ["fsync file"]  # the data itself before the rename


def test_run_json_records_the_corpus_that_identifies_the_run(tmp_path, data_path):
    done = run_tiny(tmp_path, data_path)
    info = json.loads((done.run_dir / "run.json").read_text())
    last = load_checkpoint(done.run_dir / "last.pt")
    assert info["corpus"] == last["corpus"]
    corpus = info["corpus"]
    text = data_path.read_text()
    assert corpus["files"] == 1 and corpus["heldout_files"] == [] and corpus["vocab_size"] == len(set(text))
    assert corpus["train_chars"] + corpus["heldout_chars"] == len(text)
    assert corpus["heldout_chars"] == len(text) - int(len(text) * 0.9) and len(corpus["content_key"]) == 32


def test_history_cuts_a_torn_last_line_off_and_continues(tmp_path):
    path = tmp_path / "history.jsonl"
    record = dict.fromkeys(HISTORY_FIELDS, 1)
    with History(path) as h:
        h.append(record)
    with open(path, "a") as f:
        f.write('{"step": 2, "chars_se')  # a crash mid-line
    with History(path) as h:
        h.append({**record, "step": 3})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]  # as jq reads it
    assert [r["step"] for r in read_history(path)] == [1, 3]
    path.write_text('{"step": 1, "chars')  # the only line, torn
    History(path).close()
    assert path.read_text() == ""


def test_an_older_runs_torn_line_kept_on_its_own_line_still_reads_back_without_it(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text(json.dumps({"step": 1}) + '\n{"step": 2, "chars_se\n' + json.dumps({"step": 3}) + "\n")
    assert [r["step"] for r in read_history(path)] == [1, 3]


@pytest.mark.parametrize("cut_after", ['"load": [3, 1]}', '"load": [3', '"ste', '"mfu": nu', '"lr": -1.5e', '"lr": -'])
def test_a_record_torn_anywhere_is_skipped_and_a_broken_whole_line_is_an_error(tmp_path, cut_after):
    """Torn just after a nested object's "}", the line ends as a whole record does: what tells them
    apart is where the JSON stops making sense (at the end: torn; before it: broken)."""
    path = tmp_path / "history.jsonl"
    whole = json.dumps({"step": 2, "sinks": [{"row": 0, "load": [3, 1]}], "mfu": None, "lr": -1.5e-05})
    torn = whole[:whole.index(cut_after) + len(cut_after)]
    path.write_text(json.dumps({"step": 1}) + "\n" + torn)
    assert [r["step"] for r in read_history(path)] == [1]
    path.write_text(json.dumps({"step": 1}) + "\n" + torn + "\n" + json.dumps({"step": 3}) + "\n")
    assert [r["step"] for r in read_history(path)] == [1, 3]
    path.write_text(json.dumps({"step": 1}) + "\n" + whole.replace(', "mfu"', ',, "mfu"') + "\n")
    with pytest.raises(ValueError, match=r"history.jsonl:2: not a history record"):
        read_history(path)


def test_a_history_that_is_not_utf8_text_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.jsonl: not a history \(not UTF-8 text: byte 3\)$"):
        read_history(path)


class _Killed(BaseException):
    """A kill, as far as this process's Python goes: no handler catches it, only `finally` blocks run."""


def test_a_history_line_torn_by_a_kill_is_cut_off_on_resume_and_its_record_restored(tmp_path, data_path,
                                                                                     monkeypatch, capsys):
    full = run_tiny(tmp_path, data_path, "train.eval_every=2", run_name="full")
    real_append = History.append

    def tearing(self, record):
        if record["step"] == 4:  # half the line on disk, then the kill
            self._f.write(json.dumps(record)[:40])
            self._f.flush()
            raise _Killed
        real_append(self, record)
    with monkeypatch.context() as m:
        m.setattr(History, "append", tearing)
        with pytest.raises(_Killed):
            run_tiny(tmp_path, data_path, "train.eval_every=2", run_name="torn")
    folder = tmp_path / "runs" / "torn"
    assert not (folder / "history.jsonl").read_text().endswith("\n")
    assert load_checkpoint(folder / "last.pt")["record"]["step"] == 4

    assert train_py.main(["--resume", str(folder)]) == 0
    assert "history: appended the record of step 4 that a stop had cut off" in capsys.readouterr().out
    cut = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]  # every line is JSON
    ref = read_history(full.run_dir / "history.jsonl")
    assert [r["step"] for r in cut] == [r["step"] for r in ref] == [2, 4, 6]
    for a, b in zip(cut, ref):
        for key in ("train_loss", "aux_loss", "grad_norm", "heldout_loss", "lr", "chars_seen"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (a["step"], key)


class _Windows:
    """runlog as on Windows: run.lock locked through msvcrt (recorded), and an open file not deletable."""

    def __init__(self, monkeypatch):
        self.calls, self.open = [], set()
        fake = type(sys)("msvcrt")
        fake.LK_NBLCK, fake.LK_UNLCK = "lock", "unlock"
        fake.locking = lambda fd, mode, n: self.calls.append((mode, fd))
        monkeypatch.setitem(sys.modules, "msvcrt", fake)
        monkeypatch.setattr(runlog.sys, "platform", "win32")
        real_open, real_close, real_unlink = os.open, os.close, Path.unlink

        def opened(path, *args):
            fd = real_open(path, *args)
            self.open.add((fd, Path(path).name))
            return fd

        def closed(fd):
            self.calls.append(("close", fd))
            self.open = {(f, n) for f, n in self.open if f != fd}
            real_close(fd)

        def unlink(path, missing_ok=False):
            if any(name == path.name for _, name in self.open):
                raise PermissionError(13, "The process cannot access the file because it is being used", str(path))
            real_unlink(path, missing_ok=missing_ok)
        monkeypatch.setattr(runlog.os, "open", opened)
        monkeypatch.setattr(runlog.os, "close", closed)
        monkeypatch.setattr(Path, "unlink", unlink)


def test_on_windows_a_failed_start_unlocks_then_removes_its_folder(tmp_path, monkeypatch):
    """Windows deletes no file held open, and frees a lock dropped at close only eventually: the lock
    is undone, the descriptor closed, then run.lock and the folder removed."""
    windows = _Windows(monkeypatch)
    folder = RunFolder(tmp_path / "runs" / "bad-data")
    folder.claim()
    fd = folder._lock_fd
    folder.close(discard_if_empty=True)
    assert windows.calls == [("lock", fd), ("unlock", fd), ("close", fd)]
    assert not (tmp_path / "runs" / "bad-data").exists()
