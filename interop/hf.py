"""Our GPT <-> Hugging Face transformers' GPT-2 format (config.json + model.safetensors).

The two networks are the same function: learned positions, pre-LayerNorm blocks, fused Q|K|V
projection, GELU MLP, final LayerNorm, head tied to the token embedding. So converting is
renaming plus three differences of storage:

    * GPT-2's Conv1D keeps its weight as [in, out]; nn.Linear keeps [out, in]: transpose.
    * GPT-2 always has biases; a model built with bias=false is exported with zero biases,
      which computes exactly the same thing (x W + 0, LayerNorm(x) * g + 0).
    * The tied head is stored once (transformers re-ties lm_head to wte on load).

What GPT-2's format cannot say is refused rather than approximated, both ways
(docs/huggingface.md, "What is refused, and why"). safeio/hf.py reads and checks the folder's
files for any architecture, guard/run_dir.py a config.json's values and the memory they need;
this file says what GPT-2's names and shapes are (ours, from a GPT built on the meta device).

Nothing here imports transformers: exporting and importing need only safetensors and json, so a
user without transformers can still produce a folder that transformers loads.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator, Optional

import torch

from safeio.cli import FormatError
from safeio.corpus import load_tokenizer
from safeio.hf import CONFIG, WEIGHTS, Fields, PathLike, open_folder, read_tensors, size_limit, \
    tensor_names  # CONFIG, WEIGHTS: the folder's file names, which the export writes too
from model.config import AttentionConfig, MLPKind, MaskMode, ModelConfig, Norm, Positions, Scale
from model.gpt import GPT

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which every LayerNorm of ours uses
TIED_HEAD = "lm_head.weight"  # ours and GPT-2's: the same storage as the token embedding

# GPT-2's MLPs, by transformers' names for the activation (ACT2FN keys). "gelu" is the exact erf
# GELU; "gelu_new" (OpenAI's GPT-2) and "gelu_pytorch_tanh" are both the tanh approximation,
# written out in Python or by torch: they differ by float rounding only.
GPT2_ACTIVATIONS = {"gelu": MLPKind.gelu, "gelu_new": MLPKind.gelu_tanh,
                    "gelu_pytorch_tanh": MLPKind.gelu_tanh}
EXPORT_ACTIVATION = {MLPKind.gelu: "gelu", MLPKind.gelu_tanh: "gelu_pytorch_tanh"}


# ----------------------------------------------------------------------------- the architecture


def gpt2_problems(cfg: ModelConfig) -> list[str]:
    """The switches of cfg that GPT-2's architecture does not have ([] for a GPT-2 model: every
    default of ModelConfig's switches, or `+arch=gpt2`)."""
    problems = []
    positions, norm, mlp = Positions(cfg.positions), Norm(cfg.norm), MLPKind(cfg.mlp)
    if positions is not Positions.learned:
        problems.append(f"model.positions={positions.value} (GPT-2 learns positions)")
    if norm is not Norm.layernorm:
        problems.append(f"model.norm={norm.value} (GPT-2 has LayerNorm)")
    if mlp not in GPT2_ACTIVATIONS.values():
        problems.append(f"model.mlp={mlp.value} (GPT-2's MLP is gelu or gelu_tanh)")
    if cfg.mlp_hidden is not None and cfg.mlp_hidden != cfg.mlp_ratio * cfg.n_embd:
        problems.append(f"model.mlp_hidden={cfg.mlp_hidden} (GPT-2's is a multiple of n_embd)")
    if cfg.kv_heads != cfg.n_head:
        problems.append(f"model.n_kv_head={cfg.n_kv_head} (GPT-2 has a key/value head per "
                        f"query head)")
    if cfg.qk_norm:
        problems.append("model.qk_norm=true (GPT-2 does not normalise q and k)")
    if not cfg.tie_embeddings:
        problems.append("model.tie_embeddings=false (GPT-2's head is the token embedding)")
    if cfg.norm_eps != LAYER_NORM_EPS:
        problems.append(f"model.norm_eps={cfg.norm_eps} (GPT-2's LayerNorm has {LAYER_NORM_EPS})")
    if cfg.attn_gate:
        problems.append("model.attn_gate=true (GPT-2 has no gate on its heads' outputs)")
    if cfg.window is not None:
        problems.append(f"model.window={cfg.window} (GPT-2 attends to every earlier key)")
    return problems


# ----------------------------------------------------------------------------- names and shapes


