"""Grading for a course platform (check_attention/grading/: platforms.py, submission.py,
weights.py; issues 54 and 62): Gradescope's and PrairieLearn's results.json and JUnit XML, validated against schemas written
from the platforms' published specs; points and visibility per check; N/A explained; submissions
as folders with subfolders, .py files and notebooks; a results file whatever happens; the run
again as `nobody` when the grader is root.

The specs, as read for these schemas:
  - Gradescope: gradescope/autograder_samples docs/specs.md at commit
    00f6aa02e2bb1083bd8788c5a1d306fea721e833
    ("Autograder Specifications", Output format), plus each test's `status` (passed/failed) that
    Gradescope's later spec adds (../shared/reviews/field-notes-5.md, section 3a);
  - PrairieLearn: PrairieLearn/PrairieLearn docs/externalGrading.md at commit
    06a6d5902f182e78b607eacd0819be493759b9d0
    ("Grading results": score in [0, 1], gradable, format_errors, tests[], 1 MB).

The fast tests build results from reports made here and read submissions' files; the slow ones
(tests/test_grading_platforms.py) run the checker in each platform's layout.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest

from safeio.cli import UserError
from helpers import REPO_ROOT
from check_attention.__main__ import parse_args
from check_attention.checklist import ITEM_WORDS
from check_attention.grading import platforms
from check_attention.grading.grade import Graded
from check_attention.grading.platforms import capped, gradescope, junit, prairielearn
from check_attention.grading.submission import NotGradable, locate
from check_attention.grading.weights import DEFAULT_WEIGHTS, Weight, parse_weights
from check_attention.options import Options
from check_attention.report import Report

VISIBILITY = {"enum": ["hidden", "after_due_date", "after_published", "visible"]}
GRADESCOPE_SCHEMA = {  # docs/specs.md, "Output format"
    "type": "object", "additionalProperties": False,
    "properties": {
        "score": {"type": "number"}, "execution_time": {"type": "number"},
        "output": {"type": "string"}, "visibility": VISIBILITY, "stdout_visibility": VISIBILITY,
        "extra_data": {"type": "object"},
        "tests": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"score": {"type": "number"}, "max_score": {"type": "number"},
                           "status": {"enum": ["passed", "failed"]}, "name": {"type": "string"},
                           "number": {"type": "string"}, "output": {"type": "string"},
                           "tags": {"type": "array", "items": {"type": "string"}},
                           "visibility": VISIBILITY, "extra_data": {"type": "object"}}}},
        "leaderboard": {"type": "array"}},
    "anyOf": [{"required": ["score"]}, {"required": ["tests"]}]}
PL_TEST = {"type": "object", "additionalProperties": False,
           "properties": {"name": {"type": "string"}, "description": {"type": "string"},
                          "points": {"type": "number"}, "max_points": {"type": "number"},
                          "message": {"type": "string"}, "output": {"type": "string"},
                          "images": {"type": "array"}}}
PRAIRIELEARN_SCHEMA = {  # docs/externalGrading.md, "Grading results"
    "type": "object", "additionalProperties": False,
    "properties": {
        "gradable": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 1},
        "message": {"type": "string"}, "output": {"type": "string"}, "images": {"type": "array"},
        "format_errors": {"anyOf": [{"type": "string"},
                                    {"type": "array", "items": {"type": "string"}}]},
        "tests": {"type": "array", "items": PL_TEST}},
    "if": {"properties": {"gradable": {"const": False}}, "required": ["gradable"]},
    "then": {}, "else": {"required": ["score"]}}


def report(statuses: dict, kind="module", diagnosis=()) -> Report:
    r = Report("attn.py:Attn", kind=kind)
    for key, status in statuses.items():
        r.set(key, status, f"why {key}")
    r.diagnosis = list(diagnosis)
    return r


ALL_PASS = {k: "PASS" for k in ITEM_WORDS if k != "unequal"}
NO_SCALE = dict(ALL_PASS, scale="FAIL", equation="FAIL")
FUNCTION = dict(ALL_PASS, w_o="N/A", unequal="PASS")


def graded(statuses=None, reason=None, **kw) -> Graded:
    r = Report("attn.py:Attn", error=reason) if statuses is None else report(statuses, **{
        k: kw.pop(k) for k in ("kind", "diagnosis") if k in kw})
    return Graded("attn.py", "Attn", r, "attn.py", seed=7, **kw)


# ----------------------------------------------------------------------------- the formats


@pytest.mark.parametrize("case", [ALL_PASS, NO_SCALE, FUNCTION, None])
def test_every_result_matches_the_platforms_schemas(case):
    g = graded(case, reason=None if case else "attn.py has no 'Attn'", gradable=case is not None)
    gs, pl = gradescope(g, DEFAULT_WEIGHTS), prairielearn(g, DEFAULT_WEIGHTS)
    jsonschema.validate(gs, GRADESCOPE_SCHEMA)
    jsonschema.validate(pl, PRAIRIELEARN_SCHEMA)
    for results in (gs, pl):  # the seed, in every output
        assert "seed=7" in json.dumps(results)
    suite = ET.fromstring(junit(g, DEFAULT_WEIGHTS)).find("testsuite")
    assert suite.find("properties/property[@name='seed']").get("value") == "7"


def test_the_schemas_refuse_what_the_platforms_would():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"score": 1.5}, PRAIRIELEARN_SCHEMA)  # PrairieLearn: [0, 1]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"message": "x"}, PRAIRIELEARN_SCHEMA)  # gradable needs a score
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"tests": [{"visibility": "later"}]}, GRADESCOPE_SCHEMA)


def test_a_correct_layer_gets_every_point():
    gs = gradescope(graded(ALL_PASS), DEFAULT_WEIGHTS)
    full = sum(w.points for w in DEFAULT_WEIGHTS.values())
    assert gs["score"] == full
    assert all(t["status"] == "passed" for t in gs["tests"])
    assert prairielearn(graded(ALL_PASS), DEFAULT_WEIGHTS)["score"] == 1.0


def test_a_layer_without_the_scale_loses_the_scale_and_the_equation():
    g = graded(NO_SCALE, diagnosis=["reproduced as attention=no_scale"])
    gs, pl = gradescope(g, DEFAULT_WEIGHTS), prairielearn(g, DEFAULT_WEIGHTS)
    failed = {t["tags"][0]: t["score"] for t in gs["tests"] if t["status"] == "failed"}
    assert failed == {"scale": 0.0, "equation": 0.0}
    lost = DEFAULT_WEIGHTS["scale"].points + DEFAULT_WEIGHTS["equation"].points
    full = sum(w.points for w in DEFAULT_WEIGHTS.values())
    assert gs["score"] == full - lost == sum(t["score"] for t in gs["tests"])  # no rescaling
    assert sum(t["max_score"] for t in gs["tests"]) == full
    assert pl["score"] == pytest.approx((full - lost) / full)
    assert "attention=no_scale" in gs["output"] and "attention=no_scale" in pl["message"]


def test_a_check_that_does_not_apply_leaves_the_total_and_says_why():
    """Issue 62 (3): a correct layer shows full marks over the same full total (no "16 over
    tests worth 15"), and a function's check of W_O says why it does not apply."""
    g = graded(FUNCTION, kind="function")
    gs = gradescope(g, DEFAULT_WEIGHTS)
    w_o = next(t for t in gs["tests"] if t["tags"] == ["w_o"])
    assert (w_o["score"], w_o["max_score"]) == (1.0, 1.0)
    assert w_o["output"] == "Not applicable to this submission, so counted as passed: why w_o"
    assert "Not applicable (w_o), counted as passed: why w_o" in gs["output"]
    full = sum(w.points for w in DEFAULT_WEIGHTS.values())
    assert gs["score"] == full == sum(t["max_score"] for t in gs["tests"])
    assert w_o["name"] == "W_O is applied after concatenating heads, not skipped"
    equation = next(t for t in gs["tests"] if t["tags"] == ["equation"])
    assert equation["name"] == "Matches the equation: softmax(QK^T / sqrt(d_k) + M) V"
    assert prairielearn(g, DEFAULT_WEIGHTS)["score"] == 1.0
    # a check the checker never ran on this kind of layer is N/A too, not silently dropped
    module = gradescope(graded(ALL_PASS), DEFAULT_WEIGHTS)
    unequal = next(t for t in module["tests"] if t["tags"] == ["unequal"])
    assert "does not run this check on a module" in unequal["output"]


def test_a_check_that_could_not_be_judged_earns_nothing():
    g = graded(dict(ALL_PASS, backward="SKIP"))
    test = next(t for t in gradescope(g, DEFAULT_WEIGHTS)["tests"] if t["tags"] == ["backward"])
    assert (test["score"], test["status"]) == (0.0, "failed")
    assert test["output"].startswith("Could not be judged, so no points: why backward")


def test_visibility_goes_to_gradescope_and_withholds_details_on_prairielearn():
    weights = dict(DEFAULT_WEIGHTS, scale=Weight(3, "hidden"))
    g = graded(NO_SCALE)
    scale = next(t for t in gradescope(g, weights)["tests"] if t["tags"] == ["scale"])
    assert (scale["visibility"], scale["max_score"]) == ("hidden", 3)
    pl = next(t for t in prairielearn(g, weights)["tests"] if t["description"] == "scale")
    assert pl["max_points"] == 3 and pl["message"] == "Details are shown after the due date."


def test_a_submission_that_cannot_be_imported():
    g = graded(reason="attn.py defines `Attn` but does not parse: line 3", gradable=False)
    gs, pl = gradescope(g, DEFAULT_WEIGHTS), prairielearn(g, DEFAULT_WEIGHTS)
    assert gs["score"] == 0.0 and "does not parse: line 3" in gs["output"]
    assert gs["tests"][0]["output"] == g.report.error
    assert pl["gradable"] is False and pl["format_errors"] == [g.report.error]
    # a layer that imports and then crashes is graded: 0, an attempt used
    crashed = prairielearn(graded(reason="forward raised", gradable=True), DEFAULT_WEIGHTS)
    assert (crashed["gradable"], crashed["score"]) == (True, 0.0)


def test_the_results_stay_below_one_megabyte():
    g = graded(ALL_PASS)
    payload = gradescope(g, DEFAULT_WEIGHTS)
    payload["output"] = "x" * 3_000_000
    for test in payload["tests"]:
        test["output"] = "y" * 300_000
    text = capped(payload)
    assert len(text.encode()) <= platforms.MAX_RESULTS_BYTES < 1_000_000
    jsonschema.validate(json.loads(text), GRADESCOPE_SCHEMA)
    assert "[cut: the results file stays below 1 MB]" in text


# ----------------------------------------------------------------------------- the weights


def test_the_docs_show_the_default_table():
    text = (REPO_ROOT / "docs" / "grading.md").read_text()
    rows = {k: (float(p), v) for k, p, v in
            re.findall(r"^\| `(\w+)` \| ([\d.]+) \| `(\w+)` \|", text, re.MULTILINE)}
    assert rows == {k: (float(w.points), w.visibility) for k, w in DEFAULT_WEIGHTS.items()}


def test_a_weights_file_changes_the_checks_it_names():
    table = parse_weights("# ours\nequation = 4\nbackward = 2 hidden  # later\nunequal = 0\n")
    assert table["equation"] == Weight(4.0, "visible")
    assert table["backward"] == Weight(2.0, "hidden")
    assert table["scale"] == DEFAULT_WEIGHTS["scale"]
    tests = gradescope(graded(ALL_PASS), table)["tests"]
    assert "unequal" not in {t["tags"][0] for t in tests}  # 0 points: left out


@pytest.mark.parametrize("text, words", [
    ("scales = 1", "line 1: no check 'scales'"),
    ("scale 1", "line 1: write `check = points [visibility]`"),
    ("\nscale = one", "line 2: points must be a number from 0 to 1,000, got 'one'"),
    ("scale = -1", "points must be a number from 0 to 1,000"),
    ("scale = 1 later", "visibility must be one of visible, after_due_date"),
    ("\n".join(f"{k} = 0" for k in DEFAULT_WEIGHTS), "every check has 0 points"),
])
def test_a_wrong_weights_file_is_refused_with_its_line(text, words):
    with pytest.raises(UserError, match=re.escape(words)):
        parse_weights(text)


def test_a_weights_file_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Round six's P26: Windows' Notepad starts the file with U+FEFF, refused as `no check
    '\\ufeffequation'`, words that send an instructor looking for a check's name."""
    from check_attention.grading.weights import load_weights
    (tmp_path / "w.txt").write_bytes(b"\xef\xbb\xbfequation = 4\n")
    assert load_weights(tmp_path / "w.txt")["equation"] == Weight(4.0, "visible")


# ----------------------------------------------------------------------------- submissions


LAYER = "import torch\n\nclass Attn(torch.nn.Module):\n    pass\n"


def notebook(path: Path, *cells: str) -> Path:
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": c} for c in cells]}))
    return path


def test_the_name_is_found_in_a_subfolder(tmp_path):
    (tmp_path / "main.py").write_text("def train():\n    pass\n")
    (tmp_path / "src" / "model").mkdir(parents=True)
    (tmp_path / "src" / "model" / "attention.py").write_text(LAYER)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "Attn.py").write_text(LAYER)
    found = locate(tmp_path, ("Attn",), tmp_path)
    assert (found.shown, found.name) == (os.path.join("src", "model", "attention.py"), "Attn")


