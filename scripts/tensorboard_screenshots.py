"""Serve TensorBoard on an ablation study and photograph its Images and HParams tabs with a real
browser (headless Chromium), to see what a user sees.

    python -m scripts.tensorboard_screenshots runs/ablations/<date> [--out docs] [--seed 0]

Writes <out>/tensorboard_images.png (the attention maps of one seed of every arm, side by side:
the lowest seed, or --seed)
and <out>/tensorboard_hparams.png (the HParams table of the whole study). Needs Debian's
`chromium` (apt-get install chromium); it is started with no network but the local TensorBoard
and a throw-away profile. Not part of the test suite: the same data is checked through
TensorBoard's HTTP API in tests/test_sweep.py.

TensorBoard is a single-page app that fetches its data after the page loads, so each picture
is taken by `chromium --screenshot` after a budget of virtual time in which the page settles.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

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
        raise SystemExit(f"error: TensorBoard did not load {self.expected_runs} runs from "
                         f"{self.logdir} within 3 minutes")

    def loaded(self) -> bool:
        """Whether every run is in, to its last events: its images and its HParams session
        (written when the run finished)."""
        images = self.get("/data/plugin/images/tags")
        groups = self.get("/data/plugin/hparams/session_groups", {
            "experimentName": "", "startIndex": 0, "sliceSize": 100_000, "colParams": [],
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                "STATUS_RUNNING"]})
        sessions = sum(len(g["sessions"]) for g in groups.get("sessionGroups", []))
        return len(images) >= self.expected_runs and sessions >= self.expected_runs

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
        raise SystemExit(f"error: chromium failed on {url}: {proc.stderr.strip()[-500:]}")


def one_seed(runs: list[Path], seed: int | None, into: Path) -> int:
    """Links to the runs of one seed (the lowest, unless given), so that the Images tab shows
    every arm once, side by side."""
    seeds = {int(m[1]) for run in runs if (m := re.search(r"_seed(\d+)$", run.name))}
    if not seeds or (seed is not None and seed not in seeds):
        raise SystemExit(f"error: no runs named <name>_seed{'<N>' if seed is None else seed} "
                         f"in {runs[0].parent}")
    seed = min(seeds) if seed is None else seed
    chosen = [run for run in runs if run.name.endswith(f"_seed{seed}")]
    for run in chosen:
        (into / run.name).symlink_to(run.resolve(), target_is_directory=True)
    return len(chosen)


def shrink(path: Path, max_bytes: int = 300_000) -> None:
    """Keep a picture for the README under max_bytes: a palette PNG, halved in size if need be."""
    from PIL import Image

    image = Image.open(path).convert("RGB")
    while True:
        image.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
        if path.stat().st_size <= max_bytes or image.width < 600:
            return
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", type=Path, help="a sweep directory (runs/ablations/<date>)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--seed", type=int, default=None,
                        help="the seed whose maps are shown (default: the lowest)")
    parser.add_argument("--budget-ms", type=int, default=20_000,
                        help="virtual time each page gets to load before its picture")
    args = parser.parse_args(argv)
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: no chromium on PATH (apt-get install chromium)", file=sys.stderr)
        return 2
    runs = sorted(p for p in args.study.iterdir() if p.is_dir() and any(p.glob("events.out.*"))) \
        if args.study.is_dir() else []
    if not runs:
        print(f"error: no runs with TensorBoard events in {args.study}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="one-seed-") as subset:
        n = one_seed(runs, args.seed, Path(subset))
        with TensorBoard(Path(subset), n) as tb:
            images = args.out / "tensorboard_images.png"
            screenshot(chromium, f"{tb.url}/#images", images, (1600, 1450), args.budget_ms)
    with TensorBoard(args.study, len(runs)) as tb:
        hparams = args.out / "tensorboard_hparams.png"
        screenshot(chromium, f"{tb.url}/#hparams", hparams, (1600, 1000), args.budget_ms)
    for path in (images, hparams):
        shrink(path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