def _tensor_names(n_layer: int) -> Iterator[tuple[str, str, bool]]:
    """(our name, GPT-2's name, transposed?) for every stored tensor but the tied head.

    GPT-2's names are those of GPT2LMHeadModel, whose body sits under `transformer.`."""
    yield "tok_emb.weight", "transformer.wte.weight", False
    yield "pos_emb.weight", "transformer.wpe.weight", False
    for i in range(n_layer):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        for norm in ("ln_1", "ln_2"):
            yield ours + f"{norm}.weight", theirs + f"{norm}.weight", False
            yield ours + f"{norm}.bias", theirs + f"{norm}.bias", False
        for mine, gpt2 in (("attn.qkv", "attn.c_attn"), ("attn.out_proj", "attn.c_proj"),
                           ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            yield ours + f"{mine}.weight", theirs + f"{gpt2}.weight", True  # Conv1D: [in, out]
            yield ours + f"{mine}.bias", theirs + f"{gpt2}.bias", False
    yield "ln_f.weight", "transformer.ln_f.weight", False
    yield "ln_f.bias", "transformer.ln_f.bias", False


def _gpt2_shapes(cfg: ModelConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """GPT-2's name -> the shape it has in a model of this config (our GPT's, transposed where
    GPT-2's Conv1D stores [in, out])."""
    with torch.device("meta"):
        ours = GPT(cfg, vocab_size).state_dict()
    return {theirs: tuple(ours[mine].shape[::-1] if transpose else ours[mine].shape)
            for mine, theirs, transpose in _tensor_names(cfg.n_layer)}


# ----------------------------------------------------------------------------- export


def check_exportable(model_cfg: ModelConfig, attn_cfg: AttentionConfig) -> None:
    """Raise FormatError unless GPT-2 computes what this model computes.

    GPT-2's attention is fixed: softmax(Q K^T / sqrt(d_k) + M) V with M = -inf at future keys,
    then W_O. A pitfall variant trained without one of those has weights that mean something
    else, and transformers would run them through the correct layer without a word."""
    problems = []
    if not attn_cfg.out_proj:
        problems.append("it has no output projection W_O (GPT-2 always applies c_proj)")
    if attn_cfg.scale is not Scale.d_k:
        problems.append(f"its scores are scaled by {attn_cfg.scale.value} "
                        f"(GPT-2 divides by sqrt(d_k))")
    if attn_cfg.mask_mode is not MaskMode.add or attn_cfg.mask_value != float("-inf"):
        problems.append(f"its mask is {attn_cfg.mask_mode.value} with {attn_cfg.mask_value} "
                        f"(GPT-2 adds -inf before the softmax)")
    if problems:
        raise FormatError(f"attention variant {attn_cfg.name!r} cannot be expressed in GPT-2's "
                          f"format: {'; '.join(problems)}")
    switches = gpt2_problems(model_cfg)
    if switches:
        raise FormatError(f"the model cannot be expressed in GPT-2's format: "
                          f"{'; '.join(switches)}")


def to_gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under GPT2LMHeadModel's names and layout, ready for safetensors.

    Refuses (FormatError) a model whose attention GPT-2 cannot express. Without biases
    (model.bias=false) the biases are written as zeros: the same function, in GPT-2's shape."""
    check_exportable(model.cfg, model.attn_cfg)
    ours = {k: v.detach() for k, v in model.state_dict().items() if k != TIED_HEAD}
    absent_biases = {}  # bias name -> its size, for a model without biases
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.LayerNorm)) and module.bias is None \
                and name != "lm_head":
            absent_biases[f"{name}.bias"] = module.weight.shape[0]
    out = {}
    for mine, theirs, transpose in _tensor_names(model.cfg.n_layer):
        if mine in ours:
            tensor = ours.pop(mine)
        elif mine in absent_biases:
            tensor = torch.zeros(absent_biases[mine], dtype=model.tok_emb.weight.dtype)
        else:
            raise FormatError(f"the model has no {mine}: not a GPT of this project?")
        tensor = tensor.t() if transpose else tensor
        out[theirs] = tensor.to("cpu").contiguous().clone()
    if ours:
        raise FormatError(f"tensors with no GPT-2 counterpart: {sorted(ours)[:3]}")
    return out


def gpt2_config(model_cfg: ModelConfig, vocab_size: int,
                eos_token_id: Optional[int] = None) -> dict:
    """config.json of a GPT2LMHeadModel with our shape.

    Every option transformers would otherwise fill from GPT-2's defaults is written out, since
    several of those defaults (vocabulary 50257, token id 50256, dropout 0.1) are not ours."""
    activation = EXPORT_ACTIVATION[MLPKind(model_cfg.mlp)]
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model_cfg.block_size,
        "n_embd": model_cfg.n_embd,
        "n_layer": model_cfg.n_layer,
        "n_head": model_cfg.n_head,
        "n_inner": model_cfg.mlp_ratio * model_cfg.n_embd,
        "activation_function": activation,
        "resid_pdrop": model_cfg.dropout,
        "embd_pdrop": model_cfg.dropout,
        "attn_pdrop": model_cfg.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": model_cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,  # our runs never prepend a start token
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": "float32",
    }


