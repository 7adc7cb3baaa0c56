"""Issue 24's routing study in one call: every recipe, two seeds, on h200_gutenberg, at a scale that fits.

    python tools/routing_study.py OUT --data "../shared/data/gutenberg/*.txt" --steps 200 --parallel 6
    python tools/routing_study.py OUT --steps 200 --dry-run     # the plan: runs, steps, characters, commands
    python tools/routing_report.py OUT                          # the tables and plots again (the last stage)

Runs, each seed (`--seeds`, default 1337 1338), at `--steps` S (default: the profile's 600):
  moe               today's recipe (the profile: softmax top-k, the balance term)
  nobalance         the balance term off (where the sinks and dead experts grow)
  shared_nobalance  1 shared expert + top-(k-1) routed (the same active compute), balance off
  shared            1 shared expert + top-(k-1), balance on
  sigmoid_auxfree   sigmoid scores + the aux-free bias, no balance term
  scope_batch       --set pool.balance_scope=batch     } only where the config has pool.balance_scope;
  scope_sequence    --set pool.balance_scope=sequence  } today's recipe is its default scope
  accum_step        the same step as 4 micro-batches (train.accum_steps=4, a quarter of the batch each), the
                    balance term over the whole step (the routing pre-pass's counts): today's term again
  accum_batch       the same micro-batches, the term over each micro-batch (what a trainer without the
                    pre-pass computes): the scope question of torchtitan #3864 and arXiv 2501.11873
                    (both only where train.batch_size divides by 4)
  dense_half        the dense twin for round(S x --dense-fraction) steps, which ...
  upcycled          ... the MoE is upcycled from (--init its best.pt) and trains for the rest of S:
                    equal total characters with `moe`, counting the twin's
  dense             the dense twin for S steps (equal characters)
  dense_wallclock   the dense twin for S x R steps, R its char/s over the MoE's: equal wall-clock
Every run evaluates every S // --evals steps (train.warmup_steps keeps the profile's share of the
steps), then tools/evaluate.py reads the held-out files whole (the full pass), and its checkpoints are
deleted (RUNS holds at most --parallel runs' checkpoints: ~5 GB each for the MoE of h200_gutenberg).

Stages (`--stages`, default all three): `speed` times each recipe alone with tools/bench_train.py
(one process, --speed-steps after --speed-warmup, on the corpus: the char/s column, and R, which
otherwise is --wallclock-ratio, the issue's measured 1.48); `train` runs the runs, --parallel at a
time on the one device (a run whose OUT/eval/<run>.json exists is done: a second call goes on where a
first was cut off); `report` writes OUT/tables.md and the PNGs (tools/routing_report.py).

Sharing the device changes nothing the runs are compared on at equal characters (held-out bits,
MaxVio, dead experts): the seed and the steps fix what each run computes. It does change their
char/s and wall_s, so the wall-clock comparison takes its R from the speed stage, where each recipe
ran alone. `--compile on` compiles every process (about a minute each on the H200; several compile
at once on the host's cores), `off` (the default here) trains eagerly: at a few hundred steps a run
trains in less time than it compiles.

Writes OUT/plan.json, OUT/logs/<run>.txt, OUT/histories/<run>.jsonl, OUT/runs/<run>.json (run.json),
OUT/eval/<run>.json (evaluate.py --json), OUT/status/<run>.json, OUT/speed/ (profiles and
bench_train's JSON). Exit status: 0 all done, 1 some run failed (named), 2 a bad argument or profile.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
from minagi.cli import OneLineParser, positive_int, seed
from minagi.config import Config, ConfigError, PoolConfig, config_to_dict, load_config

MEASURED_RATIO = 1.48  # h200_gutenberg_dense over h200_gutenberg char/s, compiled, H200, 2026-12-02 (issue 24)
STAGES = ("speed", "train", "report")


@dataclasses.dataclass(frozen=True)
class Recipe:
    key: str
    label: str
    sets: tuple[str, ...] = ()
    dense: bool = False
    steps: str = "full"          # full | half (the twin upcycling starts from) | rest | wallclock
    init: str | None = None      # the recipe whose best.pt this one starts from (--init)
    needs: str | None = None     # a [pool] key that must exist


MICRO_BATCHES = 4  # accum_step and accum_batch: the step as this many micro-batches


def recipes(cfg: Config) -> list[Recipe]:
    """The study's recipes for a profile (its top_k routed experts; its batch, split for accumulation)."""
    top_k, batch = cfg.pool.top_k, cfg.train.batch_size * cfg.train.accum_steps
    shared = ("pool.shared_experts=1", f"pool.top_k={top_k - 1}")
    accum = (f"train.accum_steps={MICRO_BATCHES}", f"train.batch_size={batch // MICRO_BATCHES}")
    split = batch % MICRO_BATCHES == 0
    return [
        Recipe("moe", "today's recipe (softmax, balance term)"),
        Recipe("nobalance", "balance term off", ("pool.balance_coef=0",)),
        Recipe("shared_nobalance", f"1 shared + top-{top_k - 1}, balance off", (*shared, "pool.balance_coef=0")),
        Recipe("shared", f"1 shared + top-{top_k - 1}, balance on", shared),
        Recipe("sigmoid_auxfree", "sigmoid + aux-free bias, no balance term",
               ("pool.router_score=sigmoid", "pool.aux_free_bias=true", "pool.balance_coef=0")),
        Recipe("scope_batch", "balance scope: batch", ("pool.balance_scope=batch",), needs="balance_scope"),
        Recipe("scope_sequence", "balance scope: sequence", ("pool.balance_scope=sequence",), needs="balance_scope"),
        *([Recipe("accum_step", f"{MICRO_BATCHES} micro-batches, balance scope: step", (*accum, "pool.balance_scope=step"),
                  needs="balance_scope"),
           Recipe("accum_batch", f"{MICRO_BATCHES} micro-batches, balance scope: each micro-batch",
                  (*accum, "pool.balance_scope=batch"), needs="balance_scope")] if split else []),
        Recipe("dense_half", "dense twin, the upcycling's first part", dense=True, steps="half"),
        Recipe("upcycled", "upcycled from dense_half, the rest of the characters", steps="rest", init="dense_half"),
        Recipe("dense", "dense twin, equal characters", dense=True),
        Recipe("dense_wallclock", "dense twin, equal wall-clock", dense=True, steps="wallclock"),
    ]


