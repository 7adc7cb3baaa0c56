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

Dynamo's tracing is what that leaves: seconds a process. `PrecompiledPieces` keeps the decoder's
pieces whole where torch can (`torch.compile(f, fullgraph=True).aot_compile`: dynamo's bytecode and
guards with inductor's code and kernels, one file a piece under `<key>/`; torch 2.11 has it behind
dynamo's `enable_aot_compile` setting, which the pieces turn on while they compile), so a process of
a shape seen before loads them and traces nothing; `CompileCache` serves the torch that cannot, and
any piece whose compile or file torch refuses. (Not used: torch's `caching_precompile` setting,
which keeps dynamo's output in the same artifacts: on the H200's torch 2.11 its saved guards fail to
unpickle in the next process, measured 2026-12-03. Nor AOTInductor's packages, which load without
dynamo: on that torch every CUDA package, a one-matmul piece included, crashed the process as it
loaded, and one piece took ~39 s to compile; measured 2026-12-04.)

What no cache removes is the compiler's first use in a process: importing inductor and Triton
(about a second of Python), the modules a compile imports on its way (inductor's passes, kernel
templates, sympy: `record_compile_imports` keeps their names per torch version, from a compile seen
before), and hashing torch's and Triton's sources for the cache keys (~0.5 s on the H200's host,
measured 2026-12-03). `warm_compiler` does all three on a thread of its own while the checkpoint
loads (the hashing reads files and leaves the GIL to the load), and the caller joins it before
compiling. (Where the pieces load whole, warming only the modules such a set-up had imported was
no faster on the H200: measured 2026-12-04.)
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import json
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from .atomic import atomic_write
from .data import default_cache_dir

__all__ = ["CompileCache", "PrecompiledPieces", "aot_available", "decode_key", "record_compile_imports",
           "recorded_imports", "warm_compiler"]

# What the first compile of a process imports beyond dynamo (which `warm_compiler` imports first, on
# the caller's thread), before the modules recorded from a compile seen before.
_COMPILER_MODULES = ("torch._inductor.compile_fx", "triton")
# The packages whose modules a compile imports that are worth recording (not its generated kernels).
_RECORDED_PACKAGES = frozenset({"torch", "triton", "sympy", "mpmath", "jinja2", "markupsafe", "networkx"})


def _api() -> tuple | None:
    save = getattr(torch.compiler, "save_cache_artifacts", None)
    load = getattr(torch.compiler, "load_cache_artifacts", None)
    return (save, load) if save is not None and load is not None else None


def warm_compiler(modules: tuple[str, ...] | None = None, root: str | Path | None = None) -> threading.Thread:
    """Start warming torch's compiler on a daemon thread, so that a compile later in this process
    finds it ready. By default: Triton's source hash while the caller imports dynamo here, then
    inductor and Triton imported, torch's source hash, and the modules recorded from a compile of this
    torch before (`record_compile_imports`); or only `modules`, once dynamo is in. The thread is
    returned, and the caller must `join` it before it touches the compiler itself (two threads
    importing modules that import each other can leave one of them with a half-made module: so the
    thread touches no torch module until dynamo is imported). A module that is not installed (Triton
    on a machine without it) is skipped; any other failure of a listed one is raised on the thread
    (Python prints it), and the compile that needs the module meets it again."""
    first, then = (_COMPILER_MODULES, recorded_imports(root)) if modules is None else (modules, ())
    dynamo_imported = threading.Event()

    def run() -> None:
        if modules is None:
            _hash_triton()  # Triton's own modules only: beside the caller's import of dynamo
        dynamo_imported.wait()
        _import_all(first)
        if modules is None:
            _hash_torch()
        _import_all(then, recorded=True)

    thread = threading.Thread(target=run, name="minagi-warm-compiler", daemon=True)
    thread.start()
    try:
        import torch._dynamo  # noqa: F401  (the shared root of the rest: never half made by the thread)
    except BaseException:
        dynamo_imported.set()
        thread.join()  # not left importing on its own while the caller's error goes up
        raise
    dynamo_imported.set()
    return thread


def _hash_triton() -> None:
    """Triton's source hash (its own cached `triton_key`, which inductor's cache keys call; ~0.4 s).
    Safe beside the caller's import of dynamo, which imports Triton too: Triton imports no module of
    torch's beyond torch itself (checked on the H200's Triton 3.6), so the threads meet only there."""
    if importlib.util.find_spec("triton") is None:
        return
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):  # where Triton 3.x keeps it
        try:
            key = getattr(importlib.import_module(module), "triton_key", None)
            if key is not None:
                key()
                return
        except Exception:  # noqa: BLE001 - a warm-up only: the compile computes what this could not
            continue


