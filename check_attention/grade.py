"""Check many files, or one object, and never stop at a broken one: a folder of submissions as one
table (`python -m check_attention submissions/ NAME ...`), and `check(...)`, the call a
course's own tests assert on.

Each file is checked as the command checks one (checks.check): in a fresh sandboxed child, with
the time limit `timeout=` and the memory limit `memory=`. A file the checker cannot use (a syntax
error, no such NAME, a crash, a timeout) is a row whose diagnosis says why, like any other. The
files are spread over `workers=` processes, each with its own sandbox host: the references are
computed in the checker's process, so threads would wait on each other; processes use the cores.
"""
from __future__ import annotations

import ast
import atexit
import csv
import inspect
import io
import json
import os
import signal
import sys
import threading
import time
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from safeio.cli import FileRefused, UserError
from safeio.files import check_regular, read_text, write_output
from check_attention.inert import NAME_LIMIT, csv_cell, inert, markdown_cell
from check_attention.options import GRADING_ONLY, Options, check_options
from check_attention.report import ITEM_WORDS, Report

# A submission is a page or two of Python; a bigger .py file is not one to read for its names.
MAX_SUBMISSION_BYTES = 4 << 20
OUT_OF_MEMORY = ("can't allocate memory", "MemoryError", "Cannot allocate memory")


# ----------------------------------------------------------------------------- one file


def sandbox_for(opts: Options, reads: tuple = ()):
    """A sandbox host for opts' device, its children held to opts.memory GiB (and `reads`)."""
    from check_attention.sandbox.host import Sandbox
    memory = None if opts.memory is None else int(opts.memory * 2**30)
    return Sandbox(gpu=opts.device != "cpu", memory=memory, reads=reads)


def check_file(file: str, name: str, opts: Options, sandbox,
               fingerprint: Optional[str] = None) -> Report:
    """The report on FILE:NAME, every text in it inert (inert.py); a file or object the checker
    cannot use is a report whose `error` says why (the command prints it as its one `error:`
    line). fingerprint: what the object given to check() is made of (runner.fingerprint); the
    file's NAME must still be that object when the sandbox imports it."""
    from check_attention.checks import CheckError, check
    try:
        return check(file, name, opts, sandbox=sandbox, fingerprint=fingerprint).made_inert()
    except CheckError as exc:
        words = " ".join(str(exc).split())
        if opts.memory is not None and opts.device == "cpu" and any(
                w in words for w in OUT_OF_MEMORY):
            words += f" (the layer's process may use {opts.memory:g} GiB: memory=)"
        return Report(f"{file}:{name}", error=words).made_inert()


