"""minagi/compile_cache.py: torch's compile caches kept on disk per key, loaded before a compile and written
after one, so the next process of the same shape finds its graphs compiled; and the fixed cost that
sample.py says apart from the writing rate."""
import pytest
import torch

from minagi import compile_cache
from minagi.compile_cache import CompileCache, PrecompiledPieces, aot_available, decode_key
from minagi.config import load_config
from minagi.model import build_model
from minagi.sampling import Ready


@pytest.fixture
def fake_api(monkeypatch):
    """torch.compiler's artifacts API, faked: what was "compiled" in this process, what was loaded."""
    state = {"made": b"artifacts of this process", "loaded": []}

    def load(data):
        if data == b"torn":
            raise RuntimeError("bad artifacts")
        state["loaded"].append(data)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (state["made"], object()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return state


def test_a_miss_is_written_after_the_compile_and_the_next_process_loads_it(tmp_path, fake_api):
    first = CompileCache({"model": 1}, root=tmp_path)
    assert first.load() == "miss" and first.save() and first.path.read_bytes() == fake_api["made"]
    assert first.path.parent == tmp_path and first.path.suffix == ".bin"
    second = CompileCache({"model": 1}, root=tmp_path)
    assert second.path == first.path and second.load() == "hit" and fake_api["loaded"] == [fake_api["made"]]
    fake_api["made"] = b"other"
    assert not second.save() and second.path.read_bytes() == b"artifacts of this process"  # a hit is not rewritten
    assert CompileCache({"model": 2}, root=tmp_path).path != first.path


def test_a_torn_file_is_compiled_again_and_a_torch_without_the_api_compiles_as_before(tmp_path, fake_api,
                                                                                       monkeypatch):
    torn = CompileCache({"model": 1}, root=tmp_path)
    torn.path.write_bytes(b"torn")
    assert torn.load() == "unreadable" and torn.save() and torn.path.read_bytes() == fake_api["made"]
    monkeypatch.delattr(torch.compiler, "save_cache_artifacts")
    none = CompileCache({"model": 3}, root=tmp_path)
    assert none.load() == "unavailable" and not none.save() and not none.path.exists()


def test_the_decoders_key_names_what_its_compiled_graphs_depend_on():
    cfg = load_config(None, ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "pool.n_experts=4"])
    model = build_model(cfg.model, cfg.pool, 20, "cpu")
    key = decode_key(model, 1, 64, True, "auto", torch.device("cpu"))
    assert key == decode_key(model, 1, 64, True, "auto", torch.device("cpu"))
    assert key["torch"] == torch.__version__ and key["model"]["d_model"] == 32 and key["vocab"] == 20
    paths = {CompileCache(k).path for k in (key, decode_key(model, 2, 64, True, "auto", "cpu"),
                                            decode_key(model, 1, 32, True, "auto", "cpu"),
                                            decode_key(model, 1, 64, False, "auto", "cpu"))}
    assert len(paths) == 4
    assert CompileCache(key).path.parent == compile_cache.default_cache_dir() / "compile"


@pytest.mark.slow
def test_torchs_own_artifacts_make_a_compile_in_a_fresh_inductor_cache_a_hit(tmp_path, monkeypatch):
    """What a second process sees: inductor's cache folder empty, ours holding the first compile's artifacts."""
    from torch._dynamo.utils import counters

    def compile_once() -> str:
        cache = CompileCache({"what": "test", "shape": [8, 8]}, root=tmp_path / "ours")
        status = cache.load()
        f = torch.compile(lambda x: (x.sin() * 2).sum(-1), dynamic=False)
        f(torch.randn(8, 8))
        cache.save()
        return status
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-1"))
    torch._dynamo.reset()
    counters.clear()
    assert compile_once() == "miss" and counters["inductor"]["fxgraph_cache_miss"] == 1
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor-2"))
    torch._dynamo.reset()
    counters.clear()
    assert compile_once() == "hit"
    assert counters["inductor"]["fxgraph_cache_hit"] == 1 and counters["inductor"]["fxgraph_cache_miss"] == 0
    torch._dynamo.reset()


def test_the_fixed_cost_says_what_was_done_and_what_the_cache_did():
    assert Ready(0.5, False, False).describe() == "set-up 0.50 s"
    assert Ready(1.2, True, False).describe() == "capture 1.20 s"
    assert Ready(2.0, True, True, "hit", "/c/x.bin").describe() == "compile and capture 2.00 s (compile cache hit: /c/x.bin)"
    assert "miss, written for the next run" in Ready(17.0, True, True, "miss", "/c/x.bin").describe()


