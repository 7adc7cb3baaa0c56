"""minagi/data.py: vocabulary, corpus loading and split, cache, deterministic sharded batches."""

import errno
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minagi import data
from minagi.data import DataError, Vocab, VocabError, get_batch, heldout_batches, load_corpus

REPO = Path(__file__).resolve().parent.parent

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    return path


def _many_files(root: Path, n: int = 20, size: int = 1000) -> Path:
    for i in range(n):
        _write(root / f"sub{i % 3}" / f"f{i:02d}.txt", (f"file {i} says hello. " * size)[: size + 37 * i])
    return root


# --- vocabulary --------------------------------------------------------------------------------

def test_vocab_encode_decode_round_trip_including_non_ascii():
    text = "Hello, wörld!\n\tçà 🙂 ok"
    vocab = Vocab.from_text(text)
    assert vocab.chars == "".join(sorted(set(text)))
    ids = vocab.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text)
    assert vocab.decode(ids) == text
    assert vocab.decode(torch.from_numpy(ids.astype(np.int64))) == text
    assert vocab.decode(ids.tolist()) == text
    assert Vocab.from_chars(list(vocab.chars)) == vocab == Vocab.from_chars(vocab.chars)


def test_vocab_dtype_widens_past_256_characters():
    wide = Vocab("".join(chr(0x100 + i) for i in range(300)))
    text = wide.chars[::-1]
    ids = wide.encode(text)
    assert ids.dtype == np.uint16 and wide.decode(ids) == text


def test_vocab_of_256_characters_is_uint8_and_257_is_uint16_without_wrapping():
    """uint8 holds ids 0..255: 256 characters fit, a 257th character's id 256 would wrap to 0."""
    chars = "".join(chr(0x100 + i) for i in range(257))
    full = Vocab(chars[:256])
    ids = full.encode(full.chars)
    assert ids.dtype == np.uint8 and ids.tolist() == list(range(256)) and full.decode(ids) == full.chars
    over = Vocab(chars)
    ids = over.encode(chars[-1] + chars[0])
    assert ids.dtype == np.uint16 and ids.tolist() == [256, 0] and over.decode(ids) == chars[-1] + chars[0]


def test_vocab_encode_error_names_unknown_characters_with_counts():
    vocab = Vocab.from_text("abc ")
    with pytest.raises(VocabError) as info:
        vocab.encode("abc é\té\U0001F642")
    msg = str(info.value)
    assert "\n" not in msg
    assert "'é' x2" in msg and repr("\t") in msg and repr("\U0001F642") in msg and "3 character(s)" in msg


def test_vocab_encode_error_lists_at_most_ten_characters():
    vocab = Vocab("a")
    with pytest.raises(VocabError, match=r"20 character\(s\).*\(\+10 more\)"):
        vocab.encode("".join(chr(0x400 + i) for i in range(20)))


def test_vocab_rejects_unsorted_or_duplicate_characters():
    with pytest.raises(VocabError):
        Vocab("ba")
    with pytest.raises(VocabError):
        Vocab("aab")


def test_vocab_decode_error_names_out_of_range_id():
    with pytest.raises(VocabError, match="id 7"):
        Vocab("ab").decode([0, 7])


# --- loading and the split ---------------------------------------------------------------------

def test_single_file_holds_out_the_last_fraction(tmp_path, cache):
    text = "".join(chr(ord("a") + (i * 7) % 26) for i in range(1000)) + "\r\nend\r\n"
    path = _write(tmp_path / "one.txt", text)
    corpus = load_corpus(str(path), 0.25, cache_dir=cache)
    norm = text.replace("\r\n", "\n")
    cut = int(len(norm) * 0.75)
    assert "\r" not in corpus.vocab.chars
    assert corpus.vocab.decode(corpus.train_ids) == norm[:cut]
    assert corpus.vocab.decode(corpus.heldout_ids) == norm[cut:]
    assert (corpus.train_chars, corpus.heldout_chars) == (cut, len(norm) - cut)
    assert corpus.sources == ["one.txt"] and corpus.heldout_sources == []


