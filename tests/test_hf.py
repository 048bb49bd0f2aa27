"""Hugging Face interop (interop/hf.py, scripts/export_hf.py): GPT-2 folders in and out.

transformers is the oracle here, and a test-only dependency: a tiny random GPT2LMHeadModel made
in the test is imported into our GPT, and two trained smoke runs (char-level; byte-level BPE
without biases and with tanh GELU) are exported and loaded back with AutoModelForCausalLM and
AutoTokenizer. Either way the logits, the greedy continuations and the token ids must agree.
Everything is offline (conftest sets HF_HUB_OFFLINE): folders are made in tmp_path.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel,
                          GenerationConfig)

from guard.limits import check_model
from guard.run_dir import load_folder, load_run
from helpers import REPO_ROOT, copy_folder
from model.config import AttentionConfig, MLPKind, ModelConfig, Scale
from model.gpt import GPT
from interop.hf import check_exportable, load_folder_tokenizer, to_gpt2_state_dict
from safeio.cli import FormatError
from scripts import export_hf
from guard.compose import compose

TOLERANCE = 1e-5  # fp32, max abs logit difference
NEW_TOKENS = 50
TEXT = "ROMEO:\nGood, my lord doth speak tonight.\n\nJULIET:\nNay, naïve café!"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def ours_greedy(model: GPT, prompt: torch.Tensor) -> list[int]:
    return torch.cat(list(model.generate(prompt, NEW_TOKENS, greedy=True)), dim=1)[0].tolist()


def hf_greedy(model, prompt: torch.Tensor) -> list[int]:
    """transformers' greedy search, made to run all NEW_TOKENS (no stop at an EOS token)."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    return model.generate(prompt, generation_config=config)[0, prompt.size(1):].tolist()


