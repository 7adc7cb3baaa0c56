"""Vocabulary, corpus loading, the held-out split, and deterministic batches.

A corpus is read once, split into train / held-out text, encoded with the vocabulary and cached as
two .npy files that later loads memory-map (no re-encoding). Batches are a pure function of
(seed, step): the data position on resume is just the step number. Options: Project Gutenberg
files can be cut to the book alone (minagi.gutenberg), and named files held out.

Shapes: B global batch, b = B // world_size rows per rank, T context (characters per sequence).
"""

from __future__ import annotations

import codecs
import difflib
import glob
import hashlib
import json
import os
import sysconfig
import warnings
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from .atomic import atomic_write

from .gutenberg import STRIP_VERSION, MarkersMissing, strip_gutenberg as _strip_pg

__all__ = [
    "DataError", "DataWarning", "VocabError", "Vocab", "Corpus", "file_content_key", "load_corpus", "get_batch",
    "batch_on", "heldout_batches", "default_cache_dir", "STDLIB_CAP_BYTES",
]

# The default corpus ("" path) is a subset of the stdlib's .py files, capped so the default stays
# quick to read and encode: whole files, taken in a stable hashed order of their relative paths
# (spread over the whole stdlib, not just a..c), skipping any file that would pass the cap.
STDLIB_CAP_BYTES = 4 * 2**20
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

_CACHE_FORMAT = "minagi-corpus-v1"   # bump when the encoding, split or normalisation changes
_MAX_LISTED = 10                     # characters / files named in one error line


class DataError(ValueError):
    """A corpus that cannot be loaded or batched; the message is one line naming the culprit."""


class VocabError(DataError):
    """Text holds characters outside the vocabulary (or ids outside it)."""


class DataWarning(UserWarning):
    """Files skipped while loading a corpus (binary or not UTF-8)."""


