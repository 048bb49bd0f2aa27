"""Tokenize a corpus once and keep it on disk, so the next run starts in seconds.

Layout of one cache entry, keyed by corpus and tokenizer:
    <cache_dir>/tokens/<corpus key>-<tokenizer key>/
        train.bin, validation.bin   raw token ids (uint16, or uint32 for big vocabularies)
        tokenizer.json              the fitted tokenizer
        meta.json                   dtype, token and character counts; written last = complete
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from typing import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data.config import DataConfig, TokenizerConfig
from data.corpus import corpus_key, load_documents
from data import CorpusError
from data.tokenizer import build_tokenizer, encode, load_tokenizer

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
    directory: Path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def tokenizer_key(cfg: TokenizerConfig) -> str:
    ident = {"kind": cfg.kind.value}
    if cfg.kind.value == "bpe":
        ident.update(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]


def prepare_corpus(data: DataConfig, tok_cfg: TokenizerConfig) -> PreparedCorpus:
    """The tokenized corpus, from the cache or built into it. Every failure below (undecodable
    text, an unreadable file, a tokenizer that cannot be built) comes out as a CorpusError."""
    try:
        directory = Path(data.cache_dir) / "tokens" / f"{corpus_key(data)}-{tokenizer_key(tok_cfg)}"
        if not (directory / "meta.json").exists():
            _build(data, tok_cfg, directory)
        return _open(directory)
    except CorpusError:
        raise
    except (OSError, ValueError) as exc:  # includes UnicodeDecodeError
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
    lines = [line.strip() for line in str(seen).splitlines() if line.strip()]
    text = lines[0] if lines else type(seen).__name__
    return text if seen is exc else f"{type(seen).__name__}: {text}"


def _build(data: DataConfig, tok_cfg: TokenizerConfig, directory: Path) -> None:
    print(f"tokenizing corpus into {directory} (once) ...", file=sys.stderr)
    docs = load_documents(data)
    for split in SPLITS:
        if not any(text.strip() for text in _texts(docs[split])):
            raise CorpusError(f"the {split} split of the corpus is empty")
    # fitted on the training documents as they appear in the stream: with their separator
    tokenizer = build_tokenizer(tok_cfg, (t + data.separator for t in _texts(docs["train"])))
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
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
        tmp = directory / f".{split}.bin.tmp"
        n_tokens = 0
        with open(tmp, "wb") as f:
            for row in encoded:
                ids = np.asarray(row["ids"], dtype=dtype)
                f.write(ids.tobytes())
                n_tokens += ids.size
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / f"{split}.bin")
        meta["n_tokens"][split] = n_tokens
        meta["n_chars"][split] = int(sum(encoded["n_chars"]))
    tokenizer.save(str(directory / "tokenizer.json"))
    _atomic_write(directory / "meta.json", json.dumps(meta, indent=2).encode())


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


def _open(directory: Path) -> PreparedCorpus:
    meta = json.loads((directory / "meta.json").read_text())
    arrays = {
        split: np.memmap(directory / f"{split}.bin", dtype=meta["dtype"], mode="r",
                         shape=(meta["n_tokens"][split],))
        for split in SPLITS
    }
    return PreparedCorpus(arrays["train"], arrays["validation"],
                          load_tokenizer(directory / "tokenizer.json"), meta["n_chars"], directory)


def _atomic_write(path: Path, payload: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
