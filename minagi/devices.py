"""Device choice, allocator configuration, autocast and memory figures for the training loop.

`apply_alloc_conf` is the one place under minagi/ that writes the environment (besides the
torchrun rank helper): the caching allocator reads its settings from an environment variable,
once, at the first CUDA allocation, so there is no other way to hand them over in time.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from typing import Callable

import torch

from .mlp import device_compute_dtype

__all__ = ["Compile", "DeviceError", "check_compiler", "triton_less_settings", "alloc_conf_env_names", "apply_alloc_conf",
           "apply_memory_cap", "autocast", "choose_device", "device_name", "host_syncs", "memory_stats", "rss_bytes"]

# Current torch reads PYTORCH_ALLOC_CONF, older torch PYTORCH_CUDA_ALLOC_CONF and
# ROCm builds PYTORCH_HIP_ALLOC_CONF. Setting a name a given build does not read is harmless, and
# the same value under every name means whichever the build reads first, it gets the one we meant.
_GENERIC, _CUDA, _HIP = "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"


# What torch.cuda.set_sync_debug_mode("warn") warns at each synchronizing call. Setting the mode also
# warns, once a process, that it "does not yet detect all synchronizing operations": not a sync, but
# counting every warning that says "synchroniz" took it for one (docs/benchmarks.md §10).
SYNC_WARNING = "called a synchronizing CUDA operation"


class DeviceError(RuntimeError):
    """The requested device is not usable here (one line, says what to set instead)."""


def alloc_conf_env_names() -> list[str]:
    """The environment variables the running torch may read its allocator settings from."""
    names = [_GENERIC, _CUDA]
    if torch.version.hip:  # ROCm builds: the HIP name is the one older ROCm torch reads
        names.append(_HIP)
    return names


def apply_alloc_conf(alloc_conf: str) -> list[str]:
    """Hand `memory.alloc_conf` to the caching allocator; returns the variables set.

    Must run before the first CUDA allocation (train.py calls it before building anything).
    An empty setting leaves the environment alone, so a user's own variable still applies.
    """
    if not alloc_conf:
        return []
    if sys.platform == "win32" and "expandable_segments" in alloc_conf:
        warnings.warn("memory.alloc_conf: expandable_segments is ignored by PyTorch on Windows",
                      stacklevel=2)
    if torch.cuda.is_initialized():
        # The allocator has already parsed its settings; a late variable would silently do nothing.
        warnings.warn(f"memory.alloc_conf={alloc_conf!r} set after CUDA was initialised; "
                      "it may not take effect", stacklevel=2)
    names = alloc_conf_env_names()
    for name in names:
        old = os.environ.get(name)
        if old is not None and old != alloc_conf:
            warnings.warn(f"memory.alloc_conf replaces {name}={old!r} from the environment",
                          stacklevel=2)
        os.environ[name] = alloc_conf
    return names


def apply_memory_cap(cap_gib: float, device: torch.device) -> float | None:
    """memory.gpu_cap_gib: allow this process at most that much of the GPU (a smaller card's memory on a
    larger one), through torch.cuda.set_per_process_memory_fraction. Returns the fraction set."""
    if cap_gib <= 0:
        return None
    if device.type != "cuda":
        raise DeviceError(f"memory.gpu_cap_gib = {cap_gib:g} caps a GPU, but this run trains on {device.type}")
    if device.index is None:  # "cuda": the current GPU (set_per_process_memory_fraction wants an index)
        device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def choose_device(requested: str, option: str = "train.device") -> torch.device:
    """'auto' = CUDA (or ROCm, through torch.cuda) when present, else CPU. `option` names the
    setting in errors (train.device, --device)."""
    if requested == "cpu":
        return torch.device("cpu")
    available = torch.cuda.is_available()
    if requested == "cuda":
        if not available:
            if torch.version.cuda is None and not torch.version.hip:
                why = f"torch {torch.__version__} is a CPU-only build"
            else:
                built = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
                why = (f"torch {torch.__version__} is built for {built} but sees no GPU: no driver, or "
                       "CUDA_VISIBLE_DEVICES hides them")
            raise DeviceError(f"{option}=cuda but no CUDA device is available ({why}); use {option}=cpu or auto")
        return torch.device("cuda")
    if requested == "auto":
        return torch.device("cuda" if available else "cpu")
    raise DeviceError(f"{option} must be auto, cpu or cuda; got {requested!r}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # Linux names the CPU model here; platform.processor() is often empty there
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "cpu"


def autocast(device: torch.device, dtype: torch.dtype | None = None) -> contextlib.AbstractContextManager:
    """Autocast to `dtype` (a run's `train.precision`, `mlp.precision_dtype`), by default the device's
    compute dtype (`mlp.device_compute_dtype`: bf16 on the GPU); fp32 is plain, no autocast."""
    dtype = device_compute_dtype(device) if dtype is None else dtype
    if dtype != torch.float32:
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def rss_bytes() -> int | None:
    """Resident memory of this process now (Linux /proc; Windows: the working set), else its peak
    (getrusage); None if none of them answers."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if sys.platform == "win32":
        return _working_set_bytes()
    try:
        import resource  # POSIX only: Windows has no such module, and minagi must import there
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, AttributeError, OSError):  # pragma: no cover - platforms without getrusage
        return None
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def _working_set_bytes() -> int | None:
    """This process's working set on Windows (kernel32's K32GetProcessMemoryInfo), or None."""
    import ctypes
    from ctypes import wintypes

    class Counters(ctypes.Structure):  # PROCESS_MEMORY_COUNTERS
        _fields_ = [("cb", wintypes.DWORD), ("PageFaultCount", wintypes.DWORD)] + [
            (name, ctypes.c_size_t) for name in (
                "PeakWorkingSetSize", "WorkingSetSize", "QuotaPeakPagedPoolUsage", "QuotaPagedPoolUsage",
                "QuotaPeakNonPagedPoolUsage", "QuotaNonPagedPoolUsage", "PagefileUsage", "PeakPagefileUsage")]
    counters = Counters()
    counters.cb = ctypes.sizeof(counters)
    try:
        kernel32 = ctypes.WinDLL("kernel32")
        kernel32.GetCurrentProcess.restype = wintypes.HANDLE
        get_info = kernel32.K32GetProcessMemoryInfo
        # Declared: undeclared, ctypes would pass the 64-bit pseudo-handle as a 32-bit C long and fail.
        get_info.argtypes = [wintypes.HANDLE, ctypes.POINTER(Counters), wintypes.DWORD]
        get_info.restype = wintypes.BOOL
        ok = get_info(kernel32.GetCurrentProcess(), ctypes.byref(counters), counters.cb)
    except (AttributeError, OSError, ctypes.ArgumentError):  # an old Windows without the K32 entry point
        return None
    return int(counters.WorkingSetSize) if ok else None


