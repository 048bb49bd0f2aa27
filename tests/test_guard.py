"""The checks in guard/, in process: the value table, a run directory's training state as the
setters it is loaded into judge it, the run config's YAML, and files that are not what they claim to be. (Whole commands with
bad input, through train.py and generate.py: tests/test_cli_errors.py.)"""
from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from data.batches import RandomWindows
from safeio.cli import FileRefused, StateMismatch, UserError
from safeio.files import load_run_config, read_bytes, why_not_creatable
from guard.limits import (CHOICES, MAX_WORKERS, SAMPLE, TRAIN, check_attention, check_model,
                          non_negative, positive)
from model.config import AttentionConfig, ModelConfig
from model.gpt import GPT
from training.checkpoint import load_training_state
from training.config import Config, OptimConfig
from training.optim import make_optimizer
from training.checkpoint import Progress, rng_state


# ----------------------------------------------------------------------------- the value table


def test_every_number_of_the_config_has_a_limit():
    """A field added to a config dataclass gets its range in guard/limits.py's table (or is a
    choice, an enum or a flag), or this fails naming it."""
    limited = {row.key for row in TRAIN} | set(CHOICES)
    numbers = []

    def walk(schema, prefix):
        hints = typing.get_type_hints(schema)
        for f in dataclasses.fields(schema):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
            elif kind in (int, float, typing.Optional[int], typing.Optional[float]):
                numbers.append(f"{prefix}{f.name}")

    walk(Config, "")
    assert [key for key in numbers if key not in limited] == []
    from generate import GenerateConfig  # and generate.py's: temperature has its own check

    hints = typing.get_type_hints(GenerateConfig)
    sampling = {f.name for f in dataclasses.fields(GenerateConfig) if hints[f.name] in (
        int, float, typing.Optional[int], typing.Optional[float])} - {"temperature"}
    assert {row.key for row in SAMPLE} == sampling


def test_indivisible_heads_are_one_clear_sentence():
    with pytest.raises(UserError, match=r"model.n_embd \(30\) must be divisible by model.n_head \(4\)"):
        check_model(ModelConfig(n_embd=30, n_head=4))
    check_model(ModelConfig(n_embd=32, n_head=4))  # and a valid one passes


@pytest.mark.parametrize("bad,match", [
    (dict(query_block=-1), "attention.query_block must be 0"),
    (dict(mask_value=1.0), "attention.mask_value must be"),
    (dict(qk_init_std=0.0), "attention.qk_init_std must be positive"),
])
def test_bad_attention_values_raise_one_clear_sentence(bad, match):
    with pytest.raises(ValueError, match=match):
        check_attention(AttentionConfig(**bad))
    check_attention(AttentionConfig(query_block=0))  # off is valid


# ----------------------------------------------------------------------------- memory estimate


def test_a_sweeps_seeds_of_one_model_are_counted_once(monkeypatch):
    """model_sizes builds the meta models once per distinct config: a study's 8 seeds of an
    arm share them; any field that differs (here the width) is counted anew."""
    import guard.memory as limits

    built = []
    count = limits._sizes
    monkeypatch.setattr(limits, "_sizes", lambda *a: built.append(a[0].n_embd) or count(*a))
    monkeypatch.setattr(limits, "_counted", {})
    first = limits.model_sizes(ModelConfig(n_embd=48), 500)
    assert limits.model_sizes(ModelConfig(n_embd=48), 500) == first and built == [48, 48]
    wider = limits.model_sizes(ModelConfig(n_embd=64), 500)
    assert built == [48, 48, 64, 64] and wider.params > first.params


