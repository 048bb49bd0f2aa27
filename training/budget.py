"""A run sized by time: `train.budget_minutes` fixes the step count from the measured speed.

Why: the default must finish in about the same time on every machine it meets, and 2-core CPUs
differ by 2x in speed (docs/results.md). Stopping at a deadline would cut the schedule short
(the learning rate falls in a straight line to 0 at max_steps, and most of what the weight
decay buys shows in that tail), so the count is fixed early, before the decay has gone far:
after PROBE_STEPS steps (the first SKIP left out: caches, allocator, compilation warm up),
max_steps becomes what fits in the budget left at the median step time. A host can slow down
later (a neighbour on a shared machine: 25% slower steps after the probe were seen), so the
count is checked again at every evaluation from the steps since the last check, and shortened
when the run would overrun the budget by more than SLACK of it (never lengthened: the lr only
ever moves one way). train.py writes each count into config.yaml before the evaluation's
checkpoint, so a resume continues the same schedule and the run's numbers stay exact. The
evaluations, the start-up and the final score are outside the budget.
"""
from __future__ import annotations

import statistics
from typing import Optional

SKIP, PROBE_STEPS = 10, 50
SLACK = 0.03  # a re-check shortens the run only when it would overrun by more than 3% of the budget


class StepBudget:
    """Times the steps of a run that starts before PROBE_STEPS (a resumed run past it has its
    count in config.yaml already, and keeps it)."""

    def __init__(self, minutes: Optional[float], first_step: int, recheck_every: int):
        self.minutes = minutes
        self.active = minutes is not None and first_step < PROBE_STEPS
        self.recheck_every = recheck_every
        self.spent = 0.0               # seconds of this process's steps, all of them
        self.seconds: list[float] = []  # each step's time since the last decision (after SKIP)

    def add(self, steps_done: int, seconds: float) -> bool:
        """Record one step's time; True when the count is to be decided now: at the end of the
        probe, then at every recheck_every-th step."""
        if not self.active:
            return False
        self.spent += seconds
        if steps_done > SKIP:
            self.seconds.append(seconds)
        return steps_done == PROBE_STEPS or (steps_done > PROBE_STEPS
                                             and steps_done % self.recheck_every == 0)

    def step_seconds(self) -> float:
        """The median step time since the last decision (and starts the next span)."""
        median = statistics.median(self.seconds)
        self.seconds = []
        return median

    def decide(self, steps_done: int, step_seconds: float, spent: float,
               max_steps: int) -> Optional[int]:
        """The new step count, or None to keep max_steps. The probe always decides; a re-check
        only shortens, and only past SLACK."""
        steps = steps_within(60 * self.minutes - spent, step_seconds, steps_done, max_steps)
        if steps_done == PROBE_STEPS:
            return steps
        overrun = (max_steps - steps) * step_seconds
        return steps if overrun > SLACK * 60 * self.minutes else None


def steps_within(seconds_left: float, step_seconds: float, steps_done: int, max_steps: int) -> int:
    """The count when the steps left fill `seconds_left` at `step_seconds` each: at most
    max_steps, and never fewer than the steps already taken."""
    return max(steps_done, min(max_steps, steps_done + int(seconds_left / step_seconds)))
