"""tools/gpu_mem_sampler.ps1 parses, and stays within Windows PowerShell 5.1.

No PowerShell runs here. The parse check uses the tree-sitter PowerShell grammar when the optional
packages are installed (pip install tree-sitter tree-sitter-powershell; not in requirements, so the
test skips where they are absent); the token and help checks always run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PS1 = Path(__file__).resolve().parents[1] / "tools" / "gpu_mem_sampler.ps1"
WMI_CLASS = "Win32_PerfFormattedData_GPUPerformanceCounters_GPUProcessMemory"


def source() -> str:
    return PS1.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------ tree-sitter

def _parser():
    ts = pytest.importorskip("tree_sitter")
    tsp = pytest.importorskip("tree_sitter_powershell")
    try:
        language = ts.Language(tsp.language())
    except TypeError:  # tree-sitter < 0.22 wants a name too
        language = ts.Language(tsp.language(), "powershell")
    try:
        return ts.Parser(language)
    except TypeError:  # tree-sitter < 0.22: no constructor argument
        parser = ts.Parser()
        parser.set_language(language)
        return parser


def syntax_errors(parser, text: str) -> list[str]:
    """'ERROR'/'MISSING' nodes of the parse tree, each as 'line:col kind text'."""
    data = text.encode("utf-8")
    tree = parser.parse(data)
    found = []
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        if node.type == "ERROR" or node.is_error or node.is_missing:
            kind = "MISSING " + node.type if node.is_missing else "ERROR"
            snippet = data[node.start_byte:node.end_byte][:60].decode("utf-8", "replace")
            found.append(f"{node.start_point[0] + 1}:{node.start_point[1] + 1} {kind} {snippet!r}")
        stack.extend(node.children)
    if tree.root_node.has_error and not found:
        found.append("root has_error")
    return found


def test_ps1_parses_without_error_nodes():
    assert syntax_errors(_parser(), source()) == []


def _drop_last_closing_brace(text: str) -> str:
    i = text.rindex("}")
    return text[:i] + text[i + 1:]


def _unbalanced_paren(text: str) -> str:
    assert "$samples += 1\n" in text
    return text.replace("$samples += 1\n", "$samples += (1\n", 1)


def _unclosed_string(text: str) -> str:
    assert "$stopReason = 'stopped by Ctrl-C'" in text
    return text.replace("$stopReason = 'stopped by Ctrl-C'", "$stopReason = 'stopped by Ctrl-C", 1)


@pytest.mark.parametrize("breakage", [_drop_last_closing_brace, _unbalanced_paren, _unclosed_string])
def test_the_same_check_catches_a_broken_copy(breakage):
    parser = _parser()
    assert syntax_errors(parser, breakage(source())) != []


# ------------------------------------------------------------------------------------ always run

def code_only(text: str) -> str:
    """The script with comments and string contents blanked (their quotes kept), so that token
    checks look at code only. Here-strings are not used by the script."""
    out = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if text.startswith("<#", i):
            j = text.find("#>", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif ch == "#":
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif ch == "'":
            j = text.find("'", i + 1)  # '' inside a string reads as close + open: same result
            j = n if j < 0 else j
            out.append("''")
            i = j + 1
        elif ch == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "`" else 1
            out.append('""')
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def test_code_only_blanks_comments_and_strings():
    text = "<# a ?? b #>\n$x = 'c ?? d' # e ?. f\n$y = \"g `\" ?? h\"\n"
    assert code_only(text) == "\n$x = '' \n$y = \"\"\n"


@pytest.mark.parametrize("token, why", [
    ("??", "null-coalescing (PowerShell 7)"),
    ("?.", "null-conditional member access (PowerShell 7.1)"),
    ("?[", "null-conditional index (PowerShell 7.1)"),
    ("&&", "pipeline chain operator (PowerShell 7)"),
    ("||", "pipeline chain operator (PowerShell 7)"),
])
def test_no_powershell_7_operators(token, why):
    code = code_only(source())
    for number, line in enumerate(code.splitlines(), 1):
        assert token not in line, f"{PS1.name}:{number}: {token!r} is {why}; Windows ships 5.1"


def test_no_ternary_operator():
    code = code_only(source())
    for number, line in enumerate(code.splitlines(), 1):
        # 'cond ? a : b' (PowerShell 7). The script never uses '?' (the Where-Object alias) either.
        assert not re.search(r"\s\?\s", line), f"{PS1.name}:{number}: ternary '? :' needs PowerShell 7"


def test_comment_based_help_comes_first_and_documents_every_parameter():
    text = source()
    assert text.startswith("<#"), "comment-based help must open the script for Get-Help to find it"
    help_block = text[: text.index("#>")]
    for keyword in (".SYNOPSIS", ".DESCRIPTION", ".EXAMPLE", ".NOTES"):
        assert f"\n{keyword}" in help_block, keyword
    params = re.search(r"^param\((.*?)^\)", text, re.S | re.M)
    assert params, "no param( ... ) block"
    names = re.findall(r"\[(?:int|string|switch)\]\$(\w+)", params.group(1))
    assert set(names) == {"ProcessId", "ProcessName", "All", "IntervalSeconds", "Count", "OutFile"}
    for name in names:
        assert f"\n.PARAMETER {name}\n" in help_block, f".PARAMETER {name} missing from the help"
    assert help_block.count("\n.EXAMPLE") >= 3
    # $PID is PowerShell's automatic variable: the parameter is $ProcessId with the alias -Pid.
    assert "[Alias('Pid')]" in params.group(1)


def test_reads_the_language_neutral_wmi_class_with_the_counter_fallback():
    text = source()
    assert "Get-CimInstance -ClassName $WmiClass" in text
    assert f"$WmiClass = '{WMI_CLASS}'" in text
    assert "Get-Counter -Counter $CounterPaths" in text
    for counter in ("Dedicated Usage", "Shared Usage", "Local Usage", "Non Local Usage"):
        assert f"'\\GPU Process Memory(*)\\{counter}'" in text
    for prop in ("DedicatedUsage", "SharedUsage", "LocalUsage", "NonLocalUsage"):
        assert f"$row.{prop}" in text
    # The same CSV columns as the Linux twin.
    assert "'timestamp,pid,process,dedicated,shared,local,non_local'" in text
    assert "try {" in text and "finally {" in text


def test_ps1_is_ascii_so_powershell_5_1_reads_it_right():
    # Windows PowerShell 5.1 reads a BOM-less script in the ANSI code page: any non-ASCII character
    # (a dash, a multiplication sign) would come out garbled or break a string.
    data = PS1.read_bytes()
    bad = [(data[:i].count(b"\n") + 1, hex(b)) for i, b in enumerate(data) if b > 0x7F]
    assert bad == [], f"non-ASCII bytes at (line, byte): {bad[:5]}"
