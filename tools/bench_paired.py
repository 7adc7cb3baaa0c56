"""Training settings of one profile side by side in one process, their steps alternating in blocks.

    python tools/bench_paired.py --profile strix_large --set pool.dispatch=grouped \
        --variant "train.compile=rows" --variant "train.compile=rows train.compile_mode=reduce-overhead" \
        --variant "train.compile=false"
    python tools/bench_paired.py --device cpu --profile cpu_tiny --variant "" --variant "train.compile=rows" --rounds 2
    python tools/bench_paired.py --profile strix_large --set pool.dispatch=grouped --set train.compile=false \
        --variant "@3cccc1c" --variant "pool.swiglu=eager"     # an earlier commit's code against this one's

Where the host sets a step's pace (the bucketed path on a fast GPU), its speed drifts by ±25% within one
device call (docs/benchmarks.md §22): figures from processes run one after another do not resolve a
10% change. Here every variant is built in the same process, warmed up, then timed in rounds: each
round runs `--block` steps of every variant (the order rotating), so a slow spell of the host falls on
all of them. Printed per variant: the median step and char/s over the rounds, their range, and the
median over rounds of the first variant's block time over this one's (the paired speed).

A variant whose first word is `@REV` (a commit, tag or branch of this repository) trains with that
revision's code: `git archive REV minagi profiles` is unpacked into a temporary folder with the package
renamed `minagi_<rev>` (its custom ops too), so old and new code train in one process. Where the
repository's `.git` is not at hand (a GPU machine's copy of the tree), unpack beforehand and carry
the folder: `--trees .bench_trees --unpack --variant "@3cccc1c"` here, then the same `--trees` there.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from minagi.config import ConfigError, load_config
from minagi.trainer import build_training, train_step

VOCAB = 96


REPO = Path(__file__).resolve().parent.parent


class RevisionError(Exception):
    pass


def unpack_revision(rev: str, into: Path) -> Path:
    """Revision `rev`'s code unpacked under `into`, its package renamed minagi_<rev>: the folder to put on
    sys.path. A tree already there is used as it is where git cannot say which commit `rev` is now
    (a copy without .git), and unpacked again where it can and the commit moved (a branch, HEAD~1).
    Unpacked into a folder of its own and renamed into place once whole: an interrupted unpack leaves
    no tree behind to be mistaken for a revision."""
    tree = into / package_name(rev)
    commit = _commit(rev)
    if tree.exists() and commit is not None and _read(tree / "COMMIT") != commit:
        shutil.rmtree(tree)
    if not tree.exists():
        into.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".unpacking_", dir=into))
        try:
            _unpack_into(rev, work, tree.name)
            (work / "COMMIT").write_text(commit or "")
            work.rename(tree)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return tree


def _commit(rev: str) -> str | None:
    """The commit `rev` names, where git and this repository's .git are at hand; else None."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                             capture_output=True, text=True)
    except OSError:  # no git
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None


def _unpack_into(rev: str, work: Path, name: str) -> None:
    """`git archive rev minagi profiles` into `work`, the package renamed `name` (its imports and custom ops too)."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "minagi", "profiles"], capture_output=True)
    except OSError as e:
        raise RevisionError(f"@{rev}: git archive failed: {e.strerror or e}") from None
    if archive.returncode:
        reason = (archive.stderr.decode().strip().splitlines() or ["no reason given"])[-1]
        raise RevisionError(f"@{rev}: git archive failed: {reason}")
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
    (work / "minagi").rename(work / name)
    for path in (work / name).rglob("*.py"):
        path.write_text(re.sub(r"\bminagi\b", name, path.read_text()))
    shutil.copytree(work / "profiles", work / name / "profiles")  # found beside the package or in it


def package_name(rev: str) -> str:
    """minagi_<rev> as an identifier, one for each revision: a character that is not a letter or digit
    written as _xHH_ (HEAD~1 and HEAD^1 are different revisions, and a kept tree is reused by its name)."""
    return "minagi_" + re.sub(r"[^A-Za-z0-9]", lambda m: "".join(f"_x{b:02x}_" for b in m.group().encode()), rev)


def revision_package(rev: str, into: Path):
    """(load_config, build_training, train_step) of revision `rev`'s code (`unpack_revision`)."""
    tree = str(unpack_revision(rev, into))
    if tree not in sys.path:
        sys.path.insert(0, tree)
    name = package_name(rev)
    config, trainer = importlib.import_module(f"{name}.config"), importlib.import_module(f"{name}.trainer")
    return config.load_config, trainer.build_training, trainer.train_step


