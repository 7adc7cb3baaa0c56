"""The training loop: AdamW + warmup/cosine, held-out evaluation, history records, checkpoints, resume.

Each step trains on `get_batch(train_ids, batch_size, context, seed, step)`: the batch is a pure
function of the step number, so a resumed run continues at exactly the data position it left, and
on the CPU reproduces the uninterrupted run's losses. Every `eval_every` steps and at the end: the
held-out loss, a history record, last.pt, and best.pt when the held-out loss improved.

Multi-process (DDP, launched by torchrun; docs/multi_gpu.md): with `world_size` > 1 the process
group must be joined (train.py does it, minagi.distributed). `train.batch_size` stays the global
batch: rank r trains on its `batch_size // world_size` rows of every step's batch, DDP averages the
gradients, and the routing counts (balance term, aux-free bias, sink diagnostics) are summed over
ranks, so N ranks train the run one process would. Rank 0 alone writes the run folder; every rank
resumes from its last.pt. The run name, the run folder check and the checkpoint are decided on
rank 0 and shared, so ranks go on, or fail, together.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from . import devices, distributed
from .checkpoint import capture_rng_state, copy_checkpoint, load_checkpoint, restore_rng_state, save_checkpoint
from .config import Config, ConfigError, apply_overrides, config_from_dict, config_to_dict
from .data import Vocab, get_batch, heldout_batches, load_corpus
from .model import build_model
from .runlog import HISTORY_FIELDS, History, read_run_info, write_run_info

__all__ = ["NonFiniteLossError", "TrainResult", "check_world_size", "lr_factor", "resume_config", "train"]

LN2 = math.log(2.0)
# The only setting a resumed run may change: extending it. Anything else would make the checkpoint
# and the run folder describe a run that never happened.
RESUMABLE_KEYS = ("train.steps",)


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/inf; raised before the step's update or any save."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


@dataclass
class TrainResult:
    run_dir: Path
    start_step: int                   # steps done when this call began (0 unless resumed)
    step: int                         # steps done when it returned
    losses: list[float] = field(default_factory=list)  # train cross-entropy of steps start_step+1..step
    heldout_loss: float | None = None  # the last evaluation's, in nats
    heldout_bpc: float | None = None
    best_heldout_loss: float = math.inf
    interrupted: bool = False         # Ctrl-C: last.pt holds `step`


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of train.lr for 0-based `step`: linear warmup to 1, then cosine down to min_ratio."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def resume_config(run_dir: str | Path, overrides: list[str] = ()) -> tuple[Config, str]:
    """(config, profile name) of the run in `run_dir`, with `--set train.steps=N` applied.

    Reads run.json (cheap); `train` checks it against last.pt, which is the truth.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        raise ConfigError(f"--resume {run_dir}: no run.json there (not a run folder)")
    info = read_run_info(run_dir)
    cfg = config_from_dict(info["config"], source=str(run_dir / "run.json"))
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key not in RESUMABLE_KEYS:
            raise ConfigError(f"--set {key}: cannot be changed when resuming (only "
                              f"{', '.join(RESUMABLE_KEYS)} may, to extend the run)", key)
    return apply_overrides(cfg, overrides), info["profile"]


def _check_resumed_config(cfg: Config, saved: Config, source: str) -> None:
    new, old = config_to_dict(cfg), config_to_dict(saved)
    for section, table in old.items():
        for key, value in table.items():
            if f"{section}.{key}" not in RESUMABLE_KEYS and new[section][key] != value:
                raise ConfigError(f"{section}.{key} = {new[section][key]!r} differs from the resumed "
                                  f"run's {value!r} ({source}); only {', '.join(RESUMABLE_KEYS)} may "
                                  "change on resume", f"{section}.{key}")


def check_world_size(cfg: Config, world_size: int) -> None:
    """train.batch_size is the global batch: it must split evenly over the ranks."""
    if cfg.train.batch_size % world_size:
        raise ConfigError(f"train.batch_size = {cfg.train.batch_size} is the global batch and must be a "
                          f"multiple of the {world_size} ranks (torchrun --nproc_per_node); use e.g. "
                          f"{-(-cfg.train.batch_size // world_size) * world_size}", "train.batch_size")


