"""Batched generation: prompts of different lengths in one left-padded batch, through the KV
cache, each row decoding exactly as its prompt alone would (greedy, and sampled with the same
per-row seed). The invariant underneath: a padded row's logits are its unpadded logits, whatever
the pad count and the pad token's id."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from model.config import AttentionConfig, ModelConfig
from model.gpt import GPT
from model.sampling import seeded_generator

D = torch.float64
VOCAB = 37
ARCH = {"learned": dict(),
        "rope_gqa": dict(positions="rope", n_kv_head=2),
        "llama_window": dict(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2,
                             bias=False, window=5)}
PROMPTS = [[3, 1, 4, 1, 5, 9, 2], [6], [5, 3, 5], [8, 9, 7, 9, 3]]  # lengths 7, 1, 3, 5


def model_of(arch: str, block: int = 24) -> GPT:
    cfg = ModelConfig(**{**dict(n_layer=2, n_head=4, n_embd=32, block_size=block), **ARCH[arch]})
    torch.manual_seed(0)
    model = GPT(cfg, VOCAB, AttentionConfig()).to(D).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


def left_padded(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, longest] token ids, [B] pad counts): each prompt behind its pads."""
    longest = max(map(len, prompts))
    pad = [longest - len(p) for p in prompts]
    return torch.tensor([[pad_id] * n + p for n, p in zip(pad, prompts)]), torch.tensor(pad)


def generate(model: GPT, idx, n: int, pad=None, **kwargs) -> torch.Tensor:
    return torch.cat(list(model.generate(idx, n, pad=pad, **kwargs)), dim=1)


@pytest.mark.parametrize("static", [False, True], ids=["growing", "static"])
@pytest.mark.parametrize("arch", list(ARCH))
def test_greedy_rows_equal_each_prompt_alone(arch, static):
    model = model_of(arch)
    idx, pad = left_padded(PROMPTS)
    batch = generate(model, idx, 12, pad, greedy=True, static_cache=static)  # [4, 12]
    for row, prompt in zip(batch, PROMPTS):
        alone = generate(model, torch.tensor([prompt]), 12, greedy=True)[0]
        assert torch.equal(row, alone), (prompt, row, alone)


@pytest.mark.parametrize("arch", ["learned", "rope_gqa"])
def test_sampled_rows_equal_each_prompt_alone_with_its_seed(arch):
    """Row i draws from its own generator, seeded 7 + i: the tokens of prompt i alone with that
    seed (temperature 1.5 and top-k, so that the draws matter)."""
    model = model_of(arch)
    idx, pad = left_padded(PROMPTS)
    options = dict(temperature=1.5, top_k=20)
    batch = generate(model, idx, 12, pad,
                     generator=[seeded_generator(7 + i, idx.device) for i in range(len(PROMPTS))],
                     **options)
    for i, (row, prompt) in enumerate(zip(batch, PROMPTS)):
        alone = generate(model, torch.tensor([prompt]), 12,
                         generator=seeded_generator(7 + i, idx.device), **options)[0]
        assert torch.equal(row, alone), (i, row, alone)
    # a negative control: one generator for the whole batch draws other tokens
    shared = generate(model, idx, 12, pad, generator=seeded_generator(7, idx.device), **options)
    assert not torch.equal(shared, batch)


@pytest.mark.parametrize("arch", list(ARCH))
def test_a_padded_row_s_logits_are_its_own_whatever_the_pads(arch):
    """Through the cache, prefilled at once and then a token at a time: each real position's
    logits equal those of the prompt alone, for any pad count and pad token id. Without the pad
    mask and the per-row positions (no pad given) they do not."""
    model = model_of(arch)
    prompt = torch.tensor([PROMPTS[0] + [2, 7, 1]])  # [1, 10]
    with torch.no_grad():
        alone = model(prompt)[0][0]  # [10, V]
        for n_pad, pad_id in [(1, 0), (4, 0), (4, 11), (9, 36)]:
            idx = torch.cat([torch.full((1, n_pad), pad_id), prompt], dim=1)
            for sizes in ([idx.size(1)], [n_pad + 3] + [1] * 7):
                cache = model.new_cache(1)
                cache.pad = torch.tensor([n_pad])
                pieces, start = [], 0
                for size in sizes:
                    pieces.append(model(idx[:, start:start + size], cache=cache)[0][0])
                    start += size
                logits = torch.cat(pieces)[n_pad:]
                torch.testing.assert_close(logits, alone, atol=1e-10, rtol=0)
            unmasked = model(idx)[0][0, n_pad:]  # the pads seen, the positions shifted
            assert (unmasked - alone).abs().max() > 1e-3


