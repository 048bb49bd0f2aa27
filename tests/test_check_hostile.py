"""The attention checker against hostile submissions and careless callers, round five (issue 48):
no text a submission chooses (its file's name, the names it defines, its exception messages)
reaches a terminal, a Markdown, CSV or JSON table as anything but inert text; the table is never
written through a link planted at its name; a submission that links out of the graded folder is
refused; and `check()` judges the very object it is given, from any thread, with its arguments
checked, leaving the caller's random states as they were.

The fast tests build tables and reports here, or check small files in one shared sandbox host;
the slow ones run the command as an instructor does.
"""
from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path

import pytest
import torch

from safeio.cli import FileRefused, UserError
from safeio.files import check_outputs
from helpers import REPO_ROOT, SCRIPT_ENV
from check_helpers import LAYERS, sandbox  # noqa: F401 (a fixture)
from check_attention import check, resolve
from check_attention.grading.grade import (Graded, csv_text, json_text, judge, markdown,
                                           progress_line, write_table)
from check_attention.grading.weights import DEFAULT_WEIGHTS
from check_attention.options import Options
from check_attention.report import Report

# Unicode's categories of what is not text to show: controls, format characters (bidi overrides,
# zero-width), surrogates (bytes of a name that are not UTF-8), private, unassigned, separators
HIDDEN = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
LIMIT = 2000  # the longest text of a report (inert.LIMIT)

# What a terminal acts on: ESC moves the cursor and writes PASS over the row, then hides the rest
ANSI_PASS = "\x1b[25GPASS \x1b[72G\x1b[K\x1b[8m"
HOSTILE_NAMES = ["\x1b[2J\x1b[H.py",                        # clears the screen
                 "x.py:Layer PASS (1.0 s)\n[2:2] y.py",     # prints a forged progress line
                 "\u202egnp.py",                            # right-to-left override
                 "=HYPERLINK(\"http:x\",\"ok\").py",        # a formula in a spreadsheet
                 "@SUM(1+1).py", "-2+3.py", "+cmd.py",
                 os.fsdecode(b"\xff\xfe.py"),               # not UTF-8
                 "a|b<script>&`.py"]                        # Markdown and HTML


def shown_raw(text: str) -> list[str]:
    """The characters of text that are not printable text (newlines between lines allowed)."""
    return [c for c in text if c != "\n" and unicodedata.category(c) in HIDDEN]


def hostile_rows() -> list[Graded]:
    rows = []
    for i, name in enumerate(HOSTILE_NAMES):
        r = Report(f"{name}:Layer", error=f"importing {name} failed: RuntimeError: {ANSI_PASS}"
                   if i % 2 else None)
        if not i % 2:
            r.set("scale", "FAIL", f"{ANSI_PASS} named {name}")
            r.diagnosis = [f"reproduced \n[9/9] forged.py:Layer PASS {name}" + "x" * 10**6]
        rows.append(Graded(name, "Layer" + "\u200f" * 3, r, seconds=1.0))
    return rows


# ----------------------------------------------------------------------------- inert text


def test_inert_shows_each_character_that_is_not_text_as_its_escape():
    from check_attention.inert import csv_cell, inert, markdown_cell
    assert inert("a\x1b[2Jb\n\t\r\x7f\x85\u202e\u2066\u200b\u2028") == \
        "a\\x1b[2Jb\\n\\t\\r\\x7f\\x85\\u202e\\u2066\\u200b\\u2028"
    assert inert(os.fsdecode(b"caf\xc3\xa9 \xff.py")) == "café \\xff.py"  # UTF-8 kept, a byte shown
    assert inert("é漢字 ok") == "é漢字 ok"
    assert inert("x" * 5000) == "x" * (LIMIT - 3) + "..."
    assert inert(inert("\x1b" * 10)) == inert("\x1b" * 10)  # twice is once
    assert csv_cell("=1+2") == "'=1+2" and csv_cell("  @x") == "'  @x"
    assert csv_cell("\t=x") == "\\t=x" and csv_cell("PASS") == "PASS"
    assert markdown_cell("a|b<i>&`c\\") == "a\\|b\\<i\\>\\&\\`c\\\\"