def _mean_over_ranks(total: float, count: int, device: torch.device, world_size: int) -> float:
    """Mean of per-rank sums over per-rank counts (identity on one rank)."""
    if world_size > 1:
        t = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
        total, count = distributed.mean_over_ranks(t, world_size).tolist()  # the ratio of sums
    return total / count


def _open_checkpoint(run_dir: Path, cfg: Config) -> dict:
    """last.pt of the run to resume, checked against `cfg` and `train.steps`."""
    ckpt = load_checkpoint(run_dir / "last.pt", map_location="cpu")
    _check_resumed_config(cfg, config_from_dict(ckpt["config"], source=str(run_dir / "last.pt")),
                          str(run_dir / "last.pt"))
    # At train.steps with its evaluation still due (Ctrl-C stopped it), the resume only runs that.
    if ckpt["step"] > cfg.train.steps or (ckpt["step"] == cfg.train.steps
                                          and not ckpt["meter"].get("eval_due", False)):
        raise ConfigError(f"train.steps = {cfg.train.steps}: the run in {run_dir} is already at step "
                          f"{ckpt['step']}; extend it with --set train.steps=<more>", "train.steps")
    return ckpt


def _new_run_name(cfg: Config, profile_name: str) -> str:
    """train.run_name or <profile>-<timestamp>, refusing a folder that already holds a run."""
    tc = cfg.train
    run_name = tc.run_name or f"{profile_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(tc.out_dir) / run_name
    history_path = run_dir / "history.jsonl"
    if (run_dir / "last.pt").exists() or (history_path.exists() and history_path.stat().st_size):
        raise ConfigError(f"train.run_name: {run_dir} already holds a run; resume it with "
                          f"--resume {run_dir} or choose another --run-name", "train.run_name")
    return run_name


@torch.no_grad()
def _evaluate(model, batches, device: torch.device, world_size: int) -> float:
    """Mean held-out cross-entropy in nats (the aux loss is a training term, not part of it)."""
    was_training = model.training
    model.eval()
    total = 0.0
    with devices.autocast(device):
        for x, y in batches:
            total += model(x.to(device, non_blocking=True), y.to(device, non_blocking=True)).loss.item()
    model.train(was_training)
    return _mean_over_ranks(total, len(batches), device, world_size)


def _fmt_bytes(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f}GiB"


