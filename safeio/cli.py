"""How a command fails: every user mistake ends as one `error:` line and exit status 2.

What counts as a mistake is decided here, once, for train.py, generate.py and scripts/: the
`UserError` family, raised by the checks in guard/ (a value out of range, a file that is not what
it claims to be, a corpus that cannot be read), and what Hydra, OmegaConf and the operating system
raise for a misspelt key, a mistyped value or a missing file. Anything else is a bug and keeps its
traceback. `parse_key_values` is the key=value command line of generate.py and the scripts
(train.py's is Hydra's).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import sys
import threading
import typing
from pathlib import Path
from typing import Callable, Iterator, Optional

from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from safeio.key_help import did_you_mean, help_text, is_list, type_words, written_out


class UserError(ValueError):
    """A mistake in what the user asked for or handed over; the message says what, and how to
    fix it. A ValueError, so code that treats a bad value as one sees these as such."""


class FormatError(UserError):
    """A file or folder that is not what it claims to be (a run's config.yaml, a checkpoint, a
    token cache entry, a GPT-2 folder), or a model that a format cannot hold."""


class FileRefused(FormatError):
    """A file that is missing, not a regular file, or implausibly big."""


class StateMismatch(FormatError):
    """A field of a checkpoint's training state with the wrong type, shape or range."""


class CorpusError(UserError):
    """A corpus that cannot be fetched, read or tokenized."""


MISTAKES = (UserError, HydraException, OmegaConfBaseException, OSError)


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def one_line(exc: BaseException) -> str:
    """A mistake as one line. Hydra and OmegaConf spread theirs over several: keep the first line,
    the available options of a missing config, the key, and the first line of the cause."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0].rstrip(".")
    if isinstance(exc, HydraException):
        if any(line.startswith("Available options") for line in lines):
            start = next(i for i, line in enumerate(lines) if line.startswith("Available options"))
            options = [line for line in lines[start + 1:] if " " not in line and "=" not in line]
            text += f" (available: {', '.join(options)})"
        elif len(lines) > 1 and lines[1].startswith("To append"):
            text += f" ({lines[1].rstrip('.')})"
        cause = exc.__cause__ or exc.__context__
        if cause is not None and first_line(cause) not in text:
            text += f": {first_line(cause)}"
    elif isinstance(exc, OmegaConfBaseException):
        key = getattr(exc, "full_key", None)
        if key and key not in text:
            text += f" ({key})"
    elif isinstance(exc, OSError) and not isinstance(exc, UserError) and exc.filename:
        text = f"{exc.strerror or text}: {exc.filename}"
    return text


@contextlib.contextmanager
def mistakes_exit(trace: bool = False) -> Iterator[None]:
    """Inside, a user mistake is printed as one `error:` line and ends the process with status 2.
    The exit is a SystemExit, so inside a Hydra sweep it also ends the sweep at the failing job.
    trace: re-raise instead (the user asked for tracebacks)."""
    try:
        yield
    except BrokenPipeError:
        raise  # not a mistake: the reader of stdout went away (run_cli)
    except MISTAKES as exc:
        if trace:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


class OutputError(UserError):
    """stdout cannot be written: closed, or a full disk, or a device that fails."""


class Terminated(BaseException):
    """SIGTERM or SIGHUP: a request to stop, honoured where the program waits (the training loop
    saves first instead: training.runtime.StopFlag). Not an Exception, so that no `except
    Exception` takes it for a failure to recover from."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _terminate_in(owner: int):
    """The SIGTERM / SIGHUP handler of run_cli in the process `owner`."""
    def terminate(signum, frame):
        if os.getpid() != owner:  # a forked worker (datasets.map): end as the signal asks
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        raise Terminated(signum)
    return terminate


