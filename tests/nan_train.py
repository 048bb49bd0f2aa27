"""train.py with the loss made NaN at one step: the fault train.on_nonfinite is there for.

    python tests/nan_train.py STEP [train.py arguments]

The step model (what the training step calls: the model under DDP and torch.compile, as train.py
built it) is wrapped from outside the loop, so that the loss of step STEP is NaN before backward
and its gradients are NaN too, as a diverging run's would be. Run like train.py itself, through
the fork server or as a process (tests/test_reliability.py, tests/test_cuda.py).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402

STEP = int(sys.argv.pop(1))
build_run = train.build_run


def build_run_with_nan(*args, **kwargs):
    run = build_run(*args, **kwargs)
    if run is not None:
        inner, progress = run.step_model, run.progress

        def step_model(x, y):
            logits, loss = inner(x, y)
            return logits, loss * float("nan") if progress.step == STEP else loss

        run.step_model = step_model
    return run


train.build_run = build_run_with_nan
train.cli()