def _pieces(root, functions):
    return PrecompiledPieces({"what": "test"}, functions, {n: torch.compile(f, dynamic=False) for n, f in functions.items()},
                             root=root)


needs_aot = pytest.mark.skipif(not aot_available(), reason="this torch has no aot_compile")


def _aot_setting_off():
    """Dynamo's enable_aot_compile off, as torch 2.11 ships it, by the setting's own patch (monkeypatch's
    undo would delete the setting, which hides it for good)."""
    import contextlib
    import torch._dynamo.config as dynamo_config
    if not hasattr(dynamo_config, "enable_aot_compile"):
        return contextlib.nullcontext()
    return dynamo_config.patch(enable_aot_compile=False)


@needs_aot
@pytest.mark.slow
def test_precompiled_pieces_are_written_once_then_loaded_whole_and_compute_the_same(tmp_path):
    """A second set of the same key loads each piece's file (no trace) and agrees with the eager function;
    a file that does not load sends its piece to the fallback, for good (not compiled in every process).
    With dynamo's `enable_aot_compile` off, as torch 2.11 ships it: the pieces turn it on themselves."""
    with _aot_setting_off():
        _check_precompiled_pieces(tmp_path)


def _check_precompiled_pieces(tmp_path):
    functions = {"double_sin": lambda x: (x.sin() * 2).sum(-1), "norm": lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w}
    x, w = torch.randn(4, 8), torch.randn(8)
    first = _pieces(tmp_path, functions)
    assert first.status is None and not first.complete()
    double_sin, norm = first.calls()
    torch.testing.assert_close(double_sin(x), functions["double_sin"](x))
    torch.testing.assert_close(norm(x, w), functions["norm"](x, w))
    assert first.status == "miss" and first.complete() and first.made == {"double_sin": "written", "norm": "written"}
    second = _pieces(tmp_path, functions)
    double_sin, norm = second.calls()
    for _ in range(2):  # the first call loads, the next runs what was loaded
        torch.testing.assert_close(double_sin(x), functions["double_sin"](x))
        torch.testing.assert_close(norm(x, w * 3), functions["norm"](x, w * 3))
    assert second.status == "hit"
    (tmp_path / second.folder.name / "norm.bin").write_bytes(b"torn")
    third = _pieces(tmp_path, functions)
    for call, name in zip(third.calls(), functions):
        torch.testing.assert_close(call(x) if name == "double_sin" else call(x, w), functions[name](*((x,) if name == "double_sin" else (x, w))))
    assert third.made == {"double_sin": "loaded", "norm": "fallback"} and third.status == "fallback"
    assert (third.folder / "norm.refused").read_text().startswith("load: ")
    fourth = _pieces(tmp_path, functions)
    fourth.calls()[1](x, w)
    assert fourth.made == {"norm": "fallback"}


def test_a_piece_torch_cannot_precompile_runs_torch_compile_says_why_and_is_not_tried_again(tmp_path, monkeypatch):
    """Where aot_compile refuses (a piece it cannot trace whole) the piece runs the fallback
    (torch.compile's; here an eager stand-in), no compiled file is written, and the refusal is: the
    next process goes to the fallback without compiling the piece twice."""
    tried = []

    class Refusing:
        def __init__(self, f, **kw):
            self.f = f

        def aot_compile(self, example):
            tried.append(example)
            raise RuntimeError("graph break in piece\nmore detail")
    monkeypatch.setattr(torch, "compile", Refusing)
    eager = {"twice": lambda x: x * 2}
    for run in range(2):
        pieces = PrecompiledPieces({"what": "test"}, eager, {"twice": lambda x: x + x}, root=tmp_path)
        (twice,) = pieces.calls()
        assert torch.equal(twice(torch.arange(3)), torch.tensor([0, 2, 4]))
        assert torch.equal(twice(torch.ones(2)), torch.full((2,), 2.0))
        assert pieces.status == "fallback" and pieces.made == {"twice": "fallback"}
        assert not pieces.complete() and not (pieces.folder / "twice.bin").exists()
        assert (pieces.folder / "twice.refused").read_text() == "compile: RuntimeError: graph break in piece\n"
    assert len(tried) == 1  # the second process read the refusal