def available(recipe: Recipe) -> bool:
    return recipe.needs is None or recipe.needs in {f.name for f in dataclasses.fields(PoolConfig)}


def run_steps(recipe: Recipe, steps: int, dense_fraction: float, ratio: float) -> int:
    half = max(1, round(steps * dense_fraction))
    return {"full": steps, "half": half, "rest": max(1, steps - half),
            "wallclock": max(1, round(steps * ratio))}[recipe.steps]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="output folder (histories, evaluations, logs, tables, plots)")
    p.add_argument("--data", help="the corpus (train.py --data; default: the profile's data.path, from the "
                                  "repository root)")
    p.add_argument("--profile", default="h200_gutenberg")
    p.add_argument("--dense-profile", help="the twin's profile (default: PROFILE_dense if shipped, else "
                                           "PROFILE); model.mlp = dense is set either way")
    p.add_argument("--heldout", nargs="+", metavar="FILE", help="files evaluate.py reads whole (default: the "
                   "profile's data.heldout_files in the corpus's folder, stripped as data.strip_gutenberg says)")
    p.add_argument("--steps", type=positive_int, help="S, the MoE's steps (default: the profile's train.steps)")
    p.add_argument("--seeds", type=seed, nargs="+", default=[1337, 1338])
    p.add_argument("--recipes", nargs="+", metavar="NAME", help="only these and the runs they start from "
                   "(default: all that exist in this config)")
    p.add_argument("--parallel", type=positive_int, default=6, help="runs at once on the device (default 6)")
    p.add_argument("--evals", type=positive_int, default=4, help="evaluations a run (default 4)")
    p.add_argument("--dense-fraction", type=float, default=0.5, help="dense_half's share of S (default 0.5)")
    p.add_argument("--wallclock-ratio", type=float, default=MEASURED_RATIO,
                   help=f"R without the speed stage (default {MEASURED_RATIO}, the issue's measured ratio)")
    p.add_argument("--compile", choices=("on", "off"), default="off", help="train.compile (default off)")
    p.add_argument("--speed-steps", type=positive_int, default=20)
    p.add_argument("--speed-warmup", type=positive_int, default=10)
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--runs", default=os.environ.get("RUNS", "/dev/shm/routing_study"),
                   help="where the run folders live (default $RUNS or /dev/shm/routing_study)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="added to every run (before the recipe's own, which win)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--deadline", type=positive_int, metavar="SECONDS",
                   help="start no run after this many seconds (those running finish; the report shows what is done)")
    p.add_argument("--dry-run", action="store_true", help="write and print the plan, run nothing")
    args = p.parse_args(argv)
    # The commands run from the repository root: every path as an absolute one.
    args.out, args.runs = (os.path.abspath(os.path.expanduser(a)) for a in (args.out, args.runs))
    args.data = os.path.abspath(os.path.expanduser(args.data)) if args.data else None
    args.heldout = [os.path.abspath(f) for f in args.heldout] if args.heldout else None
    return args


