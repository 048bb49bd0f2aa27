"""Points and visibility per check, for a platform's results and a course's table: the default
table, and the instructor's own from a small key=value file, one check a line:

    # check = points [visibility]
    equation = 4
    backward = 2 after_due_date
    unequal = 0            # 0 points: left out of the results

A check the file does not name keeps its default row. Visibility is Gradescope's word (hidden,
after_due_date, after_published, visible); PrairieLearn shows every check, the details of one
that is not `visible` withheld. No torch here: a mistyped file is refused before anything runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from safeio.cli import UserError
from safeio.files import read_text
from check_attention.checklist import CHECKS

VISIBILITIES = ("visible", "after_due_date", "after_published", "hidden")
MAX_WEIGHTS_BYTES = 64 << 10


@dataclass(frozen=True)
class Weight:
    points: float
    visibility: str = "visible"


# The default table: each check's points and visibility as checklist.py gives them
# (docs/grading.md shows this table; tests/test_grading.py holds the two the same).
DEFAULT_WEIGHTS = {c.key: Weight(c.points, c.visibility) for c in CHECKS}


def parse_weights(text: str, where: str = "weights") -> dict[str, Weight]:
    """The default table with the lines of `text` (`check = points [visibility]`, # comments)
    applied. Raises UserError naming the line and the fix."""
    table = dict(DEFAULT_WEIGHTS)
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        words = value.split()
        if not sep or not key or not 1 <= len(words) <= 2:
            raise UserError(f"{where}, line {n}: write `check = points [visibility]`, got "
                            f"{raw.strip()!r}")
        if key not in table:
            raise UserError(f"{where}, line {n}: no check {key!r} (the checks: "
                            f"{', '.join(DEFAULT_WEIGHTS)})")
        try:
            points = float(words[0])
        except ValueError:
            points = -1.0
        if not 0 <= points <= 1000:
            raise UserError(f"{where}, line {n}: points must be a number from 0 to 1,000, got "
                            f"{words[0]!r}")
        visibility = words[1] if len(words) == 2 else table[key].visibility
        if visibility not in VISIBILITIES:
            raise UserError(f"{where}, line {n}: visibility must be one of "
                            f"{', '.join(VISIBILITIES)}, got {visibility!r}")
        table[key] = Weight(points, visibility)
    if not any(w.points for w in table.values()):
        raise UserError(f"{where}: every check has 0 points; give one some")
    return table


def load_weights(path) -> dict[str, Weight]:
    """The table of the weights file at path, or the default table for None."""
    if path is None:
        return dict(DEFAULT_WEIGHTS)
    return parse_weights(read_text(Path(path), "weights=", MAX_WEIGHTS_BYTES), str(path))
