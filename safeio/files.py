"""Reading files that may be broken or planted: a run directory, a cache, a downloaded folder.

Such a file can be a FIFO (reading it blocks forever), a device (`/dev/zero` never ends), a sparse
file of terabytes, or a directory. Every file the project reads back is checked here first: it must
be a regular file no bigger than what its kind can legitimately be, and it is opened without
blocking, so that what is checked is what is read. JSON must hold an object. A run's config.yaml
must be plain keys and values (YAML aliases can expand to gigabytes, nesting exhaust recursion, a
tag ask for a Python object, an interpolation read the environment); train.py writes none of
these (`dump_run_config`), so anything else is refused before a node is built.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import secrets
import stat
from enum import Enum
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import DictConfig, OmegaConf

from safeio.cli import FileRefused, FormatError, UserError, first_line

KIB, MIB = 1 << 10, 1 << 20

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path, what: str, limit: int) -> int:
    """The size of path, which must be a regular file (after symbolic links: the Hugging Face
    cache is made of them) of at most limit bytes."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileRefused(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise FileRefused(f"cannot read {what} {path}: {exc.strerror}") from None
    return _check_stat(st, path, what, limit)


def _check_stat(st: os.stat_result, path: Path, what: str, limit: int) -> int:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{what} {path} is {kind_of(st.st_mode)}, not a regular file")
    if st.st_size > limit:
        raise FileRefused(f"{what} {path} is {st.st_size:,} bytes: implausibly large, more than "
                          f"a {what} can be ({limit:,})")
    return st.st_size


