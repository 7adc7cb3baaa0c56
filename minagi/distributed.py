"""Multi-process training under torchrun: the rank variables, the process group, and the few
collectives the trainer needs.

    torchrun --nproc_per_node=N train.py --profile ...     # DDP: NCCL on GPUs, gloo on the CPU

This is the one module under minagi/ that reads the environment (GUIDE convention 1): torchrun
hands every worker RANK, WORLD_SIZE and LOCAL_RANK (`rank_info`); MASTER_ADDR / MASTER_PORT are read
by torch's own `env://` rendezvous. Without them there is one process and nothing here does
anything: every helper is the identity for world_size 1.

Setup decisions (the run name, whether the run folder is free, the checkpoint to resume, the corpus
cache) are taken on rank 0 and shared, so every rank goes on, or fails with rank 0's error, together
(`from_main`, `main_first`); a rank that stopped alone would leave the others waiting in a collective.
"""
from __future__ import annotations

import inspect
import os
import pickle
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

__all__ = ["LaunchError", "RankInfo", "all_reduce_sum", "destroy_process_group", "from_main",
           "init_process_group", "wrap_ddp", "is_shared_error", "launch_local",
           "main_first", "mean_over_ranks", "one_rank_group", "process_group", "rank_info",
           "windows_store_without_libuv"]

T = TypeVar("T")
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# Set on an exception a rank re-raises because rank 0 raised it: only rank 0 needs to print it.
_SHARED_ATTR = "minagi_raised_on_rank0"