def dense_profile(args) -> str:
    if args.dense_profile:
        return args.dense_profile
    twin = REPO / "profiles" / f"{args.profile}_dense.toml"
    return twin.stem if twin.is_file() else args.profile


def heldout_files(args, cfg: Config) -> tuple[list[str], bool]:
    """(files evaluate.py reads, whether it strips Project Gutenberg's header and licence)."""
    if args.heldout:
        return list(args.heldout), False
    if not cfg.data.heldout_files:
        raise ConfigError(f"{args.profile} holds out no whole files (data.heldout_files): name them with --heldout")
    data = corpus(args, cfg)
    folder = Path(data).parent if any(c in data for c in "*?[") or Path(data).is_file() else Path(data)
    return [str(folder / name) for name in cfg.data.heldout_files], cfg.data.strip_gutenberg


def corpus(args, cfg: Config) -> str:
    """The corpus path: --data, or the profile's data.path as train.py reads it from the repository root."""
    if args.data or not cfg.data.path:  # "": the standard library's sources (bench_train's --data "" too)
        return args.data or ""
    return os.path.normpath(REPO / os.path.expanduser(cfg.data.path))


def plan_runs(args, cfg: Config, ratio: float) -> list[dict]:
    """Every run of the study: name, recipe, seed, steps, its train.py and evaluate.py commands."""
    tc = cfg.train
    chars_per_step = tc.batch_size * tc.accum_steps * cfg.model.context  # a step: accum_steps micro-batches
    wanted = set(args.recipes or [r.key for r in recipes(cfg)])
    wanted |= {r.init for r in recipes(cfg) if r.key in wanted and r.init}  # what they start from
    chosen = [r for r in recipes(cfg) if available(r) and r.key in wanted]
    files, strip = heldout_files(args, cfg)
    steps = args.steps or tc.steps
    runs = []
    for seed_ in args.seeds:
        for recipe in chosen:
            name, n = f"{recipe.key}-{seed_}", run_steps(recipe, steps, args.dense_fraction, ratio)
            init = f"{recipe.init}-{seed_}" if recipe.init else None
            sets = [f"train.seed={seed_}", f"train.out_dir={args.runs}", f"data.cache_dir={args.runs}/cache",
                    f"train.steps={n}", f"train.warmup_steps={max(1, round(n * tc.warmup_steps / tc.steps))}",
                    f"train.eval_every={max(1, n // args.evals)}",
                    f"train.compile={'true' if args.compile == 'on' else 'false'}", f"train.device={args.device}",
                    *(("model.mlp=dense",) if recipe.dense else ()), *args.sets, *recipe.sets]
            train = [sys.executable, "train.py", "--profile", dense_profile(args) if recipe.dense else args.profile,
                     *(["--data", args.data] if args.data else []), "--run-name", name,
                     *[a for s in sets for a in ("--set", s)]]
            if init:
                train += ["--init", f"{args.runs}/{init}/best.pt"]
            evaluate = [sys.executable, "tools/evaluate.py", f"{args.runs}/{name}/best.pt", "--data", *files,
                        *(["--strip-gutenberg"] if strip else []), "--json", f"{args.out}/eval/{name}.json",
                        "--device", args.device]
            runs.append({"name": name, "recipe": recipe.key, "label": recipe.label, "seed": seed_,
                         "dense": recipe.dense, "steps": n, "chars_per_step": chars_per_step, "init": init,
                         "chars_before": 0, "run_dir": f"{args.runs}/{name}", "train": train, "evaluate": evaluate})
    by_name = {r["name"]: r for r in runs}
    for r in runs:  # upcycling: the twin's characters count
        if r["init"] in by_name:
            r["chars_before"] = by_name[r["init"]]["steps"] * chars_per_step
    return runs


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return repr(value)


