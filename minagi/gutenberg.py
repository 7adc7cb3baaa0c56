"""Project Gutenberg files -> the book alone: the header, the licence and PG's own notes removed.

The body is the text strictly between the START line and the END line. The variants accepted:

  START  `*** START OF THIS PROJECT GUTENBERG EBOOK <TITLE> ***` and `***START OF THE PROJECT
         GUTENBERG EBOOK <TITLE>***` (both in ../shared/data/gutenberg), also EBOOK -> ETEXT and
         `THE COPYRIGHTED PROJECT GUTENBERG`; older files that open with the "small print" licence
         end it with a `*END*THE SMALL PRINT! ...` line, which then counts as the START line.
  END    `*** END OF THIS ...` / `***END OF THE ...` as above, or the first line before it that
         begins `End of the Project Gutenberg EBook of` / `End of Project Gutenberg's` (most files
         carry that line just above the END line; in old files it is the only end mark).
  Case, the spaces between a marker's words (one or more, or tabs) and indentation are free.

Inside the body, a paragraph (lines between blank lines) that names "Project Gutenberg" is PG's
own note, not the book's (a "Produced by an anonymous Project Gutenberg volunteer" credit, a
"[Project Gutenberg Editor's Note: ...]", a transcriber's note), and is dropped too, so no
reference to Project Gutenberg is left (what PG licence section 1.C asks of stripped copies).
"""
from __future__ import annotations

import re

__all__ = ["MarkersMissing", "strip_gutenberg", "STRIP_VERSION"]

STRIP_VERSION = "pg-strip-v2"  # part of the corpus cache key: bump when the rules below change

_GAP = r"[ \t]+"  # between a marker's words: files hand-edited or re-wrapped carry two spaces, or a tab
_BOOK = rf"(?:THE|THIS){_GAP}(?:COPYRIGHTED{_GAP})?PROJECT{_GAP}GUTENBERG{_GAP}E(?:BOOK|TEXT)\b"
_MARK = r"^[ \t]*\*\*\*[ \t]*"  # a marker line's opening stars, indented or not
_SMALL_PRINT = rf"\*END\*?[ \t]*THE{_GAP}SMALL{_GAP}PRINT"
_END_OF_PG = rf"End{_GAP}of{_GAP}(?:the{_GAP})?Project{_GAP}Gutenberg\b"
_START = re.compile(rf"(?:{_MARK}START{_GAP}OF{_GAP}{_BOOK}|^[ \t]*{_SMALL_PRINT})[^\n]*$", re.M | re.I)
_END = re.compile(rf"(?:{_MARK}END{_GAP}OF{_GAP}{_BOOK}|^[ \t]*{_END_OF_PG})[^\n]*$", re.M | re.I)
_BLANK_LINES = re.compile(r"(\n(?:[ \t]*\n)+)")  # captured: re.split keeps them
_NAMES_PG = re.compile(r"Project\s+Gutenberg", re.I)


class MarkersMissing(ValueError):
    """No START line, or no END line after it; the message says which (the caller names the file)."""


def strip_gutenberg(text: str) -> str:
    """The book in a Project Gutenberg text (LF line endings), ending in one newline.

    MarkersMissing when there is no START line or no END line after it.
    """
    start = _START.search(text)
    if start is None:
        raise MarkersMissing("no Project Gutenberg START line ('*** START OF THE PROJECT GUTENBERG "
                             "EBOOK ...' or '*END*THE SMALL PRINT ...')")
    end = _END.search(text, start.end())
    if end is None:
        raise MarkersMissing(f"no Project Gutenberg END line ('*** END OF THE PROJECT GUTENBERG EBOOK "
                             f"...') after its START line {start.group(0).strip()[:60]!r}")
    return _drop_pg_paragraphs(text[start.end():end.start()])


def _drop_pg_paragraphs(body: str) -> str:
    """Paragraphs naming Project Gutenberg removed; each kept one keeps the blank lines before it."""
    parts = _BLANK_LINES.split(body)            # paragraph, blank lines, paragraph, ...
    out: list[str] = []
    for i in range(0, len(parts), 2):
        if not _NAMES_PG.search(parts[i]):
            out += [parts[i - 1] if out else "", parts[i]]
    body = "".join(out).strip("\n")
    return body + "\n" if body else ""
