"""train.compile: a compiled training step computes what the eager one does; on the GPU's native path
routing that changes from step to step recompiles nothing, and the SwiGLU kernels stay in."""
import pytest
import torch

from minagi.config import load_config
from minagi.trainer import build_training, train_step

TINY = ["model.n_rows=2", "model.d_model=32", "model.n_heads=2", "model.context=16", "pool.n_experts=4",
        "pool.top_k=2", "pool.d_expert=32", "train.batch_size=4", "train.steps=20", "train.warmup_steps=2"]


def losses(sets, device, steps=3, compile_backend=None):
    cfg = load_config(None, TINY + [f"train.device={device}", *sets])
    training = build_training(cfg, 13, torch.device(device), 1)
    if compile_backend is not None:
        training.forward = torch.compile(training.model, backend=compile_backend)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)  # new characters each step: new routing
        x, y = (torch.randint(0, 13, (4, 16), generator=g).to(device) for _ in range(2))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            out.append(train_step(training, x, y, step=step, grad_clip=1.0, world_size=1,
                                  device=torch.device(device)).ce)
        training.updating = False
    return out


@pytest.mark.parametrize("sets", [[], ["model.mlp=dense"], ["model.dropout=0.0", "pool.capacity_factor=1.0"]],
                         ids=["pooled", "dense", "capacity"])
def test_a_compiled_step_computes_what_the_eager_step_does_on_the_cpu(sets):
    torch._dynamo.reset()
    eager = losses(sets, "cpu")
    compiled = losses(sets, "cpu", compile_backend="aot_eager")
    torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_native_path_compiles_once_whatever_the_routing_and_keeps_the_swiglu_kernels(monkeypatch):
    from minagi import swiglu
    kernels, calls = swiglu._kernels(), {"forward": 0, "backward": 0}

    class Counting:
        def forward(self, *args):
            calls["forward"] += 1
            return kernels.forward(*args)

        def backward(self, *args):
            calls["backward"] += 1
            return kernels.backward(*args)
    monkeypatch.setattr(swiglu, "_KERNELS", Counting())
    native = ["pool.dispatch=native"]
    eager = losses(native, "cuda", steps=6)
    graphs = {}
    for steps in (1, 6):
        torch._dynamo.reset()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        calls.update(forward=0, backward=0)
        compiled = losses(native, "cuda", steps=steps, compile_backend="inductor")
        graphs[steps] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    torch._dynamo.reset()
    assert compiled == pytest.approx(eager, rel=2e-2)
    assert graphs[6] == graphs[1]  # five more steps of new routing: no recompile
    assert calls["forward"] == calls["backward"] == 6 * 2  # two rows a step, through the custom op


def test_compile_without_triton_on_a_gpu_is_refused_at_start_in_one_line(monkeypatch):
    from minagi import devices
    from minagi.config import ConfigError
    monkeypatch.setattr(devices, "has_triton", lambda: False)
    cuda = torch.device("cuda")  # the check needs no GPU: it runs before anything touches one
    for setting in (True, "rows"):
        with pytest.raises(ConfigError, match=r'^train\.compile = .*Triton.*set train\.compile = "rows" with '
                                              r'train\.compile_backend = "cudagraphs" and train\.compile_mode = '
                                              r'"default" .*or train\.compile = false') as err:
            devices.check_compiler(setting, cuda)
        assert "\n" not in str(err.value) and err.value.key == "train.compile"
        devices.check_compiler(setting, cuda, "cudagraphs")  # CUDA graphs of torch's kernels: no Triton
    devices.check_compiler(False, cuda)                    # eager needs nothing
    devices.check_compiler(True, torch.device("cpu"))      # the CPU compiles through C++, not Triton
    with pytest.raises(ConfigError, match=r'^train\.compile = .rows. with train\.compile_backend = "cudagraphs": '
                                          r'.*need a GPU \(cpu here\); use train\.compile_backend = "inductor"$') as err:
        devices.check_compiler("rows", torch.device("cpu"), "cudagraphs")
    assert err.value.key == "train.compile_backend"
    devices.check_compiler(False, torch.device("cpu"), "cudagraphs")  # nothing compiled: nothing to refuse
    cfg = load_config(None, TINY + ["train.compile=true", "train.device=cpu"])
    monkeypatch.setattr(devices, "has_triton", lambda: True)
    devices.check_compiler(cfg.train.compile, cuda)