def read_bytes(path: Path, what: str, limit: int, follow: bool = True) -> bytes:
    """The bytes of a regular file of at most limit bytes (follow=False: not through a link).
    Opened without blocking and checked through the open descriptor, so a FIFO swapped in after
    a check cannot hang the read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
                     | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise FileRefused(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise FileRefused(f"{what} {path} is a directory, not a regular file") from None
    except OSError as exc:
        raise FileRefused(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        _check_stat(os.fstat(fd), path, what, limit)
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(limit + 1 - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:  # grew while being read
            raise FileRefused(f"{what} {path} is more than {limit:,} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def why_not_creatable(path: Path) -> Optional[str]:
    """Why the directory `path` could not be made (or used, where it exists), or None: its
    nearest existing ancestor (a dangling link counts as existing) must be a directory we may
    write into."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def open_folder(path: Path, what: str, create: bool) -> int:
    """The folder holding the file `path`, opened without following a link in any folder below
    the anchor (made where missing, with `create`): the deepest folder the path shares with the
    working folder as the shell names it ($PWD), or at least the root's own entry, whose system
    links (macOS's /tmp -> /private/tmp) are followed. So `out=sub/feedback/r.json`, where a
    submitter made `feedback` a link, is refused."""
    here, shell = Path.cwd(), os.environ.get("PWD", "")
    with contextlib.suppress(OSError):
        here = Path(shell) if os.path.samefile(shell, ".") else here
    parts = Path(here, path).parent.parts
    n = max(2, next((i for i, (a, b) in enumerate(zip(parts, here.parts)) if a != b),
                    len(here.parts)))
    fd = os.open(os.path.join(*parts[:n]), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i in range(n, len(parts)):
            with contextlib.suppress(FileExistsError):
                if create:
                    os.mkdir(parts[i], dir_fd=fd)
            try:
                fd, up = os.open(parts[i], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, dir_fd=fd), fd
            except OSError as exc:  # ELOOP: a link (ENOTDIR: not a folder)
                raise (FileRefused(f"cannot write {what} {path}: {os.path.join(*parts[:i + 1])} "
                                   f"is a symbolic link or not a folder (nothing is written "
                                   f"through a link)") if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                       else exc) from None
            os.close(up)
        return os.dup(fd)
    finally:
        os.close(fd)


def check_output_file(path: Path, what: str) -> None:
    """A file about to be written (created or replaced) must not be something else already:
    writing to a FIFO blocks until someone reads it, to a device writes into the device, and
    through a symbolic link (a dangling one, or one of its folders) wherever the link points."""
    try:
        os.close(open_folder(path, what, create=False))
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise FileRefused(f"cannot write {what} {path}: {exc.strerror}") from None
    _check_output_stat(st, path, what)


def _check_output_stat(st: os.stat_result, path: Path, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise FileRefused(f"{what} {path} is a symbolic link; give the file itself (nothing is "
                          f"written through a link)")
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{what} {path} is {kind_of(st.st_mode)}, not a file to write")


def write_output(path: Path, text: str, what: str, overwrite: bool) -> None:
    """Write text to path whole, never through a symbolic link, racing nothing else that writes
    in that folder: the folder is opened once and every step names files in it; the text goes to
    a new temporary name (O_EXCL | O_NOFOLLOW: nothing planted is opened) that then takes the
    name, by `rename` (which replaces the name, never a link's target) or, without overwrite, by
    `link` (only while nothing holds the name). A name that is a link, a FIFO, a device or a
    directory, a link among its folders, or an existing file without overwrite: UserError."""
    name, folder = Path(path).name, open_folder(path, what, create=True)
    try:
        try:
            _check_output_stat(os.stat(name, dir_fd=folder, follow_symlinks=False), path, what)
            if not overwrite:
                raise UserError(f"{path} exists; add overwrite=true to replace it, or give "
                                f"another {what}")
        except FileNotFoundError:
            pass
        for _ in range(100):
            temporary = f".{name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o666, dir_fd=folder)
                break
            except FileExistsError:
                continue
        else:
            raise FileRefused(f"cannot write {what} {path}: no free temporary name beside it")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            if overwrite:
                os.rename(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
            else:
                os.link(temporary, name, src_dir_fd=folder, dst_dir_fd=folder,
                        follow_symlinks=False)
        except FileExistsError:
            raise UserError(f"{path} appeared while it was written; add overwrite=true to "
                            f"replace it, or give another {what}") from None
        finally:
            try:
                os.unlink(temporary, dir_fd=folder)
            except FileNotFoundError:
                pass  # renamed
    except OSError as exc:
        raise FileRefused(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    finally:
        os.close(folder)


def check_outputs(files: list[Path], overwrite: bool, own: Optional[Path] = None) -> None:
    """Where a script writes its files: never over a file that is there already (a picture
    committed in docs/, say) unless the user asks with overwrite=true; a script's own folder (the
    study it summarises) is its to rewrite. Refuses, naming the first, files that exist outside
    `own` when overwrite is false, and outputs that are not files (a directory of that name)."""
    for path in files:
        check_output_file(path, "out=")  # a FIFO, a device or a folder is named as what it is
        inside = own is not None and path.resolve().parent == own.resolve()
        if path.exists() and not inside and not overwrite:
            raise UserError(f"{path} exists (a committed picture?); add overwrite=true to replace "
                            f"it, or give another out=")


def read_text(path: Path, what: str, limit: int, follow: bool = True) -> str:
    """read_bytes as UTF-8 text (a byte-order mark, as Windows' Notepad writes, left out)."""
    try:
        return read_bytes(path, what, limit, follow).decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise FileRefused(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None


def read_json(path: Path, what: str, limit: int, follow: bool = True) -> dict:
    """The JSON object in path (a regular file of at most limit bytes)."""
    try:
        data = json.loads(read_text(path, what, limit, follow))
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, FileRefused):
            raise
        raise FormatError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise FormatError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------- a run's config.yaml


# A saved config is about 2 KiB, and a corpus listed file by file makes it grow. train.py refuses
# to start a run whose config would exceed these (guard/preflight.py checks that what it will
# write reads back), so a bigger one was not written by train.py; reading one this big through
# OmegaConf takes a few seconds.
MAX_CONFIG_BYTES = 1 * MIB
MAX_CONFIG_VALUES = 20_000
MAX_DEPTH = 16

_OPENING = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken,
            yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)
_CLOSING = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
_REFUSED = {yaml.AnchorToken: "an anchor (&)", yaml.AliasToken: "an alias (*)",
            yaml.TagToken: "a tag (!)", yaml.DirectiveToken: "a directive (%)"}


def load_run_config(path: Path) -> DictConfig:
    """The mapping in path, a run's config.yaml, refusing anything train.py would not write."""
    return parse_run_config(read_text(path, "run config", MAX_CONFIG_BYTES), path)


def parse_run_config(text: str, path: Path) -> DictConfig:
    """load_run_config's parsing of a config's text (train.py checks what it writes with it)."""
    problem = _plain_yaml_problem(text)
    if problem:
        raise FormatError(f"{path} is not a config that train.py wrote: it holds {problem}")
    try:
        cfg = OmegaConf.create(text) if text.strip() else None
    except Exception as exc:  # YAML syntax, duplicate keys
        raise FormatError(f"{path} is not a readable run config: {_reason(exc)}") from None
    if not isinstance(cfg, DictConfig):
        raise FormatError(f"{path} is not a run config: it holds no mapping of keys to values")
    return cfg


def dump_run_config(cfg) -> str:
    """A run's config (a dataclass of */config.py) as the YAML train.py writes to config.yaml:
    OmegaConf's YAML, with strings written so that they read back as they are. A `${` in one (a
    prompt, a path) is escaped, or OmegaConf would read it as an interpolation; one holding a
    character that is not printable (a control character, or U+0085 and U+2028, which YAML reads
    as line breaks) is double-quoted, where YAML escapes it."""
    return yaml.dump(literal(cfg), default_flow_style=False, allow_unicode=True, sort_keys=False,
                     Dumper=_RunConfigDumper)


class _RunConfigDumper(yaml.SafeDumper):
    """PyYAML quotes a string that its reader would take for another type (`true`, `12`, `1.5`);
    OmegaConf's reader also takes a number with an unsigned exponent (`1e3`, `1.5e3`) for a
    float, so such a string is quoted too (check_saved_config proves each config reads back)."""


_RunConfigDumper.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _represent_str(dumper: yaml.Dumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text,
                                   style=None if text.isprintable() else '"')


_RunConfigDumper.add_representer(str, _represent_str)


def literal(value):
    r"""value as plain containers, every string escaped for OmegaConf: k backslashes before a
    `${` become 2k + 1 (OmegaConf reads `\${` as a literal `${`, and `\\` before one as a
    backslash)."""
    if dataclasses.is_dataclass(value):
        return {f.name: literal(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [literal(v) for v in value]
    if isinstance(value, dict):
        return {k: literal(v) for k, v in value.items()}
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    return value


# an interpolation that is not escaped: `${` after an even number of backslashes
_INTERPOLATION = re.compile(r"(?<!\\)(?:\\\\)*\$\{")
# libyaml's scanner when PyYAML has it (30x faster); the tokens are the same
_SCANNER = getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def _plain_yaml_problem(text: str) -> str:
    """What in text is not plain YAML keys and values, or '' if nothing."""
    depth = values = 0
    try:
        for token in yaml.scan(text, Loader=_SCANNER):
            refused = _REFUSED.get(type(token))
            if refused:
                return f"{refused} at line {token.start_mark.line + 1}"
            if isinstance(token, _OPENING):
                depth += 1
                if depth > MAX_DEPTH:
                    return f"nesting deeper than {MAX_DEPTH} levels"
            elif isinstance(token, _CLOSING):
                depth -= 1
            elif isinstance(token, yaml.ScalarToken):
                values += 1
                if values > MAX_CONFIG_VALUES:
                    return f"more than {MAX_CONFIG_VALUES:,} values"
                if _INTERPOLATION.search(token.value):
                    return (f"an interpolation ({token.value[:40]!r}) at line "
                            f"{token.start_mark.line + 1}")
    except yaml.YAMLError as exc:
        return f"invalid YAML ({_reason(exc)})"
    return ""


def _reason(exc: BaseException) -> str:
    """A YAML error as 'problem at line N' (its first line alone is often only context)."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}"
    return first_line(exc)
