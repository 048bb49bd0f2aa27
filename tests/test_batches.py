"""data.order=epochs (data/batches.py, EpochWindows): every window once per epoch in a fresh
order, steps that run across an epoch's end, and a state that resumes exactly; it is the
default since round 4 of docs/budget.md, and random offsets with replacement stay a choice."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from data.batches import EpochWindows, RandomWindows, training_windows
from data.config import DataConfig, Order
from training.checkpoint import latest_checkpoint, load_state, save_checkpoint


def starts_of(sampler, n_batches: int, accum: int = 1) -> list[int]:
    """The first token of each window of the next n_batches steps (tokens = arange: the start)."""
    out = []
    for _ in range(n_batches):
        for x, y in sampler.next_step(accum):
            assert torch.equal(y, x + 1)  # windows are slices of the stream, y shifted by one
            out += x[:, 0].tolist()
    return out


def test_every_window_once_per_epoch_in_a_fresh_order():
    block, tokens = 8, np.arange(8 * 30 + 6, dtype=np.uint16)  # 30 windows, a slack of 5
    sampler = EpochWindows(tokens, block, batch_size=7, seed=0)  # 7 does not divide 30
    assert sampler.count == 30 and sampler.slack == 5
    seen = starts_of(sampler, 30)  # 210 windows: 7 epochs
    epochs = [seen[i:i + 30] for i in range(0, 210, 30)]
    for starts in epochs:
        shift = min(starts)
        assert 0 <= shift <= 5
        assert sorted(starts) == [shift + k * block for k in range(30)]  # each window once
        assert max(starts) + block <= len(tokens) - 1  # the last target inside the stream
    assert len({tuple(e) for e in epochs}) == 7  # a fresh order each epoch
    assert len({min(e) for e in epochs}) > 1     # and the grid moves
    assert sampler.epoch == 6 and sampler.position == 30


def test_a_stream_of_one_window():
    sampler = EpochWindows(np.arange(9, dtype=np.uint16), 8, batch_size=3, seed=0)
    assert starts_of(sampler, 2) == [0] * 6


def test_the_state_resumes_exactly(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50, 8 * 40 + 3).astype(np.uint16)
    for steps_before in (0, 3, 4, 13):  # at the start, mid-epoch, at an epoch's end, later
        a = EpochWindows(tokens, 8, 5, seed=123)  # 40 windows: an epoch is 4 steps of 2 x 5
        for _ in range(steps_before):
            a.next_step(accum=2)
        ckpt = tmp_path / str(steps_before)
        save_checkpoint(ckpt, 1, torch.nn.Linear(1, 1), {"sampler": a.state_dict()}, keep=1)
        state = load_state(latest_checkpoint(ckpt))["sampler"]  # as a checkpoint stores it
        expected = [a.next_step(accum=2) for _ in range(9)]
        b = EpochWindows(tokens, 8, 5, seed=999)
        b.load_state_dict(state)
        for got, want in zip((b.next_step(accum=2) for _ in range(9)), expected):
            for (x1, y1), (x2, y2) in zip(got, want):
                assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(EpochWindows(tokens, 8, 5, seed=999).next_batch()[0],
                           EpochWindows(tokens, 8, 5, seed=123).next_batch()[0])


def test_a_state_out_of_range_is_refused():
    sampler = EpochWindows(np.arange(100, dtype=np.uint16), 8, 2, seed=0)
    state = sampler.state_dict()
    for bad in ({"position": 13}, {"position": -1}, {"epoch": -1}, {"position": 1.5}):
        with pytest.raises(ValueError, match="epoch position"):
            sampler.load_state_dict({**state, **bad})


def test_the_default_reads_epochs_and_random_offsets_stay_a_choice():
    assert DataConfig().order is Order.epochs
    tokens = np.arange(1000, dtype=np.uint16)
    default = training_windows(DataConfig().order, tokens, 16, 8, seed=3)
    assert type(default) is EpochWindows
    same = EpochWindows(tokens, 16, 8, seed=3)
    assert torch.equal(default.next_batch()[0], same.next_batch()[0])
    assert type(training_windows(Order.random, tokens, 16, 8, seed=3)) is RandomWindows


@pytest.mark.slow
def test_a_run_in_epochs_resumes_bit_exactly(tmp_path, fake_sdist):
    """train.py with data.order=epochs (60 steps of 8 windows: past the first epoch's ~47 steps),
    then a copy rolled back to its step-30 checkpoint and resumed: the same weights at 60."""
    import shutil

    from safetensors.torch import load_file

    from helpers import TRAIN, ok, run

    original, copy = tmp_path / "run", tmp_path / "copy"
    ok(run([TRAIN, "+experiment=smoke", "data.order=epochs", f"data.sdist_path={fake_sdist}",
            f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={original}"], cwd=tmp_path))
    assert "order: epochs" in (original / "config.yaml").read_text()
    shutil.copytree(original, copy)
    (copy / "checkpoints" / "latest").write_text("step_00000030")
    shutil.rmtree(copy / "checkpoints" / "step_00000060")
    ok(run([TRAIN, f"resume={copy}", f"data.cache_dir={tmp_path / 'cache'}"], cwd=tmp_path))
    a = load_file(str(original / "checkpoints" / "step_00000060" / "model.safetensors"))
    b = load_file(str(copy / "checkpoints" / "step_00000060" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_random_order_run_from_before_data_order_resumes(tmp_path, fake_sdist):
    """A run written before data.order existed has no order in its config.yaml: it trained with
    random windows, and resumes so (round five: it was read as the new default, epochs, whose
    sampler state it does not have)."""
    import shutil

    from safetensors.torch import load_file

    from helpers import TRAIN, ok, run

    original, copy = tmp_path / "run", tmp_path / "copy"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    ok(run([TRAIN, "+experiment=smoke", "data.order=random", f"data.sdist_path={fake_sdist}",
            cache, f"hydra.run.dir={original}"], cwd=tmp_path))
    shutil.copytree(original, copy)
    config = (copy / "config.yaml").read_text()
    assert "  order: random\n" in config
    (copy / "config.yaml").write_text(config.replace("  order: random\n", ""))
    (copy / "checkpoints" / "latest").write_text("step_00000030")
    shutil.rmtree(copy / "checkpoints" / "step_00000060")
    ok(run([TRAIN, f"resume={copy}", cache], cwd=tmp_path))
    a = load_file(str(original / "checkpoints" / "step_00000060" / "model.safetensors"))
    b = load_file(str(copy / "checkpoints" / "step_00000060" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
