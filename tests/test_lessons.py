"""The lessons (lessons/*.ipynb) and what they stand on: the notebook reader
(check_attention/notebook.py), each exercise's check, the solutions, and the committed outputs.

Fast: the reader on cells made here (magics and shell lines never run, top-level work left out,
later definitions win), the sentences a learner reads, lesson 01's shipped exercise and its
solution through the checker, the notebooks' shape (an exercise then its check in each of 01-03,
small, no machine's path printed, links that resolve), and lesson 04 on the project's own loop. Slow: every solution passes, every lesson's typical mistakes are named, and
every lesson, run top to bottom in a fresh kernel, prints and draws what is committed
(tools/run_lessons.py's comparison, within its stated tolerance).
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
from pathlib import Path

import pytest

from helpers import REPO_ROOT
from check_attention.notebook import (Cell, check_cells, module_of, notebook_cells,
                                      notebook_source)
from safeio.cli import FileRefused, FormatError

LESSONS = REPO_ROOT / "lessons"
NOTEBOOKS = sorted(LESSONS.glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = LESSONS / "solutions"
EXERCISES = {"01_equation": "attention", "02_heads": "MultiHeadAttention",
             "03_causal_mask": "causal_attention"}
# A lesson whose exercise is an earlier lesson's: lesson 05 trains lesson 02's layer.
SOLVED_BY = {"05_your_layer": "02_heads"}


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def cells_until_exercise(path: Path, exercise: str = None) -> list[Cell]:
    """The lesson's code cells as a learner runs them, up to and with its exercise cell; with
    `exercise`, that text in place of the shipped exercise cell."""
    out = []
    for n, cell in enumerate(c for c in load(path)["cells"] if c["cell_type"] == "code"):
        source = "".join(cell["source"])
        if "exercise" in cell.get("metadata", {}).get("tags", []):
            out.append(Cell(f"In [{n + 1}]", exercise if exercise is not None else source))
            return out
        out.append(Cell(f"In [{n + 1}]", source))
    raise AssertionError(f"{path.name} has no cell tagged 'exercise'")


def run_module(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "notebook", "exec"), namespace)  # noqa: S102  (our own test cells)
    return namespace


# ----------------------------------------------------------------------------- the reader


def test_magics_and_shell_lines_never_run_and_lines_keep_their_numbers():
    cells = [Cell("In [1]", "%matplotlib inline\nimport math\n!rm -rf /tmp/nothing\n"
                            "files = !ls\nmath?\nX = 3\n"),
             Cell("In [2]", "%%bash\nimport os\necho hello\n"),
             Cell("In [3]", "def f():\n    %time g()\n    return X\n")]
    module = module_of(cells)
    assert "rm -rf" not in module.source and "files" not in module.source
    assert "import os" not in module.source  # the cell magic's body is the magic's, not Python
    assert run_module(module.source)["f"]() == 3
    assert "In [2] is an IPython cell magic (%%bash): left out, never run" in module.notes
    assert any("!rm -rf" in n and "In [1], line 3" in n for n in module.notes)
    line = module.source.splitlines().index("X = 3") + 1
    assert module.where(line) == "In [1], line 6"


def test_top_level_work_is_left_out_and_definitions_kept():
    cells = [Cell("c1", "import torch\nimport numpy as np; noise = np.random.rand(3)\n"
                        "D = 64\nH = D // 4\nY = noise * 2\nZ: int = len('abc')\n"),
             Cell("c2", "for i in range(10**12):\n    pass\nprint('trained')\n"
                        "if __name__ == '__main__':\n    raise SystemExit('ran')\n"
                        "class Layer(torch.nn.Module):\n    size = H\n"
                        "@staticmethod\ndef g():\n    return D\n")]
    namespace = run_module(module_of(cells).source)
    assert namespace["D"] == 64 and namespace["H"] == 16 and namespace["Layer"].size == 16
    # calls, and constants made from what a call made, are work: left out
    assert not {"noise", "Y", "Z", "i"} & set(namespace)
    assert "np" in namespace  # the import that shared a line with the call is kept


def test_a_later_definition_overrides_an_earlier_one_and_future_imports_go_first():
    cells = [Cell("In [1]", "def f():\n    return 1\n"),
             Cell("In [2]", "from __future__ import annotations\ndef f() -> 'int':\n    return 2\n")]
    source = module_of(cells).source
    assert run_module(source)["f"]() == 2
    assert source.splitlines()[1] == "from __future__ import annotations"


def test_a_notebook_file_is_read_safely(tmp_path):
    source = notebook_source(LESSONS / "03_causal_mask.ipynb")  # it trains two models at its top level
    compile(source, "lesson", "exec")
    assert "def causal_attention" in source and "optimizer.step()" not in source
    assert "for name in" not in source  # the leakage test and the training loop: work
    v3 = tmp_path / "old.ipynb"
    v3.write_text(json.dumps({"worksheets": [], "nbformat": 3}))
    with pytest.raises(FormatError, match="nbformat 3"):
        notebook_cells(v3)
    other = tmp_path / "list.ipynb"
    other.write_text("[1, 2]")
    with pytest.raises(FormatError, match="must hold a JSON object"):
        notebook_cells(other)
    with pytest.raises(FileRefused, match="a directory"):
        notebook_cells(tmp_path)


def test_a_notebook_too_big_to_be_one_is_refused(tmp_path, monkeypatch):
    import check_attention.notebook as notebook
    monkeypatch.setattr(notebook, "MAX_NOTEBOOK_BYTES", 100)
    big = tmp_path / "big.ipynb"
    big.write_text(json.dumps({"cells": [{"cell_type": "code", "source": "x = 1\n" * 50}]}))
    with pytest.raises(FileRefused, match="implausibly large"):
        notebook_cells(big)


# ----------------------------------------------------------------------------- the sentences


def test_the_sentences_that_need_no_checker():
    broken = [Cell("In [1]", "import math\n"),
              Cell("In [2]", "def attention(Q, K, V, mask=None):\n    return (Q @ K.T\n")]
    report, words = check_cells("attention", broken)
    assert report is None
    assert words.startswith("The cell that defines `attention` has a syntax error at In [2], "
                            "line 2: '(' was never closed (`return (Q @ K.T`)")
    assert check_cells("attention", broken[:1])[1] == (
        "No cell defines `attention` yet: run the exercise cell (Shift+Enter), then this one.")
    nested = [Cell("In [1]", "if True:\n    def attention(Q, K, V):\n        return Q\n")]
    assert "is not defined at the top level of In [1]" in check_cells("attention", nested)[1]


def test_lesson_01s_shipped_exercise_fails_with_a_sentence_and_its_solution_passes():
    """The fast tier's one run of the checker on a lesson: the exercise as shipped, then the
    solution typed in its place."""
    lesson = LESSONS / "01_equation.ipynb"
    report, words = check_cells("attention", cells_until_exercise(lesson), LESSONS)
    assert words == ("`attention` is not written yet: it still raises NotImplementedError. "
                     "Replace the `raise NotImplementedError(...)` line with your code, run that "
                     "cell, then run this check again.")
    solution = (SOLUTIONS / "01_equation.py").read_text()
    report, words = check_cells("attention", cells_until_exercise(lesson, solution), LESSONS)
    assert report.passed, report.text
    assert words == ("`attention` passes all 12 checks: it computes the equation of the cheat "
                     "sheet (docs/cheat_sheet.md).")
    # issue 60 (5): a wrong attempt is counted over the same checks, the cause comes first, no
    # study's statistics follow, and a function's check speaks of no heads and no W_O
    wrong = solution.replace(" / math.sqrt(d_k)", "")
    report, words = check_cells("attention", cells_until_exercise(lesson, wrong), LESSONS)
    lines = words.splitlines()
    assert lines[0] == "`attention` is not right yet: 2 of its 12 checks fail.", words
    assert lines[1].startswith("The mistake: scores QK^T are not divided at all"), words
    assert lines[2].startswith("The fix: the scaling divisor is"), words
    assert "SE" not in words and "paired seeds" not in words and "W_O" not in words, words


def test_a_name_no_cell_defines_and_one_a_cell_computes_are_sentences():
    cells = [Cell("In [1]", "import math\nimport torch\nscale = torch.tensor(0.25)\n"),
             Cell("In [2]", "def attention(Q, K, V, mask=None):\n"
                            "    w = torch.softmax(Q @ K.transpose(-2, -1) * scale, -1)\n"
                            "    return w @ V, w\n")]
    words = check_cells("attention", cells)[1]
    assert words.startswith("`attention` uses `scale` (at In [2], line 2), which In [1] makes "
                            "by running code."), words
    cells[1] = Cell("In [3]", cells[1].source.replace("* scale", "/ math.sqrt(d_k)"))
    words = check_cells("attention", cells)[1]
    assert words == ("`attention` uses `d_k` (at In [3], line 2), which no cell of this notebook "
                     "defines: a typo, a missing import, or a cell not run yet?"), words


@pytest.mark.slow
def test_a_helper_module_in_the_learners_own_folder_imports(tmp_path):
    """Round six's X12, X17: a kernel in the learner's own folder, outside the project, whose
    exercise cell imports a module of that folder: the check may read the folder, as the
    kernel does (check(..., reads=)), and the solution passes."""
    (tmp_path / "r6helper.py").write_text((SOLUTIONS / "01_equation.py").read_text())
    report, words = check_cells("attention", [Cell("In [1]", "from r6helper import attention\n")],
                                str(tmp_path))
    assert report is not None and report.passed, words


@pytest.mark.slow
def test_run_lessons_says_why_a_lesson_stopped_in_one_line(tmp_path):
    """Round six's L04, L05: a cell that raises gave nbclient's traceback in colour, and Ctrl-C
    while the kernel starts an AssertionError from nbclient's own cleanup."""
    import signal
    import subprocess
    import sys
    import time
    from helpers import SCRIPT_ENV, one_error_line
    from safeio.cli import UserError
    from tools.run_lessons import execute
    nb = tmp_path / "lab.ipynb"
    nb.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": "code", "source": "raise ValueError('r6 broken cell')", "metadata": {},
         "outputs": [], "execution_count": None, "id": "c1"}]}))
    with pytest.raises(UserError, match=r"^lab.ipynb: a cell raised ValueError: r6 broken cell$"):
        execute(nb)
    proc = subprocess.Popen([sys.executable, "-m", "tools.run_lessons", "lessons=01",
                             "write=false"], cwd=REPO_ROOT, env=SCRIPT_ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    time.sleep(1.5)  # the kernel is starting
    os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (2, 130)
    one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))


