"""Atomic file replacement: a reader sees the old file or the new one, never half of either.

`atomic_write(path, write)` calls `write(tmp)` on `<name>.tmp-<pid>-<random>` beside `path`, fsyncs it
(durable writes), renames it over `path` and fsyncs the directory; the temporary file never outlives
a failure, Ctrl-C included. The pid in the name lets a later run recognise temporary files of dead
processes (`stale_temp_files`).
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

__all__ = ["atomic_write", "fsync_dir", "pid_alive", "stale_temp_files", "temp_path"]

_TEMP_RE = re.compile(r"\.tmp-(\d+)(-[0-9a-f]+)?$")


def temp_path(path: Path) -> Path:
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")


def fsync_dir(directory: Path) -> None:
    """Make a rename in `directory` durable. Directories cannot be opened on Windows: skipped there."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass        # some filesystems (e.g. network mounts) refuse fsync on a directory
    finally:
        os.close(fd)


# The process's umask, read once at import (reading it means setting it): what a plain open() leaves.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None], durable: bool = True) -> None:
    """write(tmp) beside `path`, then rename tmp over `path`. `durable`: fsync the file and the
    directory (a cache that can be rebuilt may skip it). `write` must create the file at `tmp`; it gets
    the permissions a plain open() gives, whatever `write` made (safetensors makes its files 0600: an
    exported model others could not read)."""
    path = Path(path)
    tmp = temp_path(path)
    try:
        write(tmp)
        _usual_permissions(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        _replace(tmp, path)
        # rename(2) of a hard link over another link of the same file does nothing and succeeds
        # (best.pt made again from its own last.pt): the temporary name would stay behind.
        tmp.unlink(missing_ok=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def _usual_permissions(tmp: Path) -> None:
    try:
        os.chmod(tmp, 0o666 & ~_UMASK)
    except OSError:
        pass  # a filesystem without modes (some network or Windows mounts): the file is written all the same


# Windows refuses to replace a file another process holds open (sample.py or evaluate.py reading a live
# run's best.pt, an antivirus scanning the new file): retried over ~10 s there before it is an error.
_WINDOWS_RETRIES = (0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 4.0)


def _replace(tmp: Path, path: Path) -> None:
    for delay in _WINDOWS_RETRIES if sys.platform == "win32" else ():
        try:
            os.replace(tmp, path)
            return
        except PermissionError:
            time.sleep(delay)
    os.replace(tmp, path)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (True when this platform cannot tell: its files are then kept)."""
    if pid == os.getpid():
        return True
    if sys.platform == "win32":  # os.kill(pid, 0) would send Ctrl-C there
        return _windows_pid_alive(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def _windows_pid_alive(pid: int) -> bool:
    import ctypes
    kernel32 = ctypes.windll.kernel32
    handle = kernel32.OpenProcess(0x1000, False, pid)  # PROCESS_QUERY_LIMITED_INFORMATION
    if not handle:
        return ctypes.GetLastError() == 5  # access denied: it exists
    try:
        code = ctypes.c_ulong()
        kernel32.GetExitCodeProcess(handle, ctypes.byref(code))
        return code.value == 259  # STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def stale_temp_files(directory: Path) -> list[Path]:
    """Temporary files in `directory` left by processes that no longer run (a kill mid-write)."""
    if not directory.is_dir():
        return []
    stale = []
    for p in directory.iterdir():
        m = _TEMP_RE.search(p.name)
        if m and p.is_file() and not pid_alive(int(m.group(1))):
            stale.append(p)
    return sorted(stale)
