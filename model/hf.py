"""Our GPT <-> Hugging Face transformers' GPT-2 format (config.json + model.safetensors).

The two networks are the same function: learned positions, pre-LayerNorm blocks, fused Q|K|V
projection, GELU MLP, final LayerNorm, head tied to the token embedding. So converting is
renaming plus three differences of storage:

    * GPT-2's Conv1D keeps its weight as [in, out]; nn.Linear keeps [out, in]: transpose.
    * GPT-2 always has biases; a model built with bias=false is exported with zero biases,
      which computes exactly the same thing (x W + 0, LayerNorm(x) * g + 0).
    * The tied head is stored once (transformers re-ties lm_head to wte on load).

What GPT-2's format cannot say is refused rather than approximated: our attention pitfalls
(no W_O, a scale other than 1/sqrt(d_k), a mask other than additive -inf), and, on import,
GPT-2 options our model does not have (inverse-layer scaling, cross-attention, another
LayerNorm epsilon, an untied head, an activation other than exact or tanh GELU).

Nothing here imports transformers: exporting and importing need only safetensors and json, so a
user without transformers can still produce a folder that transformers loads.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from model.config import (Activation, AttentionConfig, MaskMode, ModelConfig, Scale,
                          gpt2_problems, validate_model)
from model.gpt import GPT

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which every LayerNorm of ours uses
TIED_HEAD = "lm_head.weight"  # ours and GPT-2's: the same storage as the token embedding

# transformers' names for the activation (ACT2FN keys). "gelu" is the exact erf GELU; "gelu_new"
# (OpenAI's GPT-2) and "gelu_pytorch_tanh" are both the tanh approximation, written out in
# Python or by torch: they differ by float rounding only.
GPT2_ACTIVATIONS = {"gelu": Activation.gelu, "gelu_new": Activation.gelu_tanh,
                    "gelu_pytorch_tanh": Activation.gelu_tanh}
EXPORT_ACTIVATION = {Activation.gelu: "gelu", Activation.gelu_tanh: "gelu_pytorch_tanh"}

MAX_JSON_BYTES = 1 << 20  # config.json is a few hundred bytes
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

PathLike = Union[str, os.PathLike]


class GPT2FormatError(ValueError):
    """A folder or a model that GPT-2's format cannot hold, or that is not valid GPT-2 format.

    A ValueError, so code that already reports ValueError as one line reports this too."""


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
    """GPT-2's name -> the shape the config implies."""
    d, inner = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
    shapes = {"transformer.wte.weight": (vocab_size, d),
              "transformer.wpe.weight": (cfg.block_size, d),
              "transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        shapes.update({
            h + "ln_1.weight": (d,), h + "ln_1.bias": (d,),
            h + "ln_2.weight": (d,), h + "ln_2.bias": (d,),
            h + "attn.c_attn.weight": (d, 3 * d), h + "attn.c_attn.bias": (3 * d,),  # W_Q|W_K|W_V
            h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,),
            h + "mlp.c_fc.weight": (d, inner), h + "mlp.c_fc.bias": (inner,),
            h + "mlp.c_proj.weight": (inner, d), h + "mlp.c_proj.bias": (d,),
        })
    return shapes


# ----------------------------------------------------------------------------- export


def check_exportable(model_cfg: ModelConfig, attn_cfg: AttentionConfig) -> None:
    """Raise GPT2FormatError unless GPT-2 computes what this model computes.

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
        raise GPT2FormatError(f"attention variant {attn_cfg.name!r} cannot be expressed in GPT-2's "
                              f"format: {'; '.join(problems)}")
    switches = gpt2_problems(model_cfg)
    if switches:
        raise GPT2FormatError(f"the model cannot be expressed in GPT-2's format: "
                              f"{'; '.join(switches)}")
    validate_model(model_cfg)


def to_gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our weights under GPT2LMHeadModel's names and layout, ready for safetensors.

    Refuses (GPT2FormatError) a model whose attention GPT-2 cannot express. Without biases
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
            raise GPT2FormatError(f"the model has no {mine}: not a GPT of this project?")
        tensor = tensor.t() if transpose else tensor
        out[theirs] = tensor.to("cpu").contiguous().clone()
    if ours:
        raise GPT2FormatError(f"tensors with no GPT-2 counterpart: {sorted(ours)[:3]}")
    return out


def gpt2_config(model_cfg: ModelConfig, vocab_size: int,
                eos_token_id: Optional[int] = None) -> dict:
    """config.json of a GPT2LMHeadModel with our shape.

    Every option transformers would otherwise fill from GPT-2's defaults is written out, since
    several of those defaults (vocabulary 50257, token id 50256, dropout 0.1) are not ours."""
    activation = EXPORT_ACTIVATION[Activation(model_cfg.mlp)]
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


def _regular_file(path: Path, what: str, max_bytes: int) -> int:
    """Size of path; GPT2FormatError unless it is a regular file (links to one are fine: the
    Hugging Face cache is made of them) of at most max_bytes."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise GPT2FormatError(f"{path} does not exist ({what})") from None
    except OSError as exc:
        raise GPT2FormatError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise GPT2FormatError(f"{path} is not a regular file ({what})")
    if info.st_size > max_bytes:
        raise GPT2FormatError(f"{path} is {info.st_size:,} bytes, implausibly large for {what} "
                              f"(at most {max_bytes:,})")
    return info.st_size


