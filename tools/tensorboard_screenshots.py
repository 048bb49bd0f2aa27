"""Serve TensorBoard on a logdir or an ablation study and photograph its tabs with a real browser
(headless Chromium), to see what a user sees.

    python -m tools.tensorboard_screenshots logdir=runs/pitfalls out=docs overwrite=true
    python -m tools.tensorboard_screenshots study=runs/ablations/<date> [out=DIR] [seed=N]

logdir= writes tensorboard_leak.png (the Custom Scalars tab) and tensorboard_maps.png (Images)
into out= (else the logdir); study= writes tensorboard_scalars.png and tensorboard_images.png
(one seed of every arm: the lowest, or seed=) and tensorboard_hparams.png (the whole study) into
out= (else the study's directory): the pictures of docs/tensorboard.md, replaced only with
overwrite=true. Needs Debian's `chromium`, started with no network but the local TensorBoard
and a throw-away profile. Not in the test suite: tests/test_sweep.py checks the same data
through TensorBoard's HTTP API.

TensorBoard is a single-page app that fetches its data after the page loads, so each picture
is taken by `chromium --screenshot` after a budget of virtual time in which the page settles.
"""
from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from safeio.cli import UserError, parse_key_values, run_cli
from guard.run_dir import event_files
from safeio.files import check_outputs

