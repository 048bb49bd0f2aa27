"""The packages stand on floors, and every import points down (or stays on its floor).

    safeio -> model -> data -> interop -> training -> guard -> check_attention -> entry points

safeio/ (errors, bounded reads, readers of untrusted formats, system probes) imports nothing of the
project; the core (model/, data/, training/) and interop/ stand on it; guard/ (the policy: ranges,
run directories, preflight, sweeps) stands on all of them; check_attention/ (the checker, a
product of its own) is the top floor, and only the entry points (train.py, generate.py, scripts/,
bench/, tools/, lessons/) import the floors above the core. check_attention/sandbox/ imports nothing of the
project: the host runs its files before the project is on its path. Read from the source with `ast`, so an import
written inside a function counts as much as one at the top of a file: a late import hides a
circle from Python, not from the layering.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ["safeio", "model", "data", "interop", "training", "guard", "check_attention"]
ENTRY_POINTS = {"train", "generate", "scripts", "bench", "tools", "tests", "lessons"}  # above every floor


def imported_packages(path: Path) -> list[tuple[int, str]]:
    """(line, top-level name) of every absolute import in path, inside functions included; a
    relative import stays in its own package and is left out."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


def upward_imports(package: str) -> list[str]:
    """`file:line imports X` for each import of package's files that runs up a floor."""
    floor = FLOORS.index(package)
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for line, name in imported_packages(path):
            above = name in ENTRY_POINTS or (name in FLOORS and FLOORS.index(name) > floor)
            if above:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("package", FLOORS)
def test_no_import_runs_up_a_floor(package):
    assert upward_imports(package) == []


def test_safeio_imports_nothing_of_the_project():
    own = {"safeio"}
    project = set(FLOORS) | ENTRY_POINTS
    found = [f"{path.relative_to(ROOT)}:{line} imports {name}"
             for path in sorted((ROOT / "safeio").rglob("*.py"))
             for line, name in imported_packages(path) if name in project - own]
    assert found == []


def test_the_sandbox_imports_nothing_of_the_project():
    """check_attention/sandbox/ runs in the host before the project is importable: stdlib and torch
    only, and its own files (as top-level modules there, as check_attention.sandbox.* here)."""
    project = set(FLOORS) | ENTRY_POINTS
    found = []
    for path in sorted((ROOT / "check_attention" / "sandbox").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                      if name.split(".")[0] in project
                      and not name.startswith("check_attention.sandbox")]
    assert found == []


def may_import(package: str) -> set[str]:
    """The project packages package/__init__.py says it may import (its `May import:` line)."""
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc, f"{package}/__init__.py has no docstring"
    line = next((l for l in doc.splitlines() if l.startswith("May import:")), None)
    assert line is not None, f"{package}/__init__.py does not say what it may import"
    return {w.strip(" ,.;()") for w in line.removeprefix("May import:").split()} & set(FLOORS)


@pytest.mark.parametrize("package", FLOORS)
def test_each_package_says_truly_what_it_may_import(package):
    """The docstring names only floors below its own, and the files import no other."""
    allowed = may_import(package)
    assert allowed <= set(FLOORS[:FLOORS.index(package)]), allowed
    found = sorted({f"{path.relative_to(ROOT)} imports {name}"
                    for path in sorted((ROOT / package).rglob("*.py"))
                    for _, name in imported_packages(path)
                    if name in FLOORS and name != package and name not in allowed})
    assert found == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The reader itself: an import in a function body, and one under a condition, are found."""
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef f():\n    from guard.limits import check_model\n"
                   "    if True:\n        import training.optim\n")
    assert imported_packages(src) == [(1, "os"), (4, "guard"), (6, "training")]