def _describe_chars(counts: dict[str, int]) -> str:
    """Most frequent first, as repr (so invisible characters show): 'é' x3, '\\t' x1, ... (+N more)."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    text = ", ".join(f"{c!r} x{n}" for c, n in ranked[:_MAX_LISTED])
    return text + (f", ... (+{len(ranked) - _MAX_LISTED} more)" if len(ranked) > _MAX_LISTED else "")


# ----------------------------------------------------------------------------------------------
# Vocabulary
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Vocab:
    """The sorted unique characters of a corpus; id = position in `chars`."""

    chars: str

    def __post_init__(self) -> None:
        if not self.chars:
            raise VocabError("vocabulary is empty")
        if any(a >= b for a, b in zip(self.chars, self.chars[1:])):
            raise VocabError(f"vocabulary characters must be sorted and unique, got {self.chars[:40]!r}")

    @classmethod
    def from_chars(cls, chars: str | Sequence[str]) -> "Vocab":
        """From a checkpoint's vocab string (or a list of single characters)."""
        if not isinstance(chars, str):
            chars = "".join(chars)
        return cls(chars)

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> "Vocab":
        """From one text, or several (the union of their characters)."""
        texts = [text] if isinstance(text, str) else list(text)
        seen: set[str] = set()
        for t in texts:
            seen.update(t)
        return cls("".join(sorted(seen)))

    @property
    def size(self) -> int:
        return len(self.chars)

    def __len__(self) -> int:
        return len(self.chars)

    @property
    def dtype(self) -> np.dtype:
        """Smallest unsigned type holding every id: uint8 up to 256 characters, else uint16 / uint32."""
        if self.size <= 2**8:
            return np.dtype(np.uint8)
        return np.dtype(np.uint16) if self.size <= 2**16 else np.dtype(np.uint32)

    @cached_property
    def _codepoints(self) -> np.ndarray:
        return np.frombuffer(self.chars.encode("utf-32-le"), dtype=np.uint32)

    @cached_property
    def _lut(self) -> np.ndarray:
        # code point -> id (-1 = not in the vocabulary); at most 0x110000 int32 entries (4.4 MB).
        lut = np.full(int(self._codepoints.max()) + 1, -1, dtype=np.int32)
        lut[self._codepoints] = np.arange(self.size, dtype=np.int32)
        return lut

    def encode(self, text: str) -> np.ndarray:
        """Text -> ids [len(text)] of `self.dtype`; VocabError names characters not in the vocabulary."""
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        lut = self._lut
        ids = lut[np.minimum(cps, len(lut) - 1)]
        bad = (ids < 0) | (cps >= len(lut))
        if bad.any():
            values, counts = np.unique(cps[bad], return_counts=True)
            named = {chr(int(v)): int(n) for v, n in zip(values, counts)}
            raise VocabError(
                f"{len(named)} character(s) not in the vocabulary ({self.size} characters): {_describe_chars(named)}"
            )
        return ids.astype(self.dtype)

    def decode(self, ids: Iterable[int] | np.ndarray | torch.Tensor) -> str:
        """Ids (list, numpy or torch, any integer type) -> text; VocabError names an id out of range."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.size):
            bad = int(arr[(arr < 0) | (arr >= self.size)][0])
            raise VocabError(f"id {bad} is outside the vocabulary (valid: 0..{self.size - 1})")
        return "".join(self.chars[i] for i in arr.tolist())


# ----------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------

@dataclass
class Corpus:
    """An encoded corpus. `sources`: every file read (relative names, sorted); ids are memory-mapped."""

    vocab: Vocab
    train_ids: np.ndarray        # [train_chars], uint8 / uint16 / uint32
    heldout_ids: np.ndarray      # [heldout_chars]
    sources: list[str]
    train_chars: int
    heldout_chars: int
    heldout_sources: list[str] = field(default_factory=list)  # whole files held out ([] for one file)
    cache_hit: bool = False      # True when the ids were memory-mapped from an earlier encoding
    cache_path: str = ""         # the .json describing the cached entry ("" if caching failed)
    content_key: str = ""        # the cache's key of files, bytes and options: equal keys, same split
    # name -> (train characters, held-out characters) it gives, after stripping; in `sources` order
    chars_by_source: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class _Source:
    name: str      # relative, "/"-separated: what the split hashes and `sources` lists
    path: Path
    raw: bytes = b""
    text: str = ""


def default_cache_dir() -> Path:
    return Path("~/.cache/minagi").expanduser()


def _walk(root: Path, skip_dirs: frozenset[str] | set[str] = frozenset(), suffix: str = "") -> list[Path]:
    """Regular files under root, recursively, skipping hidden files/dirs (and `skip_dirs`)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for name in filenames:
            p = Path(dirpath, name)
            if not name.startswith(".") and name.endswith(suffix) and p.is_file():
                found.append(p)
    return found


def _stable_hash(text: str, salt: str) -> bytes:
    return hashlib.sha256(f"{salt}\0{text}".encode("utf-8", "surrogatepass")).digest()


def _stdlib_sources() -> list[_Source]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [(p.relative_to(root).as_posix(), p) for p in _walk(root, _STDLIB_SKIP_DIRS, ".py")]
    chosen, total = [], 0
    for rel, p in sorted(files, key=lambda rp: _stable_hash(rp[0], "stdlib-subset")):
        size = p.stat().st_size
        if 0 < size and total + size <= STDLIB_CAP_BYTES:
            chosen.append(_Source(f"stdlib/{rel}", p))
            total += size
    if not chosen:
        raise DataError(f"no Python source files found under the standard library at {root}")
    return sorted(chosen, key=lambda s: s.name)


