"""Train a minagi character-level MoE model.

    python train.py                                   # cpu_tiny on a CPU, cuda_small with a GPU
    python train.py --profile h200 --data shakespeare.txt --set train.steps=20000
    python train.py --resume runs/cpu_tiny-20250101-120000 [--set train.steps=2000]
    torchrun --nproc_per_node=8 train.py --profile h200 ...   # DDP over 8 GPUs (docs/multi_gpu.md)
    torchrun --nproc_per_node=8 train.py --profile h200x8_fsdp ...   # FSDP2; --set train.expert_parallel=8
    python train.py --nproc-per-node 8 --profile h200 ...     # the same 8 ranks, launched by train.py
    python train.py --profile strix_large --plan              # will it fit? the predicted peak by part, then exit
    python -m minagi.train ...  /  minagi-train ...            # the same, installed (or -m from the clone)
    torchrun --nproc_per_node=8 -m minagi.train --profile h200 ...

Under torchrun every rank runs this file; rank 0 alone prints, shows progress and writes the run.
The environment is read here and only here: MINAGI_SWIGLU=auto|jiterator|eager sets pool.swiglu, and
MINAGI_REPLAY_PIN overrides experts.replay_pin (1/true/on/yes: on; 0/false/off/no: off; anything else,
or unset: the profile's setting).
Exit codes: 0 done, 2 bad configuration / data / checkpoint / run folder (a full disk included),
3 the loss became NaN/inf, 4 out of GPU memory, 130 Ctrl-C; with --nproc-per-node, the code of the
first rank to fail (128 + N for a rank killed by signal N). minagi's warnings (a skipped file, a
fitted warmup) are one stderr line each.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import NoReturn

# No torch in these two: a Ctrl-C while torch loads is ours to report.
from minagi.cli import OneLineParser, one_line_warnings, positive_int, utf8_stdout
from minagi.config import RESUMABLE_KEYS, ConfigError, ConfigNote, load_config, override_key

PLAN_TARGETS = ("sm90", "sm80", "sm75", "rocm", "cpu")  # minagi.plan.TARGETS (not imported here: no torch yet)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", help="a name in profiles/ or a .toml path "
                                     "(default: cuda_small with a GPU, cpu_tiny without)")
    p.add_argument("--data", help="corpus: file, directory or glob (overrides data.path); with --resume, "
                                  "where the run's corpus is now (its content must be the same)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help=f"override one setting (repeatable); on --resume only {', '.join(RESUMABLE_KEYS)}")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in this folder from its last.pt")
    p.add_argument("--run-name", help="the run folder's name under train.out_dir")
    p.add_argument("--init", metavar="CKPT", help="start from a trained checkpoint's weights and vocabulary (a .pt, "
                                                  "or a run folder: its best.pt, else last.pt); its expert stacks "
                                                  "quantized when the profile freezes them")
    p.add_argument("--plan", nargs="?", const="auto", choices=["auto", *PLAN_TARGETS], metavar="TARGET",
                   help="print the predicted memory peak of the settings by part (weights, gradients, optimizer "
                        "states, activations, ...) and exit, building nothing; TARGET: the kind of device "
                        f"({', '.join(PLAN_TARGETS)}; default: this machine's)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=positive_int, metavar="N",
                   help="train on N processes of this machine (DDP), launched as torchrun --standalone does: "
                        "the settings are checked for N ranks before any starts, and an error is one line "
                        "and its exit code (docs/multi_gpu.md)")
    return p.parse_args(argv)


_PIN_ON, _PIN_OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def environment_overrides(environ=os.environ) -> list[str]:
    """--set items from the environment: MINAGI_SWIGLU -> pool.swiglu, MINAGI_REPLAY_PIN -> experts.replay_pin."""
    sets = []
    value = environ.get("MINAGI_SWIGLU")
    if value is not None:
        if value not in ("auto", "jiterator", "eager"):
            raise ConfigError(f"environment variable MINAGI_SWIGLU: must be 'auto', 'jiterator' or 'eager'; got {value!r}",
                              "MINAGI_SWIGLU")
        sets.append(f"pool.swiglu={value}")
    pin = environ.get("MINAGI_REPLAY_PIN", "").strip().lower()
    if pin in _PIN_ON:
        sets.append("experts.replay_pin=on")  # on: every stack, no size floor
    elif pin in _PIN_OFF:
        sets.append("experts.replay_pin=off")
    return sets


def resolve(args: argparse.Namespace) -> tuple:
    """(config, profile name) from the arguments, or from the run folder on --resume."""
    from minagi.trainer import resume_config

    args.sets = environment_overrides() + args.sets  # a --set of the same key wins
    if args.data is not None:
        args.sets = [f"data.path={absolute(args.data)}", *args.sets]
    if args.resume:
        given = [flag for flag, value in (("--profile", args.profile), ("--run-name", args.run_name),
                                          ("--init", args.init)) if value]
        if given:
            raise ConfigError(f"{', '.join(given)} cannot be combined with --resume (the run keeps "
                              "its own settings; --set train.steps=N extends it, --data says where its "
                              "corpus is now)")
        return resume_config(args.resume, args.sets)
    profile = args.profile
    if profile is None:
        import torch  # is_available() asks the driver; it allocates nothing, so the alloc conf still applies
        profile = "cuda_small" if torch.cuda.is_available() else "cpu_tiny"
    cfg = load_config(profile, args.sets)
    # Paths as absolute ones: run.json and the checkpoints must name the same files from anywhere.
    data = dataclasses.replace(cfg.data, path=absolute(cfg.data.path), cache_dir=absolute(cfg.data.cache_dir))
    cfg = dataclasses.replace(cfg, data=data)
    if args.run_name is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_name=args.run_name))
    return cfg, Path(profile).stem


def triton_less_compile(cfg, device, profile: str, sets: list[str]):
    """`cfg`, its train.compile made what runs here: a compile through inductor on a GPU without Triton
    (cuda_small's, on Windows) cannot run, and takes `devices.triton_less_settings` instead, said in one
    line. A train.compile or train.compile_backend of the user's own --set is honoured as given (and
    refused if it cannot run); a train.compile_mode alone (as for accumulation) is not a choice of
    compiler. Asked after the allocator's settings: whether Triton can run asks the GPU."""
    from minagi import devices
    own = bool({"train.compile", "train.compile_backend"} & set(map(override_key, sets)))
    if device.type != "cuda" or cfg.train.compile is False or cfg.train.compile_backend != "inductor" or own:
        return cfg
    settings, why = devices.triton_less_settings(cfg.train)
    if not settings:
        return cfg
    warnings.warn(f"{profile}: {why}", stacklevel=1)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **settings))