# ----------------------------------------------------------------------------- the notebooks


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_exercise_is_followed_by_its_check_and_has_a_solution(path):
    """Lessons 01-03 have one (EXERCISES); a later lesson may have one, checked the same way."""
    code = [c for c in load(path)["cells"] if c["cell_type"] == "code"]
    tags = [c.get("metadata", {}).get("tags", []) for c in code]
    exercises = [i for i, t in enumerate(tags) if "exercise" in t]
    assert exercises or path.stem not in EXERCISES
    for at in exercises:
        check = re.fullmatch(r'check_exercise\("(\w+)"\)', "".join(code[at + 1]["source"]))
        assert "check" in tags[at + 1] and check, "an exercise cell is followed by its check"
        name = check.group(1)
        assert name == EXERCISES.get(path.stem, name)
        assert re.search(rf"^(def|class) {name}\b", "".join(code[at]["source"]), re.M)
        shipped = "".join(code[at + 1]["outputs"][0]["text"])
        assert shipped.startswith(f"`{name}` is not written yet")  # as committed: unfinished
        solution = SOLUTIONS / f"{SOLVED_BY.get(path.stem, path.stem)}.py"
        assert re.search(rf"^(def|class) {name}\b", solution.read_text(), re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lesson_is_committed_small_with_outputs_and_no_error(path):
    assert path.stat().st_size < 512 * 1024  # well under 1 MiB
    nb = load(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] for c in code), "run it with python -m tools.run_lessons"
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"]
    pictures = [o["data"] for o in outputs if "data" in o and any(k.startswith("image/")
                                                                   for k in o["data"])]
    assert pictures and all("image/png" in d for d in pictures)
    assert not any("execution" in c.get("metadata", {}) for c in code)  # no timings
    printed = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                      for o in outputs)
    assert str(REPO_ROOT) not in printed, "an output names a path of this machine"