def _resolve(path: str) -> tuple[list[_Source], str]:
    """Path / directory / glob -> sorted sources; also a label for messages."""
    if path == "":
        return _stdlib_sources(), "the standard library's .py files"
    p = Path(path).expanduser()
    if p.is_file():
        return [_Source(p.name, p)], str(path)
    if p.is_dir():
        files = _walk(p)
        if not files:
            raise DataError(f"data directory {path!r} holds no files")
        return sorted((_Source(f.relative_to(p).as_posix(), f) for f in files), key=lambda s: s.name), str(path)
    if glob.has_magic(path):
        matched = sorted(Path(m) for m in glob.glob(os.path.expanduser(path), recursive=True))
        files = sorted({f for m in matched for f in ([m] if m.is_file() else _walk(m) if m.is_dir() else [])})
        if not files:
            raise DataError(f"data glob {path!r} matched no files")
        base = Path(os.path.commonpath([f.parent for f in files]))
        return sorted((_Source(f.relative_to(base).as_posix(), f) for f in files), key=lambda s: s.name), str(path)
    raise DataError(f"data path {path!r} does not exist (expected a text file, a directory or a glob)")


def why_not_text(raw: bytes, error: UnicodeDecodeError | None) -> str:
    """Why a file is not text, with the byte offset to look at: the first byte that is not UTF-8, or a NUL."""
    if error is None:
        return f"a NUL byte at offset {raw.find(bytes(1)):,}: binary"
    start = error.start + (len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0)  # utf-8-sig counts after it
    return f"byte 0x{raw[start]:02x} at offset {start:,} is not UTF-8"


def _read(sources: list[_Source], label: str) -> list[_Source]:
    """Decode each file as UTF-8 (BOM dropped, CRLF -> LF); skip binary / non-UTF-8 / empty ones."""
    kept: list[_Source] = []
    skipped: list[tuple[Path, str]] = []  # (path, why it is not text)
    for s in sources:
        try:
            s.raw = s.path.read_bytes()
            s.text = s.raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            skipped.append((s.path, why_not_text(s.raw, e)))
            continue
        except OSError as e:
            raise DataError(f"cannot read data file {str(s.path)!r}: {e.strerror or e}") from e
        if "\0" in s.text:           # valid UTF-8 but binary (NUL bytes): not text
            skipped.append((s.path, why_not_text(s.raw, None)))
            continue
        s.text = s.text.replace("\r\n", "\n")
        if s.text:
            kept.append(s)
    listed = ", ".join(f"{str(path)!r} ({why})" for path, why in skipped[:_MAX_LISTED]) + (
        f" (+{len(skipped) - _MAX_LISTED} more)" if len(skipped) > _MAX_LISTED else "")
    if not kept:
        if len(sources) == 1 and skipped and str(skipped[0][0]) == label:  # one file: named once
            raise DataError(f"{label}: not text ({skipped[0][1]})")
        if skipped:
            raise DataError(f"no UTF-8 text in {label}: {listed}")
        raise DataError(f"no text in {label}: every file is empty")
    if skipped:
        warnings.warn(f"skipped {len(skipped)} binary / non-UTF-8 file(s) in {label}: {listed}",
                      DataWarning, stacklevel=3)
    return kept


def _split(sources: list[_Source], heldout_fraction: float) -> tuple[list[_Source], list[_Source], int | None]:
    """-> (train files, held-out files, cut) where cut is the character offset when there is one file.

    Several files: whole files are held out, visited in a stable hashed order of their names (not
    content, so editing a file never moves it across the split) and taken whenever that brings the
    held-out total closer to heldout_fraction of all characters; at least one file on each side.
    """
    if len(sources) == 1:
        n = len(sources[0].text)
        return sources, [], int(n * (1.0 - heldout_fraction))   # nanoGPT's first-90% / last-10% cut
    if heldout_fraction == 0.0:
        return sources, [], None
    total = sum(len(s.text) for s in sources)
    target = heldout_fraction * total
    held: list[_Source] = []
    held_chars = 0
    for s in sorted(sources, key=lambda s: _stable_hash(s.name, "heldout")):
        if abs(held_chars + len(s.text) - target) < abs(held_chars - target):
            held.append(s)
            held_chars += len(s.text)
    if not held:                                  # every file is far bigger than the target
        held = [min(sources, key=lambda s: (abs(len(s.text) - target), _stable_hash(s.name, "heldout")))]
    if len(held) == len(sources):                 # keep one file to train on: the one whose removal
        held.remove(min(held, key=lambda s: abs(held_chars - len(s.text) - target)))  # stays closest
    names = {s.name for s in held}
    return [s for s in sources if s.name not in names], [s for s in sources if s.name in names], None