def top_level_names(source: str) -> set[str]:
    """The names a module binds at its top level (class, def, assignment, import), read from its
    syntax tree, inside if/try/with/for/while blocks too. Raises SyntaxError."""
    bound, todo = set(), list(ast.parse(source).body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            todo += [s for part in ("body", "orelse", "finalbody") for s in getattr(node, part, [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return bound


def defined_name(path: Path, names: tuple[str, ...]) -> str:
    """The first of `names` that the file binds at its top level, read from its syntax tree
    (nothing is run); names[0] when none is, or the file cannot be parsed (the child then says
    why: no such name, or the syntax error and its line)."""
    try:
        bound = top_level_names(read_text(path, "submission", MAX_SUBMISSION_BYTES))
    except Exception:  # noqa: BLE001  (a syntax error, a deep nesting, bytes that are not text)
        return names[0]
    return next((n for n in names if n in bound), names[0])


# ----------------------------------------------------------------------------- a folder


@dataclass
class Row:
    file: str          # the file's name in the folder
    name: str          # the object checked in it
    report: Report
    seconds: float

    def __post_init__(self):
        """A row holds only inert text (inert.py), and the exact names for the JSON table."""
        self.exact = (self.file, self.name)
        self.file, self.name = inert(self.file, NAME_LIMIT), inert(self.name, NAME_LIMIT)
        self.report = self.report.made_inert()

    @property
    def diagnosis(self) -> str:
        """Why, in one line: the error, else the diagnosis lines, else the first item that
        failed or could not be judged."""
        r = self.report
        if r.error is not None:
            return r.error
        if r.diagnosis:
            return "; ".join(r.diagnosis)
        for status in ("FAIL", "SKIP"):
            for key, item in r.items.items():
                if item.status == status:
                    return f"{key}: {item.detail}"
        return ""

    def cells(self, keys: list[str]) -> list[str]:
        """The row of a table: file, name, verdict, each item's status, diagnosis."""
        items = self.report.items
        return [self.file, self.name, self.report.outcome,
                *(items[k].status if k in items else "" for k in keys), self.diagnosis]


def submissions(folder: Path) -> list[Path]:
    """Every .py entry of the folder, sorted by name (not its subfolders)."""
    return sorted((p for p in folder.iterdir() if p.suffix == ".py"), key=lambda p: p.name)


_worker_box = None


def _start_worker(opts: Options) -> None:
    """A worker process of grade(): Ctrl-C is the checker's to handle (it ends the workers), and
    SIGTERM ends the worker's sandbox (its host, the check under way and its directory) first."""
    global _worker_box
    from check_attention.sandbox.host import close_all

    def stop(signum, frame):
        # The pool sends SIGTERM again to every worker once one has ended (it counts the pool
        # broken); a second stop inside this one would exit before the sandbox's directory goes.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        close_all()
        os._exit(128 + signum)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    _worker_box = sandbox_for(opts)
    atexit.register(_worker_box.close)


def outside_link(file: Path) -> Optional[str]:
    """Why a submission that is a symbolic link out of its folder is refused (the instructor's
    solution, say), or None: a submission is graded as a file of the folder."""
    if not file.is_symlink():
        return None
    folder = file.parent.resolve()
    target = file.resolve()
    if target.parent == folder or folder in target.parents:
        return None
    return (f"{file.name} is a symbolic link to {os.readlink(file)}, outside the graded folder; "
            f"only the files in it are graded")


def _grade_one(path: str, names: tuple[str, ...], opts: Options, sandbox=None) -> Row:
    """One file's row, whatever happens: the checker's own failure is a row too."""
    start, file = time.monotonic(), Path(path)
    name = names[0]
    try:
        refused = outside_link(file)
        if refused:
            raise FileRefused(refused)
        check_regular(file, "submission", MAX_SUBMISSION_BYTES)
        name = defined_name(file, names)
        report = check_file(path, name, opts, sandbox or _worker_box)
    except FileRefused as exc:
        report = Report(f"{path}:{name}", error=str(exc))
    except Exception as exc:  # noqa: BLE001  (never stop at one file: say what happened)
        report = Report(f"{path}:{name}", error=f"the checker failed on it: "
                                                f"{type(exc).__name__}: {exc}")
    return Row(file.name, name, report, time.monotonic() - start)


def grade(folder: str, names: tuple[str, ...], opts: Options, progress=None) -> list[Row]:
    """A row for every .py file of the folder, in name order, checked `opts.workers` at a time
    (one per CPU core by default). progress(row, done, total) is called as each row is made."""
    files = [str(p) for p in submissions(Path(folder))]
    workers = min(opts.workers or os.cpu_count() or 1, len(files)) or 1
    rows: list[Optional[Row]] = [None] * len(files)

    def record(i: int, row: Row) -> None:
        rows[i] = row
        if progress:
            progress(row, sum(r is not None for r in rows), len(files))

    if workers == 1:
        with sandbox_for(opts) as box:
            for i, path in enumerate(files):
                record(i, _grade_one(path, names, opts, box))
        return rows
    # spawn: a fresh interpreter per worker (forking a process that holds torch's threads can
    # hang the copy)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(opts,))
    try:
        futures = {pool.submit(_grade_one, path, names, opts): i for i, path in enumerate(files)}
        for future in as_completed(futures):
            i = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # noqa: BLE001  (a worker that died: the row says so)
                row = Row(Path(files[i]).name, names[0], Report(
                    f"{files[i]}:{names[0]}", error=f"the checker's worker failed: "
                                                    f"{type(exc).__name__}: {exc}"), 0.0)
            record(i, row)
    except BaseException:  # Ctrl-C, SIGTERM: stop now, not after the files still queued
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()  # its sandbox host and child die with it (PR_SET_PDEATHSIG)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return rows


# ----------------------------------------------------------------------------- the table


def item_keys(rows: list[Row]) -> list[str]:
    """The checklist's items in its order, then any other item a report has."""
    seen = [k for row in rows for k in row.report.items]
    return [k for k in ITEM_WORDS if k in seen] + sorted(set(seen) - set(ITEM_WORDS))


def markdown(rows: list[Row]) -> str:
    """The table in Markdown, each cell through inert.markdown_cell."""
    keys = item_keys(rows)
    head = ["file", "name", "verdict", *keys, "diagnosis"]
    lines = ["| " + " | ".join(map(markdown_cell, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(markdown_cell, row.cells(keys))) + " |" for row in rows]
    counts = {}
    for row in rows:
        counts[row.report.outcome] = counts.get(row.report.outcome, 0) + 1
    lines += ["", f"{len(rows)} file{'s' * (len(rows) != 1)}: "
              + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())), ""]
    lines += [f"- {key}: {ITEM_WORDS.get(key, key)}" for key in keys]
    return "\n".join(lines)


def csv_text(rows: list[Row]) -> str:
    """The table as CSV, each cell through inert.csv_cell (never a formula)."""
    keys = item_keys(rows)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(map(csv_cell, ["file", "name", "verdict", *keys, "diagnosis"]))
    writer.writerows(map(csv_cell, row.cells(keys)) for row in rows)
    return buf.getvalue()


def json_text(rows: list[Row], folder: str, names: tuple[str, ...], opts: Options) -> str:
    """The table as JSON: every row's items with their details, the verdicts, the seconds, and the
    options used; every text inert (Row holds only such), but the names exact (JSON escapes)."""
    keys = item_keys(rows)
    return json.dumps({
        "folder": inert(folder), "names": [inert(n, NAME_LIMIT) for n in names],
        "options": {k: inert(v) if isinstance(v, str) else v for k, v in vars(opts).items()},
        "items": {k: ITEM_WORDS.get(k, k) for k in keys},
        "rows": [{"file": r.exact[0], "name": r.exact[1], "verdict": r.report.outcome,
                  "summary": r.report.verdict, "error": r.report.error,
                  "items": {k: {"status": i.status, "detail": i.detail}
                            for k, i in r.report.items.items()},
                  "diagnosis": r.diagnosis, "seconds": round(r.seconds, 2)} for r in rows]},
        indent=2) + "\n"


def write_table(rows: list[Row], out: str, folder: str, names: tuple[str, ...],
                opts: Options) -> None:
    """out= in the format its extension names (.md, .csv, .json), written whole and never
    through a symbolic link (safeio.files.write_output: the folder's submitters may have planted
    one at that name)."""
    path = Path(out)
    suffix = path.suffix.lower()
    text = (csv_text(rows) if suffix == ".csv" else
            json_text(rows, folder, names, opts) if suffix == ".json" else markdown(rows) + "\n")
    write_output(path, text, "out=", opts.overwrite)


# ----------------------------------------------------------------------------- check(...)


def resolve(target) -> tuple[str, str, Optional[str]]:
    """"path/file.py:Name", or the class or function itself -> (file, name, fingerprint). An
    object is looked up by identity among its module's top-level names (its `__name__` is only
    what someone set: a wrong class may carry a right one's), and its fingerprint (what it is
    made of: runner.fingerprint) goes with it, so that the sandbox judges that very object or
    says it found another under that name."""
    if isinstance(target, (str, os.PathLike)):
        file, sep, name = str(target).rpartition(":")
        if not sep or not file.endswith(".py") or not name.isidentifier():
            raise ValueError(f"check() takes 'path/file.py:Name' or the class or function "
                             f"itself, got {str(target)!r}")
        return file, name, None
    obj = target
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        raise TypeError(f"check() takes a class, a function or 'path/file.py:Name', got "
                        f"{type(obj).__name__} (the checker builds the layer itself: pass its "
                        f"class, or a factory function)")
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    bound = [n for n, v in list(vars(module).items()) if v is obj] if module else []
    if not bound:
        raise ValueError(f"{obj.__qualname__} is not bound at the top level of its file; the "
                         f"checker imports the file and looks the object up there by name")
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py"):
        raise ValueError(f"{obj.__qualname__} has no .py file the checker could import")
    from check_attention.sandbox.runner import fingerprint
    return file, obj.__name__ if obj.__name__ in bound else bound[0], fingerprint(obj)


_boxes: dict = {}  # one sandbox host per process and kind, started by the first check()
_boxes_lock = threading.Lock()


def shared_sandbox(opts: Options, reads: tuple = ()):
    """The process's host for opts' device and memory and reads, started (again) when needed."""
    key = (opts.device != "cpu", opts.memory, tuple(reads))
    with _boxes_lock:
        box = _boxes.get(key)
        if box is None or box.closed:
            box = _boxes[key] = sandbox_for(opts, reads)
            atexit.register(box.close)
    return box


def check(target, *, sandbox=None, reads: tuple = (), **options) -> Report:
    """Check a layer or a scaled dot-product function against the cheat sheet, sandboxed as the
    command does, and return its Report (`.passed`, `.items`, `.diagnosis`, `.text`).

        report = check("path/to/file.py:Name", seq_len=16)   # or check(TheClass)
        assert report.passed, report.text

    options: the command's keys (d_model=, n_head=, dtype=, ...); an unknown key or a value out
    of range is a ValueError (safeio.cli.UserError), a target or a sandbox of the wrong type a
    TypeError. A file or object that cannot be used gives a report whose `.error` says why.
    Checks share one sandbox host per process unless one is given; calls from several threads
    take their turns (checks.check), and the caller's random states are left as they were.
    reads: folders the checked code may read beyond its file's (check_exercise: the kernel's)."""
    from check_attention.sandbox.host import Sandbox
    file, name, fingerprint = resolve(target)
    unknown = sorted(set(options) - set(Options.__dataclass_fields__))
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r} (known: "
                        f"{', '.join(Options.__dataclass_fields__)})")
    given = next((k for k in GRADING_ONLY if options.get(k) is not None), None)
    if given:
        raise UserError(f"{given}= is for grading a folder; check() checks one object")
    given = next((k for k in ("format", "weights") if options.get(k) is not None), None)
    if given:
        raise UserError(f"{given}= is for a platform's results (python -m check_attention "
                        f"SUBMISSION NAME format=...); check() returns the report")
    if sandbox is not None and not isinstance(sandbox, Sandbox):
        raise TypeError(f"sandbox= takes a check_attention.sandbox.host.Sandbox or None, got "
                        f"{type(sandbox).__name__}")
    opts = check_options(replace(Options(), **options))
    if not Path(file).is_file():
        return Report(f"{file}:{name}", error=f"{file}: no such file").made_inert()
    return check_file(file, name, opts, sandbox or shared_sandbox(opts, reads), fingerprint)


def progress_line(row: Row, done: int, total: int) -> None:
    print(f"[{done}/{total}] {row.file}:{row.name} {row.report.outcome} ({row.seconds:.1f} s)",
          file=sys.stderr, flush=True)