def test_several_files_hold_out_whole_files_deterministically(tmp_path, cache):
    root = _many_files(tmp_path / "corpus")
    _write(root / ".hidden.txt", "HIDDEN")
    _write(root / ".git" / "config", "GITDIR")
    a = load_corpus(str(root), 0.2, cache_dir=cache)
    b = load_corpus(str(root), 0.2, cache_dir=str(tmp_path / "other_cache"))
    assert not b.cache_hit
    assert a.heldout_sources == b.heldout_sources and np.array_equal(a.heldout_ids, b.heldout_ids)
    assert len(a.sources) == 20 and not any("hidden" in s or ".git" in s for s in a.sources)
    assert 1 <= len(a.heldout_sources) < 20
    # whole files: held-out text is exactly the held-out files, concatenated in sorted order
    texts = {s: (root / s).read_text() for s in a.sources}
    assert a.vocab.decode(a.heldout_ids) == "".join(texts[s] for s in sorted(a.heldout_sources))
    assert a.vocab.decode(a.train_ids) == "".join(texts[s] for s in a.sources if s not in a.heldout_sources)
    total = a.train_chars + a.heldout_chars
    assert abs(a.heldout_chars / total - 0.2) < 0.05


def test_two_files_keep_one_on_each_side(tmp_path, cache):
    root = tmp_path / "two"
    _write(root / "a.txt", "a" * 5000)
    _write(root / "b.txt", "b" * 10)
    for fraction in (0.01, 0.5, 0.95):
        corpus = load_corpus(str(root), fraction, cache_dir=cache)
        assert len(corpus.heldout_sources) == 1 and corpus.train_chars > 0 and corpus.heldout_chars > 0


def test_vocab_covers_heldout_only_characters(tmp_path, cache):
    root = _many_files(tmp_path / "c", n=6)
    corpus = load_corpus(str(root), 0.3, cache_dir=cache)
    held = corpus.heldout_sources[0]
    _write(root / held, (root / held).read_text() + "Ωλ")
    corpus = load_corpus(str(root), 0.3, cache_dir=cache)
    assert held in corpus.heldout_sources and "Ω" in corpus.vocab.chars and "λ" in corpus.vocab.chars


def test_glob_loads_sorted_matches(tmp_path, cache):
    _write(tmp_path / "g" / "b.txt", "bbbb")
    _write(tmp_path / "g" / "a.txt", "aaaa")
    _write(tmp_path / "g" / "c.md", "cccc")
    corpus = load_corpus(str(tmp_path / "g" / "*.txt"), 0.5, cache_dir=cache)
    assert corpus.sources == ["a.txt", "b.txt"] and corpus.vocab.chars == "ab"


def test_binary_file_in_directory_is_skipped_with_one_warning(tmp_path, cache):
    root = tmp_path / "mixed"
    _write(root / "a.txt", "plain text one")
    _write(root / "b.txt", "plain text two")
    (root / "blob.bin").write_bytes(bytes([0x89, 0x50, 0xFF, 0xFE, 0x00, 0x01]))
    (root / "nul.dat").write_bytes(b"abc\x00def")
    with pytest.warns(data.DataWarning) as record:
        corpus = load_corpus(str(root), 0.5, cache_dir=cache)
    message = str(record[0].message)
    assert len(record) == 1 and f"'{root / 'blob.bin'}' (byte 0x89 at offset 0 is not UTF-8)" in message
    assert f"'{root / 'nul.dat'}' (a NUL byte at offset 3: binary)" in message
    assert corpus.sources == ["a.txt", "b.txt"]