def absolute(path: str) -> str:
    """`path` (a file, folder or glob; ~ expanded) as an absolute path; "" stays "" (the default)."""
    return os.path.abspath(os.path.expanduser(path)) if path else path


def launches(nproc_per_node: int | None, ranks: "distributed.RankInfo") -> bool:
    """Whether this process is to launch --nproc-per-node ranks, rather than train as one."""
    from minagi.distributed import LaunchError
    if nproc_per_node is None:
        return False
    if ranks.distributed:  # already one of N ranks: launch_local's, or torchrun's
        if ranks.world_size != nproc_per_node:
            raise LaunchError(f"--nproc-per-node {nproc_per_node}, but torchrun started {ranks.world_size} "
                              "ranks: leave --nproc-per-node out under torchrun")
        return False
    return nproc_per_node > 1  # one process needs no launcher


def compile_note(cfg, device) -> str | None:
    """A one-line warning for train.compile with experts on the CPU. The H200 profiles compile because
    there the experts run torch's grouped GEMM, whose shapes routing does not change; the CPU takes the
    bucketed path (dispatch.resolve_dispatch), whose shapes change every step, so the step recompiles
    until torch's recompile limit (8), then runs eagerly: minutes of compiling for no speed-up.
    Warned, not turned off: the run trains what its config says (run.json, a resume on the GPU), and
    an explicit --set train.compile=true (to try the compiler on the CPU) is honoured."""
    if cfg.train.compile is not True or cfg.model.mlp != "pooled" or device.type != "cpu":
        return None
    return ("train.compile is on, but on the CPU the experts' matmul shapes change with routing: "
            "the step recompiles until torch's recompile limit (minutes, its recompile-limit warnings, no "
            "speed-up); --set train.compile=false trains it eagerly from the start")


