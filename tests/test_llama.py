"""Hugging Face Llama (and Qwen3) interop (interop/hf_llama.py, scripts/export_hf.py): the whole-model
oracle for rotary positions, RMSNorm, SwiGLU, grouped key/value heads, QK-norm and the untied head.

transformers is the reference: tiny random LlamaForCausalLM / Qwen3ForCausalLM models with grouped
key/value heads, saved by transformers itself with a byte-level BPE tokenizer.json, are read by our
GPT, through `generate.py run=<folder>` too; our random and trained models are exported and loaded
back with AutoModelForCausalLM. Logits must agree to 1e-4 (fp32) and greedy tokens exactly.
Everything is offline (conftest sets HF_HUB_OFFLINE): the folders are made in tmp_path.
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
from safetensors.torch import load_file, save
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from data.tokenizer import EOS, build_bpe_tokenizer
from safeio.cli import FormatError
from guard.run_dir import load_folder, load_run
from helpers import REPO_ROOT, copy_folder, ok, run, shakespeare_like
from model.config import PITFALL_SWITCHES, AttentionConfig, ModelConfig, Scale
from model.gpt import GPT
from interop.hf import tokenizer_config
from interop.hf_llama import LLAMA, QWEN3, check_llama_exportable, llama_config, to_llama_state_dict
from scripts import export_hf
from scripts.export_hf import GPT2, architecture_for

TOLERANCE = 1e-4  # fp32, max abs logit difference
NEW_TOKENS = 40
CONTEXT = 64
TEXT = "ROMEO:\nGood, my lord doth speak tonight.\n\nJULIET:\nNay, naïve café!"


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def ours_greedy(model: GPT, prompt: torch.Tensor, n: int = NEW_TOKENS) -> list[int]:
    return torch.cat(list(model.generate(prompt, n, greedy=True)), dim=1)[0].tolist()


def hf_greedy(model, prompt: torch.Tensor, n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy search, made to run all n tokens (no stop at an EOS token)."""
    config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    return model.generate(prompt, generation_config=config)[0, prompt.size(1):].tolist()


def jitter(model) -> None:
    """transformers' init leaves every norm's gain at 1: move every parameter, so that a norm
    (or anything else) mapped to the wrong place shows in the logits. Not by much more: the
    larger q and k, the more transformers' float32 rotary angles (ours are float64) move the
    scores (docs/huggingface.md, Measured agreement)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)


# ----------------------------------------------------------------------------- folders


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE of 300 tokens: every text encodes, so the folders can also be trained on."""
    return build_bpe_tokenizer(shakespeare_like(20_000, seed=3), 300)


def write_tokenizer(folder: Path, tokenizer) -> None:
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        tokenizer_config({"eos_token": EOS}, CONTEXT)))