def test_single_non_utf8_file_is_an_error_naming_it_and_the_offset_of_its_bad_byte(tmp_path, cache):
    path = tmp_path / "latin1.txt"
    path.write_bytes(("ok\n" * 1000 + "caf\xe9").encode("latin-1"))
    with pytest.raises(DataError) as err:
        load_corpus(str(path), 0.1, cache_dir=cache)
    assert str(err.value) == f"{path}: not text (byte 0xe9 at offset 3,003 is not UTF-8)"  # the file named once
    path.write_bytes(b"\xef\xbb\xbf" + "caf\xe9".encode("latin-1"))  # after a BOM: offsets count the BOM
    with pytest.raises(DataError, match=r"byte 0xe9 at offset 6 is not UTF-8\)$"):
        load_corpus(str(path), 0.1, cache_dir=cache)


def test_missing_path_and_empty_glob_are_one_line_errors_naming_them(tmp_path, cache):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="nope.txt") as info:
        load_corpus(missing, 0.1, cache_dir=cache)
    assert "\n" not in str(info.value)
    with pytest.raises(DataError, match=r"\*\.zzz.*matched no files"):
        load_corpus(str(tmp_path / "*.zzz"), 0.1, cache_dir=cache)


def test_given_vocab_is_used_and_outside_characters_name_file_and_characters(tmp_path, cache):
    path = _write(tmp_path / "t.txt", "abcabc\n" * 50)
    wider = Vocab("\nabcdz")
    corpus = load_corpus(str(path), 0.1, cache_dir=cache, vocab=wider)
    assert corpus.vocab == wider and corpus.vocab.decode(corpus.train_ids[:7]) == "abcabc\n"
    with pytest.raises(VocabError, match=r"t\.txt.*'c' x100") as info:
        load_corpus(str(path), 0.1, cache_dir=cache, vocab=Vocab("\nab"))
    assert "\n" not in str(info.value)


def test_second_load_is_a_cache_hit_without_reencoding(tmp_path, cache, monkeypatch):
    root = _many_files(tmp_path / "c", n=5)
    first = load_corpus(str(root), 0.2, cache_dir=cache)
    assert not first.cache_hit and Path(first.cache_path).is_file()
    mtime = os.stat(first.cache_path).st_mtime_ns

    def no_encoding(*args, **kwargs):
        raise AssertionError("re-encoded a cached corpus")

    monkeypatch.setattr(Vocab, "encode", no_encoding)
    second = load_corpus(str(root), 0.2, cache_dir=cache)
    assert second.cache_hit and isinstance(second.train_ids, np.memmap)
    assert os.stat(first.cache_path).st_mtime_ns == mtime
    assert np.array_equal(first.train_ids, second.train_ids) and first.vocab == second.vocab
    # resuming with the checkpoint's vocab (the same one) reuses that entry too
    assert load_corpus(str(root), 0.2, cache_dir=cache, vocab=first.vocab).cache_hit
    monkeypatch.undo()
    # changing content or split misses the cache
    assert not load_corpus(str(root), 0.3, cache_dir=cache).cache_hit
    _write(root / "sub0" / "f00.txt", "changed")
    assert not load_corpus(str(root), 0.2, cache_dir=cache).cache_hit


def test_derived_and_given_vocabularies_of_one_text_each_get_their_own_cache_entry(tmp_path, cache):
    """--init or a resume passes a wider vocabulary than the text's own: its load must not reuse the
    derived entry's ids, nor may its entry take the derived one's place for the next plain load."""
    text = "hello world\n" * 20
    path = _write(tmp_path / "t.txt", text)
    derived = load_corpus(str(path), 0.1, cache_dir=cache)
    wider = Vocab("".join(sorted(derived.vocab.chars + "A")))  # 'A' sorts before the letters: their ids shift
    given = load_corpus(str(path), 0.1, cache_dir=cache, vocab=wider)
    again = load_corpus(str(path), 0.1, cache_dir=cache)
    assert given.vocab == wider and derived.vocab == again.vocab == Vocab.from_text(text)
    for corpus in (derived, given, again):
        assert corpus.vocab.decode(np.concatenate([corpus.train_ids, corpus.heldout_ids])) == text
    assert not np.array_equal(given.train_ids, derived.train_ids)
    assert np.array_equal(again.train_ids, derived.train_ids) and again.cache_hit
    assert given.cache_path != derived.cache_path == again.cache_path


