"""Seeing attention: the future-weight scalar, the fixed window, the pictures, and the command.

The scalar must be exactly 0 for the correct layer and large for every masking pitfall (a
detector that cannot fail proves nothing); the pictures must show the causal boundary; the
command line must draw any run and prompt and refuse mistakes in one line.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.tokenizer import build_bpe_tokenizer, build_char_tokenizer
from helpers import REPO_ROOT as REPO, SCRIPT_ENV, TRAIN, corpus_args, shakespeare_like, write_corpus
from model.attention import attention_layer
from model.config import AttentionConfig, MaskMode, ModelConfig, Scale
from model.gpt import GPT
from training.attention_maps import (CARD_WIDTH, FUTURE_RGB, attention_weights, card_image,
                                     colorize, future_weight, map_window,
                                     sharpest_head, token_labels)
from training.evaluate import attention_diagnostics
from training.tb import log_attention_maps

OFF = contextlib.nullcontext()
VARIANTS = {
    "correct": AttentionConfig(),
    "no_scale": AttentionConfig(name="no_scale", scale=Scale.none),
    "scale_d_model": AttentionConfig(name="scale_d_model", scale=Scale.d_model),
    "no_out_proj": AttentionConfig(name="no_out_proj", out_proj=False),
    "mask_zero": AttentionConfig(name="mask_zero", mask_value=0.0),
    "mask_fill_zero": AttentionConfig(name="mask_fill_zero", mask_mode=MaskMode.fill, mask_value=0.0),
    "mask_after_softmax": AttentionConfig(name="mask_after_softmax", mask_mode=MaskMode.after_softmax),
}
LEAKY = ["mask_zero", "mask_fill_zero", "mask_after_softmax"]


def layer_weights(variant: str, dtype=torch.float32, T: int = 16) -> torch.Tensor:
    torch.manual_seed(0)
    layer = attention_layer(32, 4, T, VARIANTS[variant]).to(dtype)
    _, w = layer(torch.randn(3, T, 32, dtype=dtype), return_weights=True)
    return w.detach()  # [3, 4, T, T]


# ----------------------------------------------------------------------------- the scalar


@pytest.mark.parametrize("variant", ["correct", "no_scale", "scale_d_model", "no_out_proj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_future_weight_is_exactly_zero_for_causal_layers(variant, dtype):
    assert future_weight(layer_weights(variant, dtype)).item() == 0.0


@pytest.mark.parametrize("variant", LEAKY)
def test_future_weight_is_large_for_every_masking_pitfall(variant):
    """At init the scores are near 0, so a leaky row gives the future about its share of keys:
    (T - 1 - t) / T for row t, whose mean over rows is (T - 1) / 2T, 0.47 for T = 16."""
    got = future_weight(layer_weights(variant)).item()
    assert got == pytest.approx(15 / 32, abs=0.05)


def test_future_weight_is_the_mean_mass_outside_the_visible_keys():
    T = 4
    uniform = torch.full((1, 1, T, T), 1 / T)  # every row spread over all keys
    assert future_weight(uniform).item() == pytest.approx(np.mean([3, 2, 1, 0]) / T)
    # a row that lost mass (mask_after_softmax zeroes the future after normalising) counts the
    # same as one that put that mass on the future
    lost = torch.tril(uniform)
    assert future_weight(lost).item() == pytest.approx(future_weight(uniform).item())
    # right-aligned queries (KV cache): 2 queries at positions 2, 3 of 4 keys
    tail = torch.tensor([[0.2, 0.2, 0.2, 0.4], [0.25, 0.25, 0.25, 0.25]])[None, None]
    assert future_weight(tail).item() == pytest.approx(0.4 / 2)


def test_attention_diagnostics_report_the_future_weight_per_layer():
    x = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    for variant in ("correct", "mask_zero"):
        torch.manual_seed(0)
        model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16), 50,
                    VARIANTS[variant])
        diag = attention_diagnostics(model, x, OFF)
        assert len(diag) == 2
        for d in diag:
            assert (d["future_weight"] == 0.0) if variant == "correct" else (d["future_weight"] > 0.3)


# ----------------------------------------------------------------------------- window and labels


@pytest.fixture(scope="module")
def text_and_tokenizer():
    text = shakespeare_like(4000, seed=3)
    return text, build_char_tokenizer(text)


def test_map_window_is_fixed_and_starts_a_line(text_and_tokenizer):
    text, tok = text_and_tokenizer
    tokens = np.array(tok.encode(text).ids, dtype=np.uint16)  # one token per character
    window = map_window(tokens, tok, 40)
    assert window == map_window(tokens.copy(), tok, 40) and len(window) == 40
    line_end = text.index("\n", len(text) // 2)
    start = line_end + len(text[line_end:]) - len(text[line_end:].lstrip())  # next non-blank line
    assert tok.decode(window) == text[start:start + 40]


def test_map_window_without_line_breaks_or_longer_than_the_split():
    tok = build_char_tokenizer("abcdef")
    tokens = np.array(tok.encode("abcdefabcdef").ids)
    assert map_window(tokens, tok, 4) == [int(t) for t in tokens[6:10]]  # from the middle
    assert map_window(tokens, tok, 100) == [int(t) for t in tokens]


def test_token_labels_show_whitespace():
    tok = build_char_tokenizer("a b\n\tc")
    assert token_labels(tok, tok.encode("a b\n\tc").ids) == ["a", "·", "b", "↵", "→", "c"]


def test_token_labels_of_byte_level_bpe_spell_the_text():
    """BPE tokens carry their leading space ("·lord"); decoded one by one they spell the text."""
    tok = build_bpe_tokenizer(shakespeare_like(20_000, seed=4), vocab_size=300)
    text = "ROMEO:\nO, my lord doth speak tonight."
    labels = token_labels(tok, tok.encode(text).ids)
    assert "".join(labels) == text.replace(" ", "·").replace("\n", "↵")
    assert any(len(label) > 1 for label in labels)  # merges, not bytes


# ----------------------------------------------------------------------------- pictures


def test_colorize_paints_unattended_future_keys_grey_and_any_leak_in_colour():
    w = np.tril(np.full((5, 5), 0.2, dtype=np.float32))
    rgb = colorize(w)
    future = np.triu(np.ones((5, 5), dtype=bool), k=1)
    assert (rgb[future] == FUTURE_RGB).all() and not (rgb[~future] == FUTURE_RGB).all(-1).any()
    w[0, 4] = 0.01  # a little weight on a future key
    assert tuple(colorize(w)[0, 4]) != FUTURE_RGB
    assert tuple(colorize(np.zeros((2, 2)))[1, 0]) != FUTURE_RGB  # past keys with 0 weight: black


def staircase(ax) -> list:
    """The points of the lines drawn on a map's Axes (`future_line`'s staircase)."""
    return [list(zip(*line.get_data())) for line in ax.lines]


@pytest.mark.parametrize("heads", [1, 4, 6])
def test_map_figure_draws_each_head_with_the_diagonal_marked_and_a_labelled_bar(heads):
    """A panel per head, each with `query` and `key` on its axes and the staircase between each
    row's own key and the next (a leak's bright line lies right of it), one colour bar that says
    what its colours are."""
    from scripts.maps import map_figure

    n = 12
    w = np.tril(np.ones((heads, n, n), dtype=np.float32))
    fig = map_figure(w / w.sum(-1, keepdims=True), list("To be, or no"), "a title")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == heads
    for ax in panels:
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("key", "query")
        steps = staircase(ax)
        assert len(steps) == 1 and steps[0][:4] == [(0.5, -0.5), (0.5, 0.5), (1.5, 0.5), (1.5, 1.5)]
        assert steps[0][-1] == (n - 0.5, n - 0.5)  # ... down to the last row's own key
    bars = [ax for ax in fig.axes if not ax.images and ax.get_ylabel()]
    assert len(bars) == 1 and bars[0].get_ylabel().startswith("attention weight")


@pytest.mark.parametrize("heads", [1, 4])
def test_map_figure_wraps_a_long_title_within_its_width(heads):
    from scripts.maps import map_figure

    labels = list("To be, or not to be")
    w = np.tril(np.ones((heads, len(labels), len(labels)), dtype=np.float32))
    fig = map_figure(w / w.sum(-1, keepdims=True), labels,
                     "decode-cache_positions_restart_seed10_lr0.003: attention=mask_zero "
                     "through the KV cache (mask=cached), best weights (step 50, causal val loss "
                     "2.7920)\nlayer 0, head 1: x")
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent(fig.canvas.get_renderer())
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


class Recorder:
    """A SummaryWriter stand-in that keeps what is logged."""

    def __init__(self):
        self.images = []

    def add_image(self, tag, img, step, dataformats="CHW"):
        self.images.append((tag, img, step, dataformats))


def test_log_attention_maps_logs_one_grid_per_layer(text_and_tokenizer):
    text, tok = text_and_tokenizer
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=3, n_head=2, n_embd=16, block_size=24), tok.get_vocab_size())
    tokens = np.array(tok.encode(text).ids)
    writer = Recorder()
    log_attention_maps(writer, model, tokens, tok, 24, 7, OFF)
    # one tag per layer, in the section after the losses (tests/test_newcomer.py: the order)
    assert [(tag, step, fmt) for tag, _, step, fmt in writer.images] == \
        [(f"weights/attention_layer{i}", 7, "HWC") for i in range(3)]
    assert all(img.dtype == np.uint8 and img.shape[1:] == (CARD_WIDTH, 3)
               for _, img, _, _ in writer.images)
    assert model.training  # left as it was


@pytest.mark.parametrize("heads, n", [(1, 32), (4, 32), (16, 32), (4, 48)])
def test_card_image_fits_a_tensorboard_card_and_draws_the_sharpest_head_large(heads, n):
    """TensorBoard draws an image 350 pixels wide and at most 1024 high without scrolling: the
    card is drawn at that width, the sharpest head at up to 9 pixels per token (the size the
    labels need) and every head again as a thumbnail."""
    rng = np.random.default_rng(0)
    w = np.tril(rng.random((heads, n, n), dtype=np.float32) ** 4)
    w[heads // 2] = np.tril(np.ones((n, n), dtype=np.float32)) * np.eye(n, dtype=np.float32)
    w /= w.sum(-1, keepdims=True)
    assert sharpest_head(w) == heads // 2  # one-hot rows: the sharpest
    img = card_image(w, [f"t{i}" for i in range(n)], "layer 0, step 1: future weight 0.000")
    assert img.shape[1] == CARD_WIDTH and img.shape[0] <= 1024
    cell = min(9, (CARD_WIDTH - 30) // n)
    grey = int((img == FUTURE_RGB).all(-1).sum())
    main = (n * (n - 1) // 2) * cell * cell
    thumbs = heads * (n * (n - 1) // 2) if heads > 1 else 0
    assert main + thumbs <= grey <= main + 9 * thumbs  # the large map, then a thumbnail per head


def test_attention_weights_follow_the_attention_variant():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8), 20, VARIANTS["mask_zero"])
    ids = list(range(8))
    own, own_leak = attention_weights(model, ids, OFF)
    with model.attention_variant(VARIANTS["correct"]):
        causal, causal_leak = attention_weights(model, ids, OFF)
    assert own.shape == causal.shape == (1, 2, 8, 8)
    assert np.triu(own, 1).sum() > 1 and np.triu(causal, 1).sum() == 0
    assert own_leak[0] == pytest.approx(future_weight(torch.from_numpy(own)).item())
    assert causal_leak.tolist() == [0.0]


# ----------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A mask_zero smoke run, its token cache at the default relative path (root/.cache, as
    `python train.py` in root makes it)."""
    root = tmp_path_factory.mktemp("map_run")
    corpus = write_corpus(root, 20_000, 4_000)
    run = root / "runs" / "run"
    proc = subprocess.run(
        [sys.executable, TRAIN, "+experiment=smoke", "attention=mask_zero",
         *corpus_args(corpus, Path(".cache")), "train.max_steps=10", "train.eval_interval=10",
         f"hydra.run.dir={run}"],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run


def attention_map(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {**SCRIPT_ENV, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "scripts.attention_map", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_command_draws_a_head_and_a_layer_grid(trained_run, tmp_path):
    from PIL import Image

    one, grid = tmp_path / "one.png", tmp_path / "grid.png"
    proc = attention_map(f"run={trained_run}", "prompt=ROMEO:\nO, my lord", "layer=1", "head=3",
                         f"out={one}")
    assert proc.returncode == 0, proc.stderr
    assert Image.open(one).size[0] > 300
    # no prompt: the run's fixed validation window, the picture of its TensorBoard images; from
    # another directory, the run's relative token cache is still found (nothing is rebuilt)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = attention_map(f"run={trained_run}", f"out={grid}", "mask=causal", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert list(elsewhere.iterdir()) == [] and "tokenizing" not in proc.stderr
    assert (np.asarray(Image.open(grid).convert("RGB")) == FUTURE_RGB).all(-1).any()


@pytest.mark.slow
def test_command_names_the_weights_it_drew(trained_run, tmp_path):
    from scripts.attention_map import MapArgs, draw

    out = draw(MapArgs(run=str(trained_run), out=str(tmp_path / "m.png"), head="0",
                       prompt="ROMEO:"))
    assert out.is_file()
    proc = attention_map(f"run={trained_run}", f"out={tmp_path / 'g.png'}", "weights=best")
    assert proc.returncode == 0 and "wrote" in proc.stdout, proc.stderr
    # mask_zero: the best causal loss is step 10 here, before any leak was learned
    assert f"drawing {trained_run}: best weights (step 10, causal val loss" in proc.stderr
    assert "note: attention=mask_zero leaks" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["layer=2"], "layer must be below the run's 2 layers"),
    (["head=9"], "head must be all or below the run's 4 heads"),
    (["head=x"], "head must be a non-negative integer or all"),
    (["mask=maybe"], "mask must be own, causal or cached"),
    (["colour=red"], "unknown key 'colour'"),
    (["prompt=§"], "never saw in training"),
    (["tokens=0"], "tokens must be at least 2"),
    (["tokens=1"], "tokens must be at least 2"),
    (["tokens=1000"], "tokens must be at most the run's context of 32 tokens"),
    (["tokens=8", "prompt=ROMEO:"], "give one or the other"),
    (["out=noext"], "out must name a .png file"),
    (["layer=1e9"], "layer must be an integer, got '1e9' (write it as 1000000000)"),
])
def test_command_refuses_mistakes_in_one_line(trained_run, tmp_path, capsys, args, message):
    from scripts.attention_map import main

    out = [] if any(a.startswith("out=") for a in args) else [f"out={tmp_path / 'x.png'}"]
    assert main([f"run={trained_run}", *args, *out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.png").exists()


def test_command_refuses_a_missing_run(tmp_path, capsys):
    from scripts.attention_map import main

    assert main([f"run={tmp_path / 'nope'}"]) == 2
    assert "does not exist" in capsys.readouterr().err
