"""weights=auto: the tools sample and draw a causal run's best weights, and a leaky run's latest
ones (its best causal loss comes before it learns to read ahead), and say which they loaded."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from safeio.cli import UserError
from model.config import AttentionConfig
from training.config import Config
from guard.weights_choice import choose_weights


def fake_run(root: Path, attention: AttentionConfig, best_step=50, latest_step=400) -> Path:
    """A run directory as train.py leaves it, as far as choose_weights reads it."""
    run = root / attention.name
    (run / "checkpoints" / "best").mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(
        Config(attention=attention, run_name=attention.name))))
    if best_step is not None:
        (run / "checkpoints" / "best" / "model.safetensors").write_bytes(b"")
        (run / "checkpoints" / "best" / "info.txt").write_text(
            f"step {best_step}\nval_loss 2.538100\n")
    (run / "checkpoints" / "latest").write_text(f"step_{latest_step:08d}")
    return run


CORRECT = AttentionConfig()
MASK_ZERO = AttentionConfig(name="mask_zero", mask_value=0.0)


def test_auto_takes_the_best_weights_of_a_causal_run(tmp_path):
    chosen = choose_weights(fake_run(tmp_path, CORRECT), "auto")
    assert (chosen.kind, chosen.step, chosen.note) == ("best", 50, "")
    assert chosen.describe() == "best weights (step 50, causal val loss 2.5381)"


def test_auto_takes_the_latest_weights_of_a_leaky_run_and_says_why(tmp_path):
    chosen = choose_weights(fake_run(tmp_path, MASK_ZERO), "auto")
    assert (chosen.kind, chosen.step) == ("latest", 400)
    assert chosen.describe() == "latest weights (step 400)"
    assert "attention=mask_zero leaks" in chosen.note and "weights=best is step 50" in chosen.note


def test_best_on_a_leaky_run_is_what_was_asked_for_with_a_word(tmp_path):
    chosen = choose_weights(fake_run(tmp_path, MASK_ZERO), "best")
    assert (chosen.kind, chosen.step) == ("best", 50)
    assert "before the model learned to read ahead" in chosen.note


def test_latest_is_the_checkpoint_latest_names(tmp_path):
    chosen = choose_weights(fake_run(tmp_path, CORRECT), "latest")
    assert (chosen.kind, chosen.step, chosen.note) == ("latest", 400, "")


def test_a_run_without_best_weights_falls_back_to_latest_as_loading_does(tmp_path):
    chosen = choose_weights(fake_run(tmp_path, CORRECT, best_step=None), "best")
    assert (chosen.kind, chosen.step) == ("latest", 400)


def test_a_folder_that_is_no_run_is_left_to_load_run_and_a_bad_choice_is_refused(tmp_path):
    assert choose_weights(tmp_path / "nowhere", "auto").kind == "best"
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text("{}")
    assert choose_weights(tmp_path / "gpt2", "auto").describe() == "the folder's weights"
    with pytest.raises(UserError, match="weights must be auto, best or latest"):
        choose_weights(tmp_path, "newest")