def write_profile(path: Path, cfg: Config) -> None:
    """A resolved config as a TOML profile (bench_train takes profile files)."""
    lines = []
    for section, table in config_to_dict(cfg).items():
        lines += [f"[{section}]"] + [f"{k} = {toml_value(v)}" for k, v in table.items()] + [""]
    path.write_text("\n".join(lines), encoding="utf-8")


def speed_stage(args, out: Path, cfg: Config) -> float | None:
    """Each MoE recipe and the twin alone, timed by one tools/bench_train.py process; R = the twin's
    char/s over the MoE's (None when the stage failed: the caller keeps --wallclock-ratio)."""
    folder = out / "speed"
    folder.mkdir(parents=True, exist_ok=True)
    timed = [r for r in recipes(cfg) if available(r) and r.steps == "full"
             and (not args.recipes or r.key in args.recipes or r.key in ("moe", "dense"))]
    profiles = []
    for recipe in timed:
        sets = [*(("model.mlp=dense",) if recipe.dense else ()), *args.sets, *recipe.sets]
        base = dense_profile(args) if recipe.dense else args.profile
        write_profile(folder / f"{recipe.key}.toml", load_config(base, sets))
        profiles.append(str(folder / f"{recipe.key}.toml"))
    command = [sys.executable, "tools/bench_train.py", "--profiles", *profiles, "--compile", args.compile,
               "--steps", str(args.speed_steps), "--warmup", str(args.speed_warmup), "--data", corpus(args, cfg),
               "--json", str(folder / "speed.json")] + (["--device", args.device] if args.device != "auto" else [])
    with open(out / "logs" / "speed.txt", "w") as log:
        rc = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not (folder / "speed.json").is_file():
        print(f"speed: tools/bench_train.py exited {rc} (see {out}/logs/speed.txt); R stays {args.wallclock_ratio}")
        return None
    rate = {Path(r["profile"]).stem: r.get("chars_per_s") for r in json.loads((folder / "speed.json").read_text())["results"]}
    if not rate.get("moe") or not rate.get("dense"):
        return None
    return rate["dense"] / rate["moe"]


