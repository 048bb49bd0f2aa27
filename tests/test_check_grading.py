"""The attention checker over a folder of submissions, and as a call from a course's own tests
(check_attention/grading/grade.py, issues 32 and 62): every submission is a row, a broken one
included, with its score and diagnosis; a course's export (a folder per student, Gradescope's
with its metadata) is one row per student; the table is Markdown, CSV or JSON; `check(...)`
returns a report a test asserts on, as docs/check_attention.md shows.

The fast tests build tables from reports made here and parse command lines; the slow ones run
the sandbox (a host process importing torch: seconds each on 2 cores).
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from safeio.cli import UserError
from helpers import REPO_ROOT, SCRIPT_ENV, one_error_line
from check_attention import resolve
from check_attention.__main__ import parse_args
from check_attention.grading.grade import (Graded, csv_text, grade, json_text, markdown,
                                           write_table)
from check_attention.grading.submission import locate, submissions
from check_attention.grading.weights import DEFAULT_WEIGHTS
from check_attention.options import Options
from check_attention.report import Report

LAYERS = REPO_ROOT / "tests" / "attention_layers"


def report(target: str, statuses: dict, diagnosis=(), error=None) -> Report:
    r = Report(target, error=error)
    for key, status in statuses.items():
        r.set(key, status, f"why {key}")
    r.diagnosis = list(diagnosis)
    return r


ROWS = [Graded("a.py", "Attn", report("a.py:Attn", {"scale": "PASS", "w_o": "N/A"}),
               "a.py", seconds=1.0),
        Graded("b.py", "Attn", report("b.py:Attn", {"scale": "FAIL", "w_o": "PASS"},
                                      ["reproduced as attention=no_scale | x"]), "b.py", seconds=1.0),
        Graded("c.py", "Attn", report("c.py:Attn", {}, error="importing c.py failed: SyntaxError"),
               seconds=0.1)]
W = DEFAULT_WEIGHTS


# ----------------------------------------------------------------------------- the table


def test_the_table_has_a_row_per_submission_with_its_score_each_item_and_the_diagnosis():
    lines = markdown(ROWS, W).splitlines()
    assert lines[0] == ("| student | file | name | score (of 16) | verdict | scale | w_o | "
                        "diagnosis |")
    # a check that does not apply (N/A) earns its points, one that is not reported too (N/A)
    assert lines[2] == "| a.py | a.py | Attn | 16.00 | PASS | PASS | N/A |  |"
    assert lines[3] == ("| b.py | b.py | Attn | 15.00 | FAIL | FAIL | PASS | reproduced as "
                        "attention=no_scale \\| x |")  # a | in a cell is escaped
    assert lines[4] == ("| c.py |  | Attn | 0.00 | ERROR |  |  | importing c.py failed: "
                        "SyntaxError |")
    assert "3 submissions: 1 ERROR, 1 FAIL, 1 PASS" in lines


def test_csv_and_json_say_the_same():
    rows = list(csv.reader(io.StringIO(csv_text(ROWS, W))))
    assert rows[0] == ["student", "file", "name", "score (of 16)", "verdict", "scale", "w_o",
                       "diagnosis"]
    assert rows[2] == ["b.py", "b.py", "Attn", "15.00", "FAIL", "FAIL", "PASS",
                       "reproduced as attention=no_scale | x"]
    data = json.loads(json_text(ROWS, "subs", ("Attn",), Options(), W))
    assert [r["verdict"] for r in data["rows"]] == ["PASS", "FAIL", "ERROR"]
    assert [(r["score"], r["of"]) for r in data["rows"]] == [(16, 16), (15, 16), (0, 16)]
    assert data["rows"][1]["items"]["scale"] == {"status": "FAIL", "detail": "why scale"}
    assert data["rows"][2]["error"] == "importing c.py failed: SyntaxError"


def test_the_diagnosis_falls_back_to_the_first_failing_item():
    row = Graded("d.py", "A", report("d.py:A", {"scale": "PASS", "causal": "FAIL"}))
    assert row.diagnosis == "causal: why causal"


@pytest.mark.parametrize("suffix, first", [(".md", "| student |"), (".csv", "student,file"),
                                           (".json", "{")])
def test_out_is_written_in_the_format_its_extension_names(tmp_path, suffix, first):
    out = tmp_path / "deep" / f"grades{suffix}"
    write_table(ROWS, str(out), "subs", ("Attn",), Options())
    assert out.read_text().startswith(first)


def test_out_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "grades.csv"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match="FIFO"):
        write_table(ROWS, str(fifo), "subs", ("Attn",), Options())


# ----------------------------------------------------------------------------- names and files


def test_each_file_is_checked_on_the_first_name_it_defines(tmp_path):
    names = ("Layer", "CausalSelfAttention", "MultiHeadSelfAttention")

    def defined_name(path):
        return locate(path, names, tmp_path).name
    assert defined_name(LAYERS / "fused.py") == "CausalSelfAttention"
    assert defined_name(LAYERS / "escape_root.py") == "Layer"  # bound by an import
    assert defined_name(LAYERS / "separate.py") == "MultiHeadSelfAttention"
    (tmp_path / "guarded.py").write_text("try:\n    from x import MultiHeadSelfAttention\n"
                                         "except ImportError:\n    Layer = None\n")
    assert defined_name(tmp_path / "guarded.py") == "Layer"
    # unparseable, or none of them: the first name, and the child says why
    assert defined_name(LAYERS / "broken_syntax.py") == "Layer"
    assert defined_name(LAYERS / "functions.py") == "Layer"


def test_a_file_without_a_name_is_checked_on_the_one_it_defines(tmp_path):
    """Issue 60 (6): FILE.py without :NAME. The one nn.Module class (a config class beside it
    is not one), else the one class or function; several are listed in the error line."""
    (tmp_path / "mine.py").write_text("import torch.nn as nn\n\nclass Config:\n    n = 4\n\n"
                                      "class Attn(nn.Module):\n    pass\n\n"
                                      "class Wrapped(Attn):\n    pass\n")
    assert parse_args([str(tmp_path / "mine.py")])[:2] == (str(tmp_path / "mine.py"), None)
    with pytest.raises(Exception, match="mine.py defines Attn, Wrapped: give one as mine.py:NAME"):
        locate(tmp_path / "mine.py", (), tmp_path)
    (tmp_path / "mine.py").write_text("class Config:\n    pass\n\nclass Attn(nn.Module):\n"
                                      "    pass\n\ndef _helper():\n    pass\n")
    assert locate(tmp_path / "mine.py", (), tmp_path).name == "Attn"
    assert locate(REPO_ROOT / "lessons/solutions/01_equation.py", (), tmp_path).name == "attention"


def test_a_course_export_is_a_row_per_student_named_by_folder_or_metadata(tmp_path):
    """Issue 62 (3): the layouts a platform's "download all submissions" gives."""
    for who in ("alice", "bob"):
        (tmp_path / "moodle" / who / "src").mkdir(parents=True)
        (tmp_path / "moodle" / who / "src" / "attention.py").write_text("x = 1\n")
    assert submissions(tmp_path / "moodle") == ([("alice", tmp_path / "moodle" / "alice"),
                                                 ("bob", tmp_path / "moodle" / "bob")], [])
    gs = tmp_path / "gradescope"
    for sub in ("submission_101", "submission_102", "submission_103"):
        (gs / sub).mkdir(parents=True)
    (gs / "submission_metadata.yml").write_text(
        "submission_101:\n  :submitters:\n  - :name: Alice Smith\n    :sid: '1'\n"
        "  :created_at: 2026-12-01 10:00:00.000000000 -08:00\n"
        "submission_102:\n  :submitters:\n  - :name: Bob Jones\n  - :name: Carol Wu\n")
    assert [who for who, _ in submissions(gs)[0]] == [
        "Alice Smith (submission_101)", "Bob Jones, Carol Wu (submission_102)", "submission_103"]
    (gs / "submission_metadata.yml").write_text("- [unexpected\n")
    found, notes = submissions(gs)
    assert [who for who, _ in found] == ["submission_101", "submission_102", "submission_103"]
    assert "students are named by their folders" in notes[0]
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "bob.py").write_text("x = 1\n")
    (tmp_path / "flat" / "alice.ipynb").write_text("{}")
    (tmp_path / "flat" / "data").mkdir()  # a folder beside the files is not a student
    assert [who for who, _ in submissions(tmp_path / "flat")[0]] == ["alice.ipynb", "bob.py"]


