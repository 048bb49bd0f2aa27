"""train.ema: the weight average's arithmetic, what evaluations and files hold, and a resume of a
run with it that continues bit-exactly (tiny runs of train.train, in process)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train as train_script
from guard.preflight import compose
from helpers import corpus_args, write_corpus
from safeio.checkpoint import load_state
from safeio.cli import StateMismatch, UserError
from training.checkpoint import load_training_weights
from training.ema import WeightAverage
from training.runtime import World


def test_the_average_copies_the_weights_before_its_start_then_decays_towards_them():
    model = torch.nn.Linear(2, 1)
    average = WeightAverage(model, decay=0.9, start=2)
    weights = [torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]]), torch.tensor([[0.0, 5.0]])]
    with torch.no_grad():
        model.weight.copy_(weights[0])
    average.update(model, step=1)  # before `start`: the weights themselves
    assert torch.equal(average.average["weight"], weights[0])
    expected = weights[0]
    for step, w in enumerate(weights[1:], start=2):
        with torch.no_grad():
            model.weight.copy_(w)
        average.update(model, step)
        expected = 0.9 * expected + 0.1 * w
        assert torch.allclose(average.average["weight"], expected)
    with average.swapped_in(model) as own:  # the average in the model, its weights handed out
        assert torch.equal(model.weight, average.average["weight"])
        assert torch.equal(own["weight"], weights[-1])
    assert torch.equal(model.weight, weights[-1])  # and back


def tiny_config(tmp_path, *overrides):
    corpus = write_corpus(tmp_path, train_chars=6_000, val_chars=2_000)
    return compose(["+experiment=smoke", *corpus_args(corpus, tmp_path / "cache"),
                    "train.dtype=float32", "train.budget_minutes=null", "train.max_steps=8",
                    "train.eval_interval=4", "train.log_interval=4", "train.sample_tokens=0",
                    "train.attention_maps=false", "train.cached_eval_batches=0",
                    "train.progress=false", *overrides])


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_evaluations_and_the_saved_weights_are_the_average(tmp_path, monkeypatch):
    """Whatever scores or saves the model (validation batches, the whole split, best/) sees the
    average; the checkpoint holds it as its weights, and the weights trained on in its state."""
    averages, seen = [], []

    class Recorded(WeightAverage):
        def __init__(self, *args):
            super().__init__(*args)
            averages.append(self)

    def spy(function, position=0):
        def recorded(*args, **kwargs):
            average = torch.cat([v.flatten() for v in averages[0].average.values()])
            seen.append((function.__name__, torch.equal(flat(args[position]), average)))
            return function(*args, **kwargs)
        return recorded

    monkeypatch.setattr(train_script, "WeightAverage", Recorded)
    for name in ("mean_loss", "full_split_loss"):
        monkeypatch.setattr(train_script, name, spy(getattr(train_script, name)))
    monkeypatch.setattr(train_script, "save_best", spy(train_script.save_best, 1))
    run_dir = tmp_path / "run"
    train_script.train(tiny_config(tmp_path, "train.ema=0.9", "train.final_full_eval=true"),
                       run_dir, False, World())
    assert {name for name, _ in seen} == {"mean_loss", "full_split_loss", "save_best"}
    assert all(same for _, same in seen), seen
    average = averages[0].average
    ckpt = run_dir / "checkpoints" / "step_00000008"
    saved = load_file(str(ckpt / "model.safetensors"))
    trained = load_state(ckpt)["training_weights"]
    assert saved.keys() == average.keys() == trained.keys()
    assert all(torch.equal(saved[k], average[k]) for k in saved)
    assert not torch.equal(saved["tok_emb.weight"], trained["tok_emb.weight"])


def test_a_run_with_ema_resumed_from_a_checkpoint_equals_the_uninterrupted_run(tmp_path):
    original, copy = tmp_path / "run", tmp_path / "copy"
    train_script.train(tiny_config(tmp_path, "train.ema=0.8", "train.ema_start=2"), original,
                       False, World())
    shutil.copytree(original, copy)
    (copy / "checkpoints" / "latest").write_text("step_00000004")
    shutil.rmtree(copy / "checkpoints" / "step_00000008")
    train_script.train(tiny_config(tmp_path, "train.ema=0.8", "train.ema_start=2"), copy, True,
                       World())
    for name in ("model.safetensors", "state.safetensors"):
        a, b = (load_file(str(run / "checkpoints" / "step_00000008" / name))
                for run in (original, copy))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_without_ema_the_state_holds_no_second_copy_of_the_weights(tmp_path):
    run_dir = tmp_path / "run"
    train_script.train(tiny_config(tmp_path), run_dir, False, World())
    state = load_file(str(run_dir / "checkpoints" / "step_00000008" / "state.safetensors"))
    assert state and not any(k.startswith("training_weights") for k in state)


def test_training_weights_that_do_not_fit_the_model_are_refused():
    model = torch.nn.Linear(2, 1)
    good = {name: torch.ones_like(p) for name, p in model.named_parameters()}
    for bad in ({"weight": good["weight"]}, {**good, "bias": torch.tensor([float("nan")])},
                {**good, "weight": torch.ones(2)}, {**good, "bias": torch.ones(1).long()}):
        with pytest.raises(StateMismatch, match="ckpt: its training weights do not fit this run"):
            load_training_weights(model, bad, Path("ckpt"))
    load_training_weights(model, good, Path("ckpt"))
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())


@pytest.mark.parametrize("value", ["1", "-0.1", "1.5"])
def test_the_decay_must_lie_in_0_to_1(value):
    with pytest.raises(UserError, match=rf"train.ema must be in \[0, 1\), got {value}"):
        compose([f"train.ema={value}"])