class Jobs:
    """The runs, `parallel` at a time, each once its --init run is done; a run's status in OUT/status."""

    def __init__(self, runs: list[dict], out: Path, parallel: int, keep: bool, deadline: float | None = None):
        self.runs, self.out, self.parallel, self.keep, self.deadline = runs, out, parallel, keep, deadline
        self.ok: dict[str, bool] = {}
        self.lock = threading.Lock()

    def done_before(self, run: dict) -> bool:
        return (self.out / "eval" / f"{run['name']}.json").is_file() and \
            (self.out / "histories" / f"{run['name']}.jsonl").is_file()

    def run_all(self) -> list[str]:
        pending, running = list(self.runs), {}
        while pending or running:
            for name in [n for n, t in running.items() if not t.is_alive()]:
                running.pop(name)
            for run in list(pending):
                if len(running) >= self.parallel:
                    break
                if run["init"] and run["init"] not in self.ok and any(r["name"] == run["init"] for r in self.runs):
                    continue  # its twin is still training
                pending.remove(run)
                if self.deadline is not None and time.time() > self.deadline and not self.done_before(run):
                    self._finish(run, {"skipped": "past --deadline"}, False)
                    continue
                if run["init"] and not self.ok.get(run["init"], True):
                    self._finish(run, {"skipped": f"{run['init']} failed"}, False)
                    continue
                running[run["name"]] = threading.Thread(target=self._job, args=(run,), daemon=True)
                running[run["name"]].start()
            time.sleep(0.2)
        return [name for name, ok in self.ok.items() if not ok]

    def _job(self, run: dict) -> None:
        if self.done_before(run):
            self._finish(run, {"done_before": True}, True)
            return
        started, status = time.time(), {}
        with open(self.out / "logs" / f"{run['name']}.txt", "w") as log:
            status["train_rc"] = subprocess.run(run["train"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
            status["train_s"] = round(time.time() - started, 1)
            if status["train_rc"] == 0:
                if run["init"] and not self.keep:  # the twin's checkpoint has served
                    self._remove_checkpoints(run["init"])
                self._collect(run)
                status["eval_rc"] = subprocess.run(run["evaluate"], cwd=REPO, stdout=log,
                                                   stderr=subprocess.STDOUT).returncode
        if not self.keep and not any(r["init"] == run["name"] for r in self.runs):
            self._remove_checkpoints(run["name"])
        status["seconds"] = round(time.time() - started, 1)
        self._finish(run, status, status.get("train_rc") == 0 and status.get("eval_rc") == 0)

    def _collect(self, run: dict) -> None:
        folder = Path(run["run_dir"])
        shutil.copyfile(folder / "history.jsonl", self.out / "histories" / f"{run['name']}.jsonl")
        shutil.copyfile(folder / "run.json", self.out / "runs" / f"{run['name']}.json")

    def _remove_checkpoints(self, name: str) -> None:
        run_dir = next((r["run_dir"] for r in self.runs if r["name"] == name), None)
        for pt in glob.glob(f"{run_dir}/*.pt") if run_dir else []:
            os.remove(pt)

    def _finish(self, run: dict, status: dict, ok: bool) -> None:
        with self.lock:
            self.ok[run["name"]] = ok
            (self.out / "status" / f"{run['name']}.json").write_text(json.dumps({"ok": ok, **status}) + "\n")
            print(f"{time.strftime('%H:%M:%S')} {run['name']}: {'done' if ok else 'FAILED'} {status}", flush=True)


def main(argv: list[str] | None = None) -> int:
    started = time.time()
    args = parse_args(argv)
    out = Path(args.out)
    try:
        cfg = load_config(args.profile, args.sets)
        unknown = sorted(set(args.recipes or ()) - {r.key for r in recipes(cfg)})
        if unknown:
            raise ConfigError(f"--recipes: no recipe {', '.join(unknown)} (the recipes: "
                              f"{', '.join(r.key for r in recipes(cfg))})")
        plan = plan_runs(args, cfg, args.wallclock_ratio)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for sub in ("logs", "histories", "runs", "eval", "status"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    ratio, source = args.wallclock_ratio, "--wallclock-ratio"
    if "speed" in args.stages and not args.dry_run:
        measured = speed_stage(args, out, cfg)
        if measured is not None:
            ratio, source = measured, "speed stage"
    plan = plan_runs(args, cfg, ratio)
    skipped = [r.key for r in recipes(cfg) if not available(r)]
    meta = {"profile": args.profile, "dense_profile": dense_profile(args), "steps": args.steps or cfg.train.steps,
            "seeds": args.seeds, "parallel": args.parallel, "compile": args.compile, "wallclock_ratio": ratio,
            "wallclock_ratio_source": source, "skipped_recipes": skipped, "runs": plan}
    (out / "plan.json").write_text(json.dumps(meta, indent=1) + "\n")
    total = sum(r["steps"] * r["chars_per_step"] for r in plan)
    print(f"{len(plan)} runs, {total / 1e6:.1f}M characters in all; R = {ratio:.3f} ({source})"
          + (f"; not in this config: {', '.join(skipped)}" if skipped else ""), flush=True)
    if args.dry_run:
        for r in plan:
            print(f"{r['name']}: {r['steps']} steps\n  {' '.join(r['train'][1:])}\n  {' '.join(r['evaluate'][1:])}")
        return 0
    deadline = started + args.deadline if args.deadline else None
    failed = Jobs(plan, out, args.parallel, args.keep_checkpoints, deadline).run_all() if "train" in args.stages else []
    if "report" in args.stages:
        import routing_report  # beside this script (its folder is sys.path[0])
        routing_report.main([str(out)])
    if failed:
        print(f"failed: {', '.join(failed)} (their logs: {out}/logs/)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
