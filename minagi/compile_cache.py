"""The compiled writing step compiled once per model shape on a machine, not once per process.

torch.compile keeps what it compiled in caches of its own (inductor's FX graphs with their Triton
kernels, AOTAutograd's graphs, autotuning results), in a temporary folder that a new machine, or a
cleaned /tmp, starts without: then every `sample.py --compile` compiles again (15-18 s on the H200,
measured 2026-12-02). `torch.compiler.save_cache_artifacts()` serialises those caches' entries made
in this process, and `load_cache_artifacts` puts them back before compiling, so the compile finds
its graphs and kernels done (dynamo still traces: seconds). `CompileCache` keeps the artifacts in
`~/.cache/minagi/compile/<key>.bin`, the key a hash of everything the graphs depend on (the model's
shape, the streams, the window, the step's form, torch's version and the device); `decode_key`
makes it for the decoder. Where torch has no such API the cache is "unavailable" and the compile
runs as before. A file that does not load is set aside (recompiled and written again), never an error.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from .atomic import atomic_write
from .data import default_cache_dir

__all__ = ["CompileCache", "decode_key"]


def _api() -> tuple | None:
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    return (save, load) if save is not None and load is not None else None


class CompileCache:
    """torch's compile caches of one key, on disk. `status` after `load`: "hit" (loaded), "miss" (to
    compile; `save` writes it), "unreadable" (a file that failed to load: compiled and written again)
    or "unavailable" (this torch has no cache artifacts API)."""

    def __init__(self, key: dict, root: str | Path | None = None):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]
        self.key, self.path = key, Path(root if root is not None else default_cache_dir() / "compile") / f"{digest}.bin"
        self.status: str | None = None

    def load(self) -> str:
        api = _api()
        if api is None:
            self.status = "unavailable"
        elif not self.path.is_file():
            self.status = "miss"
        else:
            try:
                api[1](self.path.read_bytes())
                self.status = "hit"
            except Exception:  # noqa: BLE001 - a stale or torn file: compile as if it were not there
                self.status = "unreadable"
        return self.status

    def save(self) -> bool:
        """Write this process's compile artifacts (after the compile) unless they were loaded; True if written."""
        api = _api()
        if api is None or self.status == "hit":
            return False
        artifacts = api[0]()
        if artifacts is None:  # nothing was compiled (or torch's caches are off)
            return False
        data = artifacts[0]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(self.path, lambda tmp: tmp.write_bytes(data))
        except OSError:  # a read-only or full cache folder costs the next run a compile, nothing more
            return False
        return True


def decode_key(model, streams: int, window: int, products: bool, expert_path: str, device: torch.device) -> dict:
    """What the decoder's compiled pieces depend on (minagi/decode.py): the shapes they see and the
    code and device that compile them."""
    device = torch.device(device)
    gpu = {}
    if device.type == "cuda":
        gpu = {"name": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
               "cuda": torch.version.cuda, "hip": torch.version.hip}
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"what": "decode step", "model": dataclasses.asdict(model.cfg), "pool": dataclasses.asdict(model.pool_cfg),
            "vocab": model.vocab_size, "streams": streams, "window": window, "products": products,
            "expert_path": expert_path, "torch": torch.__version__, "triton": triton_version, "device": device.type,
            **gpu}