# ----------------------------------------------------------------------------- import


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    """A tiny random GPT-2 (tanh GELU, as OpenAI's) saved by transformers itself.

    transformers' init leaves biases at 0 and LayerNorms at (1, 0); every parameter is jittered
    so that a bias or a norm mapped to the wrong place shows in the logits."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=100,
                        activation_function="gelu_new", bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "ln_" in name else 0.3))
    folder = tmp_path_factory.mktemp("gpt2") / "tiny-gpt2"
    model.save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def gpt2_model(gpt2_folder):
    return AutoModelForCausalLM.from_pretrained(gpt2_folder).eval()


def test_imported_gpt2_gives_the_same_logits_as_transformers(gpt2_folder, gpt2_model):
    ours = load_folder(gpt2_folder)
    assert ours.cfg.mlp is MLPKind.gelu_tanh and ours.cfg.block_size == 64
    idx = torch.randint(0, 100, (3, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = max_diff(ours(idx)[0], gpt2_model(idx).logits)
    assert diff <= TOLERANCE, diff


def test_imported_gpt2_generates_the_same_greedy_tokens(gpt2_folder, gpt2_model):
    ours = load_folder(gpt2_folder)
    prompt = torch.tensor([[5, 17, 42, 3, 99]])
    tokens = ours_greedy(ours, prompt)
    assert tokens == hf_greedy(gpt2_model, prompt)
    assert len(set(tokens)) > 5  # random weights: a varied continuation, not one repeated token


def test_export_of_an_import_is_the_original_tensors(gpt2_folder):
    original = load_file(str(gpt2_folder / "model.safetensors"))
    again = to_gpt2_state_dict(load_folder(gpt2_folder))
    assert again.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(again[key], tensor), key


def test_import_reads_gpt2model_names_old_mask_buffers_and_a_stored_tied_head(gpt2_folder, tmp_path):
    """OpenAI's upload names tensors `h.0...` (no `transformer.`), stores each layer's causal
    mask as `h.N.attn.bias`, and some files repeat the tied head: all fine."""
    expected = load_folder(gpt2_folder).state_dict()
    tensors = {k.removeprefix("transformer."): v for k, v in
               load_file(str(gpt2_folder / "model.safetensors")).items()}
    for i in range(2):
        tensors[f"h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    tensors["lm_head.weight"] = tensors["wte.weight"].clone()
    folder = copy_folder(gpt2_folder, tmp_path, tensors=tensors)
    state = load_folder(folder).state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)


@pytest.mark.parametrize("change, message", [
    ({"n_embd": None}, "has no 'n_embd'"),
    ({"n_embd": "32"}, "n_embd must be a positive integer"),
    ({"n_layer": 0}, "n_layer must be a positive integer"),
    ({"n_head": 3}, r"n_embd \(32\) must be divisible by n_head \(3\)"),
    ({"n_inner": 100}, "n_inner must be a positive multiple"),
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon must be 1e-05"),
    ({"scale_attn_weights": False}, "scale_attn_weights must be true"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx must be false"),
    ({"model_type": "bert"}, "model_type must be one of 'gpt2', 'llama', 'qwen3', got 'bert'"),
    ({"tie_word_embeddings": False}, "no lm_head.weight"),
    ({"n_layer": 3}, r"missing \['transformer.h.2"),
    ({"n_positions": 32}, r"transformer.wpe.weight has shape \(64, 32\), config.json implies \(32, 32\)"),
])
def test_import_refuses_a_config_it_cannot_honour(gpt2_folder, tmp_path, change, message):
    with pytest.raises(FormatError, match=message):
        load_folder(copy_folder(gpt2_folder, tmp_path, config=change))


@pytest.mark.parametrize("replace, message", [
    ({"transformer.ln_f.bias": torch.full((32,), float("nan"))}, "NaN or infinite"),
    ({"transformer.h.0.attn.c_attn.weight": torch.zeros(96, 32)}, r"has shape \(96, 32\)"),
    ({"transformer.ln_f.weight": torch.ones(32, dtype=torch.int32)}, "not a floating"),
    ({"lm_head.weight": torch.zeros(100, 32)}, "untied head"),
    ({"transformer.h.0.attn.q_proj.weight": torch.zeros(32, 32)}, "unexpected"),
])
def test_import_refuses_tensors_that_do_not_fit(gpt2_folder, tmp_path, replace, message):
    tensors = {**load_file(str(gpt2_folder / "model.safetensors")), **replace}
    with pytest.raises(FormatError, match=message):
        load_folder(copy_folder(gpt2_folder, tmp_path, tensors=tensors))


def test_import_refuses_odd_files(gpt2_folder, tmp_path):
    folder = copy_folder(gpt2_folder, tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(FormatError, match="cannot read .* corrupt"):
        load_folder(folder)
    with open(weights, "wb") as f:  # sparse: no disk is used
        f.truncate(1 << 30)
    with pytest.raises(FormatError, match="implausibly large"):
        load_folder(folder)
    weights.unlink()
    weights.mkdir()
    with pytest.raises(FormatError, match="not a regular file"):
        load_folder(folder)
    weights.rmdir()
    (folder / "pytorch_model.bin").write_bytes(b"a pickle, never opened")
    with pytest.raises(FormatError, match="has no model.safetensors .*pytorch_model.bin"):
        load_folder(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FormatError, match="has no config.json"):
        load_folder(folder)
    with pytest.raises(FormatError, match="not a directory"):
        load_folder(tmp_path / "nowhere")
    assert load_folder_tokenizer(gpt2_folder) is None  # no tokenizer.json: None, not an error


def test_mlp_option_selects_the_tanh_gelu():
    torch.manual_seed(0)
    exact = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, mlp=MLPKind.gelu),
                vocab_size=11)
    tanh = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8,
                           mlp=MLPKind.gelu_tanh), vocab_size=11)
    tanh.load_state_dict(exact.state_dict())
    x = torch.randn(4, 16) * 2
    mlp = tanh.blocks[0].mlp
    assert torch.equal(mlp(x), mlp.proj(torch.nn.functional.gelu(mlp.fc(x), approximate="tanh")))
    idx = torch.randint(0, 11, (2, 8))
    assert not torch.equal(exact(idx)[0], tanh(idx)[0])  # the option reaches the MLP
    with pytest.raises(ValueError, match="model.mlp must be one of"):
        check_model(ModelConfig(mlp="relu"))


GPT2_ARCH = compose(["+arch=gpt2"]).model  # GPT-2's switches, at the default size


def test_pitfall_variants_are_not_exportable():
    cfg = GPT2_ARCH
    check_exportable(cfg, AttentionConfig())  # the correct layer is
    for attn in (AttentionConfig(name="no_out_proj", out_proj=False),
                 AttentionConfig(name="scale_d_model", scale=Scale.d_model),
                 AttentionConfig(name="mask_zero", mask_value=0.0)):
        with pytest.raises(FormatError, match=f"'{attn.name}' cannot be expressed"):
            check_exportable(cfg, attn)


@pytest.mark.parametrize("switch,value", [("positions", "rope"), ("norm", "rmsnorm"),
                                          ("mlp", "swiglu"), ("mlp", "relu2"), ("n_kv_head", 2),
                                          ("qk_norm", True), ("tie_embeddings", False),
                                          ("attn_gate", True)])
def test_a_model_gpt2_has_no_switch_for_is_refused_naming_it(switch, value):
    cfg = replace(GPT2_ARCH, **{switch: value})
    with pytest.raises(FormatError, match=f"model.{switch}={str(value).lower()}"):
        check_exportable(cfg, AttentionConfig())
    model = GPT(replace(cfg, n_layer=1, n_embd=16, block_size=8), vocab_size=11)
    with pytest.raises(FormatError, match=f"model.{switch}="):
        to_gpt2_state_dict(model)


# ----------------------------------------------------------------------------- export of runs


def run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}" \
                                   f"\n--- stderr\n{result.stderr[-3000:]}"
    return result


# Smoke runs with a 64-token context, so that a prompt and 50 new tokens fit in it, and a high
# learning rate, so that 60 steps learn more than "\n\n\n..." as a greedy continuation.
COMMON = ["+arch=gpt2", "model.block_size=64", "optim.lr=2e-2", "train.threads=1",
          "train.sample_tokens=0"]
RUNS = {
    "char": [],
    "bpe": ["tokenizer=bpe", "tokenizer.vocab_size=300", "model.bias=false",
            "model.mlp=gelu_tanh"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fake_sdist) -> dict[str, Path]:
    """Both smoke runs, trained side by side (one thread each)."""
    root = tmp_path_factory.mktemp("hf_runs")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs = {}
    for name, extra in RUNS.items():
        args = [str(REPO_ROOT / "train.py"), "+experiment=smoke", f"data.sdist_path={fake_sdist}",
                f"data.cache_dir={root / 'cache' / name}", f"hydra.run.dir={root / name}",
                *COMMON, *extra]
        procs[name] = subprocess.Popen([sys.executable, *args], cwd=root, env=env, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for name, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} run failed:\n{output[-3000:]}"
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def exports(runs, tmp_path_factory) -> dict[str, Path]:
    """The char run through the real command line; the BPE run through export() in-process."""
    root = tmp_path_factory.mktemp("hf_exports")
    result = ok(run(["-m", "scripts.export_hf", f"run={runs['char']}", f"out={root / 'char'}"],
                    cwd=REPO_ROOT))
    assert "exported" in result.stdout
    export_hf.export(runs["bpe"], root / "bpe", "latest")
    return {"char": root / "char", "bpe": root / "bpe"}


def ours_and_theirs(runs, exports, name):
    weights = "best" if name == "char" else "latest"
    ours, tokenizer, _ = load_run(runs[name], weights, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(exports[name], local_files_only=True).eval()
    return ours, tokenizer, theirs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_exported_run_gives_the_same_logits_and_greedy_tokens_in_transformers(runs, exports, name):
    ours, tokenizer, theirs = ours_and_theirs(runs, exports, name)
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    ids = torch.tensor([tokenizer.encode(TEXT).ids[:64]])
    with torch.no_grad():
        diff = max_diff(ours(ids)[0], theirs(ids).logits)
    assert diff <= TOLERANCE, diff
    prompt = torch.tensor([tokenizer.encode("ROMEO:\n").ids])
    tokens = ours_greedy(ours, prompt)
    assert tokens == hf_greedy(theirs, prompt)
    assert len(set(tokens)) > 5  # it learnt enough to say more than one token over and over


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_exported_tokenizer_gives_our_ids(runs, exports, name):
    ours = load_folder_tokenizer(runs[name])
    theirs = AutoTokenizer.from_pretrained(exports[name], local_files_only=True)
    text = TEXT + ("<|endoftext|>ß" if name == "bpe" else "")
    ids = ours.encode(text).ids
    assert theirs(text)["input_ids"] == ids
    assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    special = {"char": ("unk_token", "[UNK]"), "bpe": ("eos_token", "<|endoftext|>")}[name]
    assert getattr(theirs, special[0]) == special[1]
    assert theirs.convert_tokens_to_ids(special[1]) == ours.token_to_id(special[1])


@pytest.mark.slow
def test_exported_config_says_what_the_run_was(exports):
    char = json.loads((exports["char"] / "config.json").read_text())
    bpe = json.loads((exports["bpe"] / "config.json").read_text())
    assert (char["activation_function"], bpe["activation_function"]) == ("gelu", "gelu_pytorch_tanh")
    assert (char["n_positions"], char["n_embd"], char["n_layer"], char["n_head"]) == (64, 32, 2, 4)
    assert (char["eos_token_id"], bpe["eos_token_id"], bpe["vocab_size"]) == (None, 0, 300)
    # model.bias=false is exported as zero biases: the same function in GPT-2's shape
    tensors = load_file(str(exports["bpe"] / "model.safetensors"))
    biases = [k for k in tensors if k.endswith(".bias")]
    assert len(biases) == 2 * 6 + 1 and all(not tensors[k].any() for k in biases)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_import_of_an_export_is_the_run(runs, exports, name):
    weights = "best" if name == "char" else "latest"
    run_model, _, run_cfg = load_run(runs[name], weights, torch.device("cpu"))
    imported = load_folder(exports[name])
    cfg, state = imported.cfg, {k: v for k, v in imported.state_dict().items() if k != "lm_head.weight"}
    assert cfg.mlp is run_cfg.model.mlp and cfg.mlp_ratio == run_cfg.model.mlp_ratio
    original = {k: v for k, v in run_model.state_dict().items() if k != "lm_head.weight"}
    for key, tensor in state.items():
        assert torch.equal(tensor, original[key]) if key in original else not tensor.any(), key


def _pitfall_copy(run_dir: Path, tmp_path: Path, **attention) -> Path:
    copy = tmp_path / "pitfall"
    shutil.copytree(run_dir, copy)
    cfg = OmegaConf.load(copy / "config.yaml")
    for key, value in attention.items():
        cfg.attention[key] = value
    OmegaConf.save(cfg, copy / "config.yaml")
    return copy


@pytest.mark.slow
def test_export_command_refuses_a_pitfall_variant_in_one_line(runs, tmp_path):
    pitfall = _pitfall_copy(runs["char"], tmp_path, name="scale_d_model", scale="d_model")
    out = tmp_path / "out"
    result = run(["-m", "scripts.export_hf", f"run={pitfall}", f"out={out}"], cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: attention variant 'scale_d_model' cannot be expressed")
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == [pitfall]  # nothing left behind


@pytest.mark.slow
@pytest.mark.parametrize("attention", [dict(mask_value=0.0), dict(mask_mode="after_softmax"),
                                       dict(mask_mode="fill"), dict(scale="none")])
def test_export_refuses_every_attention_pitfall(runs, tmp_path, capsys, attention):
    pitfall = _pitfall_copy(runs["char"], tmp_path, **attention)
    assert export_hf.main([f"run={pitfall}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: attention variant") and err.count("\n") == 1


@pytest.mark.slow
def test_export_user_mistakes_are_one_error_line(runs, tmp_path, capsys):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    a_file = tmp_path / "file"
    a_file.write_text("")
    cases = {
        (f"run={tmp_path / 'nowhere'}", f"out={tmp_path / 'o1'}"): "does not exist",
        (f"run={runs['char']}", f"out={full}"): "exists and is not empty",
        (f"run={runs['char']}", f"out={a_file}"): "exists and is not a directory",
        (f"run={runs['char']}", f"out={a_file / 'sub'}"): "is not a directory",
        (f"run={runs['char']}", f"out={tmp_path / 'o2'}", "weights=middle"): "best or latest",
        (f"run={runs['char']}",): "out= is required",
        (f"run={runs['char']}", f"out={tmp_path / 'o3'}", "colour=red"): "unknown key 'colour'",
        (str(runs["char"]),): "must be key=value",
        (f"run={tmp_path}", f"out={tmp_path / 'o4'}"): "has no config.yaml",
    }
    for argv, message in cases.items():
        assert export_hf.main(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, (argv, err)
    assert (full / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]  # no o1..o4, no temp


@pytest.mark.slow
def test_export_takes_runs_latest_and_names_the_weights(runs, tmp_path, capsys, monkeypatch):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").write_text(f"{runs['char']}\n")  # as train.py writes it
    monkeypatch.chdir(tmp_path)
    assert export_hf.main(["run=runs/latest", "out=exported"]) == 0
    assert capsys.readouterr().out.startswith(f"exported {runs['char']}, best weights (step ")
    assert (tmp_path / "exported" / "config.json").is_file()


@pytest.mark.slow
def test_export_into_an_existing_empty_directory(runs, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    export_hf.export(runs["char"], out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert load_folder(out).vocab_size == load_folder_tokenizer(out).get_vocab_size()


# ----------------------------------------------------------------------------- using an import


@pytest.mark.slow
def test_generate_samples_from_a_gpt2_folder_as_from_the_run(runs, exports):
    """generate.py run=<GPT-2 folder>: the same greedy text as from the run it was exported from."""
    texts = [ok(run([str(REPO_ROOT / "generate.py"), f"run={source}", "prompt=ROMEO:",
                     "greedy=true", "max_new_tokens=40", "weights=latest"], cwd=REPO_ROOT)).stdout
             for source in (runs["bpe"], exports["bpe"])]
    assert texts[0] == texts[1] and len(texts[0]) > len("ROMEO:")


@pytest.mark.slow
def test_training_starts_from_a_gpt2_folder(runs, exports, fake_sdist, tmp_path):
    """train.py init_from=<folder>: the folder's shape, tokenizer and weights, so the first
    evaluation already scores what the exported run scored, far below a fresh model."""
    common = [str(REPO_ROOT / "train.py"), "+experiment=smoke", f"data.sdist_path={fake_sdist}",
              f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=1", "train.eval_interval=1",
              "train.threads=1", "train.sample_tokens=0", "optim.lr=1e-9", "optim.warmup_steps=1"]
    ok(run([*common, f"init_from={exports['bpe']}", f"hydra.run.dir={tmp_path / 'tuned'}"],
           cwd=tmp_path))
    ok(run([*common, "tokenizer=bpe", "tokenizer.vocab_size=300", f"hydra.run.dir={tmp_path / 'fresh'}"],
           cwd=tmp_path))
    tuned, tokenizer, cfg = load_run(tmp_path / "tuned", "latest", torch.device("cpu"))
    assert cfg.model.block_size == 64 and cfg.model.mlp.value == "gelu_tanh"
    assert cfg.tokenizer.kind.value == "file"
    assert tokenizer.get_vocab() == load_folder_tokenizer(exports["bpe"]).get_vocab()
    source = load_run(runs["bpe"], "latest", torch.device("cpu"))[0].state_dict()
    for name, a in tuned.state_dict().items():  # lr 1e-9: barely moved from the export
        # (the run had model.bias=false: GPT-2's format carries its biases as zeros)
        b = source[name] if name in source else torch.zeros_like(a)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    val = {name: read_val_loss(tmp_path / name) for name in ("tuned", "fresh")}
    assert val["tuned"] < val["fresh"] - 0.5, val


def read_val_loss(run_dir: Path) -> float:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return acc.Scalars("val/loss")[-1].value


@pytest.mark.slow
def test_init_from_a_folder_without_a_tokenizer_is_one_error_line(exports, tmp_path):
    folder = tmp_path / "no_tokenizer"
    shutil.copytree(exports["bpe"], folder)
    (folder / "tokenizer.json").unlink()
    result = run([str(REPO_ROOT / "train.py"), "+experiment=smoke", f"init_from={folder}",
                  f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and "tokenizer.json" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