def test_a_missing_name_is_reported_with_the_names_found(tmp_path):
    (tmp_path / "a.py").write_text("class Attention:\n    pass\ndef helper():\n    pass\n")
    notebook(tmp_path / "lab.ipynb", "def MyAttention():\n    pass\n")
    with pytest.raises(NotGradable, match=re.escape(
            "no file of the submission defines `Attn` or `Head` (a.py defines Attention, "
            "helper; lab.ipynb defines MyAttention)")):
        locate(tmp_path, ("Attn", "Head"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotGradable, match="holds no .py or .ipynb file"):
        locate(tmp_path / "empty", ("Attn",), tmp_path)
    with pytest.raises(NotGradable, match="there is no submission at"):
        locate(tmp_path / "gone", ("Attn",), tmp_path)


def test_a_syntax_error_in_the_file_that_defines_the_name_is_the_reason(tmp_path):
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "attn.py").write_text("class Attn:\n    def forward(self)\n        pass\n")
    with pytest.raises(NotGradable, match=re.escape(
            "attn.py defines `Attn` but does not parse: line 2: SyntaxError: expected ':'")):
        locate(tmp_path, ("Attn",), tmp_path)


def test_a_notebook_is_read_through_the_lessons_reader_its_magics_never_run(tmp_path):
    nb = notebook(tmp_path / "Lab 3.ipynb", "%matplotlib inline\n!pip install torch\n" + LAYER,
                  "%%bash\nrm -rf /\n", "files = !ls\nAttn()\nwhile True:\n    pass\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    found = locate(nb, ("Attn",), staging)
    source = found.file.read_text()
    assert found.file.parent == staging and found.shown == "Lab 3.ipynb"
    assert "class Attn" in source
    assert "rm -rf" not in source and "while True" not in source and "pip" not in source
    assert any("%%bash" in n for n in found.notes)
    line = source.splitlines().index("class Attn(torch.nn.Module):") + 1
    err = f"boom ({found.file.name}, line {line})"
    assert found.where(err) == "boom (Lab 3.ipynb, code cell 1, line 5)"


def test_a_notebook_cell_that_does_not_parse_is_the_reason(tmp_path):
    nb = notebook(tmp_path / "lab.ipynb", "class Attn:\n    def f(self)\n        pass\n")
    with pytest.raises(NotGradable, match="lab.ipynb defines `Attn` but does not parse: code "
                                          "cell 1, line 2"):
        locate(nb, ("Attn",), tmp_path)


def test_a_link_out_of_the_submission_is_not_followed(tmp_path):
    outside = tmp_path / "solution.py"
    outside.write_text(LAYER)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "attn.py").symlink_to(outside)
    with pytest.raises(NotGradable, match="holds no .py or .ipynb file"):
        locate(tmp_path / "sub", ("Attn",), tmp_path)