def test_text_from_a_submission_reaches_no_table_raw(tmp_path):
    rows = hostile_rows()
    md = markdown(rows, DEFAULT_WEIGHTS)
    assert shown_raw(md) == []
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the header and one line per row: no forged rows
    assert all(line.count(" | ") == table[0].count(" | ") for line in table)  # no forged cells
    assert "<script>" not in md and "\\<script\\>" in md
    parsed = list(csv.reader(io.StringIO(csv_text(rows, DEFAULT_WEIGHTS))))
    assert len(parsed) == 1 + len(rows)
    for row in parsed:
        for cell in row:
            assert shown_raw(cell) == [] and len(cell) <= LIMIT + 1, cell[:80]
            assert not cell.lstrip(" ").startswith(("=", "+", "-", "@")), cell
    assert parsed[4][0] == "'=HYPERLINK(\"http:x\",\"ok\").py"
    written = json_text(rows, "subs", ("Layer",), Options(), DEFAULT_WEIGHTS)
    data = json.loads(written)
    for row in data["rows"]:
        for text in (row["error"] or "", row["diagnosis"],
                     *(i["detail"] for i in row["items"].values())):
            assert shown_raw(text) == [] and len(text) <= LIMIT
    # the names as they are (round six: the machine-readable file held them escaped), in a file
    # of printable ASCII: JSON's own escapes
    assert [(r["student"], r["name"]) for r in data["rows"]] == [
        (n, "Layer" + "\u200f" * 3) for n in HOSTILE_NAMES]
    assert written.isascii() and shown_raw(written) == []
    for suffix in (".md", ".csv", ".json"):  # a name that is not UTF-8 is written, not a traceback
        write_table(rows, str(tmp_path / f"grades{suffix}"), "subs", ("Layer",), Options())
        assert shown_raw((tmp_path / f"grades{suffix}").read_text()) == []


def test_text_from_a_submission_reaches_no_terminal_raw(capsys):
    for done, row in enumerate(hostile_rows(), 1):
        progress_line(row, done, len(HOSTILE_NAMES))
    err = capsys.readouterr().err
    assert shown_raw(err) == [] and len(err.splitlines()) == len(HOSTILE_NAMES)
    report = Report("x.py:Layer", error=ANSI_PASS)
    report_text = report.text
    report.error = None
    report.set("scale", "FAIL", ANSI_PASS)
    report.header["layer"] = f"{ANSI_PASS}(d_model=64)"
    report.diagnosis = ["a\nverdict: PASS"]
    assert shown_raw(report_text + report.text) == []
    assert report.text.splitlines()[-1] == "verdict: FAIL (1 of 1 checks fail)"
    clean = report.made_inert()  # what check() hands a course's test
    assert "\x1b" not in clean.items["scale"].detail + clean.header["layer"]


def test_an_exception_message_reaches_the_report_inert(sandbox, tmp_path):
    """Through the sandbox, as a submission raises it: the message is shown escaped."""
    (tmp_path / "ansi.py").write_text(f"raise RuntimeError({ANSI_PASS!r})\n")
    report = check(f"{tmp_path}/ansi.py:Layer", sandbox=sandbox)
    assert report.error.startswith("importing ansi.py failed: RuntimeError: \\x1b[25GPASS")
    assert shown_raw(report.error + report.text) == []


# ----------------------------------------------------------------------------- writing out=


