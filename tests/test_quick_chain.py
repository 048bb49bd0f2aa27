"""The fast tier's one end-to-end chain, as a user runs it: train a few steps, interrupt with
Ctrl-C, resume, sample. Three genuine processes (`python train.py`, again with resume=, then
`python generate.py`), about half a minute on 2 cores; the longer runs, the kills at any instant
and the bad inputs are in the slow tier (tests/test_end_to_end.py, test_reliability.py,
test_cli_errors.py).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time

from helpers import GENERATE, SCRIPT_ENV, TRAIN, corpus_args, ok, run, scalars, write_corpus
from safeio.checkpoint import load_state
from training.checkpoint import latest_checkpoint


def test_train_interrupt_resume_sample(tmp_path):
    corpus = write_corpus(tmp_path)
    run_dir = tmp_path / "run"
    # far more steps than it will get to: Ctrl-C comes once the first evaluation is logged
    proc = subprocess.Popen([sys.executable, TRAIN, "+experiment=smoke",
                             *corpus_args(corpus, tmp_path / "cache"), "train.max_steps=100000",
                             "train.eval_interval=10", f"hydra.run.dir={run_dir}"],
                            cwd=tmp_path, env=SCRIPT_ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    log = run_dir / "train.log"
    while proc.poll() is None and time.monotonic() < deadline:
        if log.is_file() and "step 10:" in log.read_text():
            break
        time.sleep(0.05)
    assert proc.poll() is None, f"train.py ended before it was interrupted\n{proc.communicate()}"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in out + err
    assert f"python train.py resume={run_dir}" in err  # what to type next
    stopped = load_state(latest_checkpoint(run_dir))["step"]
    assert 10 <= stopped < 100000

    end = (stopped // 10 + 2) * 10 + 3  # not a multiple of log_interval (10)
    resumed = ok(run([TRAIN, f"resume={run_dir}", f"train.max_steps={end}"], cwd=tmp_path))
    assert f"from step {stopped}" in resumed.stderr
    assert latest_checkpoint(run_dir).name == f"step_{end:08d}"
    curves = scalars(run_dir)
    logged = [step for step, _ in curves["val/loss"]]
    assert logged == sorted(set(logged)) and logged[-1] == end  # none lost or repeated
    assert curves["train/loss"][-1][0] == end  # the last step's loss, not one 3 steps old

    sample = ok(run([GENERATE, f"run={run_dir}", "prompt=ROMEO:", "max_new_tokens=20"],
                    cwd=tmp_path))
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) >= len("ROMEO:") + 20