def memory_stats(device: torch.device, reset_peak: bool = True) -> dict:
    """Allocator figures since the last reset (None on the CPU) and the process resident memory.

    Keys match the history fields. Peaks are per interval: they are reset after reading.
    """
    out = {"mem_allocated": None, "mem_reserved": None, "mem_peak_allocated": None,
           "mem_peak_reserved": None, "alloc_retries": None, "ooms": None}
    if device.type == "cuda":
        s = torch.cuda.memory_stats(device)
        out.update(mem_allocated=s.get("allocated_bytes.all.current", 0),
                   mem_reserved=s.get("reserved_bytes.all.current", 0),
                   mem_peak_allocated=s.get("allocated_bytes.all.peak", 0),
                   mem_peak_reserved=s.get("reserved_bytes.all.peak", 0),
                   alloc_retries=s.get("num_alloc_retries", 0),
                   ooms=s.get("num_ooms", 0))
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(device)
    out["rss_bytes"] = rss_bytes()
    return out


def host_syncs(fn: Callable[[], object]) -> list[str]:
    """The host syncs torch's sync debug mode reports while `fn` runs, each as the "file:line" of the
    Python frame torch warned in. `fn` runs everywhere; off CUDA, where the mode does not exist, the
    list is empty."""
    if not torch.cuda.is_available():
        fn()
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]


def has_triton() -> bool:
    """Whether torch.compile can generate GPU code here (Triton importable and usable by inductor)."""
    try:
        from torch.utils._triton import has_triton as torch_has_triton
    except ImportError:  # pragma: no cover - torch without the helper
        import importlib.util
        return importlib.util.find_spec("triton") is not None
    return torch_has_triton()


# Why a GPU compile through inductor cannot run where Triton is missing (train.py, sample.py --compile).
NO_TRITON = "in Triton, which this Python does not have (Windows and most ROCm builds on Windows ship none)"