def test_an_object_is_found_again_by_its_file_and_name():
    from check_attention.checks import sandbox_for
    assert resolve("tests/attention_layers/fused.py:NoScale") == (
        "tests/attention_layers/fused.py", "NoScale", None)
    file, name, fingerprint = resolve(sandbox_for)
    assert (Path(file).resolve(), name) == (REPO_ROOT / "check_attention/checks.py",
                                            "sandbox_for")
    assert len(fingerprint) == 64  # what it is made of: runner.fingerprint

    def local():
        pass
    with pytest.raises(ValueError, match="not bound at the top level"):
        resolve(local)
    with pytest.raises(TypeError, match="pass its class, or a factory"):
        resolve(42)
    with pytest.raises(ValueError, match="path/file.py:Name"):
        resolve("fused.py")


def test_the_command_line_for_a_folder():
    folder, names, opts = parse_args(["tests/attention_layers/", "Layer", "NoScale", "workers=3",
                                      "out=x.csv"])
    assert (folder, names, opts.workers, opts.out) == ("tests/attention_layers/",
                                                       ("Layer", "NoScale"), 3, "x.csv")


@pytest.mark.parametrize("args, words", [
    (["tests/attention_layers"], "give the NAME to check in each submission"),
    (["tests/attention_layers", "fused.py:X"], "the NAMEs to check in its submissions, got "
                                               "'fused.py:X'"),
    (["docs/grading.md", "X"], "one FILE.py:NAME at a time"),
    (["tests/attention_layers/fused.py:X", "weights=w.txt"], "weights= is for grading a folder"),
    (["tests/attention_layers", "X", "out=x.txt"], "out must name a .md, .csv, .json file"),
    (["tests/attention_layers", "X", "workers=0"], "workers must be a whole number from 1"),
    (["tests/attention_layers", "X", "memory=0"], "memory must be a number of GiB above 0"),
    (["tests/attention_layers/fused.py:X", "out=x.csv"], "out= is for grading a folder"),
    (["tests/attention_layers/fused.py:X", "seq_len=x"], "seq_len must be an integer"),
])
def test_bad_grading_command_lines_are_refused(args, words):
    with pytest.raises(UserError, match=re.escape(words)):
        parse_args(args)