class LaunchError(RuntimeError):
    """torchrun's rank variables are missing or inconsistent, or a rank has no device (one line)."""


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0            # this process among all of the job's
    world_size: int = 1      # processes in the job
    local_rank: int = 0      # this process among those of its machine: its GPU index

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo:
    """This process's place in a torchrun job (RANK, WORLD_SIZE, LOCAL_RANK); one process without them."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" not in env:
        return RankInfo()
    try:
        values = {name: int(env.get(name, "0")) for name in _RANK_VARS}
    except ValueError:
        shown = ", ".join(f"{n}={env.get(n)!r}" for n in _RANK_VARS)
        raise LaunchError(f"torchrun's rank variables must be integers; got {shown}") from None
    rank, world_size, local_rank = (values[n] for n in _RANK_VARS)
    if world_size < 1 or not 0 <= rank < world_size or not 0 <= local_rank <= rank:
        raise LaunchError(f"inconsistent rank variables RANK={rank} WORLD_SIZE={world_size} "
                          f"LOCAL_RANK={local_rank}; launch with torchrun --nproc_per_node=N")
    return RankInfo(rank, world_size, local_rank)


# ---------------------------------------------------------------------------- launching

def launch_local(nproc: int, script: str, script_args: list[str], module: bool = False) -> int:
    """Run `script script_args` as `nproc` ranks on this machine through torchrun's own launcher
    (`torchrun --standalone --nproc_per_node=nproc`, in this process); returns the job's exit code.
    module: `script` names a module, run as `python -m script` (torchrun's -m).

    torchrun reports any worker's non-zero exit as a ChildFailedError traceback of ~40 lines and exits
    1, whatever the worker said and returned. Here the worker's own report (one line from rank 0) is
    the whole report, and its exit code the job's: the first rank to fail, or 128 + the signal that
    killed it (then this says so: a rank killed by a signal could print nothing).
    """
    import logging

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # The agent logs each failure (and its rendezvous chatter) besides raising it: the rank has spoken.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    windows_store_without_libuv()
    args = torchrun.parse_args(["--standalone", f"--nproc_per_node={nproc}", *(["-m"] if module else []), script,
                                *script_args])
    try:
        torchrun.run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        print(f"error: rank {rank} (pid {failure.pid}) was killed by signal {-failure.exitcode} "
              f"({failure.signal_name()})", file=sys.stderr)
        return 128 - failure.exitcode
    except SignalException as e:  # Ctrl-C or a kill of this launcher: the ranks report their own
        return 128 + int(e.sigval)
    return 0


# ---------------------------------------------------------------------------- the process group

def init_process_group(info: RankInfo, device: torch.device) -> torch.device:
    """Join the job's process group (NCCL for CUDA, gloo for the CPU); returns this rank's device.

    On CUDA each rank takes GPU LOCAL_RANK and makes it current, so "cuda" means that GPU from here
    on (collectives, broadcast_object_list and the trainer's tensors all land there).
    """
    if not info.distributed:
        return device
    windows_store_without_libuv()
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if info.local_rank >= visible:
            raise LaunchError(f"LOCAL_RANK {info.local_rank} has no GPU: {visible} visible; use "
                              f"torchrun --nproc_per_node <= {visible}")
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
        # device_id binds NCCL's communicator to this GPU now (no guessing in barrier / first collective).
        backend = gpu_backend()
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size,
                                **({"device_id": device} if backend == "nccl" else {}))
    else:
        dist.init_process_group("gloo", rank=info.rank, world_size=info.world_size)
    return device


def windows_store_without_libuv() -> None:
    """USE_LIBUV=0 on Windows unless set: torch 2.4-2.6 asked its TCPStore for libuv there, which Windows
    builds lack ("use_libuv was requested but PyTorch was build without libuv support", pytorch#139990;
    the environment variable is that issue's workaround). The ranks inherit it."""
    if sys.platform == "win32":
        os.environ.setdefault("USE_LIBUV", "0")


def gpu_backend() -> str:
    """NCCL (RCCL on ROCm) where this torch has it; gloo where it does not: Windows builds have no NCCL."""
    return "nccl" if dist.is_nccl_available() else "gloo"


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(info: RankInfo, device: torch.device) -> Iterator[torch.device]:
    """`init_process_group` ... `destroy_process_group`, also on errors; identity on one process."""
    device = init_process_group(info, device)
    try:
        yield device
    finally:
        if info.distributed:
            destroy_process_group()


@contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A process group of this process alone (an in-memory store, no rendezvous, no environment), so
    that FSDP2 can wrap a model in one process: what tools/bench_train.py measures its cost with.
    Nothing when a group is joined already."""
    if dist.is_initialized():
        yield
        return
    backend = gpu_backend() if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device} if backend == "nccl" and device.index is not None else {}))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _active(world_size: int) -> bool:
    if world_size <= 1:
        return False
    if not (dist.is_available() and dist.is_initialized()):
        raise LaunchError(f"world_size {world_size} needs the process group: launch with torchrun "
                          "(train.py joins it) or call minagi.distributed.init_process_group first")
    if dist.get_world_size() != world_size:
        raise LaunchError(f"world_size {world_size} but the process group has {dist.get_world_size()} ranks")
    return True


# ---------------------------------------------------------------------------- reductions

def all_reduce_sum(t: Tensor) -> Tensor:
    """The sum over ranks of `t`, as a new tensor (`t` stays this rank's).

    The pools' `count_reducer` under DDP (given when the model is built): called inside the forward
    on detached counts, once per pool per forward
    on every rank (every pool routes every call; a row's checkpoint replay reuses the forward's sum),
    so it is an ordinary collective for DDP.
    """
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def wrap_ddp(model: torch.nn.Module, device: torch.device, ignore: list[str] = ()) -> DistributedDataParallel:
    """DDP around `model` for the training forward (and backward's gradient averaging).

    find_unused_parameters stays off: an expert stack is one parameter, and every dispatch path
    gives all of it a gradient (zeros for idle experts) whenever the pool routes a row
    (tests/test_ddp.py checks it). Frozen parameters (requires_grad False) are left out of the
    gradient buckets by DDP itself. Buffers are not broadcast before each forward: the selection bias
    is kept identical on every rank by the summed loads, and frozen stacks are the same everywhere.
    """
    # `ignore`: buffers DDP must neither broadcast at start nor sync (frozen stacks: the same on every
    # rank already, gigabytes, and, offloaded, on the CPU where NCCL cannot reach them).
    model._ddp_params_and_buffers_to_ignore = list(ignore)
    no_buffer_sync = ({"forward_sync_buffers": False}  # newer torch's name (still syncs at init: fine)
                      if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   gradient_as_bucket_view=True, **no_buffer_sync)


def mean_over_ranks(t: Tensor, world_size: int) -> Tensor:
    """Element-wise mean over ranks of a small tensor (identity on one process)."""
    if not _active(world_size):
        return t
    return all_reduce_sum(t) / world_size


# ---------------------------------------------------------------------------- decisions taken on rank 0

def _shareable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling (the broadcast), else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # any pickling failure: fall back to the message
        return RuntimeError(f"{type(error).__name__}: {error}")


def _outcome_of_main(fn: Callable[[], T], rank: int, want_value: bool) -> tuple[bool, T | None]:
    """Run fn on rank 0; every rank learns whether it succeeded (and, if want_value, its value).
    Raises rank 0's exception on every rank when it failed."""
    value, error = None, None
    if rank == 0:
        try:
            value = fn()
        except Exception as e:  # handed to every rank below, then re-raised on rank 0 as itself
            error = e
    box = [(_shareable(error) if error is not None else None, value if want_value else None)]
    dist.broadcast_object_list(box, src=0)
    shared_error, shared_value = box[0]
    if shared_error is not None:
        if rank == 0:
            raise error
        setattr(shared_error, _SHARED_ATTR, True)
        raise shared_error
    return rank == 0, value if rank == 0 else shared_value


def from_main(fn: Callable[[], T], rank: int, world_size: int) -> T:
    """fn() run on rank 0 only; every rank returns its (picklable) value or raises its exception."""
    if not _active(world_size):
        return fn()
    return _outcome_of_main(fn, rank, want_value=True)[1]


def main_first(fn: Callable[[], T], rank: int, world_size: int) -> T:
    """fn() on rank 0, then, if it succeeded, on every other rank (each returns its own value).

    For work with a side effect the others can reuse (the corpus cache) or that fails the same way
    everywhere (a bad checkpoint): rank 0's error is raised on every rank, once decided.
    """
    if not _active(world_size):
        return fn()
    ran, value = _outcome_of_main(fn, rank, want_value=False)
    return value if ran else fn()


def is_shared_error(error: BaseException) -> bool:
    """True when this rank raised `error` because rank 0 did (rank 0 reports it; the others need not)."""
    return bool(getattr(error, _SHARED_ATTR, False))