def test_a_pad_query_sees_itself_so_no_row_is_nan():
    """The first slots of a padded row are queries before its first real token: each sees its
    own key only (visible_keys), so no row of weights is empty, and nothing turns NaN."""
    model = model_of("learned")
    idx, pad = left_padded([[1, 2, 3, 4, 5, 6], [7]])
    cache = model.new_cache(2)
    cache.pad = pad
    with torch.no_grad():
        logits, _, weights = model(idx, cache=cache, return_weights=True)
    assert torch.isfinite(logits).all()
    row = weights[0][1]  # layer 0, row 1 (5 pads): [h, T, T]
    assert (row[:, 2, 2] == 1).all() and (row[:, 2, :2] == 0).all()  # a pad query: itself
    assert (row[:, 5, :5] == 0).all() and (row[:, 5, 5] == 1).all()  # its first token: itself


def test_the_batch_is_refilled_at_once_past_the_context():
    """Past the context the whole batch starts again from the last half of its context, a
    row's pads shifted out with it: rows stay finite, and the longest row is its prompt
    alone (the shorter rows refill earlier alone than in the batch, docs/sampling.md)."""
    model = model_of("rope_gqa", block=8)
    idx, pad = left_padded(PROMPTS)
    batch = generate(model, idx, 10, pad, greedy=True)
    alone = generate(model, torch.tensor([PROMPTS[0]]), 10, greedy=True)[0]
    assert torch.equal(batch[0], alone)


def test_generate_py_samples_each_line_of_a_prompts_file_as_that_prompt_alone(tmp_path):
    """generate.py's prompts=FILE (sample_batch): line i's text is what prompt=<line i> with
    seed + i gives alone (`stream`); \\n in a line is a newline."""
    import io

    import generate
    from data.tokenizer import build_char_tokenizer

    text = "ROMEO:\nO, my lord, the night doth shine.\nJULIET:\nGood sir, anon!\n"
    tokenizer = build_char_tokenizer(text)
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, positions="rope",
                            n_kv_head=2), tokenizer.get_vocab_size()).eval()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("ROMEO:\nO\nJULIET:\\nGood\n")
    cfg = generate.GenerateConfig(prompts=str(prompts), max_new_tokens=20, temperature=1.3,
                                  top_k=10, seed=5)
    lines = generate.read_prompts(cfg)
    assert lines == ["ROMEO:", "O", "JULIET:\nGood"]
    ids = [tokenizer.encode(line).ids for line in lines]
    out = io.StringIO()
    texts = generate.sample_batch(model, tokenizer, ids, cfg, out=out)
    assert out.getvalue() == ("\n\n" + "-" * 40 + "\n").join(texts) + "\n"
    for i, prompt in enumerate(ids):
        alone = generate.stream(model, tokenizer, prompt, replace(cfg, seed=5 + i), out=io.StringIO())
        assert texts[i] == alone and alone.startswith(lines[i]), (i, texts[i], alone)


@pytest.mark.parametrize("text,keys,message", [
    ("ROMEO:\n\nO\n", {}, "line 2 of .* is empty"),
    ("", {}, "holds no prompt"),
    ("ROMEO:\n", {"num_samples": 2}, "num_samples=2 repeats prompt="),
    ("ROMEO:\n", {"use_cache": False}, "through the KV cache"),
])
def test_a_prompts_file_that_cannot_be_sampled_is_refused(tmp_path, text, keys, message):
    import generate
    from safeio.cli import UserError

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(text)
    with pytest.raises(UserError, match=message):
        generate.read_prompts(generate.GenerateConfig(prompts=str(prompts), **keys))