# Each: (transformers classes, config). GQA (2 key/value heads for 4), a theta and an epsilon
# that are not the defaults; the tied one is multi-query; Qwen3 adds q_norm / k_norm.
FOLDERS = {
    "llama_gqa": (LlamaConfig, LlamaForCausalLM, dict(
        num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "llama_mqa_tied": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=1,
                                                           tie_word_embeddings=True)),
    "llama_bias": (LlamaConfig, LlamaForCausalLM, dict(num_key_value_heads=2, attention_bias=True,
                                                       mlp_bias=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(num_key_value_heads=2, head_dim=16,
                                                  tie_word_embeddings=False)),
}


def make_folder(root: Path, name: str, tokenizer) -> Path:
    config_class, model_class, extra = FOLDERS[name]
    torch.manual_seed(0)
    config = config_class(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                          intermediate_size=176, max_position_embeddings=CONTEXT,
                          vocab_size=tokenizer.get_vocab_size(), bos_token_id=None,
                          eos_token_id=None, **extra)
    model = model_class(config).eval()
    jitter(model)
    folder = root / name
    model.save_pretrained(folder)
    write_tokenizer(folder, tokenizer)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    return {name: make_folder(root, name, tokenizer) for name in FOLDERS}


def theirs(folder: Path):
    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


# ----------------------------------------------------------------------------- import


@pytest.mark.parametrize("name", list(FOLDERS))
def test_imported_folder_gives_the_same_logits_and_greedy_tokens(folders, name):
    ours, reference = load_folder(folders[name]), theirs(folders[name])
    cfg = ours.cfg
    assert (cfg.positions.value, cfg.norm.value, cfg.mlp.value) == ("rope", "rmsnorm", "swiglu")
    assert cfg.kv_heads == reference.config.num_key_value_heads < cfg.n_head
    assert cfg.tie_embeddings == (name == "llama_mqa_tied") and cfg.qk_norm == (name == "qwen3")
    assert cfg.bias == (name == "llama_bias") and cfg.hidden == 176
    if name == "llama_gqa":
        assert (cfg.rope_theta, cfg.norm_eps) == (500000.0, 1e-5)
    idx = torch.randint(0, ours.vocab_size, (3, CONTEXT),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = max_diff(ours(idx)[0], reference(idx).logits)
    assert diff <= TOLERANCE, diff
    prompt = torch.tensor([[5, 17, 42, 3, 99]])
    tokens = ours_greedy(ours, prompt)
    assert tokens == hf_greedy(reference, prompt)
    assert len(set(tokens)) > 5  # random weights: a varied continuation, not one repeated token


@pytest.mark.slow  # a generate.py process: 8 s of CPU on 2 cores
def test_generate_samples_from_a_llama_folder_as_transformers_does(folders, tokenizer):
    """python generate.py run=<Llama folder> greedy=true: transformers' greedy text exactly."""
    folder = folders["llama_gqa"]
    result = run([str(REPO_ROOT / "generate.py"), f"run={folder}", "prompt=ROMEO:",
                  "greedy=true", f"max_new_tokens={NEW_TOKENS}"], cwd=REPO_ROOT)
    ok(result)
    hf_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    prompt = hf_tokenizer("ROMEO:", return_tensors="pt").input_ids
    assert prompt[0].tolist() == tokenizer.encode("ROMEO:").ids
    ids = prompt[0].tolist() + hf_greedy(theirs(folder), prompt)
    text = hf_tokenizer.decode(ids)
    assert result.stdout == text + "\n"
    assert len(set(ids)) > 10 and "the folder's weights" in result.stderr


def test_a_bfloat16_folder_is_read_as_float32(folders, tmp_path):
    """Published checkpoints are mostly bf16: read as float32 values, exactly the stored ones,
    they give the logits transformers gives when it loads them as float32."""
    folder = tmp_path / "bf16"
    theirs(folders["llama_gqa"]).to(torch.bfloat16).save_pretrained(folder)
    shutil.copy(folders["llama_gqa"] / "tokenizer.json", folder)
    stored = load_file(str(folder / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    ours = load_folder(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    idx = torch.randint(0, ours.vocab_size, (2, CONTEXT),
                        generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_diff(ours(idx)[0], reference(idx).logits) <= TOLERANCE
    assert all(p.dtype == torch.float32 for p in ours.parameters())


@pytest.mark.parametrize("name", list(FOLDERS))
def test_export_of_an_import_is_the_original_tensors(folders, name):
    original = load_file(str(folders[name] / "model.safetensors"))
    arch = QWEN3 if name == "qwen3" else LLAMA
    again = to_llama_state_dict(load_folder(folders[name]), arch)
    if "lm_head.weight" not in again:  # tied: stored once, as the embedding
        original.pop("lm_head.weight", None)
    assert again.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(again[key], tensor), key


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters has rope_type 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling has rope_type 'linear'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                          "partial_rotary_factor": 0.5}}, "partial_rotary_factor must be 1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0.5}}, "rope_theta must be"),
    ({"rope_parameters": "fast"}, "rope_parameters must be an object"),
    ({"head_dim": 32}, r"head_dim must be hidden_size / num_attention_heads \(16\)"),
    ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
    ({"attention_bias": True}, r"attention_bias \(true\) and mlp_bias \(false\) differ"),
    ({"num_key_value_heads": 3}, "num_key_value_heads must be a positive integer that divides"),
    ({"num_attention_heads": 5}, r"hidden_size \(64\) must be divisible by num_attention_heads"),
    ({"hidden_size": 36, "head_dim": None}, "head size hidden_size / num_attention_heads = 9 "
                                            "must be even"),
    ({"rms_norm_eps": 0}, r"rms_norm_eps must be a number in \(0, 1\)"),
    ({"hidden_size": None}, "has no 'hidden_size', which a model_type 'llama' config needs"),
    ({"intermediate_size": "176"}, "intermediate_size must be a positive integer"),
    ({"model_type": "mistral"}, "model_type must be one of 'gpt2', 'llama', 'qwen3', got 'mistral'"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be bool"),
    ({"num_hidden_layers": 3}, r"missing \['model.layers.2"),
    ({"intermediate_size": 128}, r"gate_proj.weight has shape \(176, 64\), config.json implies"),
    ({"num_key_value_heads": 4},
     r"k_proj.weight has shape \(32, 64\), config.json implies \(64, 64\)"),
])
def test_import_refuses_a_config_it_cannot_honour(folders, tmp_path, change, message):
    with pytest.raises(FormatError, match=message):
        load_folder(copy_folder(folders["llama_gqa"], tmp_path, config=change))


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True}, "use_sliding_window must be false"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types must all be"),
    ({"attention_bias": True}, r"attention_bias \(true\) and Qwen3's MLP \(no biases\) differ"),
    ({"head_dim": None}, r"head_dim must be .* \(16\) .*got 128"),  # Qwen3's default is 128
])
def test_import_refuses_a_qwen3_config_it_cannot_honour(folders, tmp_path, change, message):
    with pytest.raises(FormatError, match=message):
        load_folder(copy_folder(folders["qwen3"], tmp_path, config=change))


