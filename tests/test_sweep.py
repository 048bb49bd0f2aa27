"""A real (tiny) Hydra multirun sweep: TensorBoard serves it, and the summary script reads it.

One sweep of two attention variants x one seed is trained once per module; then
- TensorBoard is started on it (free local port) and its HTTP data API is queried for the runs,
  the scalar tags, the attention-map images and the HParams experiment, as a user's browser
  would;
- scripts/summarize_ablations.py turns it into the Markdown table and the PNG.
"""
from __future__ import annotations

import io
import json
import socket
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO_ROOT as REPO, TRAIN, corpus_args, write_corpus
from training.tb import MAP_GROUP

VARIANTS = ["correct", "mask_zero"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    corpus = write_corpus(root, 40_000, 8_000)
    out = root / "multirun"
    cmd = [sys.executable, TRAIN, "-m", "+experiment=smoke",
           f"attention={','.join(VARIANTS)}", "seed=0", *corpus_args(corpus, root / "cache"),
           "run_name=smoke-${attention.name}_seed${seed}",
           "train.max_steps=20", "train.eval_interval=10", f"hydra.sweep.dir={out}"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, payload: dict | None = None):
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_sweep_writes_one_run_directory_per_variant(sweep_dir):
    runs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert runs == [f"smoke-{v}_seed0" for v in VARIANTS]
    for run in runs:
        assert list((sweep_dir / run).glob("events.out.tfevents.*"))


def test_tensorboard_serves_runs_scalars_and_hparams(sweep_dir):
    port = free_port()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(sweep_dir),
                           "--host", "127.0.0.1", "--port", str(port), "--load_fast=false"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        runs = []
        while time.time() < deadline:  # TensorBoard loads event files in the background
            try:
                runs = get_json(f"{base}/data/runs")
                if len(runs) >= len(VARIANTS):
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert sorted(runs) == sorted(f"smoke-{v}_seed0" for v in VARIANTS), runs

        tags = get_json(f"{base}/data/plugin/scalars/tags")
        for v in VARIANTS:
            run_tags = set(tags[f"smoke-{v}_seed0"])
            assert {"train/loss", "val/loss", "val/causal_loss", "val/nats_per_char",
                    "train/lr", "train/grad_norm", "train/tokens_per_sec",
                    "weights/max_weight/layer0", "weights/entropy/layer0"} <= run_tags
            # Scalars sorts its sections by name and opens the first two: the losses'
            assert sorted({t.split("/")[0] for t in run_tags}) == ["train", "val", "weights"]
        causal = get_json(f"{base}/data/plugin/scalars/scalars?run=smoke-correct_seed0"
                          f"&tag=val%2Fcausal_loss")
        own = get_json(f"{base}/data/plugin/scalars/scalars?run=smoke-correct_seed0"
                       f"&tag=val%2Floss")
        assert [r[1:] for r in causal] == [r[1:] for r in own]  # a causal run's own loss

        scalars = get_json(f"{base}/data/plugin/scalars/scalars?run=smoke-correct_seed0&tag=train%2Floss")
        assert [row[1] for row in scalars] == [10, 20]  # [wall_time, step, value] rows

        # the weight on future keys: exactly 0 for the correct mask, large for mask_zero's leak
        for v, check in (("correct", lambda x: x == 0.0), ("mask_zero", lambda x: x > 0.2)):
            for layer in (0, 1):
                rows = get_json(f"{base}/data/plugin/scalars/scalars?run=smoke-{v}_seed0"
                                f"&tag=weights%2Ffuture_weight%2Flayer{layer}")
                assert [r[1] for r in rows] == [10, 20] and all(check(r[2]) for r in rows), rows

        check_attention_images(base)

        experiment = get_json(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        hparams = [h["name"] for h in experiment["hparamInfos"]]
        metrics = [m["name"]["tag"] for m in experiment["metricInfos"]]
        assert {"variant", "regime", "seed", "n_head", "mask_value"} <= set(hparams)
        # the five TensorBoard shows: what tells runs apart; the causal losses lead the metrics,
        # which are the runs' own series (no hparam/* chart repeats them)
        assert hparams[:5] == ["arm", "lr", "n_layer", "seed", "tokenizer"]
        assert all(h["differs"] for h in experiment["hparamInfos"][:5])
        assert not any(h["differs"] for h in experiment["hparamInfos"][5:])
        assert metrics[:4] == ["val/causal_loss", "val/nats_per_char", "val/loss", "train/loss"]
        assert not any(t.startswith("hparam/") for run in tags.values() for t in run)
        types = {h["name"]: h["type"] for h in experiment["hparamInfos"]}
        assert types["n_layer"] == types["seed"] == "DATA_TYPE_STRING"  # shown as 2, not 2.0000
        assert types["lr"] == "DATA_TYPE_FLOAT64"

        groups = get_json(f"{base}/data/plugin/hparams/session_groups",
                          {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                                                                       "STATUS_FAILURE", "STATUS_RUNNING"],
                           "colParams": [], "startIndex": 0, "sliceSize": 100})
        variants = {g["hparams"]["variant"] for g in groups["sessionGroups"]}
        assert variants == set(VARIANTS)
        assert {g["hparams"]["run"] for g in groups["sessionGroups"]} == \
            {f"smoke-{v}_seed0" for v in VARIANTS}
        assert {g["hparams"]["regime"] for g in groups["sessionGroups"]} == {"-"}  # no conf/regime
        assert {g["hparams"]["n_layer"] for g in groups["sessionGroups"]} == {"2"}
        values = {m["name"]["tag"]: m["value"] for m in groups["sessionGroups"][0]["metricValues"]}
        assert values["val/causal_loss"] > 0 and values["val/nats_per_char"] > 0
    finally:
        tb.terminate()
        tb.wait(timeout=20)


def check_attention_images(base: str) -> None:
    """The Images tab: one attention grid per layer and evaluation, the same window in every run;
    the correct run's future keys are all grey (weight exactly 0), mask_zero's none are."""
    from PIL import Image

    from training.attention_maps import FUTURE_RGB

    tags = get_json(f"{base}/data/plugin/images/tags")
    grey = {}
    for v in VARIANTS:
        run = f"smoke-{v}_seed0"
        assert set(tags[run]) == {f"{MAP_GROUP}/{kind}_layer{layer}" for layer in (0, 1)
                                  for kind in ("attention", "decoding")}, tags
        for layer in (0, 1):  # the generation path's maps, once at the end: no leak through a cache
            images = get_json(f"{base}/data/plugin/images/images?run={run}"
                              f"&tag={MAP_GROUP}%2Fdecoding_layer{layer}")
            assert [im["step"] for im in images] == [20]
            with urllib.request.urlopen(f"{base}/data/plugin/images/individualImage?"
                                        f"{images[-1]['query']}", timeout=10) as resp:
                picture = np.asarray(Image.open(io.BytesIO(resp.read())).convert("RGB"))
            grey["decoding", v, layer] = int((picture == FUTURE_RGB).all(-1).sum())
        for layer in (0, 1):
            images = get_json(f"{base}/data/plugin/images/images?run={run}"
                              f"&tag={MAP_GROUP}%2Fattention_layer{layer}")
            assert [im["step"] for im in images] == [10, 20]
            with urllib.request.urlopen(f"{base}/data/plugin/images/individualImage?"
                                        f"{images[-1]['query']}", timeout=10) as resp:
                png = resp.read()
            picture = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            grey[v, layer] = int((picture == FUTURE_RGB).all(-1).sum())
            sizes = grey.setdefault(("size", layer), picture.shape)
            assert picture.shape == sizes  # the same window, so the same picture size
            assert picture.shape[1] == 350  # TensorBoard's card: drawn at the size it is shown
    # smoke model: 4 heads, a 32-token window: the sharpest head at 9 x 9 pixels per weight,
    # then every head as a thumbnail of 2 x 2 pixels per weight
    assert grey["correct", 0] == grey["correct", 1] == (32 * 31 // 2) * (81 + 4 * 4)
    assert grey["mask_zero", 0] == grey["mask_zero", 1] == 0
    assert {grey["decoding", v, layer] for v in VARIANTS for layer in (0, 1)} == \
        {grey["correct", 0]}


def test_summary_script_writes_table_and_png(sweep_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_ablations.py"),
                           f"sweep={sweep_dir}", f"out={tmp_path}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "ablations.md").read_text()
    assert "nats per token" in table and '"a ± b" is the mean ± the' in table  # units, legend
    first, _, second = table.partition("The second table")  # (decoding: through the KV cache)
    rows = [line for line in first.splitlines() if line.startswith("| smoke |")]
    assert [r.split("|")[2].strip() for r in rows] == VARIANTS  # correct first, then the pitfall
    decoding = [line for line in second.splitlines() if line.startswith("| smoke |")]
    assert [r.split("|")[2].strip() for r in decoding] == VARIANTS  # every run scored it too
    effect = rows[1].split("|")[7].strip()
    assert effect.startswith(("+", "-")) and float(effect) == pytest.approx(float(effect))
    for name in ("ablations.png", "ablation_maps.png"):  # curves, and the maps side by side
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # the costs file the attention checker quotes: the pitfall's effect, from these runs
    costs = json.loads((tmp_path / "pitfall_costs.json").read_text())
    assert costs["studies"] == {"smoke": str(sweep_dir)}  # the sweep's +experiment=
    (entry,) = costs["costs"]["mask_zero"]
    assert entry["regime"] == "smoke" and "20 steps" in entry["setting"]
    assert entry["causal"]["effect"] == pytest.approx(float(effect), abs=1e-3)
    assert entry["causal"]["se"] is None and entry["shows_in"] is None  # one seed: no spread


def test_summary_script_rejects_a_directory_without_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_ablations.py"),
                           f"sweep={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "no runs" in proc.stderr and "Traceback" not in proc.stderr


def test_summary_script_keeps_files_it_did_not_write_unless_told(sweep_dir, tmp_path):
    """`out=docs` must not overwrite the README's pictures unasked; the study's own folder and
    overwrite=true are written."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ablations.png").write_bytes(b"committed")
    proc = subprocess.run([sys.executable, "-m", "scripts.summarize_ablations",
                           f"sweep={sweep_dir}", f"out={docs}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "overwrite=true" in proc.stderr, proc.stderr
    assert (docs / "ablations.png").read_bytes() == b"committed"
    assert not (docs / "ablations.md").exists()
    proc = subprocess.run([sys.executable, "-m", "scripts.summarize_ablations",
                           f"sweep={sweep_dir}", f"out={docs}", "overwrite=true"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and (docs / "ablations.png").read_bytes()[:4] == b"\x89PNG"


def test_summary_checks_every_run_and_the_layer_before_writing_anything(sweep_dir, tmp_path):
    """Issue 28: the summary wrote (and replaced) ablations.md and its figure, then failed on a
    run without a checkpoint; layer=99 drew the last layer titled "layer 99"."""
    from scripts.summarize_ablations import SummaryArgs, summarize
    from safeio.cli import UserError

    out = tmp_path / "out"
    with pytest.raises(UserError, match=r"layer must be below the 2 layers of .*, got 99"):
        summarize(SummaryArgs(sweep=str(sweep_dir), out=str(out), layer=99))
    assert not out.exists()
    study = tmp_path / "study"
    shutil.copytree(sweep_dir, study)
    (study / "ablations.md").write_text("the study's own summary")
    broken = next(study.rglob("smoke-mask_zero_seed0"))
    for entry in (broken / "checkpoints").iterdir():  # the folder stays, its checkpoints go
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    proc = subprocess.run([sys.executable, "-m", "scripts.summarize_ablations", f"sweep={study}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (study / "ablations.md").read_text() == "the study's own summary"
    assert not (study / "ablations.png").exists()


def test_runs_command_lists_and_compares_the_sweep(sweep_dir):
    proc = subprocess.run([sys.executable, "-m", "scripts.runs", f"root={sweep_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()
            if line.startswith("smoke-")}
    assert set(rows) == {f"smoke-{v}_seed0" for v in VARIANTS}
    # corpus (the first training file), variant, tokenizer, steps
    assert rows["smoke-correct_seed0"][1] == str(sweep_dir.parent / "corpus" / "train.txt")
    assert rows["smoke-correct_seed0"][2:5] == ["correct", "char", "20"]
    a, b = (sweep_dir / f"smoke-{v}_seed0" for v in VARIANTS)
    proc = subprocess.run([sys.executable, "-m", "scripts.runs", f"a={a}", f"b={b}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert any(line.split() == ["attention.name", "correct", "mask_zero"]
               for line in out.splitlines()), out
    assert "causal val (nats/token)" in out and "along training" in out
    # the same seed and steps: only the attention and the run's name differ
    differ = out.split("config values that differ:")[1].split("final scores:")[0]
    keys = {line.split()[0] for line in differ.strip().splitlines()[2:]}
    assert {k.split(".")[0] for k in keys} == {"attention", "run_name"}, keys


def test_the_summary_finds_runs_in_the_study_s_seed_folders(tmp_path):
    """The study puts each seed's runs in seed<N>/ (TensorBoard draws a logdir of 9 runs, not
    one of 72); flat sweeps (a sweep of one's own) keep working."""
    from scripts.summarize_ablations import run_dirs

    for path in ("seed10/leak-correct_seed10", "seed10/leak-mask_zero_seed10",
                 "seed11/leak-correct_seed11", "smoke-correct_seed0", "seed11/notes"):
        (tmp_path / path).mkdir(parents=True)
    assert [str(p.relative_to(tmp_path)) for p in run_dirs(tmp_path)] == [
        "seed10/leak-correct_seed10", "seed10/leak-mask_zero_seed10",
        "seed11/leak-correct_seed11", "smoke-correct_seed0"]


def test_the_summary_refuses_a_run_that_did_not_finish(sweep_dir, tmp_path):
    """A run stopped before its last step (here: its config asks for 40 steps, it trained 20)
    has losses that are no result: the summary names it and the command that continues it."""
    from scripts.summarize_ablations import SummaryArgs, summarize
    from safeio.cli import UserError

    study = tmp_path / "study"
    shutil.copytree(sweep_dir, study)
    stopped = next(study.rglob("smoke-mask_zero_seed0"))
    config = stopped / "config.yaml"
    config.write_text(config.read_text().replace("max_steps: 20", "max_steps: 40"))
    with pytest.raises(UserError, match=rf"smoke-mask_zero_seed0 did not finish \(step 20 of 40\)"
                                        rf".*resume={study}"):
        summarize(SummaryArgs(sweep=str(study), out=str(tmp_path / "out")))