class _Output:
    """sys.stdout, whose failures (a closed descriptor, a full disk) are an OutputError: one
    `error:` line, where Python would print a traceback and then fail again at exit."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, method: str, *args):
        if self._stream is None:
            raise OutputError("cannot write the output: stdout is closed")
        try:
            return getattr(self._stream, method)(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write the output to stdout: "
                              f"{exc.strerror or first_line(exc)}") from None

    def write(self, text):
        return self._guarded("write", text)

    def flush(self):
        return self._guarded("flush") if self._stream is not None else None

    def __getattr__(self, name):
        if self._stream is None:
            raise OutputError("cannot write the output: stdout is closed")
        return getattr(self._stream, name)


def _open_standard_descriptors() -> None:
    """Descriptors 0, 1 and 2 open (on /dev/null if they were closed): else the next file opened
    would take one of their numbers, and whatever writes to "stdout" would write into it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def _quiet_stdout() -> None:
    """Whatever is left to flush at exit goes nowhere (the reader is gone, the disk full)."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


def run_cli(body: Callable[[], Optional[int]], undo: Optional[Callable[[], None]] = None,
            trace: bool = False, interrupted: str = "interrupted") -> int:
    """The exit status of a command's body: its own, 2 after one `error:` line for a mistake (an
    unwritable stdout included), 128 + N after the signal N (Ctrl-C, SIGTERM, SIGHUP), 0 when
    stdout is closed by its reader (piped into `head`). undo runs whenever the status is not 0,
    to take back what a failed command wrote."""
    _open_standard_descriptors()
    stdout, sys.stdout = sys.stdout, _Output(sys.stdout)
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")
    handlers, terminate = {}, _terminate_in(os.getpid())
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
                handlers[signum] = signal.signal(signum, terminate)
    try:
        try:
            with mistakes_exit(trace):
                code = body() or 0
                sys.stdout.flush()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            print(f"error: {interrupted}", file=sys.stderr)
            code = 130
        except Terminated as exc:
            print(f"error: {interrupted} ({signal.Signals(exc.signum).name})", file=sys.stderr)
            code = 128 + exc.signum
        except BrokenPipeError:  # the reader has all it wanted; keep the exit's flush quiet
            _quiet_stdout()
            code = 0
        if code and undo is not None:
            undo()
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        sys.stdout = stdout
    if code and stdout is not None:
        try:
            stdout.flush()
        except OSError:
            _quiet_stdout()
    return code


def exit_with(code: int) -> None:
    """sys.exit(code), except after a signal (code > 128): then at once, as the signal's own
    action would. The interpreter's last garbage collection over what was being built (a corpus
    half tokenized: millions of objects) takes seconds, and the user asked to stop now; run_cli has
    already taken back what the command wrote."""
    if code > 128:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(code)
    sys.exit(code)


def parse_key_values(argv: list[str], schema: type, usage: str, about: str = "",
                     overrides: bool = False):
    """key=value arguments as an instance of the dataclass `schema`, its defaults for the keys
    not given. Text-valued keys keep their value verbatim (prompt=ROMEO: is text, not YAML); the
    others are parsed by OmegaConf and a value of the wrong type is refused in our words; a list
    is written with commas (dtypes=bf16,fp32); a key whose default is MISSING ("???") must be
    given. -h or --help prints `about`, the usage and every key with its default and description
    (`key_help`). With overrides=True (a bench) the arguments whose key is not the schema's are
    train.py's config overrides, returned apart and in order: (args, overrides)."""
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(schema, usage, about))
        raise SystemExit(0)
    hints = typing.get_type_hints(schema)
    keys = [f.name for f in dataclasses.fields(schema)]
    text = {k for k in keys if hints[k] in (str, Optional[str])}
    given, written, rest = {}, {}, []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if arg.startswith("--"):
            raise UserError(f"arguments are key=value: write {key[2:].replace('-', '_')}=..., "
                            f"not {arg!r}. {usage}")
        if not sep:
            raise UserError(f"arguments must be key=value, got {arg!r}. {usage}")
        if key not in keys and overrides:
            rest.append(arg)
        elif key not in keys:
            raise UserError(f"unknown key {key!r}{did_you_mean(key, keys)} (known: "
                            f"{', '.join(keys)}). {usage}")
        else:
            written[key] = value
            wrap = is_list(hints[key]) and not value.startswith("[") and value != "null"
            given[key] = f"[{value}]" if wrap else value
    try:
        typed = OmegaConf.from_dotlist([f"{k}={v}" for k, v in given.items() if k not in text])
        cfg = OmegaConf.merge(OmegaConf.structured(schema), typed,
                              {k: v for k, v in given.items() if k in text})
    except OmegaConfBaseException as exc:
        key = str(getattr(exc, "full_key", "") or "").partition("[")[0]
        if key not in given:
            raise
        raise UserError(f"{key} must be {type_words(hints[key])}, got {written[key]!r}"
                        + written_out(written[key], hints[key])) from None
    missing = [k for k in keys if OmegaConf.is_missing(cfg, k)]
    if missing:
        raise UserError(f"{missing[0]}= is required. {usage}")
    args = OmegaConf.to_object(cfg)
    return (args, rest) if overrides else args


def check_choices(args, **allowed) -> None:
    """Each named key's value, or each value of its list, one of `allowed[key]`; else the first
    that is not, named with the choices."""
    for key, choices in allowed.items():
        value = getattr(args, key)
        for v in value if isinstance(value, list) else [value]:
            if v not in choices:
                raise UserError(f"{key} must be among {', '.join(map(str, choices))}, "
                                f"got {v!r}")


def python_command() -> str:
    """This interpreter as a command the user can paste into the shell they ran it from: `python`
    where that finds it (an activated virtualenv), else its path (relative to the working
    directory inside it, as .venv/bin/python). The hints that print a command (train.py's `sample:`
    line, `resume=` after a stop) use it, so that the command runs as printed."""
    here = Path(sys.executable)
    found = shutil.which("python")
    if found and Path(found).parent.resolve() == here.parent.resolve():
        return "python"
    try:
        return str(here.relative_to(Path.cwd()))
    except ValueError:
        return str(here)


def hydra_string(text: str) -> str:
    """`text` as a quoted Hydra override value, so that a path with spaces, commas or '=' passes
    intact. In Hydra's quoted strings a backslash is literal unless it precedes a quote or the
    closing quote, where it must be doubled; the quote itself is escaped with a backslash."""
    escaped = re.sub(r"(\\*)('|$)",
                     lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text)
    return f"'{escaped}'"