@pytest.mark.parametrize("shape", [dict(), dict(n_layer=12, n_head=12, n_embd=768, block_size=1024)])
def test_memory_estimate_counts_the_kv_cache_of_the_key_value_heads(shape):
    """model_sizes (built on meta) counts the parameters and the KV cache the model has: the
    cache of n_kv_head heads, n_head / n_kv_head times smaller than multi-head attention's."""
    from guard.memory import inference_bytes, model_sizes

    cache = {}
    for kv in (None, 2, 1):
        cfg = ModelConfig(**shape, positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=kv,
                          tie_embeddings=False)
        sizes = model_sizes(cfg, 500)
        with torch.device("meta"):
            model = GPT(cfg, 500)
        assert sizes.params == model.num_params()
        assert sizes.cache_words == model.new_cache(1).nbytes // 4  # float32 words
        assert inference_bytes(sizes)["KV cache"] == 4 * sizes.cache_words
        cache[cfg.kv_heads] = sizes.cache_words
    h = shape.get("n_head", 4)
    assert cache[h] == 2 * shape.get("n_layer", 4) * shape.get("block_size", 128) * \
        shape.get("n_embd", 128)  # k and v: [n_layer, 1, h, T, d_k] each
    assert cache[h] == (h // 2) * cache[2] == h * cache[1]


# ----------------------------------------------------------------------------- state fields


@pytest.fixture
def live():
    """A tiny model's optimizer (Muon + AdamW) after two steps, its sampler and a saved state."""
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=8, block_size=8), 16)
    optimizer = make_optimizer(model, OptimConfig())
    sampler = RandomWindows(np.arange(100, dtype=np.uint16) % 16, 8, 2, seed=0)
    for _ in range(2):
        x, y = sampler.next_batch()
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    progress = Progress(step=2, tokens_seen=32, best_val=3.0, best_step=2, elapsed=1.5,
                        loss_window=[3.1, 3.0], history=[[2, 3.0, 3.05]])
    state = {"optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
             "rng": rng_state(), **progress.state_dict()}
    return state, optimizer, sampler


def _set(path: str, value):
    """A change to the state at a dotted path (integer parts index lists)."""
    def change(state):
        *parents, last = path.split(".")
        node = state
        for part in parents:
            node = node[int(part)] if isinstance(node, (list, tuple)) else node[part]
        if isinstance(node, dict):
            node[last if not last.isdigit() or last in node else int(last)] = value(node) \
                if callable(value) else value
        else:
            node[int(last)] = value(node) if callable(value) else value
    return change


def _first_moment(state):
    adamw = state["optimizer"]["optimizers"][1]["state"]
    return adamw[min(adamw)]


BAD_STATES = [
    ("step is text", _set("step", "2"), "step is '2'"),
    ("step negative", _set("step", -1), "step"),
    ("step beyond 64 bits", _set("step", 2**70), "step"),
    ("step a bool", _set("step", True), "step"),
    ("best_val text", _set("best_val", "low"), "best_val"),
    ("best_val nan", _set("best_val", float("nan")), "best_val"),
    ("best_step after step", _set("best_step", 3), "best_step"),
    ("elapsed nan", _set("elapsed", float("nan")), "elapsed"),
    ("elapsed negative", _set("elapsed", -1.0), "elapsed"),
    ("skipped more than steps", _set("skipped", 5), "skipped"),
    ("loss_window text", _set("loss_window", ["x"]), "loss_window"),
    ("loss_window too long", _set("loss_window", [1.0] * 10), "loss_window"),
    ("history entry short", _set("history", [[2, 3.0]]), "history"),
    ("history step text", _set("history", [["2", 3.0, 3.0]]), "history"),
    ("optimizer not a mapping", _set("optimizer", [1]), "optimizer state"),
    ("one optimizer missing", lambda s: s["optimizer"]["optimizers"].pop(), "optim.name"),
    ("group lists other params", lambda s: s["optimizer"]["optimizers"][1]["param_groups"][0]
     .__setitem__("params", [99]), "parameter group"),
    ("state for an unknown parameter", lambda s: s["optimizer"]["optimizers"][1]["state"]
     .__setitem__(99, {}), "does not have"),
    ("moment of the wrong shape", lambda s: _first_moment(s).__setitem__(
        "exp_avg", torch.zeros(3)), "shape (3,)"),
    ("moment with NaN", lambda s: _first_moment(s)["exp_avg"].fill_(float("nan")), "NaN"),
    ("moment of a matrix for a vector", lambda s: _first_moment(s).__setitem__(
        "exp_avg_sq", torch.zeros(2, 2)), "exp_avg_sq of shape (2, 2)"),
    ("lr text", lambda s: s["optimizer"]["optimizers"][1]["param_groups"][0]
     .__setitem__("lr", "fast"), "optimizer state"),
    ("betas of three", lambda s: s["optimizer"]["optimizers"][1]["param_groups"][0]
     .__setitem__("betas", (0.9, 0.9, 0.9)), "optimizer state"),
    ("sampler generator short", _set("sampler.generator", torch.zeros(10, dtype=torch.uint8)),
     "sampler state"),
    ("sampler generator floats", lambda s: s["sampler"].__setitem__(
        "generator", s["sampler"]["generator"].float()), "sampler state"),
    ("rng python short", lambda s: s["rng"].__setitem__("python", (3, (1, 2), None)), "rng state"),
    ("rng python version", lambda s: s["rng"].__setitem__(
        "python", (4, (0,) * 624 + (0,), None)), "rng state"),
    ("rng torch short", _set("rng.torch", torch.zeros(5, dtype=torch.uint8)), "rng state"),
    ("rng numpy short", _set("rng.numpy", [1, 2, 3]), "rng state"),
    ("rng numpy position", _set("rng.numpy_pos", 999), "numpy_pos 999"),
    ("rng numpy position negative", _set("rng.numpy_pos", -1), "numpy_pos -1"),
    ("rng missing part", lambda s: s["rng"].pop("numpy"), "rng state"),
]