def _split_named(sources: list[_Source], names: list[str]) -> tuple[list[_Source], list[_Source], None]:
    held = set(names)
    return [s for s in sources if s.name not in held], [s for s in sources if s.name in held], None


def _describe(corpus: Corpus, sources: list[_Source], content: str) -> Corpus:
    """Fill in content_key and chars_by_source (the texts are in memory on a cache hit too)."""
    held = set(corpus.heldout_sources)
    if len(sources) == 1:
        by_source = {sources[0].name: (corpus.train_chars, corpus.heldout_chars)}
    else:
        by_source = {s.name: (0, len(s.text)) if s.name in held else (len(s.text), 0) for s in sources}
    corpus.content_key, corpus.chars_by_source = content, by_source
    return corpus


def _strip_gutenberg(sources: list[_Source]) -> None:
    """Each text -> its book alone (minagi.gutenberg); DataError naming a file without the markers."""
    for s in sources:
        try:
            s.text = _strip_pg(s.text)
        except MarkersMissing as e:
            raise DataError(f"{str(s.path)!r}: strip_gutenberg is on but the file has {e}") from None
        if not s.text:
            raise DataError(f"{str(s.path)!r}: nothing between its Project Gutenberg START and END lines")


def _named_heldout(sources: list[_Source], heldout_files: Sequence[str], label: str) -> list[str]:
    """heldout_files -> the sorted source names they pick (a name as `sources` lists it, or a bare
    file name that only one source has); DataError for unknown, ambiguous or all of them."""
    if isinstance(heldout_files, str):
        raise DataError(f"heldout_files must be a list of file names, got the string {heldout_files!r}")
    if len(sources) == 1:
        raise DataError(f"heldout_files {list(heldout_files)} given but {label} is one file "
                        f"({sources[0].name!r}); its held-out part is the last heldout_fraction")
    names = [s.name for s in sources]
    by_base: dict[str, list[str]] = {}
    for n in names:
        by_base.setdefault(n.rsplit("/", 1)[-1], []).append(n)
    picked, unknown, ambiguous = set(), [], []
    for want in heldout_files:
        key = want.replace(os.sep, "/")
        if key in names:
            picked.add(key)
        elif len(by_base.get(key, [])) == 1:
            picked.add(by_base[key][0])
        elif key in by_base:
            ambiguous.append(f"{want!r} ({' or '.join(map(repr, by_base[key][:3]))})")
        else:
            unknown.append(want)
    if unknown:
        hints = [m for u in unknown for m in difflib.get_close_matches(u, names, n=2)]
        valid = list(dict.fromkeys(hints + names))[:5]
        raise DataError(f"heldout_files: {', '.join(map(repr, unknown))} not among the {len(names)} files "
                        f"of {label}; valid names include {', '.join(map(repr, valid))}")
    if ambiguous:
        raise DataError(f"heldout_files: {', '.join(ambiguous)} names several files of {label}; "
                        "give the name as Corpus.sources lists it")
    if len(picked) == len(names):
        raise DataError(f"heldout_files names every file of {label}; leave at least one to train on")
    return sorted(picked)


def _content_key(sources: list[_Source], heldout_fraction: float, *, strip_gutenberg: bool = False,
                 heldout_files: Sequence[str] = ()) -> str:
    """Hash of the names and bytes, the split and the options; the defaults hash as before they existed.

    heldout_files (resolved, sorted) replace the fraction: it plays no part in that split."""
    split = f"{float(heldout_fraction)!r}" if not heldout_files else "files:" + "\0".join(heldout_files)
    h = hashlib.sha256(f"{_CACHE_FORMAT}\0{split}\0".encode("utf-8", "surrogatepass"))
    if strip_gutenberg:
        h.update(f"strip_gutenberg={STRIP_VERSION}\0".encode())
    for s in sources:
        h.update(s.name.encode("utf-8", "surrogatepass") + b"\0" + len(s.raw).to_bytes(8, "little"))
        h.update(s.raw)
    return h.hexdigest()[:32]


