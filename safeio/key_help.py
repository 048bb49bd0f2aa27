"""The words of a key=value command line (safeio.cli.parse_key_values): --help with a line per
key, read from the comments of the schema's dataclass, and a type as a message names it."""
from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import io
import re
import textwrap
import tokenize
import typing
from typing import Optional


def is_list(hint) -> bool:
    """list[...] or Optional[list[...]]: a key written with commas."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    return typing.get_origin(hint) is list


def type_words(hint) -> str:
    """A type as the help and the messages say it."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return f"{type_words(args[0])} or null"
    if typing.get_origin(hint) is list:
        return f"{type_words(args[0])} or several, separated by commas"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(m.value for m in hint)
    return {int: "an integer", float: "a number", bool: "true or false",
            str: "text"}.get(hint, getattr(hint, "__name__", str(hint)))


def written_out(value: str, hint) -> str:
    """For an integer written as 1e9: the same number as an integer, if it is one."""
    try:
        number = float(value)
    except ValueError:
        return ""
    if int in (hint, *typing.get_args(hint)) and number.is_integer() and abs(number) < 1e18:
        return f" (write it as {int(number)})"
    return ""


def closest(word: str, known) -> Optional[str]:
    """The known word closest to a misspelt one (difflib's ratio of at least 0.75: n_layers ->
    n_layer, temprature -> temperature), or None where none is close."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.75)
    return close[0] if close else None


def did_you_mean(word: str, known) -> str:
    """"; did you mean X?" for `closest`, or ""."""
    close = closest(word, known)
    return f"; did you mean {close}?" if close else ""


def key_help(schema: type) -> dict[str, str]:
    """Each field's description: the comment on its line of the dataclass, or else the comment
    lines just above it (the source is the one place the words are written); a field of the
    dataclass it extends, from that one's source."""
    found = {}
    for cls in reversed(schema.__mro__):
        if dataclasses.is_dataclass(cls):
            found.update(_comments(cls))
    return found


def _comments(schema: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(schema))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(schema)}
    found, above = {}, []
    for number, line in enumerate(source.splitlines(), 1):
        if line.strip().startswith("#"):
            above.append(comments.get(number, ""))
            continue
        match = re.match(r"\s+(\w+)\s*:", line)
        if match and match[1] in names:
            found[match[1]] = comments.get(number) or " ".join(above)
        above = []
    return found


def help_text(schema: type, usage: str, about: str = "") -> str:
    """--help: about, usage, then one line per key: key=default and its description."""
    words = key_help(schema)
    rows = []
    for f in dataclasses.fields(schema):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        default = getattr(default, "value", default)  # an Enum's member as written
        if default == "???":
            shown = "(required)"
        elif isinstance(default, list):
            shown = ",".join(map(str, default))
        elif isinstance(default, bool) or default is None:
            shown = {None: "null", True: "true", False: "false"}[default]
        else:
            shown = repr(default) if isinstance(default, str) and not default.strip() else default
        rows.append((f"{f.name}={shown}", words.get(f.name, "")))
    width = min(max(len(key) for key, _ in rows) + 2, 30)
    lines = [f"  {key:<{width}}{text}" if len(key) < width else f"  {key}\n  {'':<{width}}{text}"
             for key, text in rows]
    return (about.strip() + "\n\n" if about else "") + usage + "\n\nkeys (key=value):\n" \
        + "\n".join(lines)