def test_import_reads_old_configs_and_stored_buffers(folders, tmp_path):
    """transformers 4.x wrote rope_theta and rope_scaling at the top level, and old checkpoints
    stored each layer's rotary inv_freq: both read as today's files."""
    expected = load_folder(folders["llama_gqa"]).state_dict()
    tensors = load_file(str(folders["llama_gqa"] / "model.safetensors"))
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    folder = copy_folder(folders["llama_gqa"], tmp_path, config={
        "rope_parameters": None, "rope_theta": 500000.0, "rope_scaling": None}, tensors=tensors)
    imported = load_folder(folder)
    cfg, state = imported.cfg, imported.state_dict()
    assert cfg.rope_theta == 500000.0
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)


@pytest.mark.parametrize("folder, change, message", [
    ("llama_gqa", {"lm_head.weight": None}, "missing .*lm_head.weight.* random head"),
    ("llama_mqa_tied", {"lm_head.weight": lambda t: torch.zeros_like(
        t["model.embed_tokens.weight"])}, "lm_head.weight differs"),
    ("llama_gqa", {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, "unexpected"),
    ("llama_gqa", {"model.norm.weight": torch.full((64,), float("nan"))}, "NaN or infinite"),
    ("qwen3", {"model.layers.1.self_attn.k_norm.weight": None}, "missing .*k_norm"),
])
def test_import_refuses_tensors_that_do_not_fit(folders, tmp_path, folder, change, message):
    tensors = load_file(str(folders[folder] / "model.safetensors"))
    tensors.update({k: v(tensors) if callable(v) else v for k, v in change.items()})
    tensors = {k: v for k, v in tensors.items() if v is not None}
    with pytest.raises(FormatError, match=message):
        load_folder(copy_folder(folders[folder], tmp_path, tensors=tensors))


def test_a_stored_tied_head_equal_to_the_embedding_is_fine(folders, tmp_path):
    tensors = load_file(str(folders["llama_mqa_tied"] / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    folder = copy_folder(folders["llama_mqa_tied"], tmp_path, tensors=tensors)
    assert load_folder(folder).cfg.tie_embeddings


# ----------------------------------------------------------------------------- export


def export_model(model: GPT, folder: Path, tokenizer, arch) -> Path:
    """What scripts/export_hf.py writes for a run, for a model of this process."""
    folder.mkdir()
    config = llama_config(model.cfg, model.vocab_size, None, arch)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(save(to_llama_state_dict(model, arch),
                                                    metadata={"format": "pt"}))
    write_tokenizer(folder, tokenizer)
    return folder


MODELS = {  # our switches -> the architecture that computes them
    "gqa_untied": (dict(n_kv_head=2, tie_embeddings=False, bias=False), LLAMA),
    "mqa_tied_bias": (dict(n_kv_head=1, bias=True, rope_theta=500.0, norm_eps=1e-6), LLAMA),
    "qk_norm": (dict(n_kv_head=2, qk_norm=True, bias=False, tie_embeddings=False), QWEN3),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_exported_model_gives_the_same_logits_and_greedy_tokens_in_transformers(
        tmp_path, tokenizer, name):
    switches, arch = MODELS[name]
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=CONTEXT, positions="rope",
                      norm="rmsnorm", mlp="swiglu", init_std=0.05, **switches)
    assert architecture_for(cfg, AttentionConfig()) is arch
    torch.manual_seed(0)
    ours = GPT(cfg, tokenizer.get_vocab_size())
    jitter(ours)
    ours.eval()
    reference = theirs(export_model(ours, tmp_path / name, tokenizer, arch))
    assert type(reference).__name__ == arch.class_name
    assert reference.config.num_key_value_heads == cfg.kv_heads
    idx = torch.randint(0, ours.vocab_size, (3, CONTEXT),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = max_diff(ours(idx)[0], reference(idx).logits)
    assert diff <= TOLERANCE, diff
    prompt = torch.tensor([tokenizer.encode("ROMEO:\n").ids])
    tokens = ours_greedy(ours, prompt)
    assert tokens == hf_greedy(reference, prompt) and len(set(tokens)) > 5
    # and back: the same tensors, the same switches
    back = load_folder(tmp_path / name)
    cfg_back = back.cfg
    state = {k: v for k, v in back.state_dict().items()
             if k != "lm_head.weight" or not cfg_back.tie_embeddings}
    assert replace(cfg_back, mlp_ratio=cfg.mlp_ratio, mlp_hidden=None) == cfg
    saved = {k: v for k, v in ours.state_dict().items()
             if k != "lm_head.weight" or not cfg.tie_embeddings}
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in state)


LLAMA_SWITCHES = ModelConfig(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2)


@pytest.mark.parametrize("switches, message", [
    (dict(mlp="relu2"), r"as Llama, model.mlp=relu2 \(Llama's MLP is swiglu\)$"),
    (dict(mlp="gelu"), "as Llama, model.mlp=gelu"),
    (dict(norm="layernorm"), r"as Llama, model.norm=layernorm \(Llama has RMSNorm\)$"),
    (dict(positions="learned"), r"as Llama, model.positions=learned \(Llama rotates"),
    (dict(positions="learned", norm="layernorm", mlp="gelu", n_kv_head=None, qk_norm=True),
     r"as GPT-2, model.qk_norm=true \(GPT-2 does not normalise q and k\)$"),
    (dict(positions="learned", n_kv_head=None, mlp="gelu"),
     r"as GPT-2, model.norm=rmsnorm \(GPT-2 has LayerNorm\)$"),
    (dict(positions="learned", mlp="gelu", norm="layernorm", n_kv_head=2),
     r"as GPT-2, model.n_kv_head=2 \(GPT-2 has a key/value head per query head\)$"),
    (dict(positions="learned", mlp="gelu"),
     r"as GPT-2, model.norm=rmsnorm .*, model.n_kv_head=2 .*; as Llama, model.positions=learned "
     r"\(Llama rotates q and k: rope\), model.mlp=gelu \(Llama's MLP is swiglu\)$"),
    (dict(qk_norm=True, bias=True),
     r"as Llama, model.qk_norm=true .*; as Qwen3, model.bias=true \(Qwen3's MLP has no biases\)$"),
])
def test_a_model_no_architecture_expresses_is_refused_naming_the_switches(switches, message):
    with pytest.raises(FormatError, match="^no transformers architecture computes this model; "
                                          "the nearest: " + message):
        architecture_for(replace(LLAMA_SWITCHES, **switches), AttentionConfig())


def test_architecture_for_each_run():
    gpt2 = ModelConfig()
    assert architecture_for(gpt2, AttentionConfig()) == GPT2
    assert architecture_for(LLAMA_SWITCHES, AttentionConfig()) is LLAMA
    assert architecture_for(replace(LLAMA_SWITCHES, qk_norm=True, bias=False),
                            AttentionConfig()) is QWEN3
    for cfg, name in ((gpt2, "GPT-2"), (LLAMA_SWITCHES, "Llama")):
        with pytest.raises(FormatError, match=f"'scale_d_model' cannot be expressed in {name}'s"):
            architecture_for(cfg, AttentionConfig(name="scale_d_model", scale=Scale.d_model))


# ----------------------------------------------------------------------------- runs


# Smoke runs as in tests/test_hf.py (a 64-token context, a high learning rate), with Llama's
# switches: one Llama can hold (GQA, untied head, no biases), one it cannot (ReLU^2).
COMMON = ["model.block_size=64", "optim.lr=2e-2", "train.threads=1", "train.sample_tokens=0",
          "tokenizer=bpe", "tokenizer.vocab_size=300", "model.positions=rope",
          "model.norm=rmsnorm", "model.n_kv_head=2"]
RUNS = {
    "llama": ["model.mlp=swiglu", "model.tie_embeddings=false", "model.bias=false"],
    "relu2": ["model.mlp=relu2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fake_sdist) -> dict[str, Path]:
    """Both smoke runs, trained side by side (one thread each)."""
    root = tmp_path_factory.mktemp("llama_runs")
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


@pytest.mark.slow
def test_exported_llama_run_gives_the_same_logits_and_greedy_text_in_transformers(runs, tmp_path):
    out = tmp_path / "export"
    result = ok(run(["-m", "scripts.export_hf", f"run={runs['llama']}", f"out={out}"],
                    cwd=REPO_ROOT))
    assert "exported" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    ours, tokenizer, cfg = load_run(runs["llama"], "best", torch.device("cpu"))
    reference = theirs(out)
    assert type(reference).__name__ == "LlamaForCausalLM"
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_heads"], config["tie_word_embeddings"], config["mlp_bias"],
            config["eos_token_id"]) == (2, False, False, 0)
    ids = torch.tensor([tokenizer.encode(TEXT).ids[:64]])
    with torch.no_grad():
        diff = max_diff(ours(ids)[0], reference(ids).logits)
    assert diff <= TOLERANCE, diff
    hf_tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = hf_tokenizer("ROMEO:\n", return_tensors="pt").input_ids
    tokens = ours_greedy(ours, prompt)
    assert tokens == hf_greedy(reference, prompt) and len(set(tokens)) > 5
    # generate.py on the export says what transformers says
    text = ok(run([str(REPO_ROOT / "generate.py"), f"run={out}", "prompt=ROMEO:\n",
                   "greedy=true", f"max_new_tokens={NEW_TOKENS}"], cwd=REPO_ROOT)).stdout
    assert text == hf_tokenizer.decode(prompt[0].tolist() + tokens) + "\n"
    # and imported back, it is the run
    state = load_folder(out).state_dict()
    run_state = ours.state_dict()
    assert state.keys() == run_state.keys()
    assert all(torch.equal(state[k], run_state[k]) for k in state)


@pytest.mark.slow
def test_export_command_refuses_a_run_no_architecture_expresses_in_one_line(runs, tmp_path):
    out = tmp_path / "out"
    result = run(["-m", "scripts.export_hf", f"run={runs['relu2']}", f"out={out}"], cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr == ("error: no transformers architecture computes this model; the "
                             "nearest: as Llama, model.mlp=relu2 (Llama's MLP is swiglu)\n")
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing left behind


@pytest.mark.slow
def test_export_command_refuses_a_pitfall_of_a_llama_run(runs, tmp_path, capsys):
    pitfall = tmp_path / "pitfall"
    shutil.copytree(runs["llama"], pitfall)
    cfg = OmegaConf.load(pitfall / "config.yaml")
    cfg.attention.name, cfg.attention.mask_mode = "mask_after_softmax", "after_softmax"
    OmegaConf.save(cfg, pitfall / "config.yaml")
    assert export_hf.main([f"run={pitfall}", f"out={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: attention variant 'mask_after_softmax' cannot be expressed in "
                          "Llama's format: its mask is after_softmax") and err.count("\n") == 1


@pytest.mark.slow
def test_training_starts_from_a_llama_folder(folders, tokenizer, fake_sdist, tmp_path):
    """train.py init_from=<Llama folder>: the folder's shape (GQA, untied head, theta), its
    tokenizer and its weights."""
    folder = folders["llama_gqa"]
    ok(run([str(REPO_ROOT / "train.py"), "+experiment=smoke", f"data.sdist_path={fake_sdist}",
            f"data.cache_dir={tmp_path / 'cache'}", "train.max_steps=1", "train.eval_interval=1",
            "train.threads=1", "train.sample_tokens=0", "optim.lr=1e-9", "optim.warmup_steps=1",
            f"init_from={folder}", f"hydra.run.dir={tmp_path / 'tuned'}"], cwd=tmp_path))
    tuned, run_tokenizer, cfg = load_run(tmp_path / "tuned", "latest", torch.device("cpu"))
    source = load_folder(folder)
    assert cfg.model.kv_heads == 2 and not cfg.model.tie_embeddings
    assert cfg.model.rope_theta == 500000.0 and cfg.model.block_size == CONTEXT
    assert run_tokenizer.get_vocab() == tokenizer.get_vocab()
    for name, a in tuned.state_dict().items():  # lr 1e-9: barely moved from the folder
        torch.testing.assert_close(a, source.state_dict()[name], atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("pitfall", PITFALL_SWITCHES)
def test_the_second_studys_mistakes_are_not_exported(pitfall):
    """A run trained with one of docs/ablations.md's second-study mistakes has weights that mean
    something else in Llama's attention (values rotated, heads tiled, pairs interleaved), or
    decodes in a way Llama does not: refused, naming the switch."""
    cfg = ModelConfig(positions="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False)
    check_llama_exportable(cfg, AttentionConfig(), LLAMA)  # the correct layer exports
    with pytest.raises(FormatError, match=f"attention.{pitfall}=true"):
        check_llama_exportable(cfg, AttentionConfig(**{pitfall: True}), LLAMA)