def test_running_out_of_device_memory_while_precompiling_is_raised_and_not_kept_as_a_refusal(tmp_path, monkeypatch):
    class OutOfMemory:
        def __init__(self, f, **kw):
            pass

        def aot_compile(self, example):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(torch, "compile", OutOfMemory)
    pieces = PrecompiledPieces({"what": "test"}, {"twice": lambda x: x * 2}, {"twice": lambda x: x + x}, root=tmp_path)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        pieces.calls()[0](torch.ones(2))
    assert not (pieces.folder / "twice.refused").exists()


def test_aot_compile_is_found_behind_dynamos_setting_where_torch_keeps_it_off():
    """torch 2.11 has aot_compile but hides it unless `torch._dynamo.config.enable_aot_compile` is set."""
    import torch._dynamo.config as dynamo_config
    if not hasattr(dynamo_config, "enable_aot_compile"):
        pytest.skip("this torch has no enable_aot_compile setting")
    compile_cache.aot_available.cache_clear()
    try:
        with _aot_setting_off():
            assert not hasattr(torch.compile(lambda x: x, fullgraph=True), "aot_compile")  # what 2.11 shows
            assert compile_cache.aot_available() == hasattr(torch.compiler, "load_compiled_function")
            assert dynamo_config.enable_aot_compile is False  # the setting is the user's again
    finally:
        compile_cache.aot_available.cache_clear()


def test_the_decoders_key_names_minagis_own_code():
    """A precompiled piece holds traced bytecode: a changed minagi must not load an old one."""
    assert len(compile_cache._source_digest()) == 16
    cfg = load_config(None, ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "pool.n_experts=4"])
    key = decode_key(build_model(cfg.model, cfg.pool, 20, "cpu"), 1, 64, True, "auto", "cpu")
    assert key["code"] == compile_cache._source_digest()


def test_precompiled_statuses_are_said():
    assert "hit, the pieces loaded whole: /c/k" in Ready(1.0, True, True, "precompiled hit", "/c/k").describe()
    assert "miss, the pieces written whole" in Ready(9.0, True, True, "precompiled miss", "/c/k").describe()