def check_compiler(compile_setting, device: torch.device, backend: str = "inductor") -> None:
    """`train.compile` on a GPU through inductor needs Triton (inductor writes its GPU kernels in it):
    where it is missing (Windows, most ROCm on Windows) refuse at start, in one line, rather than fail at
    the first step. The CPU compiles through inductor's C++ backend and needs no Triton, but a C++
    compiler, which Windows does not have unless installed and put on PATH. The "cudagraphs" backend
    writes no kernels (no Triton) but replays CUDA graphs: a GPU only."""
    if compile_setting is False:
        return
    from .config import ConfigError
    setting = f"train.compile = {'true' if compile_setting is True else repr(compile_setting)}"
    on_gpu = torch.device(device).type == "cuda"
    if backend == "cudagraphs" and not on_gpu:
        raise ConfigError(f'{setting} with train.compile_backend = "cudagraphs": it replays CUDA graphs, which '
                          f'need a GPU ({torch.device(device).type} here); use train.compile_backend = "inductor"',
                          "train.compile_backend")
    if backend == "inductor" and not on_gpu and sys.platform == "win32" and not _windows_cpp_compiler():
        raise ConfigError(f"{setting} on the CPU: inductor compiles C++ there, and on Windows finds no C++ compiler "
                          "on PATH (MSVC's cl from vcvars64.bat or a Developer Command Prompt, clang-cl or Intel's "
                          "icx); set train.compile = false, or open a shell with one", "train.compile")
    if backend != "inductor" or not on_gpu or has_triton():
        return
    raise ConfigError(f"{setting}: torch.compile writes its GPU kernels {NO_TRITON}; set train.compile = \"rows\" with "
                      "train.compile_backend = \"cudagraphs\" and train.compile_mode = \"default\" (CUDA graphs of "
                      "torch's kernels, no Triton), or train.compile = false, or install Triton", "train.compile")


def _windows_cpp_compiler() -> str | None:
    """A C++ compiler inductor's CPU backend can use on Windows (pytorch.org's "torch.compile on Windows
    CPU/XPU"), found on PATH; None if there is none (a plain Windows shell has none)."""
    import shutil
    return next((found for name in ("cl", "clang-cl", "icx") if (found := shutil.which(name))), None)


def triton_less_settings(train) -> tuple[dict, str | None]:
    """A compile through inductor (cuda_small's, the default profile with a GPU) needs Triton. Where
    there is none: (the train settings that replace its compile ones, the rest of a line saying so),
    else ({}, None). On NVIDIA each row's attention and router replayed as CUDA graphs of torch's
    kernels (the cudagraphs backend: 1.23-1.37x the eager step on the H200 standing in,
    docs/benchmarks.md section 24), unless the run's CUDA graphs would be refused (gradient
    accumulation, row checkpointing: `config.check_cuda_graphs`); else, and on ROCm (HIP graphs
    through torch on Windows were never run here), eager."""
    if has_triton():
        return {}, None
    needs = "no Triton here, which its train.compile needs"
    if torch.version.hip:
        return {"compile": False}, (f"{needs}: trained eagerly instead (--set train.compile=rows --set "
                                    "train.compile_backend=cudagraphs --set train.compile_mode=default tries "
                                    "HIP graphs of the rows)")
    if train.accum_steps > 1 or train.checkpoint_rows:
        return {"compile": False}, (f"{needs}: trained eagerly instead (CUDA graphs of the rows, what runs "
                                    "without Triton, do not run with train.accum_steps > 1 or "
                                    "train.checkpoint_rows)")
    return ({"compile": "rows", "compile_mode": "default", "compile_backend": "cudagraphs"},
            f"{needs}: each row's attention and router are replayed as CUDA graphs of torch's kernels "
            "instead (train.compile = \"rows\", train.compile_backend = \"cudagraphs\")")


@dataclasses.dataclass(frozen=True)
class Compile:
    """How torch.compile builds a compiled region or step: train.compile_mode and train.compile_backend."""

    mode: str = "default"
    backend: str = "inductor"

    @classmethod
    def of(cls, train) -> "Compile":
        """A TrainConfig's settings."""
        return cls(train.compile_mode, train.compile_backend)

    def __call__(self, fn: Callable, **kwargs) -> Callable:
        return torch.compile(fn, mode=self.mode, backend=self.backend, **kwargs)
