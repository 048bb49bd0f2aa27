"""A real (tiny) Hydra multirun sweep: TensorBoard serves it, and the summary script reads it.

One sweep of two attention variants x one seed is trained once per module; then
- TensorBoard is started on it (free local port) and its HTTP data API is queried for the runs,
  the scalar tags and the HParams experiment, as a user's browser would;
- scripts/summarize_ablations.py turns it into the Markdown table and the PNG.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import shakespeare_like

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["correct", "mask_zero"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweep")
    (root / "train.txt").write_text(shakespeare_like(40_000, seed=1))
    (root / "val.txt").write_text(shakespeare_like(8_000, seed=2))
    out = root / "multirun"
    cmd = [sys.executable, str(REPO / "train.py"), "-m", "+experiment=smoke",
           f"attention={','.join(VARIANTS)}", "seed=0",
           "data=text_files", f"data.train_files=[{root / 'train.txt'}]",
           f"data.val_files=[{root / 'val.txt'}]", f"data.cache_dir={root / 'cache'}",
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

        experiment = get_json(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        hparams = {h["name"] for h in experiment["hparamInfos"]}
        metrics = {m["name"]["tag"] for m in experiment["metricInfos"]}
        assert {"variant", "seed", "n_head", "mask_value"} <= hparams
        assert {"hparam/val_loss", "hparam/causal_val_loss"} <= metrics

        groups = get_json(f"{base}/data/plugin/hparams/session_groups",
                          {"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS",
                                                                       "STATUS_FAILURE", "STATUS_RUNNING"],
                           "colParams": [], "startIndex": 0, "sliceSize": 100})
        variants = {g["hparams"]["variant"] for g in groups["sessionGroups"]}
        assert variants == set(VARIANTS)
    finally:
        tb.terminate()
        tb.wait(timeout=20)


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
    png = (tmp_path / "ablations.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_summary_script_rejects_a_directory_without_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "summarize_ablations.py"),
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "no runs" in proc.stderr and "Traceback" not in proc.stderr