# ----------------------------------------------------------------------------- the command


def test_the_command_line_for_a_platform():
    sub, names, opts = parse_args(["sub/", "Attn", "Head", "format=gradescope",
                                   "weights=w.txt", "out=r.json"])
    assert (sub, names, opts.format, opts.weights, opts.out) == (
        "sub/", ("Attn", "Head"), "gradescope", "w.txt", "r.json")
    sub, names, opts = parse_args(["lab.ipynb:Attn", "format=junit"])
    assert (sub, names) == ("lab.ipynb", ("Attn",))


@pytest.mark.parametrize("args, words", [
    (["sub/", "format=gradescope"], "give the NAME to look for in sub/"),
    (["sub/", "Attn", "format=moodle"], "format must be one of gradescope, prairielearn, junit"),
    (["sub/", "Attn", "format=gradescope", "out=r.csv"], "out must name a .json file with "
                                                         "format=gradescope"),
    (["sub/", "Attn", "format=junit", "out=r.json"], "out must name a .xml file"),
    (["sub.py", "weights=w.txt"], "sub.py: no such file"),
    (["sub/", "Attn", "format=gradescope", "workers=2"], "workers= is for grading a folder"),
    (["nope.ipynb:Attn"], "nope.ipynb: no such file"),
])
def test_bad_platform_command_lines_are_refused(args, words):
    with pytest.raises(UserError, match=re.escape(words)):
        parse_args(args)


