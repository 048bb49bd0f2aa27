"""train.budget_minutes: the step count fixed from the measured speed (training/budget.py)."""
from __future__ import annotations

import pytest
import yaml

from helpers import TRAIN, corpus_args, ok, run, write_corpus
from training.budget import PROBE_STEPS, SKIP, SLACK, StepBudget, steps_within


def test_the_probe_times_the_steps_after_the_first_ones_then_every_evaluation_decides_again():
    budget = StepBudget(minutes=5.0, first_step=0, recheck_every=100)
    decided = []
    for step in range(1, 320):
        if budget.add(step, 9.0 if step <= SKIP else 0.25 + step % 2 * 0.01):
            decided.append((step, len(budget.seconds), budget.step_seconds()))
    assert decided[0] == (PROBE_STEPS, PROBE_STEPS - SKIP, pytest.approx(0.255))  # warm-up left out
    assert [d[:2] for d in decided[1:]] == [(100, 50), (200, 100), (300, 100)]  # since the last
    assert budget.spent == pytest.approx(SKIP * 9.0 + (319 - SKIP) * 0.255, abs=0.01)


def test_no_budget_and_a_resume_past_the_probe_never_decide():
    assert not any(StepBudget(None, 0, 100).add(s, 1.0) for s in range(1, 1000))
    assert not any(StepBudget(5.0, PROBE_STEPS, 100).add(s, 1.0)
                   for s in range(PROBE_STEPS + 1, 1000))


def test_the_count_fills_the_time_left_capped_by_max_steps_and_never_below_the_steps_taken():
    assert steps_within(600.0, 0.3, 50, 5000) == 2050   # 600 s / 0.3 s after the 50 taken
    assert steps_within(600.0, 0.1, 50, 2800) == 2800   # all fit: max_steps
    assert steps_within(-5.0, 0.3, 50, 2800) == 50      # over already: the steps taken


def test_the_probe_always_decides_a_recheck_only_shortens_past_the_slack():
    budget = StepBudget(minutes=10.0, first_step=0, recheck_every=500)
    assert budget.decide(PROBE_STEPS, 0.3, 15.0, 2800) == PROBE_STEPS + 1950  # 585 s left
    assert budget.decide(PROBE_STEPS, 0.1, 15.0, 2800) == 2800                # all fit
    # at step 1000 with 300 s spent: 300 s left for 1000 more steps at 0.3 s, fits
    assert budget.decide(1000, 0.3, 300.0, 2000) is None
    # the host slowed to 0.4 s: 750 steps fit, 250 fewer; 100 s over, more than 3% of 600 s
    assert budget.decide(1000, 0.4, 300.0, 2000) == 1750
    # over by less than the slack (0.31 s: 967 fit, 33 x 0.31 = 10 s < 18 s): kept
    assert 33 * 0.31 < SLACK * 600 and budget.decide(1000, 0.31, 300.0, 2000) is None
    # faster than measured: never lengthened
    assert budget.decide(1000, 0.1, 300.0, 2000) is None


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
    # the run says it trained fewer steps than asked, in config.yaml and in its summary
    assert saved["train"]["fewer_steps"].startswith(
        f"train.budget_minutes=0.0001 fixed {PROBE_STEPS} of the 400 steps asked")
    assert f"fewer steps than configured: {saved['train']['fewer_steps']}" in result.stderr
    assert f"step {PROBE_STEPS}: train loss" in (run_dir / "train.log").read_text()
    again = ok(run([TRAIN, f"resume={run_dir}"], cwd=tmp_path))
    assert "already finished" in again.stderr