def test_compile_on_a_windows_cpu_without_a_cpp_compiler_is_refused_at_start_in_one_line(monkeypatch):
    import shutil

    from minagi import devices
    from minagi.config import ConfigError
    monkeypatch.setattr(devices.sys, "platform", "win32")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"^train\.compile = true on the CPU: .*no C\+\+ compiler on PATH .*"
                                          r"set train\.compile = false") as err:
        devices.check_compiler(True, torch.device("cpu"))
    assert "\n" not in str(err.value) and err.value.key == "train.compile"
    devices.check_compiler(False, torch.device("cpu"))  # eager needs none
    monkeypatch.setattr(shutil, "which", lambda name: "C:/llvm/bin/clang-cl.exe" if name == "clang-cl" else None)
    devices.check_compiler("rows", torch.device("cpu"))
    monkeypatch.setattr(devices.sys, "platform", "linux")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    devices.check_compiler(True, torch.device("cpu"))  # elsewhere inductor finds its compiler itself


def test_train_py_refuses_compile_without_triton_before_the_run_folder_is_made(monkeypatch, tmp_path, capsys):
    from minagi import train as train_py
    from minagi import devices
    monkeypatch.setattr(devices, "has_triton", lambda: False)
    monkeypatch.setattr(devices, "choose_device", lambda requested, option="train.device": torch.device("cuda"))
    code = train_py.main(["--profile", "cpu_tiny", "--set", "train.compile=rows", "--set", f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Triton" in err[0] and not any(tmp_path.iterdir())


@pytest.mark.parametrize("profile", [None, "cuda_small"], ids=["default", "named"])
@pytest.mark.parametrize("hip", [None, "6.4"], ids=["nvidia", "rocm"])
def test_a_profiles_compile_on_a_gpu_without_triton_becomes_what_runs_there(monkeypatch, hip, profile):
    """The README's first command on a Triton-less GPU (Windows): cuda_small compiles the whole step
    through inductor, which cannot run there; it takes the cudagraphs backend around the rows instead
    (NVIDIA) or trains eagerly (ROCm; or where CUDA graphs are refused), says so in one line, and that
    config is not refused at start. A train.compile* of the user's own --set is left as given. Triton
    is asked after the allocator's settings (asking it starts CUDA), never by resolve (--plan, the
    --nproc-per-node launcher)."""
    import argparse

    from minagi import devices
    from minagi import train as train_py
    order = []
    monkeypatch.setattr(devices, "has_triton", lambda: order.append("has_triton") or False)
    monkeypatch.setattr(devices, "apply_alloc_conf", lambda conf: order.append("alloc_conf"))
    monkeypatch.setattr(devices, "choose_device", lambda requested, option="train.device": torch.device(
        "cpu" if requested == "cpu" else "cuda"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)

    def preflight(*sets):
        order.clear()
        args = argparse.Namespace(profile=profile, sets=list(sets), data=None, resume=None, run_name=None, init=None)
        cfg, name = train_py.resolve(args)
        assert not order  # resolve asks nothing of the GPU
        cfg = train_py._preflight(cfg, name, args.sets)[0]
        assert order[:1] == ["alloc_conf"]
        return cfg
    with pytest.warns(UserWarning, match="^cuda_small: no Triton here, which its train.compile needs: ") as said:
        cfg = preflight("train.steps=7")
    assert cfg.train.steps == 7 and len([w for w in said if str(w.message).startswith("cuda_small: no")]) == 1
    graphs = (cfg.train.compile, cfg.train.compile_backend, cfg.train.compile_mode) == ("rows", "cudagraphs", "default")
    assert graphs if hip is None else cfg.train.compile is False
    with pytest.warns(UserWarning, match="trained eagerly instead"):
        assert preflight("train.accum_steps=2").train.compile is False  # CUDA graphs would be refused
    from minagi.config import ConfigError
    with pytest.raises(ConfigError, match="Triton"):
        preflight("train.compile=true")  # the user's own: as given, and refused
    with pytest.raises(ConfigError, match="Triton"):
        preflight("train.compile = true")  # spaced, as --set allows: still the user's own
    assert preflight("train.device=cpu").train.compile is True  # the CPU compiles through C++
    monkeypatch.setattr(devices, "has_triton", lambda: True)
    assert preflight().train.compile is True and devices.triton_less_settings(cfg.train) == ({}, None)


def test_train_py_refuses_cuda_graphs_with_micro_batches_before_the_run_folder_is_made(tmp_path, capsys):
    from minagi import train as train_py
    code = train_py.main(["--profile", "cpu_tiny", "--set", "train.compile=rows", "--set",
                          "train.compile_mode=reduce-overhead", "--set", "train.accum_steps=2",
                          "--set", f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "169545" in err[0] and not any(tmp_path.iterdir())


@pytest.mark.parametrize("sets", [["pool.dispatch=grouped"], ["model.mlp=dense"],
                                  ["pool.dispatch=grouped", "pool.capacity_factor=1.0", "model.dropout=0.0"],
                                  ["pool.dispatch=grouped", "pool.balance_scope=sequence", "pool.z_loss_coef=0.001"],
                                  ["pool.dispatch=rectangle", "pool.aux_free_bias=true"],
                                  ["pool.dispatch=grouped", "train.precision=bf16"]],
                         ids=["pooled", "dense", "capacity", "sequence-scope-z-loss", "rectangle-aux-free", "bf16"])
def test_rows_compiled_by_region_compute_what_the_eager_step_does_on_the_cpu(sets, monkeypatch):
    """The attention half, and the router with its aux terms and dispatch plan (or the dense MLP)."""
    from minagi import pool
    eager_plans = []
    make_plan = pool.make_plan
    monkeypatch.setattr(pool, "make_plan", lambda *a, **k: (eager_plans.append(1) if not torch.compiler.is_compiling()
                                                            else None, make_plan(*a, **k))[1])
    torch._dynamo.reset()
    eager = losses(sets, "cpu", steps=4)
    pooled = sets != ["model.mlp=dense"]
    assert len(eager_plans) == 2 * 4 * pooled  # the counter sees eager plans: two rows, four steps
    cfg = load_config(None, TINY + ["train.device=cpu", "train.compile=rows", *sets])
    training = build_training(cfg, 13, torch.device("cpu"), 1)
    assert all(row._compiled_half is not None for row in training.model.rows) and training.forward is training.model
    assert all((row._compiled_dense_row is not None) != pooled for row in training.model.rows)
    assert all((row._compiled_half_route is not None) == pooled for row in training.model.rows)
    assert not any("_orig_mod" in k for k in training.model.state_dict())  # checkpoints as eager ones
    from torch._dynamo.utils import counters
    counters.clear()
    first = losses(sets + ["train.compile=rows"], "cpu", steps=1)
    frames, graphs = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    eager_plans.clear()
    compiled = losses(sets + ["train.compile=rows"], "cpu", steps=4)  # a new model: the same code, routing changing
    assert counters["frames"]["total"] == frames and counters["stats"]["unique_graphs"] == graphs  # no recompile
    # Whatever the rows, one graph (pooled: the attention half with the router and its plan; dense: the
    # whole row); none broken; every plan made in the compiled route.
    assert graphs == 1 and not counters["graph_break"] and not eager_plans
    torch._dynamo.reset()
    assert first == compiled[:1] and compiled == pytest.approx(eager, rel=1e-4)


def test_the_compiled_route_hands_the_experts_their_inputs_cast_and_keeps_the_unread_scores_in(monkeypatch):
    """bf16 autocast (on the CPU here): the experts' input and gates come out of the route's graph in
    bf16 (their casts fused there), and with the aux loss made inside, the scores and logits stay in
    (an output nobody reads would get a zero gradient made for it in backward)."""
    from minagi.pool import PooledMLP
    seen = []
    experts_forward, route_and_plan = PooledMLP.experts_forward, PooledMLP.route_and_plan

    def spy_experts(self, x_ND, ids, gates_NK, *a, **k):
        seen.append((x_ND.dtype, gates_NK.dtype))
        return experts_forward(self, x_ND, ids, gates_NK, *a, **k)

    def spy_route(self, *a):
        out = route_and_plan(self, *a)
        seen.append(tuple(t is None for t in out[0][0][2:]))
        return out
    monkeypatch.setattr(PooledMLP, "experts_forward", spy_experts)
    monkeypatch.setattr(PooledMLP, "route_and_plan", spy_route)
    torch._dynamo.reset()
    losses(["pool.dispatch=grouped", "train.precision=bf16", "train.compile=rows"], "cpu", steps=1)
    torch._dynamo.reset()
    assert seen == [(True, True), (torch.bfloat16, torch.bfloat16)] * 2  # traced once a row, two rows
    seen.clear()
    pool_forward = PooledMLP.forward
    for sets, read in ((["pool.dispatch=grouped", "train.precision=bf16"], False), (["pool.dispatch=grouped"], True),
                       (["pool.dispatch=grouped", "train.precision=bf16", "pool.shared_experts=1"], True)):
        # The MLP's fp32 input keeps its gradient only where something reads it (the experts uncast, or
        # a shared expert): else backward would make a zero gradient for it.
        needs = []
        monkeypatch.setattr(PooledMLP, "forward", lambda self, x, *a, needs=needs, **k: (
            needs.append(x.requires_grad), pool_forward(self, x, *a, **k))[1])
        torch._dynamo.reset()
        losses(sets + ["train.compile=rows"], "cpu", steps=1)
        assert needs == [read, read], sets
    monkeypatch.undo()
    torch._dynamo.reset()
    seen.clear()
    monkeypatch.setattr(PooledMLP, "experts_forward", spy_experts)
    losses(["pool.dispatch=grouped", "train.precision=bf16"], "cpu", steps=1)  # eager: cast by the experts
    assert seen == [(torch.float32, torch.float32)] * 2


def test_the_cudagraphs_backend_takes_every_region_and_computes_what_eager_does_on_the_cpu(monkeypatch):
    """train.compile_backend = "cudagraphs" (no Triton): the rows' regions go to torch's cudagraphs backend,
    which on the CPU runs their traced graphs plainly (it says so: a skip a graph); the losses are eager's.
    (A run on the CPU is refused at start; the check is taken out here to reach the backend.)"""
    from torch._dynamo.utils import counters

    from minagi import assemble
    monkeypatch.setattr(assemble.devices, "check_compiler", lambda *args: None)
    sets = ["pool.dispatch=grouped"]
    eager = losses(sets, "cpu", steps=3)
    torch._dynamo.reset()
    counters.clear()
    traced = losses(sets + ["train.compile=rows", "train.compile_backend=cudagraphs"], "cpu", steps=3)
    torch._dynamo.reset()
    assert counters["stats"]["unique_graphs"] == 1 and counters["inductor"]["cudagraph_skips"] == 1  # a row's one graph
    assert traced == pytest.approx(eager, rel=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["train.compile_mode=reduce-overhead", "train.compile_backend=cudagraphs"],
                         ids=["inductor", "cudagraphs"])
@pytest.mark.parametrize("sets", [[], ["model.mlp=dense"]], ids=["pooled", "dense"])
def test_rows_with_cuda_graphs_compute_what_the_eager_step_does_and_compile_once(sets, backend):
    """"rows" with CUDA graphs (inductor's reduce-overhead, or the cudagraphs backend: no Triton): the
    regions replayed as CUDA graphs, the bucketed dispatch eager between them, the routing changing every
    step (one graph a row: the attention half with the router and its plan, or a dense twin's whole row)."""
    grouped = ["pool.dispatch=grouped", *sets]
    eager = losses(grouped, "cuda", steps=6)
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    rows = grouped + ["train.compile=rows", backend]
    first = losses(rows, "cuda", steps=1)
    frames, made = counters["frames"]["total"], counters["stats"]["unique_graphs"]
    compiled = losses(rows, "cuda", steps=6)  # a new model: the same code, routing changing
    torch._dynamo.reset()
    assert counters["frames"]["total"] == frames and counters["stats"]["unique_graphs"] == made == 1
    assert counters["inductor"]["cudagraph_skips"] == 0  # every graph replayed as a CUDA graph, none run plainly
    assert first == pytest.approx(compiled[:1], rel=1e-3) and compiled == pytest.approx(eager, rel=2e-2)


@pytest.mark.parametrize("device, paths, setting, said", [
    ("cuda", ["grouped"], True, True), ("cuda", ["triton"], True, False), ("cuda", [], True, False),
    ("cuda", ["grouped"], "rows", False), ("cpu", ["grouped"], True, False)],  # the CPU's note is train.py's
    ids=["bucketed", "triton", "dense", "rows", "cpu"])
def test_a_whole_step_compile_around_the_bucketed_path_on_a_gpu_is_said_once_at_start(device, paths, setting, said):
    from types import SimpleNamespace

    from minagi.assemble import _warn_whole_step_on_padded_paths
    model = SimpleNamespace(pools=lambda: [SimpleNamespace(path=p) for p in paths * 2])  # two rows
    lines = []
    _warn_whole_step_on_padded_paths(setting, model, torch.device(device), lines.append)
    assert lines == (['train.compile = true with the bucketed dispatch (grouped): its shapes change with the '
                      'routing, so the step recompiles at new ones; train.compile = "rows" compiles around the '
                      'experts'] if said else [])


def test_building_a_run_asks_that_question_of_its_model(monkeypatch):
    from minagi import assemble
    asked = []
    monkeypatch.setattr(assemble, "_warn_whole_step_on_padded_paths", lambda *args: asked.append(args[:1] + args[2:3]))
    build_training(load_config(None, TINY + ["train.device=cpu", "train.compile=true"]), 13, torch.device("cpu"), 1)
    torch._dynamo.reset()
    assert asked == [(True, torch.device("cpu"))]


@pytest.mark.parametrize("precision,silenced", [("bf16", True), ("fp32", False)])
def test_inductors_tf32_advice_is_silenced_only_where_the_fp32_matmuls_are_the_routers(precision, silenced):
    """In a bf16 step the fp32 matmul is the router's, fp32 on purpose; an fp32 run may want the advice."""
    import warnings
    cfg = load_config(None, TINY + ["train.device=cpu", "train.compile=true", f"train.precision={precision}"])
    with warnings.catch_warnings():  # the build's filters are undone on leaving
        build_training(cfg, 13, torch.device("cpu"), 1)
        ignored = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None
                   and f[1].match("TensorFloat32 tensor cores for float32 matrix multiplication available")]
    assert bool(ignored) == silenced