def test_lesson_04_trains_through_the_projects_own_loop():
    """The study in miniature runs train.py's train() on the shipped arms (conf/arm/), and reads
    its runs back with the study's summary code: no training loop or statistics of its own."""
    source = "\n".join("".join(c["source"]) for c in load(LESSONS / "04_break_and_measure.ipynb")["cells"]
                       if c["cell_type"] == "code")
    assert "from train import train" in source and "+arm={arm}" in source
    assert "from scripts.summarize_ablations import" in source
    assert ".backward()" not in source and "optimizer" not in source
    for arm in re.search(r"ARMS = \[(.*)\]", source).group(1).replace('"', "").split(", "):
        assert (REPO_ROOT / "conf" / "arm" / f"{arm}.yaml").is_file(), arm


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lesson_ends_with_what_next_and_its_links_resolve(path):
    markdown = [("".join(c["source"])) for c in load(path)["cells"] if c["cell_type"] == "markdown"]
    assert "## What next" in markdown[-1]
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", "\n".join(markdown)):
        if not target.startswith("http"):
            assert (path.parent / target).exists(), f"{path.name} links to {target}"


def test_the_lessons_readme_lists_every_lesson():
    readme = (LESSONS / "README.md").read_text()
    for path in NOTEBOOKS:
        assert f"]({path.name})" in readme