def test_the_results_say_the_grader_did_not_finish_before_it_starts(tmp_path, monkeypatch):
    out = tmp_path / "results" / "results.json"
    seen = []

    def judge(*_):
        seen.append(json.loads(out.read_text()))
        raise KeyboardInterrupt  # killed: whatever is on disk is what the platform reads
    monkeypatch.setattr(platforms, "judge", judge)
    monkeypatch.setenv(platforms.AS_USER_ENV, "1")
    opts = Options(format="prairielearn", out=str(out))
    with pytest.raises(KeyboardInterrupt):
        platforms.run(str(tmp_path), ("Attn",), opts)
    assert seen[0]["gradable"] is False and "did not finish" in seen[0]["message"]
    assert "KeyboardInterrupt" in json.loads(out.read_text())["message"]


def test_format_keeps_an_existing_out_unless_told(tmp_path, monkeypatch):
    """Round six's P31: `format=gradescope out=notes.json` replaced the user's file without a
    word, where every other out= refuses an existing file unless overwrite=true."""
    out = tmp_path / "notes.json"
    out.write_text("mine\n")
    monkeypatch.setenv(platforms.AS_USER_ENV, "1")
    monkeypatch.setattr(platforms, "judge", lambda *_: Graded(
        "s", "Attn", Report("s", error="none"), gradable=False))
    with pytest.raises(UserError, match="notes.json exists; add overwrite=true"):
        platforms.run(str(tmp_path), ("Attn",), Options(format="gradescope", out=str(out)))
    assert out.read_text() == "mine\n"
    assert platforms.run(str(tmp_path), ("Attn",),
                         Options(format="gradescope", out=str(out), overwrite=True)) == 1
    assert json.loads(out.read_text())["score"] == 0


