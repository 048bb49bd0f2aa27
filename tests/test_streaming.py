"""Streaming a sample: incremental decoding gives exactly the text of decoding everything at once,
multi-byte characters split across byte-level tokens included, in time linear in its length."""
from __future__ import annotations

import io
import random

import pytest
import torch

import generate
from data.tokenizer import IncrementalDecoder, build_bpe_tokenizer, build_char_tokenizer
from model.config import ModelConfig
from model.gpt import GPT

TEXT = ("naïve café — ünïcödé 日本語のテキスト 😀👍🏽 " * 40) + ("plain ascii words here " * 40)


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer(TEXT, 300)


def _boundary(tok, ids, cut):
    """The largest cut <= cut after which the prefix decodes to whole characters (a prompt is
    text, so it always ends on one)."""
    while cut and tok.decode(ids[:cut]).endswith("\ufffd"):
        cut -= 1
    return cut


def test_incremental_text_equals_decoding_everything(bpe):
    rng = random.Random(0)
    ids = bpe.encode(TEXT).ids
    for trial in range(300):
        if trial % 2:  # random ids: any bytes, invalid UTF-8 included
            seq = [rng.randrange(bpe.get_vocab_size()) for _ in range(rng.randrange(1, 80))]
        else:  # real text, cut anywhere (mid-character too)
            start = rng.randrange(len(ids))
            seq = ids[start:start + rng.randrange(1, 120)]
        cut = _boundary(bpe, seq, rng.randrange(len(seq) + 1))
        decoder = IncrementalDecoder(bpe, seq[:cut])
        streamed = bpe.decode(seq[:cut]) + "".join(decoder.add(i) for i in seq[cut:]) \
            + decoder.finish()
        assert streamed == bpe.decode(seq), (trial, seq, cut)


def test_a_split_character_is_held_back_until_complete(bpe):
    emoji = bpe.encode("😀").ids
    assert len(emoji) > 1  # a 4-byte character over several byte-level tokens
    decoder = IncrementalDecoder(bpe, bpe.encode("a").ids)
    pieces = [decoder.add(i) for i in emoji]
    assert pieces[:-1] == [""] * (len(emoji) - 1) and pieces[-1] == "😀"


def test_char_tokenizer_streams_character_by_character():
    tok = build_char_tokenizer(TEXT)
    ids = tok.encode(TEXT[:200]).ids
    decoder = IncrementalDecoder(tok, ids[:3])
    assert [decoder.add(i) for i in ids[3:]] == list(TEXT[3:200])


class CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def decode(self, ids):
        self.decoded += len(ids)
        return self.tok.decode(ids)


def test_decoding_work_per_token_does_not_grow_with_the_sample(bpe):
    ids = bpe.encode(TEXT).ids * 10
    counting = CountingTokenizer(bpe)
    decoder = IncrementalDecoder(counting, ids[:1])
    text = "".join(decoder.add(i) for i in ids[1:]) + decoder.finish()
    assert bpe.decode(ids[:1]) + text == bpe.decode(ids)
    # Decoding everything at each token would decode len(ids)**2 / 2 ids; a window of a few
    # tokens decodes a small constant per token.
    assert counting.decoded < 20 * len(ids), (counting.decoded, len(ids))


def test_stream_writes_the_decoded_sample(bpe):
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), bpe.get_vocab_size())
    cfg = generate.GenerateConfig(max_new_tokens=60, seed=3, temperature=1.0)
    prompt = bpe.encode("café ").ids
    out = io.StringIO()
    text = generate.stream(model, bpe, prompt, cfg, out=out)
    tokens = [int(t) for t in model.generate(torch.tensor([prompt]), cfg.max_new_tokens,
                                             cfg.temperature, None, None,
                                             torch.Generator().manual_seed(cfg.seed))]
    assert text == bpe.decode(prompt + tokens)
    assert out.getvalue() == text + "\n"
