"""Notebooks as modules: the code cells of a .ipynb file, or the cells a running Jupyter kernel
has executed, read as one module that defines what the cells define and runs nothing else.

A learner's notebook trains, plots and prints at its top level; the checker wants only the layer.
So each code cell is parsed (nothing of it runs here) and only its definitions are kept: imports,
`def` and `class` statements, and assignments of simple constants (`D_MODEL = 64`, `N = D_MODEL
// 4`: literals, names bound above, arithmetic; no calls). A training loop, a plot, a call, an
`if __name__ == "__main__":` block are left out. IPython's own syntax never runs either: a cell
magic (`%%time`, `%%bash`) leaves the whole cell out, and a line magic (`%matplotlib inline`), a
shell line (`!pip install ...`, `files = !ls`) or a help line (`obj?`) becomes `pass`, so that
the cell's line numbers stay its own. A cell that still does not parse is left out, and said so.
Cells are read in order: a later definition overrides an earlier one, as in the kernel.

`notebook_source(path)` reads a .ipynb file (a submission, a lesson) through safeio's bounded
reader, without nbformat (the checker needs two fields of the format: `cells`, each with its
`cell_type` and `source`); `check_exercise(name)`, in a lesson, checks the learner's code as the
kernel ran it (IPython's raw input history) and prints the verdict, the mistake and its fix in a
few sentences, never a traceback. `binds` is the one reader of a file's top-level names.
"""
from __future__ import annotations

import ast
import builtins
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from safeio.cli import FileRefused, FormatError
from safeio.files import MIB, read_json

# A notebook with its outputs (pictures included) is a few MiB; a bigger file is not one to read
# for its code.
MAX_NOTEBOOK_BYTES = 32 * MIB
PROJECT_ROOT = Path(__file__).resolve().parents[1]

_LINE_MAGIC = re.compile(r"^\s*(%|!(?!=))")                      # %time f(), !ls (not !=)
_ASSIGNED_MAGIC = re.compile(r"^[\w.,\s()\[\]]+=\s*(%|!(?!=))")  # files = !ls, t = %timeit f()
_HELP = re.compile(r"^\s*(\?+[\w.]+|[\w.]+\?+)\s*$")              # ?obj, obj?, obj??
_LINES = re.compile(r"\r\n|\r|\n")  # Python's line ends (not str.splitlines': \f, U+2028, ...)
_DEFINES = "^[ \\t]*(?:async[ \\t]+)?(?:def|class)[ \\t]+{}\\b|^{}[ \\t]*(?::[^=\\n]*)?="


@dataclass
class Cell:
    label: str   # how a reader finds it: "code cell 3" in a file, "In [7]" in a kernel
    source: str


@dataclass
class Broken:
    """A cell that does not parse, even with IPython's lines left out."""

    cell: Cell
    line: int
    message: str

    def words(self) -> str:
        lines = _LINES.split(self.cell.source)
        text = lines[self.line - 1].strip() if 0 < self.line <= len(lines) else ""
        shown = f" (`{text[:80]}{'...' if len(text) > 80 else ''}`)" if text else ""
        return f"{self.cell.label}{f', line {self.line}' * bool(self.line)}: {self.message}{shown}"


@dataclass
class Module:
    """One module made of the cells' definitions."""

    source: str
    # where each line of `source` comes from: (cell label, line in the cell); ("", 0) for the
    # lines this reader writes itself
    origins: list = field(default_factory=list)
    bound: set = field(default_factory=set)      # the names the module defines at its top
    notes: list = field(default_factory=list)    # what was left out that a reader should know
    broken: list = field(default_factory=list)   # [Broken]: the cells that do not parse

    def where(self, line: int) -> str:
        """'In [7], line 3' for a line of the module, '' for one of the reader's own."""
        if 0 < line <= len(self.origins) and self.origins[line - 1][0]:
            label, n = self.origins[line - 1]
            return f"{label}, line {n}"
        return ""


# ----------------------------------------------------------------------------- cells