def test_cache_leaves_no_temp_files_and_uses_uint8_for_small_vocab(tmp_path, cache):
    corpus = load_corpus(str(_write(tmp_path / "t.txt", "hello world\n" * 20)), 0.1, cache_dir=cache)
    files = sorted(p.name for p in (Path(cache) / "corpus").iterdir())
    assert len(files) == 3 and not any(".tmp-" in f for f in files)
    assert corpus.train_ids.dtype == np.uint8 and corpus.heldout_ids.dtype == np.uint8


# A process whose files may not grow past 4 KiB: the cache's write stops part-way, as on a full disk,
# where numpy's own write reported "N requested and M written" and no cause.
_CUT_SHORT = """
import resource, signal, sys, warnings
sys.path.insert(0, sys.argv[3])
from minagi.data import load_corpus
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    corpus = load_corpus(sys.argv[1], 0.1, cache_dir=sys.argv[2])
print(corpus.train_chars, corpus.cache_hit, *[str(w.message) for w in caught], sep="\\n")
"""


@pytest.mark.skipif(sys.platform == "win32", reason="resource.RLIMIT_FSIZE is POSIX")
def test_a_cache_write_cut_short_says_the_systems_reason_and_keeps_the_corpus_in_memory(tmp_path, cache):
    text = _write(tmp_path / "t.txt", "a line of text to encode\n" * 1000)  # 25,000 characters: > 4 KiB
    done = subprocess.run([sys.executable, "-c", _CUT_SHORT, str(text), cache, str(REPO)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    chars, hit, *messages = done.stdout.splitlines()
    assert (int(chars), hit) == (22500, "False") and len(messages) == 1
    assert messages[0] == (f"cannot write the corpus cache in {str(Path(cache) / 'corpus')!r} "
                           f"({os.strerror(errno.EFBIG).lower()}); keeping the encoded corpus in memory")
    assert not any(".tmp-" in p.name for p in (Path(cache) / "corpus").iterdir())


def test_zero_heldout_fraction_gives_empty_heldout_split(tmp_path, cache):
    corpus = load_corpus(str(_write(tmp_path / "t.txt", "abcdef" * 10)), 0.0, cache_dir=cache)
    assert corpus.heldout_chars == 0 and corpus.train_chars == 60
    assert load_corpus(str(tmp_path / "t.txt"), 0.0, cache_dir=cache).cache_hit
    with pytest.raises(DataError, match="held-out split has 0 characters"):
        heldout_batches(corpus.heldout_ids, 2, 4, 1, seed=0)


def test_stdlib_default_loads_real_python_source(cache):
    corpus = load_corpus("", 0.1, cache_dir=cache)
    assert len(corpus.sources) > 20 and all(s.startswith("stdlib/") and s.endswith(".py") for s in corpus.sources)
    assert not any("site-packages" in s or "/test/" in s for s in corpus.sources)
    assert 1_000_000 < corpus.train_chars + corpus.heldout_chars <= data.STDLIB_CAP_BYTES
    assert corpus.heldout_sources and corpus.heldout_chars > 0
    text = corpus.vocab.decode(corpus.train_ids[:200_000])
    assert "def " in text and "import " in text and "return" in text


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason="../shared/data/tinyshakespeare.txt not present")
def test_tinyshakespeare_vocab_is_65_and_split_matches_nanogpt(cache):
    corpus = load_corpus(str(SHAKESPEARE), 0.1, cache_dir=cache)
    assert corpus.vocab.size == 65
    assert (corpus.train_chars, corpus.heldout_chars) == (1_003_854, 111_540)
    assert corpus.vocab.decode(corpus.train_ids[:14]) == "First Citizen:"


# --- batches -----------------------------------------------------------------------------------

def _ids(n=5000):
    return np.arange(n, dtype=np.int64) % 251


def test_get_batch_is_deterministic_in_seed_and_step():
    ids = _ids().astype(np.uint8)
    x1, y1 = get_batch(ids, 8, 16, seed=3, step=10)
    x2, y2 = get_batch(ids, 8, 16, seed=3, step=10)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert x1.dtype == torch.int64 and x1.shape == (8, 16)
    assert not torch.equal(x1, get_batch(ids, 8, 16, seed=3, step=11)[0])
    assert not torch.equal(x1, get_batch(ids, 8, 16, seed=4, step=10)[0])


def test_get_batch_targets_are_inputs_shifted_by_one():
    ids = np.random.default_rng(0).integers(0, 50, 3000).astype(np.uint8)
    x, y = get_batch(ids, 4, 32, seed=0, step=0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.numpy(), y.numpy()):   # each row is a real window of the ids
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(ids, 33) ==
                                       np.append(row_x, row_y[-1]), axis=1))
        assert len(starts) >= 1