def _report(error: BaseException, ranks: "distributed.RankInfo", joined: bool) -> None:
    """One stderr line per error: rank 0 prints it; another rank only an error of its own (before
    the process group is joined, every rank has read the same command line and files)."""
    from minagi import distributed
    if ranks.is_main:
        print(f"error: {error}", file=sys.stderr)
    elif joined and not distributed.is_shared_error(error):
        print(f"error (rank {ranks.rank}): {error}", file=sys.stderr)


def main(argv: list[str] | None = None, *, entry: str | None = None) -> int:
    """entry: the script that runs this main (train.py's path), which --nproc-per-node launches; None
    (`python -m minagi.train`, `minagi-train`): the module, as `python -m minagi.train`."""
    exiting = argv is None  # the process's own command line: it ends when this returns
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    utf8_stdout()  # the corpus's file names, the plan
    try:
        with warnings.catch_warnings():
            code = _main(args, argv, entry)
    except KeyboardInterrupt:
        # Before train() took over (importing torch, reading the corpus, building the model): train()
        # itself reports a Ctrl-C during training, and what it saved.
        if os.environ.get("RANK", "0") == "0":
            print("interrupted before training began; no checkpoint was written", file=sys.stderr)
        code = 130
    if code == 130 and exiting and threading.current_thread() is threading.main_thread():
        # Saved and said: a second Ctrl-C now would only break torch's exit handlers with a traceback.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if exiting and _is_rank():
        _leave_as_rank(code)
    return code


def _is_rank() -> bool:
    """A torchrun worker of a job of several (the launcher of --nproc-per-node is not one). Read here,
    not through distributed.rank_info, whose module imports torch: a Ctrl-C during torch's import ends
    up here too, and must not import it again."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:  # reported by _main already
        return False


def _leave_as_rank(code: int) -> NoReturn:
    """End a rank's process without the interpreter's finalisation. About one two-rank gloo run in 30
    on a busy 2-core host aborted there ("terminate called without an active exception", SIGABRT,
    no Python frame left: a C++ thread of the job destroyed still joinable; docs/LOG.md, session 20),
    after the run had finished and written everything. By here every file the run opened is closed
    (checkpoints and history written and fsynced, the run folder released) and the process group
    destroyed: what is left to do is flush what Python buffers (a closed pipe, `| head`, takes none)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _invoked_as(entry: str | None) -> list[str]:
    """How this process was started, for run.json: train.py, python -m minagi.train, or a console command."""
    if entry is not None:
        return ["train.py"]
    started = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] else None
    return ["-m", "minagi.train"] if started in (None, Path(__file__).resolve()) else [sys.argv[0]]


def _launch(nproc: int, entry: str | None, argv: list[str]) -> int:
    """--nproc-per-node: `nproc` ranks of the entry script, or of `python -m minagi.train` without one."""
    from minagi import distributed
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets, without its 6-line notice
    if entry is None:
        return distributed.launch_local(nproc, "minagi.train", argv, module=True)
    return distributed.launch_local(nproc, entry, argv)


_OOM_ADVICE = ("--plan shows where the memory goes: lower train.batch_size (raise train.accum_steps to keep the "
               "step) or model.context, or turn on train.checkpoint_rows, or train.optimizer_states = \"bf16\", "
               "or keep frozen experts on the CPU with experts.offload = \"cpu\"")


def _preflight(cfg, profile: str, sets: list[str]):
    """(config, device): the device chosen once (under DDP, the rank's GPU of it), after what must come
    before anything touches the GPU (the allocator reads its settings at the first allocation); a
    compile that cannot run here made one that can (`triton_less_compile`); the refusals that must
    come before the run folder is made (no Triton for train.compile, no TensorBoard package)."""
    from minagi import devices, watch
    devices.apply_alloc_conf(cfg.memory.alloc_conf)
    device = devices.choose_device(cfg.train.device)
    cfg = triton_less_compile(cfg, device, profile, sets)
    devices.check_compiler(cfg.train.compile, device, cfg.train.compile_backend)
    watch.require(cfg.train.tensorboard)
    note = compile_note(cfg, device)
    if note:
        warnings.warn(note, stacklevel=1)
    return cfg, device