@pytest.mark.parametrize("overwrite", [False, True])
def test_out_is_never_written_through_a_link(tmp_path, overwrite):
    """A submitter plants grades.csv in the graded folder as a link, dangling or to a file of
    theirs: the table is refused, before grading and when written, and the target untouched."""
    folder, outside = tmp_path / "subs", tmp_path / "outside"
    folder.mkdir(), outside.mkdir()
    (folder / "grades.csv").symlink_to(outside / "planted.csv")  # dangling
    (folder / "grades.md").symlink_to(outside / "theirs.md")
    (outside / "theirs.md").write_text("theirs\n")
    rows = hostile_rows()[:1]
    for name in ("grades.csv", "grades.md"):
        with pytest.raises(FileRefused, match="is a symbolic link"):
            check_outputs([folder / name], overwrite)
        with pytest.raises(FileRefused, match="is a symbolic link"):
            write_table(rows, str(folder / name), "subs", ("Layer",),
                        Options(overwrite=overwrite))
    assert sorted(p.name for p in outside.iterdir()) == ["theirs.md"]
    assert (outside / "theirs.md").read_text() == "theirs\n"
    assert sorted(p.name for p in folder.iterdir()) == ["grades.csv", "grades.md"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_planted_while_the_table_is_written_is_not_followed(tmp_path, monkeypatch,
                                                                   overwrite):
    """The race: the name is checked, then a link appears there before the table takes it. The
    table goes to a temporary file opened O_EXCL | O_NOFOLLOW, then takes the name by rename
    (which replaces the link itself) or by link (which refuses a taken name)."""
    import safeio.files as files
    from safeio.files import write_output
    out, target = tmp_path / "grades.csv", tmp_path / "victim.txt"
    target.write_text("victim\n")

    def plant_then_name(n):  # called once the name was found free, before the table is written
        out.symlink_to(target)
        return "0" * 2 * n
    monkeypatch.setattr(files.secrets, "token_hex", plant_then_name)
    if overwrite:
        write_output(out, "table\n", "out=", overwrite=True)
        assert not out.is_symlink() and out.read_text() == "table\n"  # the link was replaced
    else:
        with pytest.raises(UserError, match="appeared while it was written"):
            write_output(out, "table\n", "out=", overwrite=False)
    assert target.read_text() == "victim\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_no_out_is_written_through_a_link_among_its_folders(tmp_path, monkeypatch):
    """Round six's P32: `out=sub/feedback/results.json` where the submitter made `feedback` a link
    to a folder outside (deeper down too, and relative to the working folder): every writer
    (write_output) and every script's check (check_outputs) refuses, and nothing appears outside.
    Links above the anchor are the user's own: a working folder reached through one, named
    absolutely as the shell names it ($PWD), is written into."""
    from check_attention.grading import platforms
    from safeio.files import write_output
    sub, outside = tmp_path / "sub", tmp_path / "outside"
    (outside / "deeper").mkdir(parents=True)
    sub.mkdir()
    (sub / "feedback").symlink_to(outside)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(platforms.AS_USER_ENV, "1")
    for out in (sub / "feedback" / "results.json", sub / "feedback" / "deeper" / "r.json",
                Path("sub/feedback/new/r.json")):
        with pytest.raises(FileRefused, match="feedback is a symbolic link"):
            write_output(out, "{}\n", "out=", overwrite=True)
        with pytest.raises(FileRefused, match="feedback is a symbolic link"):
            check_outputs([out], overwrite=True)
        with pytest.raises(FileRefused, match="feedback is a symbolic link"):
            platforms.run(str(sub), ("Layer",), Options(format="gradescope", out=str(out)))
    assert sorted(p.name for p in outside.rglob("*")) == ["deeper"]
    (tmp_path / "real" / "work").mkdir(parents=True)
    (tmp_path / "home").symlink_to(tmp_path / "real")  # a home folder reached through a link
    monkeypatch.chdir(tmp_path / "home" / "work")
    monkeypatch.setenv("PWD", str(tmp_path / "home" / "work"))
    write_output(tmp_path / "home" / "work" / "out" / "t.md", "table\n", "out=", overwrite=False)
    assert (tmp_path / "real" / "work" / "out" / "t.md").read_text() == "table\n"


# ----------------------------------------------------------------------------- submissions


def test_a_submission_linking_out_of_the_folder_is_refused(tmp_path):
    folder, solution = tmp_path / "subs", tmp_path / "solution.py"
    folder.mkdir()
    shutil.copy(LAYERS / "fused.py", solution)
    (folder / "alice.py").symlink_to(solution)
    (folder / "bob.py").symlink_to("../../" * 8 + "etc/passwd")
    shutil.copy(LAYERS / "fused.py", folder / "carol.py")
    (folder / "dave.py").symlink_to("carol.py")  # inside the folder: graded as carol's file
    for name in ("alice.py", "bob.py"):
        row = judge(folder / name, ("CausalSelfAttention",), Options(), student=name)
        assert row.report.outcome == "ERROR"
        assert "is a symbolic link to" in row.diagnosis and "outside the graded folder" in \
            row.diagnosis, row.diagnosis
    from check_attention.grading.submission import outside_link
    assert outside_link(folder / "carol.py") is None and outside_link(folder / "dave.py") is None


# ----------------------------------------------------------------------------- check(...)


def import_file(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


NAMED_LIKE_THE_RIGHT_ONE = """
from separate import MultiHeadSelfAttention as Right, ScaleDModel as Wrong

class Right(Right):
    pass

class Wrong(Wrong):
    pass

Wrong.__name__ = Wrong.__qualname__ = "Right"  # the course imports Wrong
"""


@pytest.fixture
def student(tmp_path):
    """A student's module imported here, as a course's test imports it."""
    shutil.copy(LAYERS / "separate.py", tmp_path / "separate.py")
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in ("separate", "student_named", "student_chooses"):
        sys.modules.pop(name, None)


def test_check_finds_an_object_by_what_it_is_not_by_its_name(student):
    (student / "student_named.py").write_text(NAMED_LIKE_THE_RIGHT_ONE)
    module = import_file(student / "student_named.py")
    file, name, fingerprint = resolve(module.Wrong)
    assert (Path(file), name) == (student / "student_named.py", "Wrong")
    assert resolve(module.Right)[1] == "Right" and resolve(module.Right)[2] != fingerprint


def test_check_judges_the_very_object_it_is_given(sandbox, student):
    (student / "student_named.py").write_text(NAMED_LIKE_THE_RIGHT_ONE)
    module = import_file(student / "student_named.py")
    wrong = check(module.Wrong, sandbox=sandbox)
    assert not wrong.passed and wrong.items["scale"].status == "FAIL", wrong.text
    assert check(module.Right, sandbox=sandbox).passed


def test_check_refuses_an_object_its_file_binds_otherwise_in_the_sandbox(sandbox, student):
    """A choice made at import time (the machine, the environment): the sandbox's import finds
    another object under the name, and check() says so rather than judge that one."""
    (student / "student_chooses.py").write_text(
        "import os\nfrom separate import MultiHeadSelfAttention, ScaleDModel\n\n"
        "if os.environ.get('COURSE_RUN'):\n    class Attention(ScaleDModel):\n        pass\n"
        "else:\n    class Attention(MultiHeadSelfAttention):\n        pass\n")
    os.environ["COURSE_RUN"] = "1"
    try:
        module = import_file(student / "student_chooses.py")
    finally:
        del os.environ["COURSE_RUN"]
    report = check(module.Attention, sandbox=sandbox)
    assert not report.passed and "is not the object given to check()" in report.error


@pytest.mark.parametrize("kwargs, error, words", [
    ({"sandbox": "x"}, TypeError, "sandbox= takes a check_attention.sandbox.host.Sandbox"),
    ({"out": "x.csv"}, UserError, "out= is for grading a folder"),
    ({"workers": 2}, UserError, "workers= is for grading a folder"),
    ({"device": 5}, UserError, "device must be cpu, cuda, cuda:N or mps, got 5"),
    ({"device": "gpu"}, UserError, "device must be cpu, cuda, cuda:N or mps, got 'gpu'"),
    ({"overwrite": "yes"}, UserError, "overwrite must be true or false"),
    ({"dtype": 16}, UserError, "dtype must be one of"),
])
def test_check_refuses_bad_arguments_with_its_documented_errors(kwargs, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(".", r"\.")):
        check("tests/attention_layers/fused.py:NoScale", **kwargs)


def test_check_leaves_the_callers_random_states_as_they_were(sandbox):
    torch.manual_seed(1234)
    random.seed(1234)
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    threads = torch.get_num_threads()
    assert check("tests/attention_layers/odd.py:Torch", sandbox=sandbox).passed
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state and torch.get_num_threads() == threads


def test_check_from_two_threads_at_once(sandbox):
    targets = {"fused.py:CausalSelfAttention": True, "fused.py:ScaleDModel": False}
    got, failed = {}, []

    def one(target):
        try:
            got[target] = check(f"{LAYERS}/{target}", sandbox=sandbox)
        except BaseException as exc:  # noqa: BLE001  (the test reports it)
            failed.append(f"{target}: {type(exc).__name__}: {exc}")
    threads = [threading.Thread(target=one, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert {t: r.passed for t, r in got.items()} == targets, {t: r.text for t, r in got.items()}


# ----------------------------------------------------------------------------- notebooks


NOTEBOOK_LAYER = "import torch\nclass Layer(torch.nn.Module):\n    size = 4\n"


def test_a_cell_the_parser_cannot_build_is_left_out_and_said(tmp_path):
    """Round six's N13-N15, P40, P41: a cell whose syntax tree Python cannot build (200,000 minus
    signs: MemoryError; 300,000 terms: RecursionError; a lone surrogate: UnicodeEncodeError)
    beside a correct layer failed the whole notebook, or gave a correct layer 0 on a platform.
    Such a cell is left out and said so, like one that does not parse."""
    from check_attention.notebook import Cell, module_of
    from check_attention.grading.submission import locate
    odd = ["x = " + "-" * 200_000 + "1\n", "y = 1" + "+1" * 300_000 + "\n", "s = '\ud800'\n"]
    module = module_of([Cell(f"code cell {i}", c) for i, c in enumerate(odd + [NOTEBOOK_LAYER])])
    assert "Layer" in module.bound and len(module.broken) == 3
    assert [n.split(":")[1].strip() for n in module.notes] == [
        "MemoryError", "RecursionError", "UnicodeEncodeError"]
    nb = tmp_path / "lab.ipynb"
    nb.write_text(json.dumps({"cells": [{"cell_type": "code", "source": c}
                                        for c in odd + [NOTEBOOK_LAYER]]}))
    found = locate(nb, ("Layer",), tmp_path)
    assert found.name == "Layer" and len(found.notes) == 3


def test_the_reader_numbers_lines_as_python_does():
    """Round six's N11, N12, N24, X15: a form feed or U+2028 (kept inside a line by Python,
    a line end to str.splitlines) shifted the reader's lines: top-level work was copied into the
    module and ran, and a definition lost its last line."""
    from check_attention.notebook import Cell, module_of
    cells = [Cell("In [1]", "S = 'a\u2028b'\nraise SystemExit('ran')\ndef helper():\n"
                            "    x = 1\n    return x\n"),
             Cell("In [2]", "# \x0c a page\nimport math\nclass Layer:\n    def f(self):\n"
                            "        return helper() + math.floor(0.5)\n"),
             Cell("In [3]", "T = '\x1c\x1d\x85'\nprint('work')\ndef g():\n    return 2\n")]
    module = module_of(cells)
    namespace: dict = {}
    exec(compile(module.source, "lab", "exec"), namespace)  # noqa: S102  (our own cells)
    assert namespace["Layer"]().f() == 1 and namespace["g"]() == 2
    assert "SystemExit" not in module.source and "print" not in module.source
    line = module.source.split("\n").index("    return x") + 1
    assert module.where(line) == "In [1], line 5"


def test_the_readers_patterns_take_linear_time():
    """Round six's N16, P39, X09, X16: on a cell that does not parse, a line of spaces made one
    pattern backtrack with the square of its length (minutes for 150,000, outside the sandbox,
    past timeout=); 10,000 lines `Layer: int` did the same to check_exercise's."""
    from check_attention.notebook import Cell, defining_cell, python_of
    start = time.monotonic()
    tree, _, _, broken = python_of(Cell("c", "def f(:\n" + " " * 20_000 + "x\n"))
    assert tree is None and broken.line == 1
    assert defining_cell("Layer", [Cell("c", "Layer: int\n" * 10_000)]) is None
    assert time.monotonic() - start < 1  # 4.6 s and 7.8 s before


def test_a_long_line_that_does_not_parse_is_quoted_short():
    """Round six's N23: the `error:` line quoted a 1 MB line whole."""
    from check_attention.notebook import Cell, module_of
    broken = module_of([Cell("c", "x = (" + "1, " * 400_000 + "\n")]).broken[0]
    assert len(broken.words()) < 200


# ----------------------------------------------------------------------------- the working folder


# A graded folder's module named as one the checker imports: it says where it ran (the sandbox's
# child, which imports it to check it, is `runner`'s; a write from there is refused anyway).
SHADOW = ("import os, sys\n"
          "if 'runner' not in sys.modules:\n"
          "    open(os.environ['MARKER'], 'a').write(f'{__name__} in {sys.argv[0]}\\n')\n")


def test_the_checker_never_imports_from_the_folder_it_is_run_in(tmp_path):
    """Round six's P42: `cd subs && python -m check_attention ...` put the folder first on the
    checker's own import path, so a submission named yaml.py ran in its process, outside any
    sandbox, at the first import (safeio.cli imports hydra, which imports yaml)."""
    (tmp_path / "yaml.py").write_text(SHADOW)
    marker = tmp_path / "MARKER"
    env = {**SCRIPT_ENV, "MARKER": str(marker), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "check_attention", "--help"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: python -m check_attention" in result.stdout
    assert not marker.exists(), marker.read_text()


@pytest.mark.slow
def test_a_folder_graded_from_inside_imports_none_of_it_outside_the_sandbox(tmp_path):
    """The same through a grading's workers, whose interpreters start without the working folder
    on their path (PYTHONSAFEPATH): a multiprocessing.py there would run at their first import."""
    for name in ("yaml.py", "multiprocessing.py", "numpy.py"):
        (tmp_path / name).write_text(SHADOW)
    shutil.copy(LAYERS / "fused.py", tmp_path / "fused.py")
    marker = tmp_path / "MARKER"
    env = {**SCRIPT_ENV, "MARKER": str(marker), "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "check_attention", ".", "CausalSelfAttention",
                             "workers=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert "| fused.py | fused.py | CausalSelfAttention | 16.00 | PASS |" in result.stdout, result.stderr
    assert not marker.exists(), marker.read_text()


# ----------------------------------------------------------------------------- the command (slow)


@pytest.mark.slow
def test_hostile_names_and_messages_through_the_command(tmp_path):
    """As an instructor grades a folder: the terminal (stdout, stderr) and the CSV carry every
    hostile name and message inert, one line per file."""
    folder = tmp_path / "subs"
    folder.mkdir()
    for name in HOSTILE_NAMES:
        shutil.copy(LAYERS / "fused.py", os.path.join(os.fsencode(folder), os.fsencode(name)))
    (folder / "ansi.py").write_text(f"raise RuntimeError({ANSI_PASS!r})\n")
    shutil.copy(LAYERS / "fused.py", folder / "fused.py")  # imported by the copies
    out = tmp_path / "grades.csv"
    result = subprocess.run(
        [sys.executable, "-m", "check_attention", str(folder), "CausalSelfAttention",
         "workers=1", f"out={out}"], cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True,
        timeout=600)
    stdout, stderr = (os.fsdecode(b) for b in (result.stdout, result.stderr))
    assert result.returncode == 1, stderr
    n = len(HOSTILE_NAMES) + 2
    assert shown_raw(stdout) == [] and shown_raw(stderr) == []
    assert len([line for line in stdout.splitlines() if line.startswith("| ")]) == 1 + n
    assert len([line for line in stderr.splitlines() if line.startswith("[")]) == n
    rows = {r["file"]: r for r in csv.DictReader(out.open(encoding="utf-8"))}
    assert rows["ansi.py"]["verdict"] == "ERROR" and rows["\\x1b[2J\\x1b[H.py"]["verdict"] == "PASS"
    assert "\\x1b[25GPASS" in rows["ansi.py"]["diagnosis"]
    assert rows["'=HYPERLINK(\"http:x\",\"ok\").py"]["verdict"] == "PASS"
    assert rows["\\xff\\xfe.py"]["verdict"] == "PASS"


@pytest.mark.slow
def test_a_tiny_memory_limit_is_a_tiny_limit(tmp_path):
    """memory=1e-10 (GiB) once meant no limit at all (it rounded to 0 bytes)."""
    shutil.copy(LAYERS / "fused.py", tmp_path / "fused.py")
    (tmp_path / "hog.py").write_text(
        "import torch\nfrom fused import CausalSelfAttention\n\n"
        "class Attn(CausalSelfAttention):\n    def forward(self, x):\n"
        "        self.junk = torch.ones(2**27)  # 512 MiB\n        return super().forward(x)\n")
    from check_attention.grading.grade import grade
    rows = grade(str(tmp_path), ("Attn", "CausalSelfAttention"), Options(memory=1e-10, workers=1))
    hog = next(r for r in rows if r.student == "hog.py")
    assert hog.report.outcome == "ERROR" and "memory=" in hog.diagnosis, hog.diagnosis
