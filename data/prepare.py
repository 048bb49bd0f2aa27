"""Tokenize a corpus once and keep it on disk, so the next run starts in seconds.

Layout of one cache entry, keyed by corpus (the hash of its texts) and tokenizer:
    <cache_dir>/tokens/<corpus key>-<tokenizer key>/
        train.bin, validation.bin   raw token ids (uint16, or uint32 for big vocabularies)
        tokenizer.json              the fitted tokenizer
        meta.json                   dtype, token and character counts

An entry is built by one process at a time (data.cache_lock) in a temporary directory, then
renamed into place whole: an entry that exists is complete. Opening one checks it (sizes, the
tokenizer, every id inside the vocabulary: guard/corpus.py), since a cache can be damaged or
handed over.
"""
from __future__ import annotations

import hashlib
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
from data.corpus import check_split_overlap, corpus_key, load_documents
from data.tokenizer import build_tokenizer, encode, token_dtype
from guard.cli import CorpusError, UserError, first_line
from guard.corpus import MAX_TOKENIZER_BYTES, read_cache_entry
from guard.files import read_bytes

SPLITS = ("train", "validation")
# Below this many documents a split is tokenized in this process (starting workers costs more).
PARALLEL_MIN_DOCUMENTS = 1000


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
        if not cfg.path:
            raise CorpusError("tokenizer.kind=file needs tokenizer.path (a tokenizer.json)")
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
    docs = load_documents(data)
    for split in SPLITS:
        if not any(text.strip() for text in _texts(docs[split])):
            raise CorpusError(f"the {split} split of the corpus is empty")
    # fitted on the training documents as they appear in the stream: with their separator
    tokenizer = build_tokenizer(tok_cfg, (t + data.separator for t in _texts(docs["train"])))
    dtype = token_dtype(tokenizer.get_vocab_size())
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"n_tokens": {}, "n_chars": {}, "vocab_size": tokenizer.get_vocab_size(),
            "dtype": np.dtype(dtype).name}
    for split in SPLITS:
        n_docs = len(docs[split])
        procs = data.num_proc or (1 if n_docs < PARALLEL_MIN_DOCUMENTS else min(8, os.cpu_count() or 1))
        if procs > 1:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
        # Batched map over the documents, in several processes for a big corpus; datasets caches
        # the result next to a hub dataset's own cache files.
        encoded = docs[split].map(
            encode_documents, batched=True, with_indices=True, num_proc=procs if procs > 1 else None,
            remove_columns=["text"], desc=f"tokenizing {split}",
            fn_kwargs={"tokenizer": tokenizer, "separator": data.separator, "last": n_docs - 1})
        n_tokens = 0
        with open(directory / f"{split}.bin", "wb") as f:
            for row in encoded:
                ids = np.asarray(row["ids"], dtype=dtype)
                f.write(ids.tobytes())
                n_tokens += ids.size
            f.flush()
            os.fsync(f.fileno())
        meta["n_tokens"][split] = n_tokens
        meta["n_chars"][split] = int(sum(encoded["n_chars"]))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "meta.json").write_text(json.dumps(meta, indent=2))


def _texts(split, batch_size: int = 1000) -> Iterator[str]:
    """The documents of a split, streamed in batches (a hub corpus need not fit in memory)."""
    for batch in split.iter(batch_size=batch_size):
        yield from batch["text"]


def encode_documents(batch: dict, indices: list[int], tokenizer: Tokenizer, separator: str,
                     last: int) -> dict:
    """datasets.map function: each document's ids, with data.separator after all but the last
    document, so the split's stream is the documents joined by the separator."""
    texts = [t if i == last else t + separator for t, i in zip(batch["text"], indices)]
    return {"ids": [encode(tokenizer, t) for t in texts], "n_chars": [len(t) for t in texts]}