def _main(args: argparse.Namespace, argv: list[str], entry: str | None) -> int:
    import torch
    from minagi import devices, distributed
    from minagi.checkpoint import CheckpointError
    from minagi.data import DataError
    from minagi.runlog import RunFolderError
    usage_errors = (ConfigError, DataError, CheckpointError, RunFolderError, devices.DeviceError,
                    distributed.LaunchError)
    try:
        ranks = distributed.rank_info()  # torchrun's RANK / WORLD_SIZE / LOCAL_RANK; one process without
    except distributed.LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    warnings.showwarning = one_line_warnings(ranks.is_main)
    joined = False
    try:
        launching = launches(args.nproc_per_node, ranks)
        with warnings.catch_warnings():
            if launching and not args.plan:  # the ranks resolve it again, and rank 0 says its notes
                warnings.simplefilter("ignore", ConfigNote)
            cfg, profile = resolve(args)
        from minagi.trainer import NonFiniteLossError, check_world_size, train
        # With --nproc-per-node, for its N ranks before any of them starts (and imports torch).
        world_size = args.nproc_per_node if launching else ranks.world_size
        check_world_size(cfg, world_size, resuming=bool(args.resume))
        if args.plan:
            from minagi.plan_report import plan_report
            if ranks.is_main:
                vocab_size = _run_vocab(args.resume, args.init)
                print(plan_report(cfg, profile, args.plan, world_size=world_size, vocab_size=vocab_size))
            return 0
        if launching:
            return _launch(args.nproc_per_node, entry, argv)
        cfg, device = _preflight(cfg, profile, args.sets)
        with distributed.process_group(ranks, device) as device:
            joined = True
            devices.apply_memory_cap(cfg.memory.gpu_cap_gib, device)
            command = [sys.executable, *_invoked_as(entry), *argv]
            try:
                result = train(cfg, profile, args.resume, rank=ranks.rank, world_size=ranks.world_size,
                               device=device, argv=command, init=args.init)
            except NonFiniteLossError as e:
                # The loss checked is the mean over ranks: every rank stops at this step; rank 0 says so.
                if ranks.is_main:
                    print(f"error: {e}", file=sys.stderr)
                return 3
    except usage_errors as e:
        _report(_where_data_came_from(e, args), ranks, joined)
        return 2
    except torch.OutOfMemoryError as e:
        _report(RuntimeError(f"out of GPU memory ({str(e).splitlines()[0].rstrip('.')}); {_OOM_ADVICE}"), ranks, joined)
        return 4
    if result.interrupted:
        return 130
    if result.heldout_bpc is not None and ranks.is_main:
        print(f"final held-out: {result.heldout_loss:.4f} nats = {result.heldout_bpc:.4f} bits/char "
              f"(best {result.best_heldout_loss:.4f} nats) at step {result.step}; run folder {result.run_dir}")
    return 0


def _run_vocab(resume: str | None, init: str | None = None) -> int | None:
    """The vocabulary size a run will have, from run.json: the resumed run's, or that of the run whose
    checkpoint --init starts from (a run folder, or a checkpoint in one). None when there is neither,
    or it is not recorded: the plan then says it assumed one."""
    from minagi.runlog import read_run_info
    if resume:
        folder = Path(resume)
    elif init:
        folder = Path(init) if Path(init).is_dir() else Path(init).parent
        if not (folder / "run.json").is_file():  # a checkpoint outside its run folder: not read for a plan
            return None
    else:
        return None
    corpus = read_run_info(folder).get("corpus") or {}
    return corpus.get("vocab_size")


def _where_data_came_from(e: Exception, args: argparse.Namespace) -> Exception:
    """A data error of a path the profile gave (not --data, --set or a resumed run): named as the
    profile's, which the user may not know is where the path came from."""
    from minagi.data import DataError
    given = args.data is not None or args.resume or "data.path" in map(override_key, args.sets)
    if isinstance(e, DataError) and not given and args.profile:
        return DataError(f"{e} (data.path of the profile {args.profile}; --data PATH trains on another)")
    return e


if __name__ == "__main__":
    sys.exit(main())