def tokenizer_config(special_tokens: dict[str, str], model_max_length: int) -> dict:
    """tokenizer_config.json that makes AutoTokenizer wrap tokenizer.json as it is.

    PreTrainedTokenizerFast adds nothing of its own (no start token, no space clean-up), so its
    ids are exactly those of the `tokenizers` file our runs use."""
    return {"tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            **special_tokens}


# ----------------------------------------------------------------------------- import


def gpt2_model_config(config: dict, path: Path = Path(CONFIG)) -> tuple[ModelConfig, int]:
    """(our ModelConfig, vocab_size) from a parsed GPT-2 config.json, or FormatError.

    Options missing from the file take transformers' GPT-2 defaults, as transformers would.
    Dropout is not carried over (0.0 here): it is a training choice, not part of the function."""
    fields = Fields(config, path)
    if config.get("model_type") != "gpt2":
        raise FormatError(f"{path}: model_type must be 'gpt2', got {config.get('model_type')!r}")
    sizes = {k: fields.positive_int(k)
             for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    inner = config.get("n_inner")
    if inner is None:
        inner = 4 * sizes["n_embd"]  # GPT-2's default
    elif isinstance(inner, bool) or not isinstance(inner, int) or inner <= 0 \
            or inner % sizes["n_embd"]:
        raise FormatError(f"{path}: n_inner must be a positive multiple of n_embd "
                          f"({sizes['n_embd']}) for our MLP, got {inner!r}")
    activation = fields.option("activation_function", "gelu_new")
    if activation not in GPT2_ACTIVATIONS:
        raise FormatError(f"{path}: activation_function {activation!r} is not one our MLP has "
                          f"(known: {', '.join(GPT2_ACTIVATIONS)})")
    eps = fields.option("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps is None or not math.isclose(eps, LAYER_NORM_EPS, rel_tol=1e-6):
        raise FormatError(f"{path}: layer_norm_epsilon must be {LAYER_NORM_EPS} (our "
                          f"LayerNorm's), got {eps!r}")
    for key, needed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if fields.option(key, needed) is not needed:
            raise FormatError(f"{path}: {key} must be {str(needed).lower()} for our attention "
                              f"layer, got {config.get(key)!r}")
    init_std = fields.option("initializer_range", 0.02)
    init_std = float(init_std) if init_std and init_std > 0 and math.isfinite(init_std) else 0.02
    cfg = ModelConfig(n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=sizes["n_embd"],
                      block_size=sizes["n_positions"], dropout=0.0, bias=True, init_std=init_std,
                      mlp_ratio=inner // sizes["n_embd"], mlp=GPT2_ACTIVATIONS[activation])
    return cfg, sizes["vocab_size"]


def _is_ignored(name: str) -> bool:
    """Causal-mask buffers that older GPT-2 checkpoints stored (`h.0.attn.bias` [1, 1, n, n],
    `h.0.attn.masked_bias`): constants, rebuilt by our attention layer."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-2] == "attn" and parts[-1] in ("bias", "masked_bias") \
        and parts[-4] == "h"


def gpt2_state(path: PathLike, cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our state dict, without the tied lm_head, from a GPT-2 folder whose config.json read as
    (cfg, vocab_size) (gpt2_model_config), a shape the caller has checked (guard/run_dir.py: a
    300-byte config.json can claim 10**9 layers). GPT2LMHeadModel's names (`transformer.h.0...`)
    and GPT2Model's (`h.0...`, OpenAI's upload) are accepted; anything else is a FormatError."""
    config, config_path, weights_path = open_folder(path)
    config_tied = Fields(config, config_path).option("tie_word_embeddings", True)
    expected = _gpt2_shapes(cfg, vocab_size)
    # besides the model's tensors, old checkpoints' [n, n] mask buffers may come along
    names = tensor_names(weights_path, size_limit(expected, cfg.n_layer * (cfg.block_size ** 2 + 1)))
    body = {k for k in names if k != TIED_HEAD and not _is_ignored(k)}
    prefix = "transformer." if "transformer.wte.weight" in names else ""
    found = {(k if prefix else f"transformer.{k}"): k for k in body if k.startswith(prefix)}
    unexpected = sorted(body - set(found.values())) + sorted(
        k for gpt2_name, k in found.items() if gpt2_name not in expected)
    missing = sorted(set(expected) - set(found))
    if missing or unexpected:
        raise FormatError(
                          f"{weights_path} does not match {CONFIG}: missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]} (another architecture, or a different n_layer?)")
    wanted = {found[theirs]: shape for theirs, shape in expected.items()}
    if TIED_HEAD in names:
        wanted[TIED_HEAD] = expected["transformer.wte.weight"]
    tensors = read_tensors(weights_path, wanted)
    state = {mine: (tensors[found[theirs]].t() if transpose else tensors[found[theirs]]).contiguous()
             for mine, theirs, transpose in _tensor_names(cfg.n_layer)}
    head = tensors.get(TIED_HEAD)
    if head is None and config_tied is False:
        raise FormatError(f"{config_path}: tie_word_embeddings is false but {weights_path} has "
                          f"no lm_head.weight (transformers would start from a random head)")
    if head is not None and not torch.equal(head, state["tok_emb.weight"]):
        raise FormatError(f"{weights_path}: lm_head.weight differs from the token embedding; "
                          f"our head is tied to it, so an untied head cannot be imported")
    return state


def load_folder_tokenizer(path: PathLike):
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`, or None when it has none.

    Checked as a run directory's is (safeio.corpus.load_tokenizer: a regular file of bounded
    size, no custom regular expression, every id inside the vocabulary): FormatError (or
    FileRefused) otherwise."""
    file = Path(path) / TOKENIZER
    if not os.path.lexists(file):
        return None
    return load_tokenizer(file)
