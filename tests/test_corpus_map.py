"""The hub path's tokenization: records streamed to the token cache.

The hub cannot be reached here, so `datasets.load_dataset` is replaced by in-memory datasets
with the hub's shape (a `story` column, train and validation splits); everything after it is the
real code path (BPE training on the split, the streamed encoding, the token cache).
"""
from __future__ import annotations

import datasets
import pytest

from data.config import DataConfig, Source, TokenizerConfig, TokenizerKind
from data.prepare import prepare_corpus
from helpers import shakespeare_like


def stories(n: int, seed: int) -> list[str]:
    return [shakespeare_like(300, seed=seed * 1000 + i) for i in range(n)]


@pytest.fixture
def fake_hub(monkeypatch):
    splits = {"train": stories(40, 1), "validation": stories(8, 2)}
    calls = []

    def load_dataset(name, config=None, split=None, revision=None, **kwargs):
        calls.append((name, split))
        return datasets.Dataset.from_dict({"story": splits[split], "id": list(range(len(splits[split])))})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return splits, calls


def hub_cfg(tmp_path) -> DataConfig:
    return DataConfig(source=Source.hub, hub_name="someone/stories", text_column="story",
                      separator="\n", cache_dir=str(tmp_path / "cache"))


def test_bpe_on_a_hub_dataset(fake_hub, tmp_path):
    splits, calls = fake_hub
    bpe = TokenizerConfig(kind=TokenizerKind.bpe, vocab_size=300)
    corpus = prepare_corpus(hub_cfg(tmp_path), bpe)
    assert ("someone/stories", "train") in calls and ("someone/stories", "validation") in calls
    for split in ("train", "validation"):
        joined = "\n".join(splits[split])
        tokens = getattr(corpus, split)
        assert corpus.tokenizer.decode(tokens.tolist()) == joined
        assert corpus.n_chars[split] == len(joined)
        assert len(tokens) < len(joined)  # BPE merged something


def test_max_documents_caps_each_split(fake_hub, tmp_path):
    splits, _ = fake_hub
    cfg = hub_cfg(tmp_path)
    cfg.max_documents = 5
    corpus = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
    assert corpus.tokenizer.decode(corpus.train.tolist()) == "\n".join(splits["train"][:5])
