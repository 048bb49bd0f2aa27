"""What a learner reads first stays the size it is: the attention layer's forward, the model's
forward and constructor, train.py's loop (`train()`, the function its docstring says to read
first), the layer's methods and the model's config, counted from the source
with `ast` against the targets of design review 5, so that the next study cannot grow them
silently. A function's lines run from its `def` to its last line, docstring included; a branch is
an `if` statement or an `x if c else y` expression. A study that needs more moves its steps
where the layer's pitfalls and the cache's already are (model/pitfalls.py, model/decoding.py); a
new step of the loop goes into a piece beside `train()`, a new figure into training/summary.py.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (file, class or None for a module's function, function): (most lines, most branches)
FUNCTIONS = {("model/attention.py", "CausalSelfAttention", "forward"): (26, 4),
             ("model/gpt.py", "GPT", "forward"): (30, 7),
             ("model/gpt.py", "GPT", "__init__"): (16, 3),
             ("train.py", None, "train"): (52, 11)}
MOST_METHODS = ("model/attention.py", "CausalSelfAttention", 12)  # defined in the class itself
MOST_FIELDS = ("model/config.py", "ModelConfig", 20)


def module(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"))


def class_def(path: str, name: str) -> ast.ClassDef:
    return next(node for node in module(path).body
                if isinstance(node, ast.ClassDef) and node.name == name)


def lines_and_branches(node: ast.AST) -> tuple[int, int]:
    branches = sum(isinstance(n, (ast.If, ast.IfExp)) for n in ast.walk(node))
    return node.end_lineno - node.lineno + 1, branches


@pytest.mark.parametrize("path,cls,name", list(FUNCTIONS))
def test_a_function_a_learner_reads_keeps_its_size(path, cls, name):
    body = class_def(path, cls).body if cls else module(path).body
    function = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines, branches = lines_and_branches(function)
    most_lines, most_branches = FUNCTIONS[path, cls, name]
    what = f"{cls}.{name}" if cls else f"{name}()"
    assert lines <= most_lines and branches <= most_branches, (
        f"{path}: {what} is {lines} lines with {branches} branches, at most "
        f"{most_lines} and {most_branches}: move the new step into a function of its own")


def test_the_attention_layer_keeps_its_methods():
    path, cls, most = MOST_METHODS
    methods = [n.name for n in class_def(path, cls).body if isinstance(n, ast.FunctionDef)]
    assert len(methods) <= most, f"{path}: {cls} has {len(methods)} methods, at most {most}"


def test_the_model_config_keeps_its_fields():
    path, cls, most = MOST_FIELDS
    fields = [n.target.id for n in class_def(path, cls).body if isinstance(n, ast.AnnAssign)]
    assert len(fields) <= most, (f"{path}: {cls} has {len(fields)} fields, at most {most}: "
                                 f"retire a switch first (guard/retired.py)")


def test_the_counts_see_what_they_count():
    """The counter itself, on a function of known size: 4 lines, an `if` and a conditional."""
    function = ast.parse("def f(x):\n    if x:\n        return 1\n    return 2 if x else 3\n")
    assert lines_and_branches(function.body[0]) == (4, 2)


def test_no_code_asks_one_layer_for_every_layer():
    """The positions, the visible keys and the reset between sequences are the KV cache's
    (model/decoding.py): no code reaches into the first layer for what every layer shares."""
    sources = [p for p in ROOT.rglob("*.py") if not {".venv", "tests"} & set(p.parts)]
    found = [f"{p.relative_to(ROOT)}" for p in sources if "blocks[0].attn" in p.read_text()]
    assert found == []


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix()
                                        for p in (ROOT / "guard").glob("*.py")))
def test_no_guard_file_grows_past_one_idea(path):
    """guard/ was split by what it does (composing, checking, launching, memory) when
    preflight.py reached 869 lines (design review 5): a file past 530 lines holds two ideas."""
    lines = (ROOT / path).read_text(encoding="utf-8").count("\n")
    assert lines <= 530, f"{path} has {lines} lines: split it by what it does"