def test_check_refuses_an_unknown_option():
    from check_attention import check
    with pytest.raises(UserError, match="unknown option 'heads'"):
        check("tests/attention_layers/fused.py:NoScale", heads=2)


# ----------------------------------------------------------------------------- the sandbox (slow)


@pytest.mark.slow
def test_grading_the_test_layers_gives_a_row_per_file_broken_ones_included(tmp_path):
    out = tmp_path / "grades.csv"
    result = subprocess.run(
        [sys.executable, "-m", "check_attention", "tests/attention_layers/", "Layer",
         "Unscaled", "NoOutProj", "fill_zero", "Torch", "ComplexOutput", f"out={out}"],
        cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1, result.stderr  # some fail
    files = sorted(p.name for p in LAYERS.glob("*.py"))
    rows = {r["student"]: r for r in csv.DictReader(out.open())}
    assert sorted(rows) == files
    assert [line.split(" | ")[0].lstrip("| ") for line in result.stdout.splitlines()[2:]
            if line.startswith("| ")] == files
    assert rows["broken_syntax.py"]["verdict"] == "ERROR"
    assert "SyntaxError: expected ':' (broken_syntax.py, line 10)" in \
        rows["broken_syntax.py"]["diagnosis"]
    assert rows["outputs.py"]["verdict"] == "ERROR"
    assert "complex tensor" in rows["outputs.py"]["diagnosis"]
    assert (rows["hostile.py"]["name"], rows["hostile.py"]["scale"]) == ("Unscaled", "FAIL")
    assert (rows["fused.py"]["verdict"], rows["fused.py"]["w_o"]) == ("FAIL", "FAIL")
    assert rows["escape_tty.py"]["verdict"] == "PASS" and rows["odd.py"]["verdict"] == "PASS"
    # and an existing table is kept unless told
    again = subprocess.run([sys.executable, "-m", "check_attention",
                            "tests/attention_layers/", "Layer", f"out={out}"], cwd=REPO_ROOT,
                           env=SCRIPT_ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "overwrite=true" in one_error_line(again)


@pytest.mark.slow
def test_grading_never_stops_at_a_broken_file(tmp_path):
    """A hang, a crash at import, a process that ends itself, a name it lacks, memory without
    bound: each a row saying so, and the good file after them still checked."""
    shutil.copy(LAYERS / "fused.py", tmp_path / "z_good.py")
    (tmp_path / "crash.py").write_text("raise RuntimeError('no GPU here')\n")
    layer = ("import os\nimport torch.nn as nn\n\nclass Attn(nn.Module):\n"
             "    def __init__(self, d_model, n_head):\n        super().__init__()\n"
             "        self.proj = nn.Linear(d_model, d_model)\n\n    def forward(self, x):\n")
    (tmp_path / "hang.py").write_text(layer + "        while True:\n            pass\n")
    (tmp_path / "quits.py").write_text(layer + "        os._exit(0)\n")
    (tmp_path / "other.py").write_text("def something_else():\n    pass\n")
    (tmp_path / "hog.py").write_text(
        "import torch\nfrom fused import CausalSelfAttention\n\n"
        "class Attn(CausalSelfAttention):\n    def forward(self, x):\n"
        "        self.junk = torch.ones(2**31)  # 8 GiB\n        return super().forward(x)\n")
    shutil.copy(LAYERS / "fused.py", tmp_path / "fused.py")
    opts = Options(timeout=5.0, memory=1.0, workers=1)
    rows = {r.student: r for r in grade(str(tmp_path), ("Attn", "CausalSelfAttention"), opts)}
    assert sorted(rows) == sorted(p.name for p in tmp_path.glob("*.py"))
    words = {"crash.py": "RuntimeError: no GPU here (crash.py, line 1)",
             "hang.py": "took more than 5 s (timeout=) and was stopped",
             "quits.py": "ended its process",
             "other.py": "has no 'Attn' (it defines something_else)",
             "hog.py": "can't allocate memory"}
    for file, expected in words.items():
        assert rows[file].report.outcome == "ERROR" and expected in rows[file].diagnosis, file
    assert "(the layer's process may use 1 GiB: memory=)" in rows["hog.py"].diagnosis
    assert rows["z_good.py"].report.passed and rows["z_good.py"].name == "CausalSelfAttention"


def course_example() -> str:
    """The pytest example of docs/check_attention.md, as a reader copies it."""
    text = (REPO_ROOT / "docs" / "check_attention.md").read_text()
    section = text.split("## From a course's tests", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_docs_pytest_example_is_five_lines():
    assert len([line for line in course_example().splitlines() if line.strip()]) == 5


@pytest.mark.slow
def test_the_docs_pytest_example_runs(tmp_path):
    """The example as a course's test file beside the student's my_attention.py: it passes on a
    correct layer, and on a wrong one fails showing the checker's whole report."""
    (tmp_path / "test_attention.py").write_text(course_example())
    shutil.copy(LAYERS / "fused.py", tmp_path / "my_attention.py")
    env = {**SCRIPT_ENV, "PYTHONPATH": f"{REPO_ROOT}:{tmp_path}"}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
            str(tmp_path), str(tmp_path / "test_attention.py")]
    ok = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "my_attention.py").write_text(
        (LAYERS / "fused.py").read_text() + "\n\nCausalSelfAttention = ScaleDModel\n")
    wrong = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert wrong.returncode == 1
    assert "FAIL  The scaling divisor is the per-head d_k" in wrong.stdout
    assert "verdict: FAIL (2 of 13 checks fail)" in wrong.stdout


@pytest.mark.slow
def test_check_takes_an_object_or_a_path_and_reports_an_unusable_one():
    from check_attention import check
    sys.path.insert(0, str(LAYERS))
    try:
        from separate import ScaleDModel  # only defines classes: safe to import here
        got = check(ScaleDModel)
    finally:
        sys.path.remove(str(LAYERS))
        sys.modules.pop("separate", None)
    assert not got.passed and got.items["scale"].status == "FAIL"
    assert got.target == f"{LAYERS / 'separate.py'}:ScaleDModel"
    assert "FAIL  The scaling divisor" in str(got) and got.text == str(got)
    good = check("tests/attention_layers/per_head.py:MultiHeadAttention", seq_len=6)
    assert good.passed and good.exit_code == 0
    broken = check("tests/attention_layers/odd.py:ReturnsDict")
    assert not broken.passed and "forward returned a dict" in broken.error
    assert broken.text.splitlines()[1].startswith("error: ")
