"""What a resumed run checks before it goes on: its config (only RESUMABLE_KEYS may change), its
checkpoint against the steps asked for, and its corpus (the same content, wherever it is now). Each
refusal says what to do instead: a run stopped before its first checkpoint is started again, a
corpus that moved is pointed at with --data."""
from __future__ import annotations

import glob
import os
from pathlib import Path

from .checkpoint import Checkpoint, CheckpointError
from .config import RESUMABLE_KEYS, Config, ConfigError, DataConfig, apply_overrides, config_from_dict, \
    config_to_dict, override_key, upgrade_config_dict
from .data import Corpus, DataError, Vocab, VocabError, file_content_key, load_corpus
from .runlog import read_history, read_run_info

__all__ = ["check_same_corpus", "describe_corpus", "load_run_corpus", "open_checkpoint", "resume_config"]


def _start_again(run_dir: Path) -> str:
    return f"start it again with its settings and --run-name {run_dir.name} (under train.out_dir {run_dir.parent})"


def resume_config(run_dir: str | Path, overrides: list[str] = ()) -> tuple[Config, str]:
    """(config, profile name) of the run in `run_dir`, with `--set` of RESUMABLE_KEYS applied.

    Reads run.json (cheap); `train` checks it against last.pt, which is the truth.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        if run_dir.is_dir() and {p.name for p in run_dir.iterdir() if ".tmp-" not in p.name} <= {"run.lock"}:
            raise ConfigError(f"--resume {run_dir}: no run.json there: the run stopped before it began, so "
                              f"there is nothing to resume; {_start_again(run_dir)}")
        if not run_dir.exists():
            raise ConfigError(f"--resume {run_dir}: no such folder")
        if run_dir.is_file():
            raise ConfigError(f"--resume {run_dir}: a file; --resume takes its run folder ({run_dir.parent})")
        raise ConfigError(f"--resume {run_dir}: no run.json there (not a run folder)")
    info = read_run_info(run_dir)
    cfg = config_from_dict(upgrade_config_dict(info["config"]), source=str(run_dir / "run.json"))
    try:  # first: a misspelled key is named as unknown, with a guess
        changed = apply_overrides(cfg, overrides)
    except ConfigError as err:
        keys = {override_key(item) for item in overrides}
        if err.key != "train.warmup_steps" or "train.steps" not in keys or "train.warmup_steps" in keys:
            raise
        warmup = cfg.train.warmup_steps  # not resumable, so "lower the warm-up" is no advice here
        raise ConfigError(f"--set train.steps: the run warms up over {warmup} steps (train.warmup_steps, fixed when "
                          f"it began), so it trains at least that far: --set train.steps={warmup} or more",
                          "train.steps") from None
    for item in overrides:
        key = override_key(item)
        if key not in RESUMABLE_KEYS:
            raise ConfigError(f"--set {key}: cannot be changed when resuming (only "
                              f"{', '.join(RESUMABLE_KEYS)} may)", key)
    return changed, info["profile"]


def _check_resumed_config(cfg: Config, saved: Config, source: str) -> None:
    new, old = config_to_dict(cfg), config_to_dict(saved)
    for section, table in old.items():
        for key, value in table.items():
            if f"{section}.{key}" not in RESUMABLE_KEYS and new[section][key] != value:
                raise ConfigError(f"{section}.{key} = {new[section][key]!r} differs from the resumed "
                                  f"run's {value!r} ({source}); only {', '.join(RESUMABLE_KEYS)} may "
                                  "change on resume", f"{section}.{key}")


def open_checkpoint(run_dir: Path, cfg: Config) -> Checkpoint:
    """last.pt of the run to resume, checked against `cfg` and `train.steps`."""
    path = run_dir / "last.pt"
    history = run_dir / "history.jsonl"
    if not path.exists() and not (history.exists() and read_history(history)):
        own = read_run_info(run_dir)["config"]["train"]  # the run's schedule, not a --set train.steps of now
        first = min(own.get("eval_every", cfg.train.eval_every), own.get("steps", cfg.train.steps))
        raise CheckpointError(f"{path}: no such checkpoint file: the run stopped before its first checkpoint "
                              f"(step {first}), so there is nothing to resume; {_start_again(run_dir)}")
    # A sharded layout's ranks each read the whole file: mapped, one machine's ranks share its pages
    # (POSIX: on Windows a mapped file could not be replaced by the next save).
    sharded = cfg.train.parallel == "fsdp" or cfg.train.expert_parallel > 1
    ckpt = Checkpoint.load(path, map_location="cpu", mmap=sharded and os.name == "posix")
    ckpt.check_trains()
    _check_resumed_config(cfg, ckpt.config, str(path))
    # At train.steps with its evaluation still due (Ctrl-C stopped it), the resume only runs that.
    if ckpt.step > cfg.train.steps or (ckpt.step == cfg.train.steps and not ckpt.meter.eval_due):
        raise ConfigError(f"train.steps = {cfg.train.steps}: the run in {run_dir} is already at step "
                          f"{ckpt.step}; extend it with --set train.steps=<more>", "train.steps")
    return ckpt


def _exists(path: str) -> bool:
    """Whether a data path names something: a file, a folder, or a glob that matches ("": the standard library)."""
    if not path:
        return True
    if glob.has_magic(path):
        return bool(glob.glob(str(Path(path).expanduser()), recursive=True))
    return Path(path).expanduser().exists()


def load_run_corpus(data: DataConfig, vocab: Vocab | None, *, resumed: Path | None = None,
                    init: str | Path | None = None) -> Corpus:
    """`load_corpus` of a run: with the vocabulary of the run it resumes (`resumed`: its folder) or of
    the checkpoint it starts from (`init`), whose errors then say what to do."""
    try:
        return load_corpus(data.path, data.heldout_fraction, data.cache_dir, vocab=vocab,
                           strip_gutenberg=data.strip_gutenberg, heldout_files=data.heldout_files)
    except VocabError as e:
        if resumed is not None:
            raise VocabError(f"{e}; the run in {resumed} knows only the {vocab.size} characters of its corpus: "
                             "resume with --data pointing at the run's corpus (text with new characters is "
                             "a new run)") from None
        if init is not None:
            raise VocabError(f"{e}; --init {init}: a run started from a checkpoint keeps its vocabulary "
                             f"({vocab.size} characters)") from None
        raise
    except DataError as e:
        if resumed is None or _exists(data.path):
            raise
        raise DataError(f"{e}; the run in {resumed} trained on it: if its corpus moved, resume with --data "
                        "pointing at where it is now") from None


def check_corpus_fits(corpus: Corpus, path: str, context: int) -> None:
    """DataError, one line naming the text and what to change, when a split is shorter than one window
    of model.context + 1 characters (a first try on one's own small file)."""
    need = context + 1
    for split, size in (("training", corpus.train_chars), ("held-out", corpus.heldout_chars)):
        if size < need:
            raise DataError(f"{path or 'the standard library'}: its {split} split has {size:,} characters, and "
                            f"model.context = {context} needs at least {need:,}: use a longer text, or --set "
                            f"model.context (smaller), or data.heldout_fraction (the held-out share)")


def describe_corpus(corpus: Corpus, path: str) -> str:
    """One line for the start of a run: what it trains on and what it holds out."""
    where = path or "the standard library's .py files"
    held = (f"{len(corpus.heldout_sources)} whole files ({', '.join(corpus.heldout_sources[:4])}"
            f"{', ...' if len(corpus.heldout_sources) > 4 else ''})" if corpus.heldout_sources
            else "the end of the text")
    return (f"data: {where}: {len(corpus.sources)} file(s), {corpus.train_chars:,} training characters, "
            f"vocabulary {corpus.vocab.size}; held out: {held}, {corpus.heldout_chars:,} characters")


def check_same_corpus(corpus: Corpus, ckpt: Checkpoint, path: str, source: Path) -> None:
    """A resume trains on the run's corpus: the same content key (files, bytes, split options)."""
    saved = ckpt.corpus
    if saved is None:  # format 1 did not record it
        return
    data = ckpt.config.data  # where the checkpoint's own steps read it
    if saved.content_key != corpus.content_key and not (  # a renamed copy of a one-file corpus is the same corpus
            len(corpus.sources) == 1 and saved.files == 1 and data.path and Path(path).is_file()
            and file_content_key(path, Path(data.path).name, data.heldout_fraction,
                                 strip_gutenberg=data.strip_gutenberg) == saved.content_key):
        raise DataError(f"data.path {path or '(the standard library)'}: its content (key {corpus.content_key}, "
                        f"{len(corpus.sources)} files, {corpus.train_chars + corpus.heldout_chars:,} characters) "
                        f"differs from the corpus of the run in {source.parent} "
                        f"({data.path or '(the standard library)'} when it trained: key {saved.content_key}, "
                        f"{saved.files} files, {saved.chars:,} characters); "
                        "resume with --data pointing at the run's corpus")