class Variant:
    """One variant's training, its random characters and its block times (ms a step)."""

    def __init__(self, name: str, profile: str, sets: list[str], device: torch.device, code=None):
        self.name = name
        load, build, self.train_step = code or (load_config, build_training, train_step)
        self.cfg = load(profile, [f"train.device={device.type}", "train.steps=100000", "train.warmup_steps=1", *sets])
        self.training = build(self.cfg, VOCAB, device, 1)
        self.device, self.step, self.times = device, 0, []
        self.shape = (self.cfg.train.accum_steps * self.cfg.train.batch_size, self.cfg.model.context)
        self.generator = torch.Generator(device=device).manual_seed(0)

    def run(self, steps: int) -> None:
        for _ in range(steps):
            x, y = (torch.randint(0, VOCAB, self.shape, device=self.device, generator=self.generator) for _ in range(2))
            self.train_step(self.training, x, y, step=self.step, grad_clip=self.cfg.train.grad_clip, world_size=1,
                            device=self.device)
            self.training.updating = False
            self.step += 1


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(variants: list[Variant], rounds: int, block: int, warmup: int) -> int:
    """Warm every variant up, then time the rounds; the graphs torch.compile made during the rounds (a
    recompile: a variant may then have run eagerly, past dynamo's limit)."""
    from torch._dynamo.utils import counters
    for v in variants:
        v.run(warmup)
    graphs = counters["stats"]["unique_graphs"]
    device = variants[0].device
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            synchronize(device)
            start = time.perf_counter()
            v.run(block)
            synchronize(device)
            v.times.append((time.perf_counter() - start) / block * 1e3)
    return counters["stats"]["unique_graphs"] - graphs


def summary(variants: list[Variant]) -> list[dict]:
    first = variants[0].times
    out = []
    for v in variants:
        step_ms = statistics.median(v.times)
        out.append({"variant": v.name, "median_step_ms": step_ms, "chars_per_s": v.shape[0] * v.shape[1] / step_ms * 1e3,
                    "min_step_ms": min(v.times), "max_step_ms": max(v.times),
                    "paired_speed": statistics.median(a / b for a, b in zip(first, v.times)), "times_ms": v.times})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="for every variant")
    ap.add_argument("--variant", action="append", required=True, metavar='"[@REV] SECTION.KEY=VALUE ..."',
                    help="one variant's settings, space-separated (\"\" for the profile as it is), after @REV to "
                         "train with that revision's code; the first is the one the others are paired against")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=5, help="steps of a variant in a row, each round")
    ap.add_argument("--warmup", type=int, default=10, help="steps of each variant before the rounds (compiles)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--trees", metavar="DIR",
                    help="unpack the @REV variants' code here and keep it (a revision already there is used as it "
                         "is: a copy of the repository without .git, such as a GPU machine's, trains what was "
                         "unpacked beforehand); default: a temporary folder")
    ap.add_argument("--unpack", action="store_true", help="only unpack the @REV variants into --trees, then stop")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.unpack and not args.trees:
        print("bench_paired: --unpack needs --trees DIR (where the revisions' code is kept)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    with contextlib.ExitStack() as stack:
        trees = Path(args.trees) if args.trees else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_paired_")))
        try:
            if args.unpack:
                revs = [words[0][1:] for words in map(str.split, args.variant) if words and words[0].startswith("@")]
                if not revs:
                    print("bench_paired: --unpack: no variant names a revision (@REV)", file=sys.stderr)
                    return 2
                for rev in revs:
                    print(f"bench_paired: @{rev} unpacked in {unpack_revision(rev, trees)}")
                return 0
            variants = [make_variant(v, args, device, trees) for v in args.variant]
        except Exception as e:
            if not isinstance(e, (ConfigError, RevisionError)) and type(e).__name__ != "ConfigError":  # a revision's own
                raise
            print(f"bench_paired: {e}", file=sys.stderr)
            return 2
        return report(variants, args, device)


def make_variant(spec: str, args, device: torch.device, trees: Path) -> Variant:
    words = spec.split()
    code = revision_package(words.pop(0)[1:], trees) if words and words[0].startswith("@") else None
    return Variant(spec or "(as the profile)", args.profile, [*args.sets, *words], device, code)


def report(variants: list[Variant], args, device: torch.device) -> int:
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "profile": args.profile, "sets": args.sets, "rounds": args.rounds, "block": args.block}
    print(json.dumps(meta), flush=True)
    meta["recompiles_in_rounds"] = measure(variants, args.rounds, args.block, args.warmup)
    results = summary(variants)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if meta["recompiles_in_rounds"]:
        print(f"bench_paired: {meta['recompiles_in_rounds']} graph(s) compiled during the timed rounds: a variant "
              "recompiled (more --warmup, or fewer variants that compile)", file=sys.stderr)
    print(f"| {args.profile} variant | char/s (median) | step ms: median (range) | paired speed vs the first |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['chars_per_s']:,.0f} | {r['median_step_ms']:.1f} ({r['min_step_ms']:.1f}-"
              f"{r['max_step_ms']:.1f}) | {r['paired_speed']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