def _import_all(names: tuple[str, ...], recorded: bool = False) -> None:
    """Import each; one not installed is skipped, and so is any failure of a recorded one (a record of
    another install: the compile imports what it needs itself)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            pass
        except Exception:  # noqa: BLE001
            if not recorded:
                raise


def _hash_torch() -> None:
    """torch's source hash, which inductor's first cache key computes (cached for the process; ~0.2 s
    of file reads and hashing). torch's own name, so a torch without it is skipped."""
    try:
        key = getattr(importlib.import_module("torch._inductor.codecache"), "torch_key", None)
        if key is not None:
            key()
    except Exception:  # noqa: BLE001 - a warm-up only: the compile computes what this could not
        pass


def _imports_file(root: str | Path | None) -> Path:
    return _cache_root(root) / f"imports-torch-{torch.__version__}.json"


def recorded_imports(root: str | Path | None = None) -> tuple[str, ...]:
    """The modules a compile of this torch imported before (`record_compile_imports`); () if none."""
    try:
        names = json.loads(_imports_file(root).read_text())
    except (OSError, ValueError):
        return ()
    return tuple(n for n in names if isinstance(n, str)) if isinstance(names, list) else ()


def _importable(name: str) -> bool:
    """A module an import statement makes: not one inductor put in sys.modules itself (its generated
    code, `torch._inductor.runtime.compile_tasks.<hash>`, one a kernel: the record would grow each shape)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return spec is not None and ".compile_tasks." not in name


def record_compile_imports(before: set[str], root: str | Path | None = None) -> bool:
    """Add the modules imported since `before` (a `set(sys.modules)` taken before a compile) to this
    torch's record, for the next process's `warm_compiler`; True if the record grew."""
    known = recorded_imports(root)
    new = sorted(n for n in set(sys.modules) - before - set(known) - set(_COMPILER_MODULES)
                 if n.partition(".")[0] in _RECORDED_PACKAGES and _importable(n))
    if not new:
        return False
    path = _imports_file(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(list(known) + new)), durable=False)  # a cache
    except OSError:  # a read-only cache folder: the next process imports them as the compile goes
        return False
    return True


def _one_compile_thread() -> contextlib.AbstractContextManager:
    """Inductor's compile threads set to one: no pool of compile workers (a process a CPU core, each
    importing torch), which a set-up with nothing left to compile would only wait for at exit."""
    import torch._inductor.config
    return torch._inductor.config.patch(compile_threads=1)


def _digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _cache_root(root: str | Path | None) -> Path:
    return Path(root if root is not None else default_cache_dir() / "compile")


class CompileCache:
    """torch's compile caches of one key, on disk. `status` after `load`: "hit" (loaded), "miss" (to
    compile; `save` writes it), "unreadable" (a file that failed to load: compiled and written again)
    or "unavailable" (this torch has no cache artifacts API)."""

    def __init__(self, key: dict, root: str | Path | None = None):
        self.key, self.path = key, _cache_root(root) / f"{_digest(key)}.bin"
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

    def compiling(self) -> contextlib.AbstractContextManager:
        """What the compile after `load` runs under: on a hit, inductor's compile threads set to one.
        Everything is in the loaded caches, so the pool of compile workers inductor starts at its
        first compile (a process a CPU core, each importing torch) only competes for the host and
        holds the process ~2 s at exit (H200 host, measured 2026-12-03)."""
        return _one_compile_thread() if self.status == "hit" else contextlib.nullcontext()

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


def _aot_setting() -> contextlib.AbstractContextManager:
    """Dynamo's `enable_aot_compile` on: torch 2.11 hides `aot_compile` behind it (off by default
    there, on in 2.13); a torch without the setting has it on or lacks it."""
    import torch._dynamo.config as dynamo_config
    if not hasattr(dynamo_config, "enable_aot_compile"):
        return contextlib.nullcontext()
    return dynamo_config.patch(enable_aot_compile=True)


def _aot_compile(fn: Callable, args: tuple):
    """`fn` compiled ahead of time for `args` (dynamo's bytecode and guards with inductor's code)."""
    with _aot_setting():
        return torch.compile(fn, fullgraph=True, dynamic=False).aot_compile((args, {}))


@functools.cache
def aot_available() -> bool:
    """Whether this torch compiles a function ahead of time into a file (`aot_compile` with
    `load_compiled_function`: 2.13 has both, 2.11 both behind dynamo's `enable_aot_compile`)."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return False
    with _aot_setting():
        return hasattr(torch.compile(lambda x: x, fullgraph=True), "aot_compile")


class PrecompiledPieces:
    """Compiled pieces of one key, each made at its first call from that call's arguments (the shapes
    every later call has; dynamic=False): its file loaded where it is there and takes the call, else
    compiled ahead of time and written; where torch cannot (no `aot_compile`, a piece it refuses, or
    a file it cannot load), the piece runs `fallback`'s (torch.compile's lazy compile) and
    `CompileCache` keeps its caches; a refusal is written down (`<name>.refused`, holding why), so
    later processes go straight to the fallback instead of compiling twice.

    functions / fallback: name -> the eager function / its torch.compile. `calls()`: the callables to
    run, in `functions`' order. `status` after every piece ran once: "hit" (all loaded), "miss"
    (compiled and written), "fallback" (a piece on torch.compile), or None before.
    """

    def __init__(self, key: dict, functions: dict[str, Callable], fallback: dict[str, Callable],
                 root: str | Path | None = None):
        self.folder = _cache_root(root) / _digest({**key, "form": "aot pieces"})
        self.functions, self.fallback = functions, fallback
        self.made: dict[str, str] = {}  # name -> "loaded", "written" or "fallback"
        self._calls = {name: _Piece(self, name) for name in functions}

    def calls(self) -> tuple:
        return tuple(self._calls.values())

    def complete(self) -> bool:
        """Every piece's file is there and none was refused (then torch's own caches are not needed)."""
        return all((self.folder / f"{name}.bin").is_file() and not (self.folder / f"{name}.refused").is_file()
                   for name in self.functions)

    def compiling(self) -> contextlib.AbstractContextManager:
        """What the set-up runs under when every piece's file is there: inductor's compile threads set to
        one, as `CompileCache.compiling` on a hit (loading the pieces' kernels would start the pool of
        compile workers, which then held each process ~1.5 s at exit: H200, torch 2.11)."""
        return _one_compile_thread() if self.complete() else contextlib.nullcontext()

    @property
    def status(self) -> str | None:
        if len(self.made) < len(self.functions):
            return None
        states = set(self.made.values())
        return "fallback" if "fallback" in states else "hit" if states == {"loaded"} else "miss"

    def make(self, name: str, args: tuple) -> tuple[Callable, object]:
        """The callable of piece `name` made for `args` (the piece's first call), and that call's output."""
        path, refused = self.folder / f"{name}.bin", self.folder / f"{name}.refused"
        if refused.is_file():  # aot_compile refused this piece before: not tried again
            return self._fall_back(name, args)
        stage = "load"
        try:
            if path.is_file():  # written atomically under a key naming torch and minagi's code
                with open(path, "rb") as fh:
                    loaded = torch.compiler.load_compiled_function(fh)
                stage = "call"
                out = loaded(*args)  # its guards check the call
                self.made[name] = "loaded"
                return loaded, out
            stage = "compile"
            compiled = _aot_compile(self.functions[name], args)
            stage = "save"
            self._write(path, lambda tmp: compiled.save_compiled_function(str(tmp)))
        except torch.cuda.OutOfMemoryError:  # the device's state, not the piece's: no refusal kept
            raise
        except Exception as e:  # noqa: BLE001 - an experimental API: a refusal to compile, save or load the
            # piece falls back to torch.compile, and is kept, so that no later process compiles twice
            why = f"{stage}: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}\n"
            self._write(refused, lambda tmp: tmp.write_text(why, encoding="utf-8"))
            return self._fall_back(name, args)
        self.made[name] = "written"
        return compiled, compiled(*args)

    def _fall_back(self, name: str, args: tuple) -> tuple[Callable, object]:
        self.made[name] = "fallback"
        return self.fallback[name], self.fallback[name](*args)

    def _write(self, path: Path, write: Callable[[Path], object]) -> None:
        """`write` atomically at `path`; an unwritable folder is let be (the next run compiles again),
        any other failure of `write` goes up."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write(path, write)
        except OSError:  # a read-only or full cache folder costs the next run a compile, nothing more
            pass


class _Piece:
    """One piece's callable: made by its `PrecompiledPieces` at the first call, then called directly."""

    def __init__(self, owner: PrecompiledPieces, name: str):
        self.owner, self.name, self.fn = owner, name, None

    def __call__(self, *args):
        if self.fn is None:
            self.fn, out = self.owner.make(self.name, args)
            return out
        return self.fn(*args)


@functools.cache
def _source_digest() -> str:
    """minagi's own code: a precompiled piece holds the traced bytecode of the code that made it."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


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
            "code": _source_digest(), **gpu}