def test_a_grader_bug_is_a_result_too(tmp_path, monkeypatch):
    def broken(*_):
        raise RuntimeError("a bug of ours")
    monkeypatch.setattr("check_attention.grading.grade.locate", broken)
    g = platforms.judge(tmp_path, ("Attn",), Options())
    assert g.report.error == "the grader failed: RuntimeError: a bug of ours"
    jsonschema.validate(gradescope(g, DEFAULT_WEIGHTS), GRADESCOPE_SCHEMA)


def test_a_course_export_given_to_format_is_refused_with_the_command_that_grades_it(
        tmp_path, monkeypatch):
    """Issue 62 (3): several students' folders are not one submission; nothing is graded."""
    monkeypatch.setenv(platforms.AS_USER_ENV, "1")
    for who in ("alice", "bob", "carol"):
        (tmp_path / "export" / who).mkdir(parents=True)
        (tmp_path / "export" / who / "attn.py").write_text("class Attn:\n    pass\n")
    out = tmp_path / "r.json"
    with pytest.raises(UserError, match=r"holds 3 students' submissions \(alice, bob, carol\); "
                                        r"format= grades one: .* python -m check_attention "
                                        r".*export Attn out=grades.csv"):
        platforms.run(str(tmp_path / "export"), ("Attn",),
                      Options(format="gradescope", out=str(out)))
    assert json.loads(out.read_text())["score"] == 0
    # one student's folder with a helper subfolder is one submission
    (tmp_path / "export" / "alice" / "lib").mkdir()
    assert platforms.several_students(tmp_path / "export" / "alice", ("Attn",)) == []