def _read_json(path: Path, what: str) -> dict:
    _regular_file(path, what, MAX_JSON_BYTES)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise GPT2FormatError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise GPT2FormatError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _positive_int(config: dict, key: str, path: Path) -> int:
    if key not in config:
        raise GPT2FormatError(f"{path} has no {key!r}: not a GPT-2 config")
    value = config[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise GPT2FormatError(f"{path}: {key} must be a positive integer, got {value!r}")
    return value


def _option(config: dict, key: str, default, path: Path):
    """An optional GPT-2 option: transformers' default when absent, checked for its type."""
    value = config.get(key, default)
    if value is not None and type(value) is not type(default) and not (
            isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
        raise GPT2FormatError(f"{path}: {key} must be {type(default).__name__}, got {value!r}")
    return value


def gpt2_model_config(config: dict, path: Path = Path(CONFIG)) -> tuple[ModelConfig, int]:
    """(our ModelConfig, vocab_size) from a parsed GPT-2 config.json, or GPT2FormatError.

    Options missing from the file take transformers' GPT-2 defaults, as transformers would.
    Dropout is not carried over (0.0 here): it is a training choice, not part of the function."""
    if config.get("model_type") != "gpt2":
        raise GPT2FormatError(f"{path}: model_type must be 'gpt2', got {config.get('model_type')!r}")
    sizes = {k: _positive_int(config, k, path)
             for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")}
    if sizes["n_embd"] % sizes["n_head"]:
        raise GPT2FormatError(f"{path}: n_embd ({sizes['n_embd']}) must be divisible by n_head "
                              f"({sizes['n_head']})")
    inner = config.get("n_inner")
    if inner is None:
        inner = 4 * sizes["n_embd"]  # GPT-2's default
    elif isinstance(inner, bool) or not isinstance(inner, int) or inner <= 0 \
            or inner % sizes["n_embd"]:
        raise GPT2FormatError(f"{path}: n_inner must be a positive multiple of n_embd "
                              f"({sizes['n_embd']}) for our MLP, got {inner!r}")
    activation = _option(config, "activation_function", "gelu_new", path)
    if activation not in GPT2_ACTIVATIONS:
        raise GPT2FormatError(f"{path}: activation_function {activation!r} is not one our MLP has "
                              f"(known: {', '.join(GPT2_ACTIVATIONS)})")
    eps = _option(config, "layer_norm_epsilon", LAYER_NORM_EPS, path)
    if eps is None or not math.isclose(eps, LAYER_NORM_EPS, rel_tol=1e-6):
        raise GPT2FormatError(f"{path}: layer_norm_epsilon must be {LAYER_NORM_EPS} (our "
                              f"LayerNorm's), got {eps!r}")
    for key, needed in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        if _option(config, key, needed, path) is not needed:
            raise GPT2FormatError(f"{path}: {key} must be {str(needed).lower()} for our attention "
                                  f"layer, got {config.get(key)!r}")
    init_std = _option(config, "initializer_range", 0.02, path)
    init_std = float(init_std) if init_std and init_std > 0 and math.isfinite(init_std) else 0.02
    cfg = ModelConfig(n_layer=sizes["n_layer"], n_head=sizes["n_head"], n_embd=sizes["n_embd"],
                      block_size=sizes["n_positions"], dropout=0.0, bias=True, init_std=init_std,
                      mlp_ratio=inner // sizes["n_embd"], activation=GPT2_ACTIVATIONS[activation])
    validate_model(cfg)
    return cfg, sizes["vocab_size"]


def _is_ignored(name: str) -> bool:
    """Causal-mask buffers that older GPT-2 checkpoints stored (`h.0.attn.bias` [1, 1, n, n],
    `h.0.attn.masked_bias`): constants, rebuilt by our attention layer."""
    parts = name.split(".")
    return len(parts) >= 4 and parts[-2] == "attn" and parts[-1] in ("bias", "masked_bias") \
        and parts[-4] == "h"


def load_gpt2_folder(path: PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(our ModelConfig, our state dict without the tied lm_head) from a GPT-2 folder on disk.

    Reads config.json and model.safetensors only; pytorch_model.bin is never unpickled. Both
    GPT2LMHeadModel's names (`transformer.h.0...`) and GPT2Model's (`h.0...`, as in OpenAI's
    original upload) are accepted. Every tensor's shape is checked against the config before
    it is read, and values are converted to float32 and must be finite. The vocabulary size is
    the first dimension of `tok_emb.weight`. Raises GPT2FormatError, with one clear sentence,
    for anything else."""
    folder = Path(path)
    if not folder.is_dir():
        raise GPT2FormatError(f"{folder} is not a directory (expected a GPT-2 folder with "
                              f"{CONFIG} and {WEIGHTS})")
    config_path, weights_path = folder / CONFIG, folder / WEIGHTS
    if not config_path.exists():
        raise GPT2FormatError(f"{folder} has no {CONFIG}: not a Hugging Face model folder")
    if not weights_path.exists():
        others = [n for n in ("model.safetensors.index.json", "pytorch_model.bin")
                  if (folder / n).exists()]
        hint = (f" (it has {others[0]}: only a single, unsharded model.safetensors is read, "
                f"never a pickle)" if others else "")
        raise GPT2FormatError(f"{folder} has no {WEIGHTS}{hint}")
    config = _read_json(config_path, "a GPT-2 config")
    cfg, vocab_size = gpt2_model_config(config, config_path)
    config_tied = _option(config, "tie_word_embeddings", True, config_path)
    expected = _gpt2_shapes(cfg, vocab_size)
    # At most 8 bytes a value (float64), plus the old checkpoints' [n, n] mask buffers and the
    # header: anything bigger is not the model the config describes.
    elements = sum(math.prod(s) for s in expected.values())
    limit = 8 * (elements + cfg.n_layer * (cfg.block_size ** 2 + 1)) + MAX_HEADER_BYTES
    _regular_file(weights_path, "the weights of this config", limit)

    state = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            names = set(f.keys())
            body = {k for k in names if k != TIED_HEAD and not _is_ignored(k)}
            prefix = "transformer." if "transformer.wte.weight" in names else ""
            found = {(k if prefix else f"transformer.{k}"): k for k in body if k.startswith(prefix)}
            head = f.get_tensor(TIED_HEAD) if TIED_HEAD in names else None
            unexpected = sorted(body - set(found.values())) + sorted(
                k for gpt2_name, k in found.items() if gpt2_name not in expected)
            missing = sorted(set(expected) - set(found))
            if missing or unexpected:
                raise GPT2FormatError(
                    f"{weights_path} does not match {CONFIG}: missing {missing[:3]}, unexpected "
                    f"{unexpected[:3]} (another architecture, or a different n_layer?)")
            for mine, theirs, transpose in _tensor_names(cfg.n_layer):
                stored = found[theirs]
                shape = tuple(f.get_slice(stored).get_shape())
                if shape != expected[theirs]:
                    raise GPT2FormatError(
                        f"{weights_path}: {stored} has shape {shape}, {CONFIG} implies "
                        f"{expected[theirs]}")
                tensor = f.get_tensor(stored)
                if tensor.dtype not in FLOAT_DTYPES:
                    raise GPT2FormatError(f"{weights_path}: {stored} is {tensor.dtype}, not a "
                                          f"floating-point tensor")
                tensor = tensor.to(torch.float32)
                if not torch.isfinite(tensor).all():
                    raise GPT2FormatError(f"{weights_path}: {stored} holds NaN or infinite values")
                state[mine] = (tensor.t() if transpose else tensor).contiguous()
    except SafetensorError as exc:
        raise GPT2FormatError(f"cannot read {weights_path} (truncated or corrupt?): "
                              f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    except OSError as exc:
        raise GPT2FormatError(f"cannot read {weights_path}: {exc.strerror or exc}") from None
    if head is None and config_tied is False:
        raise GPT2FormatError(f"{config_path}: tie_word_embeddings is false but {weights_path} has "
                              f"no lm_head.weight (transformers would start from a random head)")
    if head is not None and not torch.equal(head.to(torch.float32), state["tok_emb.weight"]):
        raise GPT2FormatError(f"{weights_path}: lm_head.weight differs from the token embedding; "
                              f"our head is tied to it, so an untied head cannot be imported")
    return cfg, state


def gpt_from_gpt2_folder(path: PathLike) -> GPT:
    """Our GPT (float32, eval mode, correct attention) holding a GPT-2 folder's weights."""
    cfg, state = load_gpt2_folder(path)
    model = GPT(cfg, state["tok_emb.weight"].shape[0], AttentionConfig())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert missing == [TIED_HEAD] and not unexpected, (missing, unexpected)
    return model.eval()


def load_folder_tokenizer(path: PathLike):
    """The folder's tokenizer.json as a `tokenizers.Tokenizer`, or None when it has none.

    GPT2FormatError for one that is not a regular file or that `tokenizers` cannot read."""
    from tokenizers import Tokenizer

    file = Path(path) / TOKENIZER
    if not file.exists():
        return None
    _regular_file(file, "a tokenizer", 1 << 30)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception
        reason = next((l.strip() for l in str(exc).splitlines() if l.strip()), type(exc).__name__)
        raise GPT2FormatError(f"cannot read {file}: {reason}") from None