# The page the README sends a learner to: the Custom Scalars tab, unsmoothed (its smoothing
# would draw the leak's last causal loss 0.7 below the value logged).
LEAK_PAGE = "/#custom_scalars&_smoothingWeight=0"

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--force-device-scale-factor=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoard:
    """`tensorboard --logdir` on a free local port, for the duration of a `with` block."""

    def __init__(self, logdir: Path, expected_runs: int):
        self.logdir, self.expected_runs = logdir, expected_runs
        self.url = f"http://127.0.0.1:{free_port()}"

    def __enter__(self) -> "TensorBoard":
        port = self.url.rsplit(":", 1)[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.logdir),
             "--host", "127.0.0.1", "--port", port, "--load_fast=false"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 180
        while time.time() < deadline:  # event files load in the background
            try:
                if self.loaded():
                    return self
            except OSError:
                pass
            time.sleep(1)
        self.__exit__()
        raise UserError(f"TensorBoard did not load {self.expected_runs} runs from "
                        f"{self.logdir} within 3 minutes")

    def loaded(self) -> bool:
        """Whether every run is in, to its last events: its HParams session, written when the run
        finished (a run's maps come before it; a learner's layer's run has none)."""
        groups = self.get("/data/plugin/hparams/session_groups", {
            "experimentName": "", "startIndex": 0, "sliceSize": 100_000, "colParams": [],
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                "STATUS_RUNNING"]})
        sessions = sum(len(g["sessions"]) for g in groups.get("sessionGroups", []))
        return sessions >= self.expected_runs

    def get(self, path: str, payload: dict | None = None):
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            return json.loads(resp.read())

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def screenshot(chromium: str, url: str, out: Path, size: tuple[int, int], budget_ms: int) -> None:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        proc = subprocess.run(
            [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             f"--window-size={size[0]},{size[1]}", f"--virtual-time-budget={budget_ms}",
             f"--screenshot={out}", url],
            capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.is_file():
        raise UserError(f"chromium failed on {url}: {proc.stderr.strip()[-500:]}")


def one_seed(runs: list[Path], seed: Optional[int], into: Path) -> tuple[Path, int]:
    """The TensorBoard logdir of one seed's runs (the lowest seed, unless given) and their
    number: the study's seed<N>/ folder, or for a study of an earlier layout (every run in one
    folder) a folder of links to them in `into`."""
    seeds = {int(m[1]) for run in runs if (m := re.search(r"_seed(\d+)$", run.name))}
    if not seeds or (seed is not None and seed not in seeds):
        raise UserError(f"no runs named <name>_seed{'<N>' if seed is None else seed} in "
                        f"{runs[0].parent}")
    seed = min(seeds) if seed is None else seed
    chosen = [run for run in runs if run.name.endswith(f"_seed{seed}")]
    if all(run.parent.name == f"seed{seed}" for run in chosen):
        return chosen[0].parent, len(chosen)
    for run in chosen:
        (into / run.name).symlink_to(run.resolve(), target_is_directory=True)
    return into, len(chosen)


def shrink(path: Path, max_bytes: int = 300_000) -> None:
    """Keep a picture for docs/ under max_bytes: a palette PNG, halved in size if need be."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    while True:
        image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        if path.stat().st_size <= max_bytes or image.width < 600:
            return
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)


@dataclass
class ScreenshotArgs:
    logdir: Optional[str] = None  # a folder of runs (runs/pitfalls): the landing page and the maps
    study: Optional[str] = None  # or a study's directory (runs/ablations/<date>)
    out: Optional[str] = None    # where the pictures go (null: the logdir's or study's directory)
    # the seed whose runs the Scalars and Images pictures show (null: the lowest)
    seed: Optional[int] = None
    budget_ms: int = 20_000      # virtual time each page gets to load before its picture
    overwrite: bool = False      # replace pictures already in out= (docs/ holds those of docs/tensorboard.md)


def runs_in(folder: Path) -> list[Path]:
    """The runs (folders of TensorBoard events) under folder, each checked readable."""
    runs = sorted({p.parent for p in folder.rglob("events.out.*")}) if folder.is_dir() else []
    if not runs:
        raise UserError(f"no runs with TensorBoard events in {folder}")
    for run in runs:  # (TensorBoard itself would hang on a FIFO named like an events file)
        event_files(run)
    return runs


def photograph(args: ScreenshotArgs) -> list[Path]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise UserError("no chromium on PATH (apt-get install chromium)")
    if (args.logdir is None) == (args.study is None):
        raise UserError("give logdir= (a folder of runs) or study= (a study's directory)")
    if args.logdir is not None:
        return photograph_logdir(chromium, args)
    study = Path(args.study)
    runs = runs_in(study)
    out = Path(args.out) if args.out else study
    names = ("tensorboard_scalars.png", "tensorboard_images.png", "tensorboard_hparams.png")
    scalars, images, hparams = files = [out / name for name in names]
    check_outputs(files, args.overwrite, own=study)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="one-seed-") as links:
        logdir, n = one_seed(runs, args.seed, Path(links))
        with TensorBoard(logdir, n) as tb:
            screenshot(chromium, f"{tb.url}/#scalars", scalars, (1600, 1200), args.budget_ms)
            screenshot(chromium, f"{tb.url}/#images", images, (1600, 1450), args.budget_ms)
    with TensorBoard(study, len(runs)) as tb:
        screenshot(chromium, f"{tb.url}/#hparams", hparams, (1600, 1000), args.budget_ms)
    for path in files:
        shrink(path)
        print(f"wrote {path}")
    return files


def photograph_logdir(chromium: str, args: ScreenshotArgs) -> list[Path]:
    """The Custom Scalars tab (training/tb.py's LEAK_LAYOUT), at a laptop's window size, and the
    Images tab."""
    logdir = Path(args.logdir)
    runs = runs_in(logdir)
    out = Path(args.out) if args.out else logdir
    files = [out / "tensorboard_leak.png", out / "tensorboard_maps.png"]
    check_outputs(files, args.overwrite, own=logdir)
    out.mkdir(parents=True, exist_ok=True)
    with TensorBoard(logdir, len(runs)) as tb:
        screenshot(chromium, tb.url + LEAK_PAGE, files[0], (1440, 900), args.budget_ms)
        screenshot(chromium, f"{tb.url}/#images", files[1], (1440, 1200), args.budget_ms)
    for path in files:
        shrink(path)
        print(f"wrote {path}")
    return files


def main(argv: list[str]) -> int:
    usage = ("usage: python -m tools.tensorboard_screenshots logdir=DIR | study=DIR [out=DIR] "
             "[seed=N] [overwrite=true]")

    def body() -> None:
        photograph(parse_key_values(argv, ScreenshotArgs, usage, about=__doc__.split("\n\n")[0]))
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