# ----------------------------------------------------------------------------- comparing outputs


def _notebook(text: str, picture: bytes = None):
    import nbformat.v4 as v4
    cell = v4.new_code_cell("print(x)")
    cell.outputs = [v4.new_output("stream", name="stdout", text=text)]
    if picture is not None:
        cell.outputs.append(v4.new_output("display_data", data={
            "image/png": base64.b64encode(picture).decode()}))
    return v4.new_notebook(cells=[cell])


def _png(value: float) -> bytes:
    import matplotlib.image
    import numpy as np
    buffer = io.BytesIO()
    matplotlib.image.imsave(buffer, np.full((20, 30), value), vmin=0, vmax=1, cmap="gray",
                            format="png")
    return buffer.getvalue()


def test_outputs_compare_as_a_reader_sees_them():
    from tools.run_lessons import differences
    committed = _notebook("loss 1.234, shape [2, 8]\n", _png(0.5))
    assert differences(_notebook("loss 1.2341, shape [2, 8]\n", _png(0.505)), committed) == []
    assert differences(_notebook("loss 1.31, shape [2, 8]\n", _png(0.5)), committed)  # a number
    assert differences(_notebook("loss 1.234, shape [2, 9]\n", _png(0.5)), committed)
    assert differences(_notebook("loss 1.234, shape [2, 101]\n", _png(0.5)),
                       _notebook("loss 1.234, shape [2, 100]\n", _png(0.5)))  # 1%, but a count
    assert differences(_notebook("loss 1.234, shapes [2, 8]\n", _png(0.5)), committed)  # words
    assert differences(_notebook("loss 1.234, shape [2, 8]\n", _png(0.9)), committed)  # picture
    assert differences(_notebook("loss 1.234, shape [2, 8]\n"), committed)  # a missing one


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
@pytest.mark.parametrize("lesson", ["02_heads", "03_causal_mask"])
def test_each_solution_passes_in_its_lesson(lesson):
    cells = cells_until_exercise(LESSONS / f"{lesson}.ipynb",
                                 (SOLUTIONS / f"{lesson}.py").read_text())
    report, words = check_cells(EXERCISES[lesson], cells, LESSONS)
    assert report.passed, report.text
    shipped = check_cells(EXERCISES[lesson], cells_until_exercise(LESSONS / f"{lesson}.ipynb"), LESSONS)
    assert "is not written yet" in shipped[1]


