"""How a run ends, piece by piece (train.py's `stop_after_signal` and `stopped_early`, the units of
training/summary.py), on stand-ins: the whole runs that stop by a signal, by the clock and by the
guard are tests/test_reliability.py, tests/test_newcomer.py and tests/test_overfitting.py (slow)."""
from __future__ import annotations

import logging
import math
import signal
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from safeio.cli import python_command
from training.checkpoint import Progress
from training.config import Config
from training.summary import to_bpc, to_nats_per_char


class Writer:
    closed = False

    def close(self):
        self.closed = True


def ended_run(step: int = 700, **data) -> SimpleNamespace:
    cfg = Config()
    cfg.train.max_steps, cfg.train.max_minutes = 1000, 1.5
    for key, value in data.items():
        setattr(cfg.data, key, value)
    return SimpleNamespace(cfg=cfg, progress=Progress(step=step), saved_at=step, writer=Writer(),
                           run_dir=Path("runs/x"), world=SimpleNamespace(is_main=False))


ANOTHER = "a signal to another process"


@pytest.mark.parametrize("name,code,who", [("SIGINT", 128 + signal.SIGINT, "SIGINT"),
                                           (None, 128 + signal.SIGTERM, ANOTHER)])
def test_a_signal_stops_with_the_command_that_continues(caplog, name, code, who):
    """Saved at this step already: no second checkpoint; the exit code is the signal's (SIGTERM
    where it reached another process), and the resume command is pasteable."""
    import train

    run = ended_run()
    with caplog.at_level(logging.INFO, logger="train"), pytest.raises(SystemExit) as exited:
        train.stop_after_signal(run, SimpleNamespace(signal=name))
    assert exited.value.code == code and run.writer.closed
    assert caplog.messages == [f"stopped by {who} at step 700; checkpoint saved. Continue "
                               f"with:\n  {python_command()} train.py resume=runs/x"]


def test_the_resume_command_keeps_a_cache_dir_of_its_own(caplog):
    import train

    with caplog.at_level(logging.INFO, logger="train"), pytest.raises(SystemExit):
        train.stop_after_signal(ended_run(cache_dir="/tmp/c"), SimpleNamespace(signal="SIGTERM"))
    assert caplog.messages[0].endswith("train.py resume=runs/x data.cache_dir=/tmp/c")


def test_a_run_cut_short_says_by_what(caplog):
    import train

    run = ended_run()
    with caplog.at_level(logging.INFO, logger="train"):
        train.stopped_early(run, out_of_time=True)
    assert caplog.messages == ["time budget of 1.5 min reached at step 700"]
    assert run.cfg.train.fewer_steps == ("train.max_minutes=1.5 stopped it at step 700 of "
                                         "train.max_steps=1,000")
    train.stopped_early(run, out_of_time=False)
    assert run.cfg.train.fewer_steps == ("train.early_stop stopped it at step 700 of "
                                         "train.max_steps=1,000: the validation loss was rising")


def test_the_units_count_every_predicted_token_over_the_characters():
    """1,001 validation tokens (1,000 predicted) over 4,000 characters: a loss of 2 nats a token
    is 0.5 nats a character, 0.5 / ln 2 bits."""
    corpus = SimpleNamespace(validation=np.zeros(1001), n_chars={"validation": 4000})
    run = SimpleNamespace(corpus=corpus)
    assert to_nats_per_char(run, 2.0) == pytest.approx(0.5)
    assert to_bpc(run, 2.0) == pytest.approx(0.5 / math.log(2))