def test_rank_shards_concatenate_to_the_single_rank_batch():
    ids = _ids()
    whole_x, whole_y = get_batch(ids, 8, 12, seed=1, step=5)
    halves = [get_batch(ids, 8, 12, seed=1, step=5, rank=r, world_size=2) for r in range(2)]
    assert halves[0][0].shape == (4, 12)
    assert torch.equal(torch.cat([h[0] for h in halves]), whole_x)
    assert torch.equal(torch.cat([h[1] for h in halves]), whole_y)
    quarters = [get_batch(ids, 8, 12, seed=1, step=5, rank=r, world_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(quarters), whole_x)


def test_batch_size_not_divisible_by_world_size_is_an_error():
    with pytest.raises(DataError, match="batch_size 10.*world_size 4"):
        get_batch(_ids(), 10, 8, seed=0, step=0, rank=0, world_size=4)


def test_split_shorter_than_context_names_split_and_length():
    with pytest.raises(DataError, match="train split has 10 characters.*context 16"):
        get_batch(np.zeros(10, np.uint8), 2, 16, seed=0, step=0)
    with pytest.raises(DataError, match="held-out split has 10 characters"):
        heldout_batches(np.zeros(10, np.uint8), 2, 16, n_batches=2, seed=0)


def test_heldout_batches_are_fixed_and_shardable():
    ids = _ids()
    a = heldout_batches(ids, 6, 10, n_batches=3, seed=7)
    b = heldout_batches(ids, 6, 10, n_batches=3, seed=7)
    assert len(a) == 3 and all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])
    halves = [heldout_batches(ids, 6, 10, n_batches=3, seed=7, rank=r, world_size=2) for r in range(2)]
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), a[i][0])


def test_heldout_batches_under_accumulation_are_the_whole_steps_in_micro_batches():
    """batch_size B with accum_steps M evaluates what batch_size M*B with 1 does: a run's held-out loss
    does not change with how its step is split (it did: the sample was eval_batches x B windows)."""
    ids = _ids()
    whole = heldout_batches(ids, 6, 10, n_batches=3, seed=7)
    micro = heldout_batches(ids, 3, 10, n_batches=3, seed=7, accum_steps=2)
    assert len(micro) == 6 and all(x.shape == (3, 10) for x, _ in micro)
    for i, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([micro[2 * i][0], micro[2 * i + 1][0]]), x)
        assert torch.equal(torch.cat([micro[2 * i][1], micro[2 * i + 1][1]]), y)


def test_batch_windows_stay_inside_the_ids():
    ids = np.arange(20, dtype=np.int64)          # tiny: every window start 0..3 must appear, none past
    seen = set()
    for step in range(50):
        x, y = get_batch(ids, 4, 16, seed=0, step=step)
        assert int(y.max()) <= 19
        seen.update(x[:, 0].tolist())
    assert seen == {0, 1, 2, 3}


