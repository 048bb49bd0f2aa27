"""Text from a submission, made inert before anyone reads it: in a terminal, a Markdown table, a
CSV file a spreadsheet opens, a JSON file another program prints.

A submission chooses its file's name, the names it defines and the message of every exception it
raises, and all of them reach the report. Left as they are, an escape sequence in a message
(`\\x1b[25GPASS\\x1b[K\\x1b[8m`) makes a terminal, and `cat grades.md`, show a failing row as PASS; a
newline in a name prints a forged progress line; a right-to-left override reorders what follows
it; a cell starting with `=` is a formula a spreadsheet evaluates; a name that is not UTF-8 cannot
be printed at all. So every text the checker shows goes through `inert` (report.py's lines, every
cell and value of grade.py's tables): each character that is not printable text is shown as its
Python escape (`\\x1b`, `\\n`, `\\u202e`; a byte that is not UTF-8 in a file name as `\\xff`), and
the text is cut to a bounded length. The formats add what each needs on top: `csv_cell` turns a
cell a spreadsheet would evaluate into text, `markdown_cell` escapes what Markdown or HTML would
read as markup.
"""
from __future__ import annotations

import unicodedata

NAME_LIMIT = 200     # characters of a file's name, or a name found in it
TEXT_LIMIT = 2000    # characters of any other text: an error, an item's detail, a diagnosis
# Unicode categories that are not text to show: controls (C0, DEL, C1), format characters (the
# bidirectional overrides and isolates, zero-width characters), lone surrogates (how Python holds
# the bytes of a file name that are not UTF-8), private use, unassigned, line and paragraph
# separators.
HIDDEN = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
# What a spreadsheet evaluates when a cell starts with it (OWASP's list), and the full-width forms
# some locales also read as formulas.
FORMULA_START = ("=", "+", "-", "@", "\t", "\r", "\uff1d", "\uff0b", "\uff0d", "\uff20")
MARKUP = "\\|<>&`"   # Markdown's escape and table characters, HTML's tags and entities, code spans


def _escaped(ch: str) -> str:
    if ch in SHORT:
        return SHORT[ch]
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a file name that is not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def inert(text, limit: int = TEXT_LIMIT) -> str:
    """text with every character that is not printable shown as its escape, cut to `limit`
    characters (ending in '...'). Applying it twice changes nothing more."""
    text = "" if text is None else str(text)
    shown = "".join(_escaped(ch) if unicodedata.category(ch) in HIDDEN else ch for ch in text)
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


def csv_cell(text, limit: int = TEXT_LIMIT) -> str:
    """An inert cell that a spreadsheet shows as text: one that would start a formula gets a
    leading apostrophe (spaces before the formula included)."""
    cell = inert(text, limit)
    return "'" + cell if cell.lstrip(" ").startswith(FORMULA_START) else cell


def markdown_cell(text, limit: int = TEXT_LIMIT) -> str:
    """An inert table cell in one line: Markdown's escape character, the table's `|`, HTML's `<`,
    `>`, `&` and code spans' backquote escaped, so the cell renders as the text it holds."""
    return "".join("\\" + ch if ch in MARKUP else ch for ch in inert(text, limit))
