"""minagi/devices.py: a device asked for and missing is one line saying why; the allocator settings
reach every name torch reads; the CPU's memory figures."""
import os
import sys
import types
import warnings

import pytest
import torch

from minagi import devices
from minagi.runlog import HISTORY_FIELDS


@pytest.mark.parametrize("cuda, hip, why", [
    (None, None, "is a CPU-only build)"),
    ("12.8", None, "is built for CUDA 12.8 but sees no GPU: no driver, or CUDA_VISIBLE_DEVICES hides them)"),
    (None, "6.4", "is built for ROCm 6.4 but sees no GPU"),
])
def test_cuda_requested_without_cuda_is_a_one_line_error_saying_why(monkeypatch, cuda, hip, why):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip)
    with pytest.raises(devices.DeviceError) as err:
        devices.choose_device("cuda")
    msg = str(err.value)
    assert msg.startswith(f"train.device=cuda but no CUDA device is available (torch {torch.__version__} ")
    assert why in msg and msg.endswith("; use train.device=cpu or auto") and "\n" not in msg
    assert devices.choose_device("auto").type == "cpu"


def test_alloc_conf_is_set_under_every_name_torch_reads_and_warns_on_windows(monkeypatch):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # earlier GPU tests may have
    assert devices.apply_alloc_conf("") == []
    assert "PYTORCH_ALLOC_CONF" not in os.environ
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = devices.apply_alloc_conf("expandable_segments:True")
    assert {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"} <= set(names)
    assert all(os.environ[n] == "expandable_segments:True" for n in names)
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.warns(UserWarning, match="expandable_segments is ignored by PyTorch on Windows"):
        devices.apply_alloc_conf("expandable_segments:True")


def test_cpu_memory_stats_are_none_beside_the_resident_memory():
    stats = devices.memory_stats(torch.device("cpu"))
    assert set(stats) <= set(HISTORY_FIELDS)
    assert stats["mem_peak_reserved"] is None and stats["alloc_retries"] is None
    assert stats["rss_bytes"] > 10 * 2**20


def test_rss_on_windows_is_the_working_set_from_kernel32(monkeypatch):
    """No /proc and no `resource` there: the history's rss_bytes came back None on Windows."""
    import builtins
    import ctypes
    real_open = builtins.open

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc/"):
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    class Function:  # a foreign function as ctypes gives it, with Windows x64's argument rules
        def __init__(self, body):
            self.body, self.argtypes, self.restype = body, None, None

        def __call__(self, *args):
            if self.argtypes is None and any(isinstance(a, int) and not -2**31 <= a < 2**31 for a in args):
                raise ctypes.ArgumentError("argument 1: OverflowError: int too long to convert")  # C long is 32-bit
            return self.body(*args)

    def memory_info(handle, counters_ref, size):
        counters = counters_ref._obj
        assert handle == 2**64 - 1 and size == ctypes.sizeof(counters) == counters.cb
        counters.WorkingSetSize = 123 * 2**20
        return 1
    kernel32 = types.SimpleNamespace(GetCurrentProcess=Function(lambda: 2**64 - 1),  # the pseudo-handle -1, as HANDLE
                                     K32GetProcessMemoryInfo=Function(memory_info))
    monkeypatch.setattr(builtins, "open", no_proc)
    monkeypatch.setattr(sys, "platform", "win32")
    monkeypatch.setattr(ctypes, "WinDLL", lambda name: kernel32 if name == "kernel32" else None, raising=False)
    assert devices.rss_bytes() == 123 * 2**20
    kernel32.K32GetProcessMemoryInfo = Function(lambda *a: 0)
    assert devices.rss_bytes() is None  # the call failed: no figure rather than a wrong one


def test_host_syncs_counts_sync_warnings_only_not_the_modes_own_notice(monkeypatch):
    """torch's sync debug mode warns "called a synchronizing CUDA operation" at each sync, and once a
    process, on being set, that it "does not yet detect all synchronizing operations": one sync
    in the step is one, not two (what bench_train counted until session 7)."""
    mode = {"now": "default"}

    def set_mode(m):
        if m == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet detect all "
                          "synchronizing operations")
        mode["now"] = m

    def step():
        warnings.warn("some other warning")
        if mode["now"] == "warn":
            warnings.warn(devices.SYNC_WARNING)  # the loss read

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    sites = devices.host_syncs(step)
    assert len(sites) == 1 and sites[0].startswith(__file__) and mode["now"] == "default"


def test_host_syncs_off_cuda_runs_the_call_and_counts_none(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    assert devices.host_syncs(lambda: ran.append(1)) == [] and ran == [1]
