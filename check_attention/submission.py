"""One student's submission as a platform hands it over: a .py file, a Jupyter notebook, or a
folder of them with subfolders. `locate` finds the class or function to check by name anywhere
in it, reading each file's syntax tree (nothing of it runs in the checker's process), and a
notebook's code cells through the reader the lessons use (notebook.py: definitions only, IPython
magics and shell lines never run). A notebook is checked as the .py module that reader makes of
it, written to a directory of its own; the sandbox runs it as it runs any file.

A submission without the name is reported with the names it does define, so that a student who
called the class `Attention` instead of `CausalSelfAttention` reads why they got no points.
"""
from __future__ import annotations

import ast
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from safeio.cli import FileRefused, FormatError
from safeio.files import read_text
from check_attention.grade import MAX_SUBMISSION_BYTES, top_level_names
from check_attention.notebook import module_of, notebook_cells

MAX_FILES = 200                  # .py and .ipynb files read in one submission folder
MAX_DEPTH = 8                    # subfolders below the submission's top
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", "__MACOSX", "node_modules", ".git",
                "venv", ".venv", "site-packages"}
KINDS = (".py", ".ipynb")


class NotGradable(Exception):
    """The submission holds nothing the checker can import under the names asked for (a syntax
    error, no such name, no Python file): PrairieLearn's `gradable: false`, no attempt used."""


@dataclass
class Located:
    file: Path            # the .py file the sandbox imports (a notebook's: the module made of it)
    name: str             # the object checked in it
    shown: str            # the file as the student knows it, relative to the submission
    notes: list = field(default_factory=list)  # what the notebook reader left out, and why
    module: object = None  # notebook.Module for a notebook (its lines' cells), else None

    def where(self, error: str) -> str:
        """The checker's error with the file it imported told as the student's file, and a
        notebook's `(file.py, line N)` as its code cell."""
        stem = re.escape(self.file.name)
        if self.module is not None:
            def place(m: re.Match) -> str:
                cell = self.module.where(int(m.group(1)))
                return f"({self.shown}, {cell})" if cell else f"({self.shown})"
            error = re.sub(rf"\({stem}, line (\d+)\)", place, error)
        return re.sub(rf"(?<![\w/.\\-]){stem}", lambda _: self.shown, error)


def python_files(top: Path) -> list[Path]:
    """The .py and .ipynb files of a submission folder and its subfolders, sorted by path, past
    caches, checkpoints and hidden folders; no symbolic link is followed out of the folder."""
    found = []
    for folder, dirs, files in os.walk(top):
        depth = len(Path(folder).relative_to(top).parts)
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.startswith(".")
                         and depth < MAX_DEPTH)
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in KINDS and not name.startswith("."):
                if path.is_symlink() and top.resolve() not in path.resolve().parents:
                    continue
                found.append(path)
        if len(found) > MAX_FILES:
            raise FileRefused(f"{top} holds more than {MAX_FILES} .py and .ipynb files; a "
                              f"submission is a few")
    return sorted(found, key=lambda p: p.relative_to(top).parts)


def defined(source: str) -> set[str]:
    """The classes and functions a module defines at its top level: what a student would call
    their layer (imports and constants are not)."""
    return {n.name for n in ast.parse(source).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


@dataclass
class _Read:
    """What one file of a submission binds, defines and fails to parse."""

    bound: set
    defined: list
    broken: list          # "line N: SyntaxError: ..." for a .py file, the cells for a notebook
    text: str             # its source (a notebook's: its cells'), for naming what failed
    module: object = None


def _read(path: Path) -> _Read:
    if path.suffix == ".ipynb":
        try:
            cells = notebook_cells(path)
        except (FileRefused, FormatError) as exc:
            return _Read(set(), [], [str(exc)], "")
        module = module_of(cells)
        return _Read(module.bound, sorted(module.bound & defined(module.source)),
                     [b.words() for b in module.broken],
                     "\n".join(b.cell.source for b in module.broken), module)
    source = read_text(path, "submission", MAX_SUBMISSION_BYTES)  # a regular file, not too big
    try:
        return _Read(top_level_names(source), sorted(defined(source)), [], source)
    except SyntaxError as exc:
        return _Read(set(), [], [f"line {exc.lineno}: SyntaxError: {exc.msg}"], source)
    except (ValueError, RecursionError, MemoryError) as exc:  # a NUL byte, absurd nesting
        return _Read(set(), [], [f"{type(exc).__name__}: {exc}"], source)


def locate(submission: Path, names: tuple[str, ...], staging: Path) -> Located:
    """The first of `names` found in the submission (a .py or .ipynb file, or a folder searched
    with its subfolders in path order), as a .py file the sandbox can import: the file itself,
    or the module made of a notebook's code cells, written into `staging`. Raises NotGradable
    (nothing to import: the reason, with the names that were found) or FileRefused."""
    submission = Path(submission)
    if not os.access(submission, os.R_OK):  # (graded as nobody: a folder only root may enter)
        raise NotGradable(f"there is no submission at {submission} that the grader may read")
    if submission.suffix == ".py" and not submission.is_dir():
        # one .py file: the sandbox imports it and says what is wrong (the syntax error and its
        # line, no such name and the names it has), as for every file the checker is given
        got = _read(submission)
        name = next((n for n in names if n in got.bound), names[0])
        return Located(submission, name, submission.name)
    top = submission if submission.is_dir() else submission.parent
    files = python_files(submission) if submission.is_dir() else [submission]
    if not files:
        raise NotGradable(f"the submission holds no .py or .ipynb file (give the file that "
                          f"defines {' or '.join(names)})")
    read = {path: _read(path) for path in files}
    for name in names:
        for path, got in read.items():
            if name not in got.bound:
                continue
            shown = str(path.relative_to(top))
            if got.module is None:
                return Located(path, name, shown)
            staged = Path(staging) / f"{_identifier(path.stem)}_ipynb.py"
            staged.write_text(got.module.source, encoding="utf-8")
            return Located(staged, name, shown, got.module.notes, got.module)
    for name in names:  # defined where the text does not parse: that is the reason
        pattern = re.compile(rf"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{re.escape(name)}\b",
                             re.MULTILINE)
        for path, got in read.items():
            if got.broken and pattern.search(got.text):
                raise NotGradable(f"{path.relative_to(top)} defines `{name}` but does not "
                                  f"parse: {'; '.join(got.broken[:3])}")
    wanted = " or ".join(f"`{n}`" for n in names)
    found = [f"{p.relative_to(top)} defines {', '.join(g.defined)}"
             for p, g in read.items() if g.defined]
    found += [f"{p.relative_to(top)} does not parse ({'; '.join(g.broken[:3])})"
              for p, g in read.items() if g.broken and not g.module]
    raise NotGradable(f"no file of the submission defines {wanted} ("
                      + ("; ".join(found) or "no class or function was found in it") + ")")


def _identifier(stem: str) -> str:
    """A notebook's name as a module name ('Lab 3 - attention' -> 'Lab_3___attention')."""
    out = re.sub(r"\W", "_", stem)
    return out if out and not out[0].isdigit() else f"nb_{out}"


def staging_dir() -> tempfile.TemporaryDirectory:
    """Where a notebook's module is written: a directory of its own, removed after the check."""
    return tempfile.TemporaryDirectory(prefix="check_attention-submission-")