# --- Project Gutenberg stripping and named held-out files ----------------------------------------

GUTENBERG = SHARED_DATA / "gutenberg"
BOOK = "CHAPTER I\n\nIt was a dark night.\n\n\n\nCHAPTER II\n\n  The end came; it was not Pale.\n"
LICENCE = ("*** START: FULL LICENSE ***\n\nTHE FULL PROJECT GUTENBERG LICENSE\n"
           "Section 1.  General Terms of Use & Redistributing Project Gutenberg-tm electronic works\n"
           "#$%@ www.gutenberg.org\n")


def _pg_file(start: str, end: str, book: str = BOOK) -> str:
    """A Project Gutenberg file as the real ones are laid out, with CRLF line endings."""
    text = (f"The Project Gutenberg EBook of Night, by Nobody\n\nTitle: Night\n\n{start}\n\n\n\n"
            f"Produced by an anonymous Project Gutenberg volunteer\n\n\n\n{book}\n\n\n"
            f"End of the Project Gutenberg EBook of Night, by\nNobody\n\n{end}\n\n{LICENCE}")
    return text.replace("\n", "\r\n")


@pytest.mark.parametrize("start, end", [
    ("*** START OF THIS PROJECT GUTENBERG EBOOK NIGHT ***", "*** END OF THIS PROJECT GUTENBERG EBOOK NIGHT ***"),
    ("***START OF THE PROJECT GUTENBERG EBOOK NIGHT***", "***END OF THE PROJECT GUTENBERG EBOOK NIGHT***"),
    ("*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*", "(no END line: old files)"),
    ("  ***  START OF THIS  PROJECT\tGUTENBERG EBOOK NIGHT ***", "\t*** END  OF THE PROJECT GUTENBERG\tEBOOK NIGHT ***"),
])
def test_strip_gutenberg_keeps_only_the_book_before_vocab_and_split(tmp_path, cache, start, end):
    path = _write(tmp_path / "night.txt", _pg_file(start, end))
    corpus = load_corpus(str(path), 0.25, cache_dir=cache, strip_gutenberg=True)
    assert corpus.vocab.decode(np.concatenate([corpus.train_ids, corpus.heldout_ids])) == BOOK
    assert corpus.vocab == Vocab.from_text(BOOK)           # no licence character ('#', '@', ...) in it
    cut = int(len(BOOK) * 0.75)
    assert (corpus.train_chars, corpus.heldout_chars) == (cut, len(BOOK) - cut)
    assert corpus.chars_by_source == {"night.txt": (cut, len(BOOK) - cut)}


def test_strip_gutenberg_drops_paragraphs_naming_project_gutenberg_and_keeps_blank_lines():
    from minagi.gutenberg import strip_gutenberg
    body = ("\n\n\nTITLE\n\n[Project Gutenberg Editor's Note: see\nanother edition]\n\n\n\nOne.\n  \nTwo,"
            " the project; Gutenberg's press.\n\n\nEnd of Project Gutenberg's Title, by A\n\n")
    text = f"head\n*** START OF THE PROJECT GUTENBERG EBOOK T ***{body}*** END OF THE PROJECT GUTENBERG EBOOK T ***\n"
    assert strip_gutenberg(text) == "TITLE\n\n\n\nOne.\n  \nTwo, the project; Gutenberg's press.\n"


def test_strip_gutenberg_finds_lower_case_markers_and_notes_naming_it_in_any_case_or_spacing():
    """Real books write the markers and their notes as they please: in lower case, and with the name split
    by two spaces or wrapped onto the next line; each such note is still PG's own and dropped."""
    from minagi.gutenberg import strip_gutenberg
    body = ("\n\nOne.\n\nproduced by the project gutenberg online team\n\nTwo.\n\n"
            "Transcribed for Project  Gutenberg by a volunteer\n\nThree.\n\n"
            "[Transcriber's note: this Project\nGutenberg edition keeps the spelling]\n\nFour.\n\n")
    text = f"head\n*** start of the project gutenberg ebook t ***{body}*** end of the project gutenberg ebook t ***\n"
    assert strip_gutenberg(text) == "One.\n\nTwo.\n\nThree.\n\nFour.\n"