# Each typical mistake as one edit of the lesson's solution: (lesson, mistake, the text it
# replaces, its replacement, the checklist items that fail, words the learner reads). The softmax
# over the query axis is not named yet: the checker says that no variant reproduces it.
MISTAKES = [
    ("01_equation", "no scale", "Q @ K.transpose(-2, -1) / math.sqrt(d_k)",
     "Q @ K.transpose(-2, -1)", {"scale", "equation"},
     "scores QK^T are not divided at all; they should be divided by sqrt(d_k) = 4.0"),
    ("01_equation", "softmax over the queries", "dim=-1", "dim=-2", {"causal", "equation"},
     "softmax runs over the queries (dim=-2) instead of the keys"),
    ("01_equation", "divided by d_k", "/ math.sqrt(d_k)", "/ d_k", {"scale", "equation"},
     "scores are divided by d_k = 16, not sqrt(d_k) = 4.0"),
    ("02_heads", "head split without transpose",
     "t.view(B, T, self.n_head, self.d_k).transpose(1, 2)", "t.view(B, self.n_head, T, self.d_k)",
     {"causal", "equation"}, "heads are split by reshaping to (B, 4, T, 16), which mixes "
                             "positions and heads, instead of .view(B, T, 4, 16).transpose(1, 2)"),
    ("02_heads", "no W_O", "return self.W_O(y)", "return y", {"w_o", "equation"},
     "The mistake: the concatenated heads are the output: W_O is never applied"),
    ("02_heads", "divided by sqrt(d_model)", "causal_pattern(T, T))",
     "causal_pattern(T, T), scale=d_model ** -0.5)", {"scale", "equation"},
     "scores are divided by sqrt(d_model) = 8.0, not sqrt(d_k) = 4.0"),
    ("03_causal_mask", "mask after softmax", "torch.softmax(scores + M, dim=-1)",
     "torch.softmax(scores, dim=-1).masked_fill(~visible, 0.0)",
     {"causal", "before_softmax", "equation"},
     "softmax runs over every key and the future weights are zeroed afterwards"),
    ("03_causal_mask", "a 0 mask", "masked_fill(~visible, -math.inf)", "masked_fill(~visible, 0.0)",
     {"causal", "mask_value", "equation"},
     "the mask adds 0 to the future scores, which does not hide them"),
    ("03_causal_mask", "future scores filled with 0", "torch.softmax(scores + M, dim=-1)",
     "torch.softmax(scores.masked_fill(~visible, 0.0), dim=-1)", {"causal", "mask_value", "equation"},
     "future scores are set to 0 instead of -inf: exp(0) = 1 still competes"),
    ("03_causal_mask", "mask aligned top-left", "tril(diagonal=m - n)", "tril()", {"unequal"},
     "the mask is aligned top-left"),
]


@pytest.mark.slow
@pytest.mark.parametrize("lesson, mistake, old, new, items, words", MISTAKES,
                         ids=[f"{m[0][:2]}-{m[1]}" for m in MISTAKES])
def test_each_typical_mistake_is_named(lesson, mistake, old, new, items, words):
    solution = (SOLUTIONS / f"{lesson}.py").read_text()
    assert solution.count(old) == 1, f"the solution no longer has {old!r}"
    cells = cells_until_exercise(LESSONS / f"{lesson}.ipynb", solution.replace(old, new))
    report, sentence = check_cells(EXERCISES[lesson], cells, LESSONS)
    failed = {k for k, item in report.items.items() if item.status == "FAIL"}
    assert failed == items, report.text
    assert words in sentence, sentence
    assert sentence.startswith(f"`{EXERCISES[lesson]}` is not right yet")


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_lesson_runs_top_to_bottom_and_prints_what_is_committed(path):
    """A fresh kernel, no network: if this fails after a change of the code, regenerate the
    outputs with `python -m tools.run_lessons` and read what moved."""
    import nbformat
    from tools.run_lessons import differences, execute
    found = differences(execute(path), nbformat.read(path, as_version=4))
    assert found == [], "\n".join(found)