def notebook_cells(path: Path) -> list[Cell]:
    """The code cells of a .ipynb file (nbformat 4), labelled "code cell N" (N counts code cells
    from 1). Raises FileRefused (not a regular file, too big) or FormatError (not a notebook)."""
    path = Path(path)
    data = read_json(path, "notebook", MAX_NOTEBOOK_BYTES)
    if "worksheets" in data:
        raise FormatError(f"{path} is an nbformat 3 notebook; open it in Jupyter and save it "
                          f"again to convert it to nbformat 4")
    cells = data.get("cells")
    if not isinstance(cells, list):
        raise FormatError(f"{path} is not a Jupyter notebook: it has no list of `cells`")
    out = []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list) and all(isinstance(s, str) for s in source):
            source = "".join(source)
        if not isinstance(source, str):
            raise FormatError(f"{path}: code cell {len(out) + 1} has a source that is not text")
        out.append(Cell(f"code cell {len(out) + 1}", source))
    return out


def kernel_cells(history: Optional[list] = None) -> list[Cell]:
    """The cells this IPython kernel has executed, in the order it ran them, as typed (IPython's
    raw input history; `In` holds them already translated to Python calls of the magics)."""
    if history is None:
        from IPython import get_ipython  # noqa: PLC0415  (only inside a kernel)
        shell = get_ipython()
        if shell is None:
            raise RuntimeError("not inside IPython or Jupyter")
        history = shell.history_manager.input_hist_raw
    return [Cell(f"In [{n}]", text) for n, text in enumerate(history) if n and text.strip()]


# ----------------------------------------------------------------------------- one cell


def python_of(cell: Cell) -> tuple[Optional[ast.Module], str, list[str], Optional[Broken]]:
    """(tree, text, notes, broken) of a cell: its text with IPython's lines as `pass`, parsed."""
    text = cell.source
    first = next((l for l in _LINES.split(text) if l.strip()), "")
    if first.lstrip().startswith("%%"):
        magic = first.split()[0]
        return None, text, [f"{cell.label} is an IPython cell magic ({magic}): left out, never "
                            f"run"], None
    try:
        return ast.parse(text), text, [], None
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # said by the parse below
        pass
    lines, notes = _LINES.split(text), []
    for i, line in enumerate(lines):
        if _LINE_MAGIC.match(line) or _ASSIGNED_MAGIC.match(line) or _HELP.search(line):
            indent = line[:len(line) - len(line.lstrip())]
            lines[i] = f"{indent}pass"
            notes.append(f"{cell.label}, line {i + 1}: IPython's `{line.strip()[:60]}` left "
                         f"out, never run")
    text = "\n".join(lines) + "\n"
    try:
        return ast.parse(text), text, notes, None
    except SyntaxError as exc:
        return None, text, notes, Broken(cell, exc.lineno or 0, exc.msg)
    except (ValueError, RecursionError, MemoryError) as exc:  # a NUL byte, absurd nesting, a
        return None, text, notes, Broken(cell, 0, ": ".join(filter(None, (  # surrogate
            type(exc).__name__, str(exc)))))