@pytest.mark.parametrize("case", ["no start", "no end"])
def test_strip_gutenberg_without_markers_is_a_one_line_error_naming_the_file(tmp_path, cache, case):
    good = _write(tmp_path / "pg" / "good.txt", _pg_file("*** START OF THIS PROJECT GUTENBERG EBOOK X ***",
                                                         "*** END OF THIS PROJECT GUTENBERG EBOOK X ***"))
    bad = _write(tmp_path / "pg" / "plain.txt", "just a text\n" if case == "no start"
                 else "*** START OF THIS PROJECT GUTENBERG EBOOK Y ***\nand no end\n")
    with pytest.raises(DataError) as info:
        load_corpus(str(tmp_path / "pg"), 0.5, cache_dir=cache, strip_gutenberg=True)
    msg = str(info.value)
    assert "\n" not in msg and str(bad) in msg and str(good) not in msg
    assert ("no Project Gutenberg START line" if case == "no start" else "no Project Gutenberg END line") in msg
    load_corpus(str(tmp_path / "pg"), 0.5, cache_dir=cache)  # without the option the file is fine


def test_strip_gutenberg_and_heldout_files_change_the_cache_key(tmp_path, cache):
    root = tmp_path / "pg"
    for name in ("a.txt", "b.txt", "c.txt"):
        _write(root / name, _pg_file("*** START OF THIS PROJECT GUTENBERG EBOOK X ***",
                                     "*** END OF THIS PROJECT GUTENBERG EBOOK X ***", BOOK + name))
    plain = load_corpus(str(root), 0.3, cache_dir=cache)
    stripped = load_corpus(str(root), 0.3, cache_dir=cache, strip_gutenberg=True)
    named = load_corpus(str(root), 0.3, cache_dir=cache, heldout_files=["b.txt"])
    keys = {plain.content_key, stripped.content_key, named.content_key}
    assert len(keys) == 3 and not stripped.cache_hit and not named.cache_hit
    assert stripped.train_chars + stripped.heldout_chars < plain.train_chars + plain.heldout_chars
    for c in (plain, stripped, named):
        assert Path(c.cache_path).name.startswith(c.content_key + "-")
    again = load_corpus(str(root), 0.3, cache_dir=cache, strip_gutenberg=True)
    assert again.cache_hit and again.content_key == stripped.content_key
    assert again.chars_by_source == stripped.chars_by_source
    # The fraction plays no part in a split by named files: same key, a cache hit.
    other = load_corpus(str(root), 0.05, cache_dir=cache, heldout_files=["b.txt"])
    assert other.cache_hit and other.content_key == named.content_key


def test_default_content_key_is_the_one_caches_were_written_under_before_the_options(tmp_path, cache):
    import hashlib
    root = _many_files(tmp_path / "c", n=4)
    corpus = load_corpus(str(root), 0.2, cache_dir=cache)
    h = hashlib.sha256(f"{data._CACHE_FORMAT}\0{0.2!r}\0".encode())
    for name in corpus.sources:
        raw = (root / name).read_bytes()
        h.update(name.encode() + b"\0" + len(raw).to_bytes(8, "little") + raw)
    assert corpus.content_key == h.hexdigest()[:32]


