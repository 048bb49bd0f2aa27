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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO_ROOT as REPO, TRAIN, corpus_args, write_corpus

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
            assert {"train/loss", "val/loss", "lr", "grad_norm", "tokens_per_sec",
                    "attn/max_weight/layer0", "attn/entropy/layer0"} <= run_tags
        assert "val/causal_loss" in tags["smoke-mask_zero_seed0"]
        assert "val/causal_loss" not in tags["smoke-correct_seed0"]

        scalars = get_json(f"{base}/data/plugin/scalars/scalars?run=smoke-correct_seed0&tag=train%2Floss")
        assert [row[1] for row in scalars] == [10, 20]  # [wall_time, step, value] rows

        # the weight on future keys: exactly 0 for the correct mask, large for mask_zero's leak
        for v, check in (("correct", lambda x: x == 0.0), ("mask_zero", lambda x: x > 0.2)):
            for layer in (0, 1):
                rows = get_json(f"{base}/data/plugin/scalars/scalars?run=smoke-{v}_seed0"
                                f"&tag=attn%2Ffuture_weight%2Flayer{layer}")
                assert [r[1] for r in rows] == [10, 20] and all(check(r[2]) for r in rows), rows

        check_attention_images(base)

        experiment = get_json(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        hparams = [h["name"] for h in experiment["hparamInfos"]]
        metrics = [m["name"]["tag"] for m in experiment["metricInfos"]]
        assert {"variant", "seed", "n_head", "mask_value"} <= set(hparams)
        # what tells runs apart leads the table, and the causal loss leads the metrics
        assert hparams[:3] == ["regime", "seed", "variant"]
        assert all(h["differs"] for h in experiment["hparamInfos"][:3])
        assert not any(h["differs"] for h in experiment["hparamInfos"][3:])
        assert metrics[:2] == ["hparam/causal_val_loss", "hparam/val_loss"]

        groups = get_json(f"{base}/data/plugin/hparams/session_groups",
                          {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                                                                       "STATUS_FAILURE", "STATUS_RUNNING"],
                           "colParams": [], "startIndex": 0, "sliceSize": 100})
        variants = {g["hparams"]["variant"] for g in groups["sessionGroups"]}
        assert variants == set(VARIANTS)
        assert {g["hparams"]["run"] for g in groups["sessionGroups"]} == \
            {f"smoke-{v}_seed0" for v in VARIANTS}
        assert {g["hparams"]["regime"] for g in groups["sessionGroups"]} == {"-"}  # no conf/regime
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
        assert set(tags[run]) == {"attention/layer0", "attention/layer1"}, tags
        for layer in (0, 1):
            images = get_json(f"{base}/data/plugin/images/images?run={run}"
                              f"&tag=attention%2Flayer{layer}")
            assert [im["step"] for im in images] == [10, 20]
            with urllib.request.urlopen(f"{base}/data/plugin/images/individualImage?"
                                        f"{images[-1]['query']}", timeout=10) as resp:
                png = resp.read()
            picture = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
            grey[v, layer] = int((picture == FUTURE_RGB).all(-1).sum())
            sizes = grey.setdefault(("size", layer), picture.shape)
            assert picture.shape == sizes  # the same window, so the same picture size
    # smoke model: 4 heads, a 32-token window, 9 x 9 pixels per weight
    assert grey["correct", 0] == grey["correct", 1] == 4 * (32 * 31 // 2) * 81
    assert grey["mask_zero", 0] == grey["mask_zero", 1] == 0


def test_summary_script_writes_table_and_png(sweep_dir, tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_ablations.py"),
                           str(sweep_dir), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = (tmp_path / "ablations.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| smoke |")]
    assert [r.split("|")[2].strip() for r in rows] == VARIANTS  # correct first, then the pitfall
    effect = rows[1].split("|")[7].strip()
    assert effect.startswith(("+", "-")) and float(effect) == pytest.approx(float(effect))
    for name in ("ablations.png", "ablation_maps.png"):  # curves, and the maps side by side
        png = (tmp_path / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_summary_script_rejects_a_directory_without_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_ablations.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "no runs" in proc.stderr and "Traceback" not in proc.stderr