def file_content_key(path: str, name: str, heldout_fraction: float, *, strip_gutenberg: bool = False) -> str:
    """`Corpus.content_key` of the one-file corpus at `path` as if the file were called `name`: a renamed
    copy of a run's text has the run's key (one file is split by position, not by its name)."""
    p = Path(path).expanduser()
    return _content_key([_Source(name, p, p.read_bytes())], heldout_fraction, strip_gutenberg=strip_gutenberg)


def _vocab_key(vocab: Vocab) -> str:
    return hashlib.sha256(vocab.chars.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _cache_write(path: Path, write) -> None:
    """write(f) into a new file that replaces `path` whole (no fsync: a lost entry is re-encoded)."""
    def into(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            write(f)
    atomic_write(path, into, durable=False)


def _save_npy(f, ids: np.ndarray) -> None:
    """np.save's bytes, the data written by Python: np.save's own C write reports a short write (a
    full disk) as "N requested and M written", without the errno that names the cause."""
    np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(ids))
    f.write(memoryview(np.ascontiguousarray(ids)).cast("B"))


def _load_npy(path: Path, n: int) -> np.ndarray:
    if n == 0:                      # mmap cannot map zero bytes past the header
        return np.load(path)
    return np.load(path, mmap_mode="r")


def _try_cache(meta_path: Path, vocab: Vocab | None) -> Corpus | None:
    """The cached entry described by meta_path, or None if absent, stale or unreadable."""
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != _CACHE_FORMAT or (vocab is not None and meta["vocab"] != vocab.chars):
            return None
        base = meta_path.with_suffix("")
        train = _load_npy(base.with_suffix(".train.npy"), meta["train_chars"])
        heldout = _load_npy(base.with_suffix(".heldout.npy"), meta["heldout_chars"])
        if len(train) != meta["train_chars"] or len(heldout) != meta["heldout_chars"]:
            return None
        return Corpus(Vocab(meta["vocab"]), train, heldout, meta["sources"], meta["train_chars"],
                      meta["heldout_chars"], meta["heldout_sources"], cache_hit=True, cache_path=str(meta_path))
    except (OSError, ValueError, KeyError, TypeError):
        return None        # absent or half-written by an older crash: re-encode and overwrite


def _encode_files(vocab: Vocab, texts: list[tuple[str, str]]) -> np.ndarray:
    parts = []
    for where, text in texts:
        try:
            parts.append(vocab.encode(text))
        except VocabError as e:
            raise VocabError(f"{where}: {e}") from None
    return np.concatenate(parts) if parts else np.zeros(0, dtype=vocab.dtype)


def load_corpus(path: str, heldout_fraction: float, cache_dir: str = "", vocab: Vocab | None = None, *,
                strip_gutenberg: bool = False, heldout_files: Sequence[str] = ()) -> Corpus:
    """Read, split, encode and cache a corpus (see module docstring).

    path: a text file, a directory (every regular non-hidden file under it, recursively, sorted), a
    glob (sorted), or "" = a capped subset of the standard library's .py files (STDLIB_CAP_BYTES).
    vocab: None derives it from all the text (train and held-out, so evaluation never meets an
    unknown character); given (resume / sampling) it is used as is and a character outside it is a
    VocabError naming the file and the characters.
    cache_dir: "" = ~/.cache/minagi. Entries are keyed by a hash of the files' names and bytes, the
    split (held-out fraction or files), strip_gutenberg and the vocabulary; `Corpus.content_key`
    is that hash without the vocabulary.
    strip_gutenberg: keep only the book of each file (minagi.gutenberg: the text between the
    Project Gutenberg START and END lines, PG's own notes dropped), before the vocabulary and the
    split are made; a file without the markers is a DataError naming it.
    heldout_files: hold out exactly these files (names as `Corpus.sources` lists them, or a bare
    file name that only one of them has); heldout_fraction is then ignored. Only for corpora of
    several files, and at least one file must be left to train on.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    sources, label = _resolve(path)
    sources = _read(sources, label)
    if strip_gutenberg:
        _strip_gutenberg(sources)
    named = _named_heldout(sources, heldout_files, label) if len(heldout_files) else []
    content = _content_key(sources, heldout_fraction, strip_gutenberg=strip_gutenberg, heldout_files=named)

    cache = (Path(cache_dir).expanduser() if cache_dir else default_cache_dir()) / "corpus"
    hit, meta_path = _cached(cache, content, vocab)
    if hit is not None:
        return _describe(hit, sources, content)
    vocab, train_ids, heldout_ids, held_src = _encode_split(sources, named, heldout_fraction, vocab, label)
    return _describe(_store(cache, meta_path, vocab, sources, held_src, train_ids, heldout_ids), sources, content)


def _cached(cache: Path, content: str, vocab: Vocab | None) -> tuple["Corpus | None", Path]:
    """(the cached entry or None, the .json path an entry of this content and vocabulary lives at).
    An entry made with the derived vocabulary is reused when the given vocab is that same one (the
    common resume case), so resuming does not encode the corpus a second time."""
    auto_meta = cache / f"{content}-auto.json"
    hit = _try_cache(auto_meta, vocab)
    meta_path = auto_meta if vocab is None else cache / f"{content}-{_vocab_key(vocab)}.json"
    if hit is None and vocab is not None:
        hit = _try_cache(meta_path, vocab)
    return hit, meta_path


def _encode_split(sources, named, heldout_fraction: float, vocab: Vocab | None, label: str):
    """(vocab, train ids, held-out ids, held-out sources): the split made and both sides encoded;
    the vocabulary derived from all the text where none is given."""
    train_src, held_src, cut = _split(sources, heldout_fraction) if not named else _split_named(sources, named)
    if vocab is None:
        vocab = Vocab.from_text(s.text for s in sources)
    if cut is not None:
        only = sources[0]
        train_ids = _encode_files(vocab, [(str(only.path), only.text)])
        train_ids, heldout_ids = train_ids[:cut], train_ids[cut:]
    else:
        train_ids = _encode_files(vocab, [(str(s.path), s.text) for s in train_src])
        heldout_ids = _encode_files(vocab, [(str(s.path), s.text) for s in held_src])
    if len(train_ids) == 0:
        raise DataError(f"the train split of {label} is empty (heldout_fraction={heldout_fraction})")
    return vocab, train_ids, heldout_ids, held_src


def _store(cache: Path, meta_path: Path, vocab: Vocab, sources, held_src, train_ids, heldout_ids) -> "Corpus":
    """The encoded corpus written to the cache (the .json last: its presence marks a complete entry)
    and read back from it; kept in memory, with a warning, where the cache cannot be written."""
    meta = {
        "format": _CACHE_FORMAT, "vocab": vocab.chars, "sources": [s.name for s in sources],
        "heldout_sources": [s.name for s in held_src], "train_chars": int(len(train_ids)),
        "heldout_chars": int(len(heldout_ids)),
    }
    try:
        cache.mkdir(parents=True, exist_ok=True)
        base = meta_path.with_suffix("")
        _cache_write(base.with_suffix(".train.npy"), lambda f: _save_npy(f, train_ids))
        _cache_write(base.with_suffix(".heldout.npy"), lambda f: _save_npy(f, heldout_ids))
        _cache_write(meta_path, lambda f: f.write(json.dumps(meta, ensure_ascii=True).encode()))
        written = _try_cache(meta_path, vocab)
    except OSError as e:
        warnings.warn(f"cannot write the corpus cache in {str(cache)!r} ({(e.strerror or str(e)).lower()}); "
                      "keeping the encoded corpus in memory", DataWarning, stacklevel=3)
        written = None
    if written is not None:
        written.cache_hit = False
        return written
    return Corpus(vocab, train_ids, heldout_ids, meta["sources"], meta["train_chars"], meta["heldout_chars"],
                  meta["heldout_sources"], cache_hit=False, cache_path="")


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------

_TRAIN_STREAM, _HELDOUT_STREAM = 0, 1   # keeps training and held-out windows independent for one seed


def _windows(ids: np.ndarray, batch_size: int, context: int, entropy: list[int], rank: int,
             world_size: int, split: str, accum_steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    if world_size < 1 or not 0 <= rank < world_size:
        raise DataError(f"rank {rank} is outside world_size {world_size}")
    if batch_size < 1 or batch_size % world_size:
        raise DataError(f"batch_size {batch_size} is not a positive multiple of world_size {world_size}")
    if accum_steps < 1:
        raise DataError(f"accum_steps must be positive, got {accum_steps}")
    if context < 1:
        raise DataError(f"context must be positive, got {context}")
    if len(ids) < context + 1:
        raise DataError(f"the {split} split has {len(ids)} characters; context {context} needs at least {context + 1}")
    if any(e < 0 for e in entropy):
        raise DataError(f"seed and step must be non-negative, got {entropy[:2]}")
    rng = np.random.default_rng(entropy)
    # The whole step's starts, every rank: accum_steps micro-batches of batch_size, in order.
    starts_MB = rng.integers(0, len(ids) - context, size=accum_steps * batch_size).reshape(accum_steps, batch_size)
    b = batch_size // world_size
    starts_b = starts_MB[:, rank * b:(rank + 1) * b].reshape(-1)  # this rank's rows of each micro-batch
    rows = np.asarray(ids[starts_b[:, None] + np.arange(context + 1)], dtype=np.int64)  # [accum_steps * b, T+1]
    rows_t = torch.from_numpy(rows)
    return rows_t[:, :-1].contiguous(), rows_t[:, 1:].contiguous()    # x, y: [accum_steps * b, T]


def get_batch(ids: np.ndarray, batch_size: int, context: int, seed: int, step: int,
              rank: int = 0, world_size: int = 1, accum_steps: int = 1, *,
              split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the step's batch for (seed, step): x, y int64 [accum_steps * b, context],
    b = batch_size // world_size, micro-batch after micro-batch (`x.chunk(accum_steps)`).

    The step's window starts (accum_steps x batch_size of them) come from a numpy Generator seeded by
    (seed, step), so any rank count sees the same step and rank r takes rows [r*b, (r+1)*b) of each
    micro-batch; and batch_size B with accum_steps M draws the sequences of batch_size M*B with 1, in
    the same order. `split` names the ids in errors.
    """
    return _windows(ids, batch_size, context, [seed, step, _TRAIN_STREAM], rank, world_size, split, accum_steps)


def batch_on(device: torch.device, ids: np.ndarray, batch_size: int, context: int, seed: int, step: int,
             rank: int = 0, world_size: int = 1, accum_steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`get_batch`'s x, y on `device`, their copies queued: pinned first on CUDA, so the copy waits for
    nothing queued before it (a copy from pageable memory would)."""
    x, y = get_batch(ids, batch_size, context, seed, step, rank, world_size, accum_steps)
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def heldout_batches(ids: np.ndarray, batch_size: int, context: int, n_batches: int, seed: int,
                    rank: int = 0, world_size: int = 1, accum_steps: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of (x, y) micro-batches for evaluation, the same at every training step: n_batches
    batches of the step (accum_steps x batch_size sequences), each in its accum_steps micro-batches of
    this rank's rows. As in `get_batch`, batch_size B with accum_steps M evaluates the sequences of
    batch_size M*B with 1, in the same order, and a forward never holds more than a micro-batch."""
    out = []
    for i in range(n_batches):
        x, y = _windows(ids, batch_size, context, [seed, i, _HELDOUT_STREAM], rank, world_size, "held-out",
                        accum_steps)
        out.extend(zip(x.chunk(accum_steps), y.chunk(accum_steps)))
    return out