def _names_read(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


_CONSTANT_NODES = (ast.Constant, ast.Name, ast.Load, ast.Attribute, ast.UnaryOp, ast.BinOp,
                   ast.BoolOp, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.operator,
                   ast.unaryop, ast.boolop)


def _constant(node: ast.stmt, bound: set[str]) -> bool:
    """An assignment of a simple constant to plain names: no call, no subscript, and only names
    the module already binds (so that `Y = X * 2` is left out with the `X = f()` it needs)."""
    if isinstance(node, ast.Assign):
        targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        targets, value = [node.target], node.value
    else:
        return False
    return (all(isinstance(t, ast.Name) for t in targets)
            and all(isinstance(n, _CONSTANT_NODES) for n in ast.walk(value))
            and _names_read(value) <= bound | set(dir(builtins)))


def binds(node: ast.stmt) -> set[str]:
    """The names a top-level statement binds (an import, a def or class, an assignment), inside
    if/try/with/for/while blocks too: a file's top-level names, read from its syntax tree."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if not isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
        return set()
    inner = [s for part in ("body", "orelse", "finalbody") for s in getattr(node, part, [])]
    return set().union(*map(binds, inner + [s for h in getattr(node, "handlers", [])
                                            for s in h.body]))


# ----------------------------------------------------------------------------- the module


def module_of(cells: list[Cell], folder: Optional[str] = None) -> Module:
    """The definitions of the cells, in order, as one module (see the module docstring). folder:
    put first on the module's import path, as a kernel's folder is on its own (a lesson's
    cells import lessons/lesson.py)."""
    future, body, origins = [], [], []
    module = Module("")
    for cell in cells:
        tree, text, notes, broken = python_of(cell)
        module.notes += notes
        if broken is not None:
            module.broken.append(broken)
            module.notes.append(f"{broken.words()}: the cell does not parse and is left out")
        if tree is None:
            continue
        lines = _LINES.split(text)
        kept = []
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                future.append(ast.get_source_segment(text, node))
                continue
            definition = isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                           ast.AsyncFunctionDef, ast.ClassDef))
            if not (definition or _constant(node, module.bound)):
                continue  # top-level work: never run when checked
            module.bound |= binds(node)
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            if node.end_lineno == first == node.lineno:  # one line: maybe one of `a; b`
                kept.append(([ast.get_source_segment(text, node)], first))
            else:
                kept.append((lines[first - 1:node.end_lineno], first))
        if kept:
            body.append(f"# {cell.label}")
            origins.append(("", 0))
            for segment, first in kept:
                body += segment
                origins += [(cell.label, first + i) for i in range(len(segment))]
    head = ['"""Definitions read out of notebook cells (check_attention/notebook.py)."""']
    head += sorted(set(future))
    if folder is not None:
        head.append(f"import sys as _sys; _sys.path.insert(0, {str(folder)!r})  # the kernel's folder")
    module.source = "\n".join(head + body) + "\n"
    module.origins = [("", 0)] * len(head) + origins
    return module


def notebook_source(path) -> str:
    """The .ipynb file at path as the source of a .py module: its code cells' imports,
    definitions and simple constants, each cell's under a `# code cell N` comment. Raises
    FileRefused or FormatError for a file that is not a notebook it can read."""
    module = module_of(notebook_cells(Path(path)))
    notes = [f"# left out: {n}" for n in module.notes]
    return module.source + ("\n" + "\n".join(notes) + "\n" if notes else "")


# ----------------------------------------------------------------------------- an exercise


def defining_cell(name: str, cells: list[Cell]) -> Optional[Cell]:
    """The last cell whose text defines `name` at its top level (`def name`, `class name`,
    `name = ...`), parsed or not: the learner's latest attempt."""
    pattern = re.compile(_DEFINES.format(re.escape(name), re.escape(name)), re.MULTILINE)
    return next((c for c in reversed(cells) if pattern.search(c.source)), None)


def assigned_in(name: str, cells: list[Cell]) -> Optional[Cell]:
    """The last cell that assigns `name` by running something (a statement this reader leaves
    out), or None."""
    for cell in reversed(cells):
        tree = python_of(cell)[0]
        for node in tree.body if tree else []:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
                targets = [n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                           and isinstance(n.ctx, ast.Store)]
                if name in targets:
                    return cell
    return None


FILE_NAME = "exercise.py"
_AT_LINE = re.compile(r"\(" + re.escape(FILE_NAME) + r", line (\d+)\)")
_NAME_ERROR = re.compile(r"NameError: name '(\w+)' is not defined")


def explain_error(name: str, error: str, module: Module, cells: list[Cell]) -> str:
    """The checker's error about the learner's code as a sentence about their cells."""
    error = _AT_LINE.sub(lambda m: f"({module.where(int(m.group(1))) or FILE_NAME})", error)
    if "NotImplementedError" in error:
        return (f"`{name}` is not written yet: it still raises NotImplementedError. Replace the "
                f"`raise NotImplementedError(...)` line with your code, run that cell, then run "
                f"this check again.")
    missing = _NAME_ERROR.search(error)
    if missing:
        other = missing.group(1)
        where = re.search(r"\(((?:In \[\d+\]|code cell \d+), line \d+)\)", error)
        at = f" (at {where.group(1)})" if where else ""
        runs = assigned_in(other, cells)
        if runs is not None:
            return (f"`{name}` uses `{other}`{at}, which {runs.label} makes by running code. "
                    f"The check takes only the imports, functions, classes and constants of "
                    f"your cells (it never runs a notebook's top-level work), so compute "
                    f"`{other}` inside `{name}`, or pass it in as an argument.")
        return (f"`{name}` uses `{other}`{at}, which no cell of this notebook defines: a typo, "
                f"a missing import, or a cell not run yet?")
    return f"The checker could not use `{name}`: {error}"


def explain(name: str, report) -> str:
    """A checker's Report as a few sentences for a learner: the verdict, counted over the checks
    that apply to this kind of code (the same count for a wrong and a right attempt), then the
    mistake, its fix, what showed it, the checks that fail, and what it costs in a sentence."""
    from check_attention import costs  # noqa: PLC0415
    from check_attention.checklist import SHEET, words  # noqa: PLC0415
    items = report.items
    judged = sum(i.status != "N/A" for i in items.values())
    if report.passed:
        return (f"`{name}` passes all {judged} checks: it computes the equation of the cheat "
                f"sheet (docs/cheat_sheet.md).")
    failed = {k: i.detail for k, i in items.items() if i.status == "FAIL"}
    if not failed:
        return "\n".join([f"`{name}` could not be fully checked: {report.verdict}.",
                          "Checks it could not judge:"] + [
            f"  - {words(k, report.kind)}: {i.detail}" for k, i in items.items()
            if i.status == "SKIP"])
    cause = [failed["equation"]] if "equation" in failed else [
        d for k, d in failed.items() if k != "causal" and d]
    fix = "; ".join(words(k, report.kind) for k in SHEET if k in failed)
    fix = fix[:1].lower() + fix[1:] if fix[1:2].islower() else fix
    lines = [f"`{name}` is not right yet: {len(failed)} of its {judged} checks fail."]
    lines += [f"The mistake: {'; '.join(cause)}."] if cause else []
    lines += [f"The fix: {fix}."] if fix else []
    lines += [f"What shows it: {failed['causal']}."] if failed.get("causal") else []
    lines += ["Checks that fail:"] + [f"  - {words(k, report.kind)}" for k in failed]
    table = costs.load()
    return "\n".join(lines + list(filter(None, (costs.plain(s, table)
                                                for s in report.mistakes))))


def check_cells(name: str, cells: list[Cell], folder: Optional[str] = None,
                **options) -> tuple[Optional[object], str]:
    """(report or None, the sentences to print): `name` as the cells define it, checked, with
    `folder` (default: the current one, a kernel's) on the import path as in the kernel."""
    if not name.isidentifier():
        return None, f"check_exercise takes the name of your function or class, got {name!r}."
    folder = os.getcwd() if folder is None else folder
    module = module_of(cells, folder=folder)
    latest = defining_cell(name, cells)
    broken = next((b for b in module.broken if latest is not None and b.cell is latest), None)
    if broken is not None:
        return None, (f"The cell that defines `{name}` has a syntax error at {broken.words()}. "
                      f"Fix it and run the cell again, then run this check.")
    if name not in module.bound:
        if latest is not None:
            return None, (f"`{name}` is not defined at the top level of {latest.label}: write "
                          f"`def {name}(...)` or `class {name}(...)` at the start of a line.")
        return None, (f"No cell defines `{name}` yet: run the exercise cell (Shift+Enter), then "
                      f"this one.")
    from check_attention import check  # noqa: PLC0415  (torch: only when a check runs)
    root = str(PROJECT_ROOT)  # the sandboxed child imports the project (model/) from here
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in paths if p])
    with tempfile.TemporaryDirectory(prefix="exercise-") as staging:
        file = Path(staging) / FILE_NAME
        file.write_text(module.source, encoding="utf-8")
        report = check(f"{file}:{name}", reads=(folder,), **options)  # its helper modules
    if report.error is not None:
        return report, explain_error(name, report.error, module, cells)
    return report, explain(name, report)


def wrapped(text: str, width: int = 90) -> str:
    """Each line cut to `width` (a notebook's output wraps mid-word otherwise), a bullet's
    continuation indented under its text."""
    return "\n".join(textwrap.fill(line, width, subsequent_indent="    " if line.startswith("  -")
                                    else "") for line in text.splitlines())


def check_exercise(name: str, report: bool = False, **options) -> None:
    """In a lesson's check cell: check `name` (your function or layer) as this notebook's cells
    define it, and print the verdict and the mistake. report=True also prints the checker's whole
    report; options are the checker's (seq_len=16, dtype="float64", ...)."""
    try:
        found, words = check_cells(name, kernel_cells(), **options)
    except Exception as exc:  # noqa: BLE001  (a learner sees a sentence, never a traceback)
        found, words = None, f"The check could not run: {type(exc).__name__}: {exc}"
    print(wrapped(words))
    if report and found is not None:
        print("\n" + found.text)
