"""A run sized by time: `train.budget_minutes` fixes the step count from the measured speed.

Why: the default must finish in about the same time on every machine it meets, and 2-core CPUs
differ by 2x in speed (docs/results.md). Stopping at a deadline would cut the schedule short
(the learning rate falls in a straight line to 0 at max_steps, and most of what the weight
decay buys shows in that tail), so the count is fixed once, early, before the decay starts:
after PROBE_STEPS steps (the first SKIP left out: caches, allocator, compilation warm up),
max_steps becomes min(max_steps, budget / median step time). train.py writes the count into
config.yaml, so a resume continues the same schedule and the run's numbers stay exact. The
evaluations, the start-up and the final score are outside the budget.
"""
from __future__ import annotations

import statistics
from typing import Optional

SKIP, PROBE_STEPS = 10, 50


class StepBudget:
    """Times the steps after SKIP up to PROBE_STEPS, for a run that starts before PROBE_STEPS
    (a resumed run past it has its count in config.yaml already)."""

    def __init__(self, minutes: Optional[float], first_step: int):
        self.active = minutes is not None and first_step < PROBE_STEPS
        self.seconds: list[float] = []

    def add(self, steps_done: int, seconds: float) -> bool:
        """Record one step's time; True when the probe has just ended (decide now)."""
        if not self.active:
            return False
        if steps_done > SKIP:
            self.seconds.append(seconds)
        if steps_done < PROBE_STEPS:
            return False
        self.active = False
        return True

    def step_seconds(self) -> float:
        return statistics.median(self.seconds)


def steps_within(minutes: float, step_seconds: float, max_steps: int) -> int:
    """The steps that fit in `minutes` at `step_seconds` each, at most max_steps (and never fewer
    than the PROBE_STEPS already taken)."""
    return max(PROBE_STEPS, min(max_steps, int(60 * minutes / step_seconds)))