def test_scores_are_sums_of_points_rounded_and_students_read_the_cost_plainly(monkeypatch):
    """Issue 62 (3): no 10.2857-like fraction; the studies' statistics stay in the table."""
    from check_attention import costs
    line = ("measured cost of attention=no_scale: causal validation loss +0.2180 nats per "
            "character, SE 0.0100 (22 SE), 8 paired seeds (the ablations study, regime scale)")
    monkeypatch.setattr(costs, "plain", lambda switch, table: f"Measured cost of {switch}.")
    g = graded(NO_SCALE, diagnosis=["reproduced as attention=no_scale", line])
    g.report.mistakes = ["no_scale"]
    earned, full = g.score(dict(DEFAULT_WEIGHTS, w_o=Weight(1 / 3)))
    assert (earned, round(full, 4)) == (12.33, 15.3333)  # 16 - 1 + 1/3, less scale and equation
    out = gradescope(g, DEFAULT_WEIGHTS)["output"]
    assert "reproduced as attention=no_scale" in out and "Measured cost of no_scale." in out
    assert "paired seeds" not in out and "SE" not in out
    assert line in g.diagnosis  # the instructor's table keeps it


def test_a_misconfigured_weights_file_still_leaves_a_result(tmp_path, monkeypatch):
    monkeypatch.setenv(platforms.AS_USER_ENV, "1")
    (tmp_path / "w.txt").write_text("scales = 1\n")
    out = tmp_path / "r.json"
    with pytest.raises(UserError, match="no check 'scales'"):
        platforms.run(str(tmp_path), ("Attn",),
                      Options(format="gradescope", out=str(out), weights=str(tmp_path / "w.txt")))
    results = json.loads(out.read_text())
    assert results["score"] == 0 and "the grader is misconfigured" in results["output"]


def test_the_default_place_is_the_platforms_and_only_in_its_layout():
    if Path("/autograder").is_dir() or Path("/grade").is_dir():
        pytest.skip("this machine has a platform's layout")
    with pytest.raises(UserError, match=re.escape("/autograder does not exist here (not the "
                                                  "platform's layout): give out=")):
        platforms.results_path(Options(format="gradescope"))
    assert platforms.PLACES == {"gradescope": Path("/autograder/results/results.json"),
                                "prairielearn": Path("/grade/results/results.json")}


# ----------------------------------------------------------------------------- not as root


FAKE_GRADER = """
import json, os, sys
out = next(a for a in sys.argv if a.startswith("out=")).partition("=")[2]
sub = sys.argv[1]
seen = {}
for path in ([os.path.join(d, n) for d, _, names in os.walk(sub) for n in names]
             if os.path.isdir(sub) else [sub]):
    try:
        seen[os.path.basename(path)] = open(path).read(200)
    except OSError as exc:
        seen[os.path.basename(path)] = type(exc).__name__
try:
    open("/root/.probe", "w")
    wrote_root = True
except OSError:
    wrote_root = False
json.dump({"score": 1.0, "output": json.dumps([os.getuid(), os.getgid(), os.getgroups(), sub,
                                                seen, wrote_root])}, open(out, "w"))
"""