def test_the_compiler_is_imported_on_a_thread_of_its_own_and_a_missing_module_is_skipped(monkeypatch):
    import sys
    import threading
    for name in ("colorsys", "minagi_no_such_module"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    importer = []
    real_import = compile_cache.importlib.import_module
    monkeypatch.setattr(compile_cache.importlib, "import_module",
                        lambda name: importer.append(threading.current_thread().name) or real_import(name))
    thread = compile_cache.warm_compiler(("minagi_no_such_module", "colorsys"))
    thread.join(timeout=60)
    assert not thread.is_alive() and thread.daemon
    assert "colorsys" in sys.modules and "minagi_no_such_module" not in sys.modules  # tried, skipped, went on
    assert importer == ["minagi-warm-compiler"] * 2



def test_by_default_the_thread_imports_the_compiler_hashes_the_sources_then_imports_the_record(tmp_path, monkeypatch):
    import sys
    (tmp_path / "minagi_fails_on_import.py").write_text("raise ImportError('not on this install')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("colorsys", "minagi_fails_on_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    compile_cache._imports_file(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    compile_cache._imports_file(tmp_path).write_text('["minagi_fails_on_import", "minagi_no_such_module", "colorsys"]')
    done = []
    real_import = compile_cache.importlib.import_module
    monkeypatch.setattr(compile_cache.importlib, "import_module", lambda name: done.append(name) or real_import(name))
    monkeypatch.setattr(compile_cache, "_COMPILER_MODULES", ("json",))
    monkeypatch.setattr(compile_cache, "_hash_torch", lambda: done.append("hash"))
    monkeypatch.setattr(compile_cache, "_hash_triton", lambda: done.append("triton's hash"))
    thread = compile_cache.warm_compiler(root=tmp_path)
    thread.join(timeout=60)
    assert done == ["triton's hash", "json", "hash", "minagi_fails_on_import", "minagi_no_such_module", "colorsys"]
    assert "colorsys" in sys.modules  # a failing or missing recorded module is skipped, and the rest go on


def test_the_modules_a_compile_imported_are_recorded_once_for_this_torch(tmp_path):
    import sys
    assert compile_cache.recorded_imports(tmp_path) == ()
    before = set(sys.modules) - {"torch.nn.functional", "json", "torch._inductor.compile_fx"}
    assert compile_cache.record_compile_imports(before, tmp_path)
    # Only torch's own (and its compiler's dependencies'), not what the compiler modules list already has.
    assert compile_cache.recorded_imports(tmp_path) == ("torch.nn.functional",)
    assert not compile_cache.record_compile_imports(before, tmp_path)  # nothing new: not rewritten
    assert compile_cache.record_compile_imports(before - {"torch.nn.init"}, tmp_path)
    assert compile_cache.recorded_imports(tmp_path) == ("torch.nn.functional", "torch.nn.init")
    assert compile_cache._imports_file(tmp_path).name == f"imports-torch-{torch.__version__}.json"
    compile_cache._imports_file(tmp_path).write_text("{not json")
    assert compile_cache.recorded_imports(tmp_path) == ()  # a torn record is no record


def test_triton_is_hashed_only_by_default_and_a_machine_without_it_skips(monkeypatch):
    done = []
    monkeypatch.setattr(compile_cache, "_hash_triton", lambda: done.append("triton's hash"))
    compile_cache.warm_compiler(("json",)).join(timeout=60)
    assert done == []
    monkeypatch.undo()
    monkeypatch.setattr(compile_cache.importlib.util, "find_spec", lambda name: None)
    compile_cache._hash_triton()  # no Triton: nothing imported, no error


def test_source_hashing_calls_torchs_keys_and_a_failing_one_is_no_error(monkeypatch):
    import torch._inductor.codecache as codecache
    called = []
    monkeypatch.setattr(codecache, "torch_key", lambda: called.append("torch") or b"k")
    compile_cache._hash_torch()
    assert called == ["torch"]
    monkeypatch.setattr(codecache, "torch_key", lambda: 1 / 0)
    compile_cache._hash_torch()  # a warm-up only


def test_a_hit_compiles_with_one_compile_thread_and_a_miss_with_torchs_setting(tmp_path):
    import torch._inductor.config as inductor_config
    cache = CompileCache({"k": 1}, tmp_path)
    threads = inductor_config.compile_threads
    for status, inside in (("hit", 1), ("miss", threads), ("unavailable", threads)):
        cache.status = status
        with cache.compiling():
            assert inductor_config.compile_threads == inside
        assert inductor_config.compile_threads == threads


@pytest.mark.parametrize("status, threads_inside", [("miss", None), ("hit", 1)])
def test_the_writers_set_up_compiles_under_the_cache_and_records_what_the_compile_imported(tmp_path, monkeypatch,
                                                                                      status, threads_inside):
    import sys
    import torch._inductor.config as inductor_config
    from minagi import sampling
    seen = {}

    class CompilingDecoder:  # stands in for the CUDA-only compiled decoder: imports as a compile would
        def __init__(self, *args, **kwargs):
            import torch.utils.bundled_inputs  # noqa: F401
            seen["threads"] = inductor_config.compile_threads

        def prepare_slides(self, sizes):
            pass

    monkeypatch.setattr(compile_cache, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(sampling, "aot_available", lambda: False)
    monkeypatch.setattr(sampling, "Decoder", CompilingDecoder)
    monkeypatch.delitem(sys.modules, "torch.utils.bundled_inputs", raising=False)
    monkeypatch.setattr(CompileCache, "load", lambda self: setattr(self, "status", status) or status)
    monkeypatch.setattr(CompileCache, "save", lambda self: False)
    cfg = load_config(None, ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "pool.n_experts=4"])
    model = build_model(cfg.model, cfg.pool, 20, "cpu")
    sampling._set_up(model, [0], 64, 32, (0.0, 0, 1.0), False, None, ("auto", True, True), set())
    assert seen["threads"] == (threads_inside or inductor_config.compile_threads)
    assert "torch.utils.bundled_inputs" in compile_cache.recorded_imports(tmp_path / "compile")


def test_a_set_up_that_loads_every_piece_whole_runs_one_compile_thread(tmp_path, monkeypatch):
    import sys
    import torch._inductor.config as inductor_config
    from minagi import sampling
    seen = {}

    class LoadingDecoder:  # stands in for the CUDA-only compiled decoder: its pieces' loads import a module
        def __init__(self, *args, pieces=None, **kwargs):
            import torch.utils.bundled_inputs  # noqa: F401
            seen["threads"], seen["pieces"] = inductor_config.compile_threads, pieces

        def prepare_slides(self, sizes):
            pass

    monkeypatch.setattr(compile_cache, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(sampling, "aot_available", lambda: True)
    monkeypatch.setattr(sampling, "Decoder", LoadingDecoder)
    monkeypatch.setattr(sampling, "compiled_pieces", lambda: (None,) * 4)
    monkeypatch.delitem(sys.modules, "torch.utils.bundled_inputs", raising=False)
    monkeypatch.setattr(PrecompiledPieces, "complete", lambda self: True)
    monkeypatch.setattr(PrecompiledPieces, "status", "hit")
    monkeypatch.setattr(CompileCache, "load", lambda self: pytest.fail("torch's caches are not needed"))
    cfg = load_config(None, ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "pool.n_experts=4"])
    model = build_model(cfg.model, cfg.pool, 20, "cpu")
    with inductor_config.patch(compile_threads=4):  # not monkeypatch: its undo hides a torch setting
        _, ready = sampling._set_up(model, [0], 64, 32, (0.0, 0, 1.0), False, None, ("auto", True, True), set())
    assert seen["threads"] == 1 and len(seen["pieces"]) == 4 and ready.cache == "precompiled hit"


def test_a_piece_whose_file_did_not_load_has_its_compile_saved_in_torchs_caches(tmp_path, monkeypatch):
    """Every file was there, so torch's caches were not loaded; a piece whose file then did not load
    ran torch.compile: what it compiled is written for the next run (which reads the refusal)."""
    from minagi import sampling

    class Decoder:
        def __init__(self, *args, **kwargs):
            pass

        def prepare_slides(self, sizes):
            pass

    saved = []
    monkeypatch.setattr(compile_cache, "default_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(sampling, "aot_available", lambda: True)
    monkeypatch.setattr(sampling, "Decoder", Decoder)
    monkeypatch.setattr(sampling, "compiled_pieces", lambda: (None,) * 4)
    monkeypatch.setattr(PrecompiledPieces, "complete", lambda self: True)
    monkeypatch.setattr(PrecompiledPieces, "status", "fallback")
    monkeypatch.setattr(CompileCache, "load", lambda self: pytest.fail("every file was there"))
    monkeypatch.setattr(CompileCache, "save", lambda self: saved.append(self.status) or True)
    cfg = load_config(None, ["model.n_rows=1", "model.d_model=32", "model.n_heads=2", "pool.n_experts=4"])
    _, ready = sampling._set_up(build_model(cfg.model, cfg.pool, 20, "cpu"), [0], 64, 32, (0.0, 0, 1.0), False, None,
                                ("auto", True, True), set())
    assert saved == ["miss"] and ready.cache == "miss"


def test_a_refused_piece_leaves_the_set_incomplete_so_torchs_caches_serve_it(tmp_path):
    pieces = _pieces(tmp_path, {"a": lambda x: x, "b": lambda x: x})
    pieces.folder.mkdir(parents=True)
    for name in ("a", "b"):
        (pieces.folder / f"{name}.bin").write_bytes(b"made")
    assert pieces.complete()
    (pieces.folder / "b.refused").write_text("UnpicklingError: could not find MARK\n")
    assert not pieces.complete()


def test_inductors_generated_modules_are_not_recorded(tmp_path, monkeypatch):
    import sys
    import types
    generated = "torch._inductor.runtime.compile_tasks.cminagitestkernel"
    module = types.ModuleType(generated)
    module.__spec__ = None  # what inductor's loader leaves: made from code, not found by an import
    monkeypatch.setitem(sys.modules, generated, module)
    before = set(sys.modules) - {generated, "torch.nn.functional"}
    assert compile_cache.record_compile_imports(before, tmp_path)
    assert compile_cache.recorded_imports(tmp_path) == ("torch.nn.functional",)


def test_a_failing_dynamo_import_stops_the_thread_before_the_error_goes_up(monkeypatch):
    import builtins
    import time
    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name == "torch._dynamo":
            raise ImportError("dynamo broken here")
        return real_import(name, *args, **kwargs)
    started = []
    real_thread = compile_cache.threading.Thread

    def recording_thread(*args, **kwargs):
        started.append(real_thread(*args, **kwargs))
        return started[-1]
    monkeypatch.setattr(compile_cache.threading, "Thread", recording_thread)
    monkeypatch.setattr(compile_cache, "_hash_triton", lambda: None)
    monkeypatch.setattr(compile_cache, "_import_all", lambda names, recorded=False: time.sleep(0.5))  # a slow import
    monkeypatch.setattr(builtins, "__import__", failing)
    with pytest.raises(ImportError, match="dynamo broken"):
        compile_cache.warm_compiler(("json",))
    monkeypatch.undo()
    assert len(started) == 1 and not started[0].is_alive()
