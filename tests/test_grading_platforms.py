"""docs/grading.md's scripts, run as written in temporary directories laid out as each platform's
(`/autograder/{source,submission,results}`, `/grade/{student,tests,results}`), on a correct layer,
one without the scale, a notebook and a file with a syntax error; and a notebook as the
command's target (issue 51). Slow: each run starts the checker and its sandbox (5 to 15 s).

The scripts' absolute paths are the platforms'; here they point into the temporary directory,
and `python3`, `apt-get` and `pip` are stubs on PATH (the stubbed `python3` runs this project's
interpreter). Started as root, as here, the grader runs the check again as `nobody`; where
`nobody` may not run this interpreter (it lives under /root on the development machine),
CHECK_ATTENTION_UNPRIVILEGED=1 tells the grader it already is, and tests/test_grading.py checks
the drop itself with the system's Python.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from helpers import REPO_ROOT, SCRIPT_ENV
from test_grading import GRADESCOPE_SCHEMA, PRAIRIELEARN_SCHEMA, nobody_can_run

pytestmark = pytest.mark.slow
DOC = REPO_ROOT / "docs" / "grading.md"

LAYER = '''import math
import torch
import torch.nn as nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))
        att = att.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf")).softmax(-1)
        return self.proj((att @ v).transpose(1, 2).reshape(B, T, C))
'''
TRAINING = "x = torch.randn(2, 8, 64)\nprint(CausalSelfAttention(64, 4)(x))\n"
NO_SCALE = LAYER.replace(" / math.sqrt(k.size(-1))", "")
SYNTAX = LAYER.replace("def forward(self, x):", "def forward(self, x)")


def script(first_line: str) -> str:
    """The ```bash block of docs/grading.md whose second line starts with `first_line`."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.DOTALL)
    found = [b for b in blocks if b.split("\n")[1:2] and b.split("\n")[1].startswith(first_line)]
    assert len(found) == 1, first_line
    return found[0]


def stubs(folder: Path, log: Path) -> dict:
    """PATH with python3 -> this interpreter (pip logged, not run) and apt-get logged."""
    folder.mkdir()
    (folder / "python3").write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pip" ]; then echo "pip $*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    (folder / "apt-get").write_text(f'#!/bin/sh\necho "apt-get $*" >> {log}\n')
    for f in folder.iterdir():
        f.chmod(0o755)
    env = dict(SCRIPT_ENV, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}")
    env["PYTHONPATH"] = str(REPO_ROOT)
    if os.geteuid() == 0 and not nobody_can_run(sys.executable):
        env["CHECK_ATTENTION_UNPRIVILEGED"] = "1"
    return env


def run_script(text: str, root: Path, platform_root: str, env: dict, name: str):
    body = text.replace(platform_root, str(root))
    body = body.replace("cd /scratch-gpt", f"cd {REPO_ROOT}")
    path = root / name
    path.write_text(body)
    path.chmod(0o755)
    return subprocess.run([str(path)], env=env, capture_output=True, text=True, timeout=600)


def weights(folder: Path) -> None:
    (folder / "weights.txt").write_text("equation = 4\nbackward = 2 after_due_date\n")


def gradescope_layout(tmp_path: Path, files: dict) -> tuple[Path, dict]:
    root = tmp_path / "autograder"
    for sub in ("source", "submission", "results"):
        (root / sub).mkdir(parents=True)
    shutil.copy(REPO_ROOT / "requirements.txt", root / "source")
    weights(root / "source")
    for rel, text in files.items():
        (root / "submission" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "submission" / rel).write_text(text)
    return root, stubs(tmp_path / "bin", tmp_path / "calls.log")


@pytest.mark.parametrize("layer, score, failed", [(LAYER, 19.0, set()),
                                                  (NO_SCALE, None, {"scale", "equation"})])
def test_gradescope_setup_and_run_autograder(tmp_path, layer, score, failed):
    root, env = gradescope_layout(tmp_path, {"hw3/src/attention.py": layer, "main.py": "x = 1\n"})
    setup = run_script(script("# setup.sh"), root, "/autograder", env, "setup.sh")
    assert setup.returncode == 0, setup.stderr
    calls = (tmp_path / "calls.log").read_text()
    assert "apt-get install -y python3 python3-pip" in calls
    assert "-r requirements.txt" in calls
    # run_autograder cds into source/: the project is there on Gradescope, here it is REPO_ROOT
    done = run_script(script("# run_autograder"), root, "/autograder", env, "run_autograder")
    results = json.loads((root / "results" / "results.json").read_text())
    jsonschema.validate(results, GRADESCOPE_SCHEMA)
    got = {t["tags"][0] for t in results["tests"] if t["status"] == "failed"}
    assert got == failed, results["output"]
    full = 19.0  # the default table with equation = 4 and backward = 2
    assert sum(t["max_score"] for t in results["tests"]) == full  # unequal (N/A) counts as passed
    if score is not None:
        assert results["score"] == score and done.returncode == 0
    else:
        assert results["score"] == full - 1 - 4  # scale and equation: whole checks' points
        assert "attention=no_scale" in results["output"]
    assert "seed=0" in results["output"]
    assert os.path.join("hw3", "src", "attention.py") in results["output"]


def prairielearn_layout(tmp_path: Path, files: dict) -> tuple[Path, dict]:
    root = tmp_path / "grade"
    for sub in ("student", "tests"):
        (root / sub).mkdir(parents=True)
    weights(root / "tests")
    for rel, text in files.items():
        (root / "student" / rel).write_text(text)
    return root, stubs(tmp_path / "bin", tmp_path / "calls.log")


def notebook(layer: str) -> str:
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None,
         "source": src} for src in ("%pip install torch\n!nvidia-smi\n", layer, TRAINING)]})


@pytest.mark.parametrize("files, expect", [
    ({"attention.py": LAYER}, {"gradable": True, "score": 1.0}),
    ({"attention.py": NO_SCALE}, {"gradable": True}),
    ({"lab.ipynb": notebook(LAYER)}, {"gradable": True, "score": 1.0}),
    ({"attention.py": SYNTAX}, {"gradable": False}),
])
def test_prairielearn_entrypoint(tmp_path, files, expect):
    root, env = prairielearn_layout(tmp_path, files)
    done = run_script(script("# run.sh"), root, "/grade", env, "run.sh")
    results = json.loads((root / "results" / "results.json").read_text())
    jsonschema.validate(results, PRAIRIELEARN_SCHEMA)
    assert {k: results[k] for k in expect} == expect, results
    assert done.returncode == (0 if expect["gradable"] else 1), done.stderr
    assert "seed=0" in results["message"]
    if "lab.ipynb" in files:
        assert "IPython's `!nvidia-smi` left out, never run" in results["message"]
    if files.get("attention.py") == NO_SCALE:
        assert 0 < results["score"] < 1
        scale = next(t for t in results["tests"] if t["description"] == "scale")
        assert scale["points"] == 0 and "divided" in scale["message"]
    if not expect["gradable"]:
        assert results["format_errors"] == [
            "attention.py defines `CausalSelfAttention` but does not parse: line 13: "
            "SyntaxError: expected ':'"]


def test_a_notebook_is_a_target_of_the_command(tmp_path):
    nb = tmp_path / "lesson.ipynb"
    nb.write_text(notebook(LAYER))
    done = subprocess.run([sys.executable, "-m", "check_attention", f"{nb}:CausalSelfAttention"],
                          cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "verdict: PASS" in done.stdout
    assert "notebook: code cell 1, line 2: IPython's `!nvidia-smi` left out, never run" \
        in done.stdout
    nb.write_text(notebook(SYNTAX))
    done = subprocess.run([sys.executable, "-m", "check_attention", f"{nb}:CausalSelfAttention"],
                          cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: lesson.ipynb defines `CausalSelfAttention` but does "
                                   "not parse: code cell 2, line 13: expected ':' "
                                   "(`def forward(self, x)`)")