NOBODY_PYTHON = "/usr/bin/python3"  # the system's, which nobody may run (ours lives under /root)


def nobody_can_run(python: str) -> bool:
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        return False
    import subprocess
    try:
        return subprocess.run([python, "-c", "0"], user="nobody", capture_output=True,
                              timeout=30).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="the grader drops root only when it is root")
def test_a_grader_run_as_root_runs_the_check_as_nobody_on_the_submissions_path():
    """The `nobody` run is handed the submission's path and reads it with its own permissions:
    a file only root may read stays unread (root copies nothing)."""
    python = "/usr/bin/python3"
    if not nobody_can_run(python):
        pytest.skip("no interpreter that nobody may run")
    shared = tempfile.TemporaryDirectory()  # pytest's own are root's alone
    os.chmod(shared.name, 0o755)
    fake = Path(shared.name) / "fake_grader.py"
    fake.write_text(FAKE_GRADER)
    fake.chmod(0o644)
    sub = Path(shared.name) / "submission"
    (sub / "src").mkdir(parents=True)
    (sub / "src" / "attn.py").write_text(LAYER)
    (sub / "src" / "root_only.py").write_text("SECRET = 1\n")
    os.chmod(sub / "src" / "root_only.py", 0o600)
    text, ok = platforms.as_unprivileged(str(sub), ("Attn",), Options(format="gradescope"),
                                         command=[python, str(fake)])
    uid, gid, groups, given, seen, wrote_root = json.loads(json.loads(text)["output"])
    nobody = pwd.getpwnam("nobody")
    assert (uid, gid, groups) == (nobody.pw_uid, nobody.pw_gid, [])
    assert given == str(sub) and seen == {"attn.py": LAYER[:200], "root_only.py": "PermissionError"}
    assert not wrote_root and ok
    # a run that writes nothing (killed, crashed) leaves the failure, not silence
    text, ok = platforms.as_unprivileged(str(sub), ("Attn",), Options(format="prairielearn"),
                                         command=[python, "-c", "import sys; sys.exit(3)"])
    results = json.loads(text)
    assert not ok and results["gradable"] is False
    assert "left no results (exit status 3)" in results["message"]
    shared.cleanup()


@pytest.fixture
def shared():
    """A folder `nobody` may enter (pytest's are root's alone), with FAKE_GRADER in it."""
    if os.geteuid() != 0 or not nobody_can_run(NOBODY_PYTHON):
        pytest.skip("needs root, and an interpreter that nobody may run")
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        (Path(folder) / "fake_grader.py").write_text(FAKE_GRADER)
        (Path(folder) / "fake_grader.py").chmod(0o644)
        yield Path(folder)


def test_root_never_reads_a_submission_that_links_to_a_root_only_file(shared):
    """Round six's P10 and P11: the submission is one file, a link to the instructor's root-only
    solution (or a file holding a token). Root once copied it, following the link, into the
    `nobody` run's folder; now nobody is handed the link and may not read what it points to."""
    (shared / "instructor").mkdir(mode=0o755)
    solution = shared / "instructor" / "solution.py"
    solution.write_text("R6SECRETTOKEN7f3a9c = 1\n" + LAYER)
    solution.chmod(0o600)
    (shared / "sub").mkdir(mode=0o755)
    (shared / "sub" / "attention.py").symlink_to(solution)
    text, ok = platforms.as_unprivileged(str(shared / "sub" / "attention.py"), ("Attn",),
                                         Options(format="gradescope"),
                                         command=[NOBODY_PYTHON, str(shared / "fake_grader.py")])
    assert "R6SECRETTOKEN7f3a9c" not in text
    assert json.loads(json.loads(text)["output"])[4] == {"attention.py": "PermissionError"}