def test_heldout_files_hold_out_exactly_those_files(tmp_path, cache):
    root = _many_files(tmp_path / "corpus", n=9)
    corpus = load_corpus(str(root), 0.5, cache_dir=cache, heldout_files=["sub1/f04.txt", "f00.txt", "f00.txt"])
    assert corpus.heldout_sources == ["sub0/f00.txt", "sub1/f04.txt"]
    texts = {s: (root / s).read_text() for s in corpus.sources}
    assert corpus.vocab.decode(corpus.heldout_ids) == texts["sub0/f00.txt"] + texts["sub1/f04.txt"]
    assert corpus.vocab.decode(corpus.train_ids) == "".join(
        texts[s] for s in corpus.sources if s not in corpus.heldout_sources)
    assert list(corpus.chars_by_source) == corpus.sources
    for name, (train, held) in corpus.chars_by_source.items():
        assert (train, held) == ((0, len(texts[name])) if name in corpus.heldout_sources else (len(texts[name]), 0))
    assert sum(t for t, _ in corpus.chars_by_source.values()) == corpus.train_chars
    assert sum(h for _, h in corpus.chars_by_source.values()) == corpus.heldout_chars


@pytest.mark.parametrize("names, expected", [
    (["f01.txt", "sub2/nope.txt"], r"'sub2/nope.txt' not among the 6 files of .*valid names include 'sub2/f02.txt'"),
    (["x.txt"], r"'x.txt' \('a/x.txt' or 'b/x.txt'\) names several files"),
    (["a/x.txt", "b/x.txt", "sub0/f00.txt", "f01.txt", "f02.txt", "f03.txt"], "names every file"),
    ("f01.txt", "must be a list of file names, got the string 'f01.txt'"),
])
def test_heldout_files_errors_are_one_line_naming_the_files(tmp_path, cache, names, expected):
    root = _many_files(tmp_path / "corpus", n=4)
    _write(root / "a" / "x.txt", "ax")
    _write(root / "b" / "x.txt", "bx")
    with pytest.raises(DataError, match=expected) as info:
        load_corpus(str(root), 0.2, cache_dir=cache, heldout_files=names)
    assert "\n" not in str(info.value)


def test_heldout_files_on_a_single_file_corpus_is_an_error(tmp_path, cache):
    path = _write(tmp_path / "one.txt", "abc" * 100)
    with pytest.raises(DataError, match=r"heldout_files \['one.txt'\] given but .*one.txt.* is one file"):
        load_corpus(str(path), 0.1, cache_dir=cache, heldout_files=["one.txt"])
    assert load_corpus(str(path), 0.1, cache_dir=cache, heldout_files=[]).chars_by_source == {"one.txt": (270, 30)}


@pytest.mark.skipif(not GUTENBERG.is_dir(), reason="../shared/data/gutenberg not present")
def test_all_real_gutenberg_books_strip_to_their_text(cache):
    from minagi.gutenberg import strip_gutenberg
    files = sorted(GUTENBERG.glob("*.txt"))
    assert len(files) == 18
    for path in files:
        text = path.read_text(encoding="utf-8").replace("\r\n", "\n")
        book = strip_gutenberg(text)
        assert "gutenberg" not in book.lower(), path.name
        assert "*** START" not in book and "***END" not in book.replace("*** END", "***END"), path.name
        # Alice, the shortest book, keeps the least: 88%; every other book over 95%.
        assert len(book) / len(text) > (0.85 if path.name.startswith("pg11_") else 0.95), path.name
        assert book.endswith("\n") and not book.startswith("\n")
        assert set(book.split("\n")) <= set(text.split("\n")), path.name  # whole lines dropped, none cut
    # The README's suggested split: hold out Alice and Frankenstein (about 0.57 M characters).
    corpus = load_corpus(str(GUTENBERG / "*.txt"), 0.1, cache_dir=cache, strip_gutenberg=True,  # not MANIFEST.tsv
                         heldout_files=["pg11_alice_in_wonderland.txt", "pg84_frankenstein.txt"])
    assert corpus.heldout_sources == ["pg11_alice_in_wonderland.txt", "pg84_frankenstein.txt"]
    assert 560_000 < corpus.heldout_chars < 575_000 and corpus.vocab.size <= 87
    assert corpus.train_chars + corpus.heldout_chars == sum(t + h for t, h in corpus.chars_by_source.values())
