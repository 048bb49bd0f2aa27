"""train.budget_minutes: the step count fixed from the measured speed (training/budget.py)."""
from __future__ import annotations

import pytest
import yaml

from helpers import TRAIN, corpus_args, ok, run, write_corpus
from training.budget import PROBE_STEPS, SKIP, StepBudget, steps_within


def test_the_probe_times_the_steps_after_the_first_ones_and_decides_once():
    budget = StepBudget(minutes=5.0, first_step=0)
    decided = [step for step in range(1, PROBE_STEPS + 20)
               if budget.add(step, 9.0 if step <= SKIP else 0.25 + step % 2 * 0.01)]
    assert decided == [PROBE_STEPS]
    assert len(budget.seconds) == PROBE_STEPS - SKIP  # the warm-up steps' 9 s are left out
    assert budget.step_seconds() == pytest.approx(0.255)  # the median of 0.25 and 0.26


def test_no_budget_and_a_resume_past_the_probe_never_decide():
    assert not any(StepBudget(None, 0).add(s, 1.0) for s in range(1, 100))
    assert not any(StepBudget(5.0, PROBE_STEPS).add(s, 1.0) for s in range(PROBE_STEPS + 1, 200))


def test_the_count_is_what_fits_capped_by_max_steps_and_never_below_the_probe():
    assert steps_within(10.0, 0.3, 5000) == 2000          # 600 s / 0.3 s
    assert steps_within(10.0, 0.1, 2800) == 2800          # all fit: max_steps
    assert steps_within(0.001, 0.3, 2800) == PROBE_STEPS  # the steps already taken


@pytest.mark.slow  # a train.py run and its resume: ~15 s
def test_a_run_over_budget_stops_at_its_fixed_count_and_config_yaml_keeps_it(tmp_path):
    corpus = write_corpus(tmp_path)
    run_dir = tmp_path / "run"
    args = ["+experiment=smoke", *corpus_args(corpus, tmp_path / "cache"), "train.threads=1",
            "train.eval_interval=1000"]
    result = ok(run([TRAIN, *args, f"hydra.run.dir={run_dir}", "train.max_steps=400",
                     "train.budget_minutes=0.0001"], cwd=tmp_path))
    assert f"{PROBE_STEPS} steps" in result.stderr and "time budget: 0.0001 min" in result.stderr
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train"]["max_steps"] == PROBE_STEPS
    assert f"step {PROBE_STEPS}: train loss" in (run_dir / "train.log").read_text()
    again = ok(run([TRAIN, f"resume={run_dir}"], cwd=tmp_path))
    assert "already finished" in again.stderr
