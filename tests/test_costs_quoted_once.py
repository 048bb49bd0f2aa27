"""Each pitfall's cost is quoted once: the README's tables carry the numbers of
docs/pitfall_costs.json, which the studies' summary writes from the runs (the checker's sentences
read the file itself). A table edited by hand, or a study rerun without its tables, fails here."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COSTS = json.loads((ROOT / "docs" / "pitfall_costs.json").read_text(encoding="utf-8"))["costs"]
README = (ROOT / "README.md").read_text(encoding="utf-8")
NUMBER = r"[+-]?\d+\.\d+"


def measured(variant: str, study: str, loss: str) -> dict:
    [entry] = [e for e in COSTS[variant] if e["study"] == study]
    return entry[loss]


def agrees(cell: str, value: float) -> bool:
    """`cell` is `value` rounded to the cell's own decimals."""
    decimals = len(cell.split(".")[1])
    return abs(float(cell) - value) <= 0.5 * 10 ** -decimals + 1e-12


def rows(header: str) -> list[list[str]]:
    """The cells of the table whose header line starts with `header` (separator skipped)."""
    lines = README.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    table = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            return table
        table.append([cell.strip() for cell in line.strip("|").split("|")])
    return table


def test_the_first_study_s_table_is_the_costs_file_s():
    checked = 0
    for regime, variant, _, effect, se, interval, *_ in rows("| regime | variant | causal val"):
        if not effect:  # the correct arm
            continue
        cost = measured(variant, "ablations", "causal")
        low, high = re.findall(NUMBER, interval)
        assert agrees(effect, cost["effect"]) and agrees(se, cost["se"]), (variant, effect, se)
        assert agrees(low, cost["low"]) and agrees(high, cost["high"]), (variant, interval)
        checked += 1
    assert checked == 6


def test_the_decoding_study_s_table_is_the_costs_file_s():
    checked = 0
    for variant, causal, cached, *_ in rows("| variant | effect on causal val loss"):
        if variant == "correct":
            continue
        for loss, cell in (("causal", causal), ("cached", cached)):
            cost = measured(variant, "decoding", loss)
            if cell.startswith("0 (runs identical"):
                assert cost["identical"], (variant, loss)
            elif cell != "the same":
                effect, se, low, high = re.findall(NUMBER, cell)[:4]
                assert agrees(effect, cost["effect"]) and agrees(se, cost["se"]), (variant, cell)
                assert agrees(low, cost["low"]) and agrees(high, cost["high"]), (variant, cell)
        checked += 1
    assert checked == 5


@pytest.mark.parametrize("cell, value, ok", [("+0.845", 0.84521, True), ("+0.845", 0.8267, False),
                                             ("-0.0000", -0.00003, True), ("9.7", 9.8, False)])
def test_a_cell_agrees_with_its_value_to_its_own_decimals(cell, value, ok):
    assert agrees(cell, value) is ok