def train(cfg: Config, profile_name: str, resume: str | Path | None = None, *,
          rank: int = 0, world_size: int = 1, progress: bool = True, argv: list[str] | None = None,
          log: Callable[[str], None] | None = None) -> TrainResult:
    """Train (or resume) one run; returns its per-step losses and held-out figures.

    resume: a run folder; its last.pt sets model, optimizer, scheduler, RNG and step, and `cfg` must
    equal the run's config except `train.steps` (see `resume_config`). Raises NonFiniteLossError on a
    NaN/inf loss, before anything is saved for that step. Ctrl-C saves last.pt and returns with
    `interrupted=True`.
    """
    is_main = rank == 0
    tc, mc = cfg.train, cfg.model
    say = (log or (lambda msg: tqdm.write(msg, file=sys.stdout))) if is_main else (lambda msg: None)
    check_world_size(cfg, world_size)
    device = devices.choose_device(tc.device)
    if world_size > 1 and device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # LOCAL_RANK's, made current at init

    # --- the run folder and, on resume, the checkpoint: decided on rank 0, shared with the others
    ckpt = None
    if resume is not None:
        run_dir = Path(resume)
        # Every rank loads last.pt (rank 0 first: a bad file is one error, raised on all ranks).
        ckpt = distributed.main_first(lambda: _open_checkpoint(run_dir, cfg), rank, world_size)
        vocab = Vocab.from_chars(ckpt["vocab"])
        run_name = ckpt["run_name"]
    else:
        # Timestamps may differ between ranks: rank 0 names the run for all.
        run_name = distributed.from_main(lambda: _new_run_name(cfg, profile_name), rank, world_size)
        run_dir = Path(tc.out_dir) / run_name
        vocab = None

    # Rank 0 encodes and caches the corpus; the others then read its cache entry.
    corpus = distributed.main_first(
        lambda: load_corpus(cfg.data.path, cfg.data.heldout_fraction, cfg.data.cache_dir, vocab=vocab),
        rank, world_size)
    vocab = corpus.vocab
    eval_batches = heldout_batches(corpus.heldout_ids, tc.batch_size, mc.context, tc.eval_batches,
                                   tc.seed, rank, world_size)

    # --- model, optimizer, schedule
    torch.manual_seed(tc.seed)
    model = build_model(mc, vocab.size, device)
    optimizer = torch.optim.AdamW(model.param_groups(tc.weight_decay), lr=tc.lr,
                                  betas=(tc.beta1, tc.beta2), fused=device.type == "cuda")
    schedule = lambda s: lr_factor(s, tc.steps, tc.warmup_steps, tc.min_lr_ratio)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    step, best, wall_s = 0, math.inf, 0.0
    loss_sum = aux_sum = norm_sum = 0.0
    since = 0  # steps since the last record (they may straddle a resume)
    eval_due = False  # the evaluation of `step` is still to run (Ctrl-C stopped it: the resume runs it first)
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        # The lambda is code, not state: recompute the next lr from it, so an extended run (a new
        # train.steps) follows its new cosine from here on. The same value otherwise, to the bit.
        for group, base_lr in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = base_lr * schedule(scheduler.last_epoch)
        restore_rng_state(ckpt["rng"])
        step, best = ckpt["step"], ckpt["best_heldout_loss"]
        meter = ckpt["meter"]
        loss_sum, aux_sum, norm_sum = meter["loss_sum"], meter["aux_sum"], meter["norm_sum"]
        since, wall_s = meter["since"], meter["wall_s"]
        eval_due = meter.get("eval_due", False)
        del ckpt  # the model and optimizer hold copies; free the CPU one
    start_step = step
    # The training forward goes through DDP (and compile); the optimizer, saving, evaluation,
    # diagnostics and the bias step use the plain module, so state dicts carry no `module.` or
    # `_orig_mod.` prefixes.
    forward = model
    if world_size > 1:
        distributed.install_count_reducers(model)
        forward = distributed.wrap_ddp(model, device)
    forward = torch.compile(forward) if tc.compile else forward
    params = [p for g in optimizer.param_groups for p in g["params"]]
    chars_per_step = tc.batch_size * mc.context

    def payload() -> dict:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "rng": capture_rng_state(),
                "config": config_to_dict(cfg), "vocab": vocab.chars, "step": step,
                "best_heldout_loss": best, "run_name": run_name,
                "meter": {"loss_sum": loss_sum, "aux_sum": aux_sum, "norm_sum": norm_sum,
                          "since": since, "wall_s": wall_s, "eval_due": eval_due}}

    def write_evaluation(record: dict, improved: bool) -> None:
        save_checkpoint(run_dir / "last.pt", payload())
        if improved:
            copy_checkpoint(run_dir / "last.pt", run_dir / "best.pt")
        # After the checkpoints: a crash in between loses a line, never duplicates one.
        history.append({k: record[k] for k in HISTORY_FIELDS})

    history = None
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_info(run_dir, config=config_to_dict(cfg), profile=profile_name,
                       device=devices.device_name(device), argv=argv if argv is not None else sys.argv,
                       world_size=world_size, resumed_at_step=step if resume is not None else None)
        history = History(run_dir / "history.jsonl")
    say(f"run folder: {run_dir}" + (f" (resumed at step {step})" if resume is not None else ""))

    result = TrainResult(run_dir=run_dir, start_step=start_step, step=step, best_heldout_loss=best)
    bar = tqdm(total=tc.steps, initial=step, file=sys.stderr, mininterval=1.0, dynamic_ncols=True,
               disable=True if not (progress and is_main) else None, unit="step")
    devices.memory_stats(device)  # reset the peaks: the first record covers this call's steps only
    interval_chars, interval_s = 0, 0.0
    updating = False  # True while parameters and optimizer state may disagree with `step`
    owed = None  # (record, improved) of an evaluation whose files are not all written yet
    lr = scheduler.base_lrs[0] * schedule(step - 1) if eval_due else None  # the last step's, for its record
    model.train()
    try:
        while step < tc.steps or eval_due:
            if eval_due:
                # Collectives follow (diagnostics, held-out): every rank runs this block.
                diagnostics = model.sink_diagnostics(reset=True)  # training steps' routing, all ranks
                heldout = _evaluate(model, eval_batches, device, world_size)
                model.sink_diagnostics(reset=True)                # drop the evaluation's routing
                if not math.isfinite(heldout):
                    raise NonFiniteLossError(f"step {step}: held-out loss is not finite ({heldout}); "
                                             f"stopped without saving; {run_dir / 'last.pt'} keeps the "
                                             "last good checkpoint", step)
                record = {
                    "step": step, "chars_seen": step * chars_per_step,
                    "train_loss": loss_sum / since, "aux_loss": aux_sum / since,
                    "grad_norm": norm_sum / since,
                    "heldout_loss": heldout, "heldout_bpc": heldout / LN2, "lr": lr,
                    "chars_per_s": interval_chars / interval_s if interval_s > 0 else None,
                    "wall_s": wall_s,
                    **devices.memory_stats(device),
                    "sinks": diagnostics,
                    "dropped_fraction": sum(d["dropped_fraction"] for d in diagnostics) / max(1, len(diagnostics)),
                }
                improved = heldout < best
                best = min(best, heldout)
                loss_sum = aux_sum = norm_sum = 0.0
                since, interval_chars, interval_s = 0, 0, 0.0
                owed, eval_due = (record, improved), False  # from here on, Ctrl-C finishes the writes
                result.heldout_loss, result.heldout_bpc, result.best_heldout_loss = heldout, heldout / LN2, best
                if is_main:
                    write_evaluation(record, improved)
                    owed = None
                say(f"step {step}/{tc.steps}: train {record['train_loss']:.4f} | held-out "
                    f"{heldout:.4f} nats = {heldout / LN2:.4f} bits/char" + (" (best)" if improved else ""))
                continue
            t0 = time.perf_counter()
            x, y = get_batch(corpus.train_ids, tc.batch_size, mc.context, tc.seed, step, rank, world_size)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)  # [b, T]
            with devices.autocast(device):
                out = forward(x, y)
            (out.loss + out.aux_loss).backward()
            if tc.grad_clip > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            # The one host sync per step: the bar needs the loss, and a NaN must stop the update.
            # Mean over ranks: the loss of the global batch, and every rank stops on the same step
            # (the gradient norm is already the same everywhere: DDP averaged the gradients).
            stats = torch.stack([out.loss.detach().float(), out.aux_loss.detach().float(),
                                 norm.detach().float()])
            ce, aux, gnorm = distributed.mean_over_ranks(stats.double(), world_size).tolist()
            if not (math.isfinite(ce) and math.isfinite(aux) and math.isfinite(gnorm)):
                what = "loss" if not math.isfinite(ce + aux) else "gradient norm"
                raise NonFiniteLossError(
                    f"step {step + 1}: {what} is not finite (loss {ce}, aux {aux}, grad norm {gnorm}); "
                    f"stopped before updating; {run_dir / 'last.pt'} keeps the last good checkpoint",
                    step + 1)
            lr = optimizer.param_groups[0]["lr"]
            updating = True
            optimizer.step()
            scheduler.step()
            model.step_router_bias()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            eval_due = step % tc.eval_every == 0 or step == tc.steps
            dt = time.perf_counter() - t0
            wall_s += dt
            interval_s += dt
            interval_chars += chars_per_step
            loss_sum, aux_sum, norm_sum, since = loss_sum + ce, aux_sum + aux, norm_sum + gnorm, since + 1
            updating = False  # only now do step, meters and parameters agree
            result.losses.append(ce)
            result.step = step
            if not bar.disable:
                mem = (f"mem {_fmt_bytes(torch.cuda.memory_allocated(device))}" if device.type == "cuda"
                       else f"rss {_fmt_bytes(devices.rss_bytes())}")
                bar.set_postfix_str(f"loss {ce:.4f} | {interval_chars / interval_s:,.0f} char/s | {mem}",
                                    refresh=False)
                bar.update(1)
    except KeyboardInterrupt:
        result.interrupted = True
        if updating:
            # Some parameters may have moved and others not: nothing consistent to save.
            say(f"interrupted during the update of step {step + 1}; {run_dir / 'last.pt'} is unchanged")
        elif is_main:
            if owed is not None:  # stopped while writing an evaluation's files: finish them
                write_evaluation(*owed)
            else:
                save_checkpoint(run_dir / "last.pt", payload())
            say(f"interrupted: saved {run_dir / 'last.pt'} at step {step}; "
                f"continue with --resume {run_dir}")
    finally:
        bar.close()
        if history is not None:
            history.close()
    return result
