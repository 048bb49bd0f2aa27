"""The hub path's tokenization: records streamed to the token cache, whatever data.num_proc says
(it was the number of datasets.map processes; it is kept for old configs and changes nothing).

The hub cannot be reached here, so `datasets.load_dataset` is replaced by in-memory datasets
with the hub's shape (a `story` column, train and validation splits); everything after it is the
real code path (BPE training on the split, the streamed encoding, the token cache).
"""
from __future__ import annotations

import datasets
import numpy as np
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


def hub_cfg(tmp_path, num_proc: int) -> DataConfig:
    return DataConfig(source=Source.hub, hub_name="someone/stories", text_column="story",
                      separator="\n", num_proc=num_proc, cache_dir=str(tmp_path / f"cache{num_proc}"))


def test_bpe_on_a_hub_dataset_with_several_processes(fake_hub, tmp_path):
    splits, calls = fake_hub
    bpe = TokenizerConfig(kind=TokenizerKind.bpe, vocab_size=300)
    parallel = prepare_corpus(hub_cfg(tmp_path, num_proc=2), bpe)
    assert ("someone/stories", "train") in calls and ("someone/stories", "validation") in calls
    for split in ("train", "validation"):
        joined = "\n".join(splits[split])
        tokens = getattr(parallel, split)
        assert parallel.tokenizer.decode(tokens.tolist()) == joined
        assert parallel.n_chars[split] == len(joined)
        assert len(tokens) < len(joined)  # BPE merged something
    single = prepare_corpus(hub_cfg(tmp_path, num_proc=1), bpe)
    assert np.array_equal(single.train, parallel.train)
    assert np.array_equal(single.validation, parallel.validation)


def test_max_documents_caps_each_split(fake_hub, tmp_path):
    splits, _ = fake_hub
    cfg = hub_cfg(tmp_path, num_proc=1)
    cfg.max_documents = 5
    corpus = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
    assert corpus.tokenizer.decode(corpus.train.tolist()) == "\n".join(splits["train"][:5])
