"""What the checker's test files share: the test layers' folder, the checklist's and the probes'
item names, one sandbox host per test module, and a check of `file.py:Name` in it."""
from __future__ import annotations

import pytest

from helpers import REPO_ROOT
from check_attention.checks import check
from check_attention.options import Options
from check_attention.sandbox.host import Sandbox

LAYERS = REPO_ROOT / "tests" / "attention_layers"
ITEMS = ("scale", "w_o", "before_softmax", "mask_value", "shape", "causal", "equation")
PROBES = ("backward", "lengths", "large_scores", "batch", "deterministic", "input_kept")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox() as box:
        yield box


def run(sandbox, target: str, **options):
    file, name = target.split(":")
    return check(str(LAYERS / file), name, Options(**options), sandbox=sandbox)


def failing(report) -> set:
    return {k for k, item in report.items.items() if item.status == "FAIL"}


def text(report) -> str:
    return "\n".join(report.lines())