def test_a_saved_state_loads(live):
    progress = load_training_state(*live, Path("ckpt"))
    assert progress.step == 2 and progress.history == [[2, 3.0, 3.05]]


@pytest.mark.parametrize("case", BAD_STATES, ids=[c[0] for c in BAD_STATES])
def test_a_state_that_does_not_fit_the_run_is_refused_in_one_line_naming_the_part(live, case):
    _, change, words = case
    state, optimizer, sampler = live
    change(state)
    with pytest.raises(StateMismatch) as info:
        load_training_state(state, optimizer, sampler, Path("ckpt"))
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- run config YAML


@pytest.mark.parametrize("text, words", [
    ("a: &x [1, 2]\nb: *x\n", "anchor"),
    ("a: !!python/object/apply:os.system ['true']\n", "tag"),
    ("a: " + "[" * 40 + "]" * 40 + "\n", "nesting"),
    ("a: ${oc.env:HOME}\n", "interpolation"),
    ("- 1\n- 2\n", "no mapping"),
    ("a: [\n", "not a readable run config"),
    ("a: 1\na: 2\n", "duplicate"),
    ("%YAML 1.1\n---\na: 1\n", "directive"),
])
def test_run_config_refuses_what_train_py_never_writes(tmp_path, text, words):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_run_config(path)
    assert words in str(info.value), str(info.value)


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (tmp_path / "config.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match="anchor"):
        load_run_config(tmp_path / "config.yaml")


def test_run_config_of_plain_keys_and_values_loads(tmp_path):
    (tmp_path / "config.yaml").write_text("model:\n  n_layer: 2\nseed: 3\nrun_name: a_b\n")
    assert load_run_config(tmp_path / "config.yaml").model.n_layer == 2


# ----------------------------------------------------------------------------- files


def test_files_that_are_not_regular_files_or_too_big_are_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FileRefused, match="FIFO"):
        read_bytes(fifo, "config", 1000)  # would block forever if opened for reading plainly
    with pytest.raises(FileRefused, match="character device"):
        read_bytes(os.devnull, "config", 1000)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(10**12)  # sparse: a terabyte on paper
    with pytest.raises(FileRefused, match="more than"):
        read_bytes(big, "config", 1000)
    with pytest.raises(FileRefused, match="directory"):
        read_bytes(tmp_path, "config", 1000)
    with pytest.raises(FileRefused, match="does not exist"):
        read_bytes(tmp_path / "nope", "config", 1000)


@pytest.mark.parametrize("row, value, words", [
    (positive("threads", MAX_WORKERS), 0, "threads must be from 1 to 1,024, got 0"),
    (non_negative("seed", 10), -1, "seed must be from 0 to 10, got -1"),
    (positive("lr", 1.0), 0.0, "lr must be above 0 and at most 1.0, got 0.0"),
])
def test_a_refusal_states_the_bound_it_enforces(row, value, words):
    """The message's range is the one the check applies: `threads=0` was refused by a message
    that said 0 was allowed ("between 0 and 1,024")."""
    assert row.problem(value) == words
    assert row.problem(1) is None


def test_a_folder_is_creatable_only_under_a_directory_and_never_through_a_link(tmp_path):
    """One check for every folder the project makes (a run directory, bench.record's out= and
    runs=): the nearest existing ancestor must be a directory, and a dangling link counts as
    existing (a folder is never made through a link)."""
    assert why_not_creatable(tmp_path / "a" / "b") is None
    (tmp_path / "file").write_text("x")
    assert why_not_creatable(tmp_path / "file" / "run") == f"{tmp_path / 'file'} is not a directory"
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")
    assert why_not_creatable(tmp_path / "link" / "run") == f"{tmp_path / 'link'} is not a directory"
