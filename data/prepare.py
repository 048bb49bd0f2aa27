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
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data.config import DataConfig, TokenizerConfig
from data.corpus import corpus_key, load_texts
from data.shakespeare import CorpusError
from data.tokenizer import build_tokenizer, encode, load_tokenizer

SPLITS = ("train", "validation")


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
    directory = Path(data.cache_dir) / "tokens" / f"{corpus_key(data)}-{tokenizer_key(tok_cfg)}"
    if not (directory / "meta.json").exists():
        _build(data, tok_cfg, directory)
    return _open(directory)


def _build(data: DataConfig, tok_cfg: TokenizerConfig, directory: Path) -> None:
    print(f"tokenizing corpus into {directory} (once) ...", file=sys.stderr)
    texts = load_texts(data)
    for split in SPLITS:
        if not texts[split].strip():
            raise CorpusError(f"the {split} split of the corpus is empty")
    tokenizer = build_tokenizer(tok_cfg, texts["train"])
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"n_tokens": {}, "n_chars": {}, "vocab_size": tokenizer.get_vocab_size()}
    for split in SPLITS:
        ids = encode(tokenizer, texts[split])
        meta["dtype"] = ids.dtype.name
        meta["n_tokens"][split] = int(ids.size)
        meta["n_chars"][split] = len(texts[split])
        _atomic_write(directory / f"{split}.bin", ids.tobytes())
    tokenizer.save(str(directory / "tokenizer.json"))
    _atomic_write(directory / "meta.json", json.dumps(meta, indent=2).encode())


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
