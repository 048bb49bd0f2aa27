"""What a student hands in, and what a course's platform hands over: a .py file, a notebook, or
a folder of them with subfolders (`locate` finds the object to check in it, reading syntax trees
only: nothing of it runs in the checker's process, and a notebook is read as notebook.py's module
of its code cells); and a course's export, a folder of every student's submissions
(`submissions`): files side by side, a folder per student, or Gradescope's folders named by its
submission_metadata.yml (docs/check_attention.md, "Grading a folder").
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from safeio.cli import FileRefused, FormatError
from safeio.files import read_text
from check_attention.notebook import binds, module_of, notebook_cells

MAX_SUBMISSION_BYTES = 4 << 20   # a submission is a page or two of Python, not a 4 MiB file
MAX_FILES = 200                  # .py and .ipynb files read in one submission folder
MAX_DEPTH = 8                    # subfolders below the submission's top
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", "__MACOSX", "node_modules", ".git",
                "venv", ".venv", "site-packages"}
KINDS = (".py", ".ipynb")
METADATA = "submission_metadata.yml"   # Gradescope's export: folder -> its :submitters


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


@dataclass
class _Read:
    """What one file of a submission binds, defines and fails to parse."""

    bound: set
    tree: Optional[ast.Module]
    broken: list          # "line N: SyntaxError: ..." for a .py file, the cells for a notebook
    text: str             # its source (a notebook's: its cells'), for naming what failed
    module: object = None

    @property
    def defined(self) -> list[str]:
        """The classes and functions it defines at its top level: what a student would call
        their layer (imports and constants are not)."""
        return sorted(n.name for n in self.tree.body if isinstance(n, (
            ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))) if self.tree else []

    def candidates(self) -> list[str]:
        """What FILE.py without :NAME may mean: its nn.Module classes, else its public classes,
        else its public functions."""
        public = [n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                  and not n.name.startswith("_")] if self.tree else []
        classes, layers = [n for n in public if isinstance(n, ast.ClassDef)], {"Module"}
        for c in self.tree.body if self.tree else []:  # nn.Module's subclasses, and theirs
            if isinstance(c, ast.ClassDef) and {ast.unparse(b).split(".")[-1]
                                                for b in c.bases} & layers:
                layers.add(c.name)
        return [n.name for n in [c for c in classes if c.name in layers] or classes or public]


def _read(path: Path) -> _Read:
    if path.suffix == ".ipynb":
        try:
            cells = notebook_cells(path)
        except (FileRefused, FormatError) as exc:
            return _Read(set(), None, [str(exc)], "")
        module = module_of(cells)
        return _Read(module.bound, ast.parse(module.source), [b.words() for b in module.broken],
                     "\n".join(b.cell.source for b in module.broken), module)
    source = read_text(path, "submission", MAX_SUBMISSION_BYTES)  # a regular file, not too big
    try:
        tree = ast.parse(source)
        return _Read(set().union(*map(binds, tree.body)), tree, [], source)
    except SyntaxError as exc:
        return _Read(set(), None, [f"line {exc.lineno}: SyntaxError: {exc.msg}"], source)
    except (ValueError, RecursionError, MemoryError) as exc:  # a NUL byte, absurd nesting
        return _Read(set(), None, [f"{type(exc).__name__}: {exc}"], source)


def locate(submission: Path, names: tuple[str, ...], staging) -> Located:
    """The first of `names` found in the submission (a .py or .ipynb file, or a folder searched
    with its subfolders in path order), as a .py file the sandbox can import: the file itself,
    or a notebook's module, written into `staging` (a folder, or a function making one). No
    names (FILE without :NAME): the one class or function it defines. Raises NotGradable (nothing to
    import: the reason, with the names that were found) or FileRefused."""
    submission = Path(submission)
    if not os.access(submission, os.R_OK):  # (graded as nobody: a folder only root may enter)
        raise NotGradable(f"there is no submission at {submission} that the grader may read")
    if submission.suffix == ".py" and not submission.is_dir() and names:
        # one .py file: the sandbox imports it and says what is wrong (the syntax error and its
        # line, no such name and the names it has), as for every file the checker is given
        got = _read(submission)
        return Located(submission, next((n for n in names if n in got.bound), names[0]),
                       submission.name)
    top = submission if submission.is_dir() else submission.parent
    files = python_files(submission) if submission.is_dir() else [submission]
    if not files:
        raise NotGradable(f"the submission holds no .py or .ipynb file (give the file that "
                          f"defines {' or '.join(names)})")
    read = {path: _read(path) for path in files}
    if not names:  # FILE without :NAME
        got = read[submission]
        found = got.candidates()
        if len(found) != 1:
            raise NotGradable(f"{submission.name} " + (
                f"does not parse: {'; '.join(got.broken[:3])}" if got.broken and not got.tree
                else f"defines {', '.join(found)}: give one as {submission.name}:NAME" if found
                else "defines no class or function to check"))
        names = tuple(found)
    for name in names:
        for path, got in read.items():
            if name not in got.bound:
                continue
            shown = str(path.relative_to(top))
            if got.module is None:
                return Located(path, name, shown)
            stem = re.sub(r"\W", "_", path.stem)  # a module's name: 'Lab 3 - x' -> 'Lab_3___x'
            staged = Path(staging() if callable(staging) else staging) / \
                f"{'nb_' * (not stem or stem[0].isdigit())}{stem}_ipynb.py"
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


def outside_link(file: Path) -> Optional[str]:
    """Why a submission that is a symbolic link out of its folder is refused (the instructor's
    solution, say), or None: a submission is graded as a file of the folder."""
    target = file.resolve()
    if not file.is_symlink() or file.parent.resolve() in target.parents:
        return None
    return (f"{file.name} is a symbolic link to {os.readlink(file)}, outside the graded folder; "
            f"only the files in it are graded")


# ----------------------------------------------------------------------------- a course's export


def submissions(folder: Path) -> tuple[list[tuple[str, Path]], list[str]]:
    """([(how the student is named, the submission)], notes) of a course's export, in name
    order: its .py files and notebooks, or where it has none, its folders (a student's each)."""
    entries = sorted((p for p in folder.iterdir() if not p.name.startswith(".")),
                     key=lambda p: p.name)
    files = [p for p in entries if p.suffix in KINDS and not p.is_dir()]
    if files:
        return [(p.name, p) for p in files], []
    folders = [p for p in entries if p.is_dir() and p.name not in SKIPPED_DIRS]
    who, notes = metadata(folder)
    return [(f"{who[p.name]} ({p.name})" if p.name in who else p.name, p) for p in folders], notes


def metadata(folder: Path) -> tuple[dict, list[str]]:
    """({submission folder: the names of who made it}, notes) from Gradescope's
    submission_metadata.yml ({} without one)."""
    path = folder / METADATA
    if not path.exists():
        return {}, []
    import yaml
    try:
        data = yaml.safe_load(read_text(path, METADATA, 1 << 20))
        who = {str(k): ", ".join(s[":name"] for s in v[":submitters"][:20]
                                 if isinstance(s.get(":name"), str))
               for k, v in data.items()}
        return {k: v for k, v in who.items() if v}, []
    except (FileRefused, yaml.YAMLError, AttributeError, KeyError, TypeError) as exc:
        return {}, [f"{METADATA} could not be read ({type(exc).__name__}): students are named "
                    f"by their folders"]


def several_students(submission: Path, names: tuple[str, ...]) -> list[str]:
    """The students of a course's export given where one submission belongs (format=): the
    folders of a Gradescope export, or two or more folders that each define a name; [] else."""
    if not submission.is_dir():
        return []
    folders, _ = submissions(submission)
    if (submission / METADATA).exists():
        return [who for who, _ in folders]
    if any(p.is_file() for _, p in folders):
        return []
    defining = [who for who, p in folders if any(set(names) & _read(f).bound
                                                 for f in python_files(p)[:MAX_FILES])]
    return defining if len(defining) > 1 else []
