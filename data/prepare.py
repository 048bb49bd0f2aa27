"""Tokenize a corpus once and keep it on disk, so the next run starts in seconds.

Layout of one cache entry, keyed by corpus (the hash of its texts) and tokenizer:
    <cache_dir>/tokens/<corpus key>-<tokenizer key>/
        train.bin, validation.bin   raw token ids (uint16, or uint32 for big vocabularies)
        tokenizer.json              the fitted tokenizer
        meta.json                   dtype, token and character counts

An entry is built by one process at a time (data.cache_lock) in a temporary directory, then renamed
into place whole: an entry that exists is complete. Opening one checks it (sizes, the tokenizer,
every id inside the vocabulary: safeio/corpus.py), since a cache can be damaged or handed over.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from typing import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data.cache_lock import cache_lock
from data.config import DataConfig, TokenizerConfig
from data.corpus import check_split_overlap, corpus_key, documents
from data.tokenizer import (ENCODE_CALL_CHUNKS, build_tokenizer, in_worker, stream_chunks,
                            token_dtype)
from safeio.cli import CorpusError, UserError, first_line
from safeio.corpus import MAX_TOKENIZER_BYTES, read_cache_entry
from safeio.files import read_bytes

SPLITS = ("train", "validation")


@dataclass
class PreparedCorpus:
    """Token ids of both splits (read-only memmaps) and the tokenizer that made them."""

    train: np.ndarray
    validation: np.ndarray
    tokenizer: Tokenizer
    n_chars: dict  # characters per split, to turn nats/token into bits/character
    warnings: list = field(default_factory=list)  # what the run should say about its data

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def tokenizer_key(cfg: TokenizerConfig) -> str:
    ident = {"kind": cfg.kind.value}
    if cfg.kind.value == "bpe":
        ident.update(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency)
    if cfg.kind.value == "file":  # the file's content: an edited tokenizer re-tokenizes
        content = read_bytes(Path(cfg.path), "tokenizer.path", MAX_TOKENIZER_BYTES)
        ident.update(content=hashlib.sha256(content).hexdigest())
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]


def cache_entry(data: DataConfig, tok_cfg: TokenizerConfig) -> Path:
    """The cache directory of this corpus tokenized this way."""
    return Path(data.cache_dir) / "tokens" / f"{corpus_key(data)}-{tokenizer_key(tok_cfg)}"


def prepare_corpus(data: DataConfig, tok_cfg: TokenizerConfig) -> PreparedCorpus:
    """The tokenized corpus, from the cache or built into it. Every failure below (undecodable
    text, an unreadable file, a tokenizer that cannot be built) comes out as a CorpusError."""
    try:
        overlap = check_split_overlap(data)
        directory = cache_entry(data, tok_cfg)
        if not os.path.lexists(directory / "meta.json"):
            with cache_lock(Path(data.cache_dir), "the token cache"):
                if not os.path.lexists(directory / "meta.json"):  # not built while we waited
                    _build(data, tok_cfg, directory)
        meta, splits, tokenizer = read_cache_entry(directory, SPLITS)
        return PreparedCorpus(splits["train"], splits["validation"], tokenizer, meta["n_chars"],
                              [overlap] if overlap else [])
    except UserError:
        raise
    except (OSError, ValueError, OverflowError) as exc:  # includes UnicodeDecodeError
        raise CorpusError(f"cannot read or tokenize the corpus: {root_cause(exc)}") from exc
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "datasets":
            raise
        raise CorpusError(f"cannot read the corpus files: {root_cause(exc)}") from exc


def root_cause(exc: BaseException) -> str:
    """The innermost cause of a chained exception, in one line (datasets wraps the real error)."""
    seen = exc
    while (seen.__cause__ or seen.__context__) is not None and len(str(seen)) < 10_000:
        seen = seen.__cause__ or seen.__context__
    text = first_line(seen)
    return text if seen is exc else f"{type(seen).__name__}: {text}"


def _build(data: DataConfig, tok_cfg: TokenizerConfig, directory: Path) -> None:
    """Build the entry in a directory of its own, then rename it into place (under the lock)."""
    print(f"tokenizing corpus into {directory} (once) ...", file=sys.stderr)
    for stale in directory.parent.glob(".tmp-*"):  # left by builders that were killed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = directory.with_name(f".tmp-{directory.name}-{uuid.uuid4().hex[:12]}")
    try:
        _tokenize(data, tok_cfg, tmp)
        if directory.exists():  # an unfinished entry of an earlier version
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tokenize(data: DataConfig, tok_cfg: TokenizerConfig, directory: Path) -> None:
    """The entry's files, streamed: the tokenizer is fitted on the training text piece by piece,
    and each split is encoded a few pieces at a time, its ids appended to its .bin file, so that
    memory holds a block of text and a call's ids whatever the size of the corpus
    (docs/data.md measures it)."""
    for split in SPLITS:
        if not any(piece.strip() for piece in _pieces(data, split, final_separator=True)):
            raise CorpusError(f"the {split} split of the corpus is empty")
    # fitted on the training documents as they appear in the stream: with their separator
    tokenizer = build_tokenizer(tok_cfg, _pieces(data, "train", final_separator=True))
    dtype = token_dtype(tokenizer.get_vocab_size())
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"n_tokens": {}, "n_chars": {}, "vocab_size": tokenizer.get_vocab_size(),
            "dtype": np.dtype(dtype).name}
    for split in SPLITS:
        n_tokens = n_chars = 0
        with open(directory / f"{split}.bin", "wb") as f:
            for call in _calls(_pieces(data, split, final_separator=False)):
                for encoding in in_worker(tokenizer.encode_batch, call, add_special_tokens=False):
                    ids = np.asarray(encoding.ids, dtype=dtype)
                    f.write(ids.tobytes())
                    n_tokens += ids.size
                n_chars += sum(map(len, call))
            f.flush()
            os.fsync(f.fileno())
        meta["n_tokens"][split], meta["n_chars"][split] = n_tokens, n_chars
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))


def _pieces(data: DataConfig, split: str, final_separator: bool) -> Iterator[str]:
    """A split's stream of text, the documents joined by data.separator (and one after the last
    when final_separator), in pieces of at most ENCODE_CHUNK_CHARS characters cut at line ends
    (data.tokenizer.stream_chunks): each document's pieces are those of its text whole."""
    docs = documents(data, split)
    following = next(docs, None)
    while following is not None:
        doc, following = following, next(docs, None)
        ending = [data.separator] if following is not None or final_separator else []
        yield from stream_chunks(itertools.chain(doc, ending))


def _calls(pieces: Iterator[str]) -> Iterator[list[str]]:
    """The pieces, ENCODE_CALL_CHUNKS at a time: one encode_batch call, which tokenizers spreads
    over every core."""
    while call := list(itertools.islice(pieces, ENCODE_CALL_CHUNKS)):
        yield call