@pytest.mark.parametrize("kind", ["fifo", "nested", "dev_zero", "missing"])
def test_root_hands_nobody_any_submission_as_it_is(shared, kind):
    """Round six's P07-P09, P36, P38: root copied the whole submission before anything, so a FIFO
    failed the grading, 1,200 nested folders raised RecursionError, a link to /dev/zero copied
    until the disk was full, a missing one was `the grader failed`. Now root only hands the path
    to the `nobody` run (whose reader has limits: python_files, check_regular)."""
    sub = shared / "sub"
    if kind == "fifo":
        sub.mkdir()
        os.mkfifo(sub / "data.pipe")
    elif kind == "nested":  # made, and removed, one level at a time (os.makedirs recurses)
        sub.mkdir()
        fd = os.open(sub, os.O_RDONLY)
        for _ in range(1200):
            os.mkdir("d", dir_fd=fd)
            fd, up = os.open("d", os.O_RDONLY, dir_fd=fd), fd
            os.close(up)
        os.close(fd)
    elif kind == "dev_zero":
        sub.mkdir()
        sub = sub / "attention.py"
        sub.symlink_to("/dev/zero")
    echo = ("import json, sys; out = [a for a in sys.argv if a.startswith('out=')][0][4:]; "
            "json.dump({'score': 1.0, 'output': sys.argv[1]}, open(out, 'w'))")
    text, ok = platforms.as_unprivileged(str(sub), ("Attn",), Options(format="gradescope"),
                                         command=[NOBODY_PYTHON, "-c", echo])
    assert ok and json.loads(text)["output"] == str(sub)
    subprocess.run(["rm", "-rf", str(shared / "sub")], check=True)


ROOT_GRADING = """
import sys
from safeio.cli import run_cli
from check_attention.grading import platforms
from check_attention.options import Options
sys.exit(run_cli(lambda: platforms.as_unprivileged(sys.argv[1], ("Attn",), Options(
    format="gradescope"), command=sys.argv[2:]) and 0))
"""
SLOW_NOBODY = """
import os, sys, tempfile, time
os.fork()  # a second process in its group, as the check's sandbox would be
made = tempfile.mkdtemp()  # in its TMPDIR, as the sandbox's directories are
open(os.environ["MARKS"], "a").write(f"{os.getpid()} {made}\\n")
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_signal_to_a_root_grading_ends_its_nobody_run_within_two_seconds(shared, how):
    """Round six's P34 and P35: Ctrl-C or SIGTERM to the root process ended it, but the `nobody`
    run (a session of its own, out of a terminal's reach) went on running the student's code,
    its directories left in TMPDIR. Now every process of the nobody run ends, and what it made
    goes with the root's folder, within 2 s of the signal."""
    (shared / "slow.py").write_text(SLOW_NOBODY)
    marks = shared / "marks"
    marks.touch(mode=0o666)
    marks.chmod(0o666)
    proc = subprocess.Popen(
        [sys.executable, "-c", ROOT_GRADING, str(shared), NOBODY_PYTHON, str(shared / "slow.py")],
        cwd=REPO_ROOT, env={**os.environ, "MARKS": str(marks)}, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(marks.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    seen = [line.split() for line in marks.read_text().splitlines()]
    start = time.monotonic()
    os.killpg(proc.pid, getattr(signal, how))  # as Ctrl-C does, or a kill
    while (proc.poll() is None or any(alive(int(pid)) or os.path.exists(made)
                                      for pid, made in seen)) and time.monotonic() < start + 5:
        time.sleep(0.02)
    took = time.monotonic() - start
    for pid, _ in seen:
        if alive(int(pid)):
            os.kill(int(pid), signal.SIGKILL)
    assert proc.wait(timeout=5) == 128 + getattr(signal, how), proc.communicate()
    assert took < 2, f"{took:.2f} s; still there: {seen}"


def test_an_error_names_the_file_as_the_student_knows_it(tmp_path):
    (tmp_path / "hw3" / "src").mkdir(parents=True)
    (tmp_path / "hw3" / "src" / "attn.py").write_text(LAYER)
    found = locate(tmp_path, ("Attn",), tmp_path)
    shown = os.path.join("hw3", "src", "attn.py")
    assert found.where("importing attn.py failed: NameError: x (attn.py, line 4)") == (
        f"importing {shown} failed: NameError: x ({shown}, line 4)")
