"""Our GPT <-> Hugging Face transformers' Llama and Qwen3 formats (config.json, model.safetensors).

With `positions=rope, norm=rmsnorm, mlp=swiglu` our blocks are Llama's: rotary positions in the
rotate-half layout (rope_theta), pre-RMSNorm (rms_norm_eps), a SwiGLU MLP, grouped key/value
heads (num_key_value_heads), a head tied to the token embedding or not (tie_word_embeddings).
Qwen3 is the same network with QK-norm (a per-head RMSNorm of q and k before the rotation, our
`qk_norm`). Converting is renaming plus stacking: our fused `attn.qkv` holds the rows of
q_proj | k_proj | v_proj, our `mlp.fc` those of gate_proj | up_proj (BLOCK_MAPPING). Both store
nn.Linear's [out, in], so nothing is transposed.

Biases: our `model.bias` is one switch for every Linear, so Llama's attention_bias and mlp_bias
must agree (Qwen3's MLP has none). Whatever else a config.json says that our model cannot
compute (RoPE scaling, sliding windows, ...) is refused, naming the field, not approximated.

Like interop/hf.py, nothing here imports transformers; safeio/hf.py reads and checks the files.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from safeio.cli import FormatError
from safeio.hf import CONFIG, Fields, PathLike, open_folder, read_tensors, size_limit, tensor_names
from model.config import AttentionConfig, MaskMode, MLPKind, ModelConfig, Norm, Positions, Scale
from model.gpt import GPT

HEAD = "lm_head.weight"  # ours and theirs


@dataclass(frozen=True)
class Architecture:
    """What differs between the transformers architectures our Llama-like blocks map onto."""

    name: str                 # as the messages say it
    model_type: str           # config.json's
    class_name: str           # config.json's `architectures`
    qk_norm: bool             # q_norm / k_norm per head (Qwen3)
    mlp_bias: bool            # the config has mlp_bias (Llama); without it the MLP has no biases
    head_dim: Optional[int]   # transformers' default when config.json has none (None: d_model / h)
    kv_heads: Optional[int]   # likewise for num_key_value_heads (None: the query heads)
    rms_norm_eps: float       # likewise


LLAMA = Architecture("Llama", "llama", "LlamaForCausalLM", qk_norm=False, mlp_bias=True,
                     head_dim=None, kv_heads=None, rms_norm_eps=1e-6)
QWEN3 = Architecture("Qwen3", "qwen3", "Qwen3ForCausalLM", qk_norm=True, mlp_bias=False,
                     head_dim=128, kv_heads=32, rms_norm_eps=1e-6)
ARCHITECTURES = {a.model_type: a for a in (LLAMA, QWEN3)}

# The one mapping: our name -> transformers' names whose rows it stacks, in order. Names in a
# block are under `blocks.{i}.` (ours) and `model.layers.{i}.` (theirs); `.weight` and `.bias`
# map alike. Which of these a model has is what its config builds (GPT on the meta device).
BLOCK_MAPPING = {
    "ln_1": ("input_layernorm",),
    "ln_2": ("post_attention_layernorm",),
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.q_norm": ("self_attn.q_norm",),
    "attn.k_norm": ("self_attn.k_norm",),
    "attn.out_proj": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.proj": ("mlp.down_proj",),
}
OUTER_MAPPING = {"tok_emb": ("model.embed_tokens",), "ln_f": ("model.norm",),
                 "lm_head": ("lm_head",)}


# ----------------------------------------------------------------------------- names and shapes


def _theirs(ours: str) -> tuple[str, ...]:
    """Our tensor name -> the names of the transformers tensors whose rows it stacks."""
    module, _, kind = ours.rpartition(".")  # kind: weight | bias
    if module.startswith("blocks."):
        _, i, inner = module.split(".", 2)
        return tuple(f"model.layers.{i}.{name}.{kind}" for name in BLOCK_MAPPING[inner])
    return tuple(f"{name}.{kind}" for name in OUTER_MAPPING[module])


def _rows(cfg: ModelConfig, ours: str, shape: torch.Size) -> tuple[int, ...]:
    """How many of our tensor's rows each of its transformers tensors holds."""
    if ".attn.qkv." in ours:
        d = cfg.head_dim
        return cfg.n_head * d, cfg.kv_heads * d, cfg.kv_heads * d  # q | k | v
    if ".mlp.fc." in ours:
        return cfg.hidden, cfg.hidden  # gate | up
    return (shape[0],)


Layout = dict[str, tuple[tuple[str, tuple[int, ...]], ...]]


def _layout(cfg: ModelConfig, vocab_size: int) -> Layout:
    """Our name -> ((their name, its shape), ...) for every tensor a model of cfg stores (the
    tied head once, as the token embedding)."""
    with torch.device("meta"):
        ours = GPT(cfg, vocab_size).state_dict()
    if cfg.tie_embeddings:
        del ours[HEAD]
    layout = {}
    for name, tensor in ours.items():
        parts = zip(_theirs(name), _rows(cfg, name, tensor.shape))
        layout[name] = tuple((theirs, (rows, *tensor.shape[1:])) for theirs, rows in parts)
    return layout


# ----------------------------------------------------------------------------- export


def llama_problems(cfg: ModelConfig, arch: Architecture = LLAMA) -> list[str]:
    """The switches of cfg that arch (Llama or Qwen3) does not have ([] when it expresses cfg)."""
    name, problems = arch.name, []
    if Positions(cfg.positions) is not Positions.rope:
        problems.append(f"model.positions={Positions(cfg.positions).value} ({name} rotates q and "
                        f"k: rope)")
    if Norm(cfg.norm) is not Norm.rmsnorm:
        problems.append(f"model.norm={Norm(cfg.norm).value} ({name} has RMSNorm)")
    if MLPKind(cfg.mlp) is not MLPKind.swiglu:
        problems.append(f"model.mlp={MLPKind(cfg.mlp).value} ({name}'s MLP is swiglu)")
    if cfg.qk_norm and not arch.qk_norm:
        problems.append(f"model.qk_norm=true ({name} does not normalise q and k)")
    if arch.qk_norm and not cfg.qk_norm:
        problems.append(f"model.qk_norm=false ({name} normalises q and k)")
    if cfg.bias and not arch.mlp_bias:
        problems.append(f"model.bias=true ({name}'s MLP has no biases)")
    if cfg.attn_gate:
        problems.append(f"model.attn_gate=true ({name} has no gate on its heads' outputs)")
    if cfg.window is not None:
        problems.append(f"model.window={cfg.window} ({name} attends to every earlier key)")
    return problems


def attention_problems(attn: AttentionConfig, name: str) -> list[str]:
    """What in the attention variant a transformers architecture (`name`) cannot compute."""
    problems = []
    if not attn.out_proj:
        problems.append(f"it has no output projection W_O ({name} always applies o_proj)")
    if attn.scale is not Scale.d_k:
        problems.append(f"its scores are scaled by {attn.scale.value} ({name} divides by "
                        f"sqrt(d_k))")
    if attn.mask_mode is not MaskMode.add or attn.mask_value != float("-inf"):
        problems.append(f"its mask is {attn.mask_mode.value} with {attn.mask_value} ({name} adds "
                        f"-inf before the softmax)")
    for pitfall in attn.pitfalls():  # the second and third studies' (docs/ablations.md)
        problems.append(f"it trained with attention.{pitfall}=true ({name} has no such mistake)")
    return problems


def check_llama_exportable(cfg: ModelConfig, attn: AttentionConfig,
                           arch: Architecture = LLAMA) -> None:
    """FormatError unless arch computes what this model computes."""
    problems = attention_problems(attn, arch.name)
    if problems:
        raise FormatError(f"attention variant {attn.name!r} cannot be expressed in {arch.name}'s "
                          f"format: {'; '.join(problems)}")
    switches = llama_problems(cfg, arch)
    if switches:
        raise FormatError(f"the model cannot be expressed in {arch.name}'s format: "
                          f"{'; '.join(switches)}")


def to_llama_state_dict(model: GPT, arch: Architecture = LLAMA) -> dict[str, torch.Tensor]:
    """Our weights under arch's names (LlamaForCausalLM's, Qwen3ForCausalLM's), ready for
    safetensors. A tied head is stored once (transformers ties lm_head to embed_tokens on load)."""
    check_llama_exportable(model.cfg, model.attn_cfg, arch)
    state = model.state_dict()
    out = {}
    for ours, parts in _layout(model.cfg, model.vocab_size).items():
        tensor = state[ours].detach().to("cpu")
        pieces = tensor.split([shape[0] for _, shape in parts], dim=0)
        for (theirs, _), piece in zip(parts, pieces):
            out[theirs] = piece.contiguous().clone()
    return out


def llama_config(cfg: ModelConfig, vocab_size: int, eos_token_id: Optional[int] = None,
                 arch: Architecture = LLAMA) -> dict:
    """config.json of a LlamaForCausalLM (or Qwen3ForCausalLM) with our shape. Every field is
    written out: several of transformers' defaults (vocabulary 32000, start token 1, Qwen3's
    head_dim 128) are not ours."""
    config = {
        "architectures": [arch.class_name],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": cfg.bias,
        "attention_dropout": cfg.dropout if cfg.attn_dropout is None else cfg.attn_dropout,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "bos_token_id": None,  # our runs never prepend a start token
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "dtype": "float32",
    }
    if arch.mlp_bias:
        config["mlp_bias"] = cfg.bias
    if arch is QWEN3:
        config.update(use_sliding_window=False, sliding_window=None,
                      max_window_layers=cfg.n_layer,
                      layer_types=["full_attention"] * cfg.n_layer)
    return config


# ----------------------------------------------------------------------------- import


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _rope_theta(config: dict, path: Path) -> float:
    """rope_theta of plain RoPE, from transformers 5's rope_parameters or 4.x's rope_theta and
    rope_scaling; FormatError for any scaled or partial rotation (our rotary has neither)."""
    scaling = config.get("rope_scaling")
    rope = scaling or config.get("rope_parameters") or {}
    key = "rope_scaling" if scaling else "rope_parameters"
    if not isinstance(rope, dict):
        raise FormatError(f"{path}: {key} must be an object or null, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise FormatError(f"{path}: {key} has rope_type {kind!r}; our rotary positions are plain "
                          f"RoPE only (rope_type 'default', {key} null)")
    for where in (rope, config):
        partial = where.get("partial_rotary_factor")
        if partial is not None and partial != 1:
            raise FormatError(f"{path}: partial_rotary_factor must be 1 (our RoPE turns every "
                              f"dimension of a head), got {partial!r}")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if not _number(theta) or theta <= 1:
        raise FormatError(f"{path}: rope_theta must be a finite number above 1, got {theta!r}")
    return float(theta)


def llama_model_config(config: dict, path: Path = Path(CONFIG)) -> tuple[ModelConfig, int]:
    """(our ModelConfig, vocab_size) from a parsed Llama or Qwen3 config.json, or FormatError
    naming the field. Fields missing from the file take transformers' defaults, as transformers
    would; dropout is not carried over (0.0): it is a training choice, not part of the function."""
    arch = ARCHITECTURES.get(config.get("model_type"))
    if arch is None:
        raise FormatError(f"{path}: model_type must be one of {', '.join(map(repr, ARCHITECTURES))}"
                          f", got {config.get('model_type')!r}")
    fields = Fields(config, path)
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings")
    absent = [k for k in required if k not in config]
    if absent:
        raise FormatError(f"{path} has no {absent[0]!r}, which a model_type "
                          f"{arch.model_type!r} config needs")
    sizes = {k: fields.positive_int(k) for k in required}
    width, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    if width % heads:
        raise FormatError(f"{path}: hidden_size ({width}) must be divisible by "
                          f"num_attention_heads ({heads})")
    kv = config.get("num_key_value_heads", arch.kv_heads)
    kv = heads if kv is None else kv
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0 or heads % kv:
        raise FormatError(f"{path}: num_key_value_heads must be a positive integer that divides "
                          f"num_attention_heads ({heads}), got {kv!r}")
    head_dim = config.get("head_dim", arch.head_dim)
    if head_dim is not None and head_dim != width // heads:
        raise FormatError(f"{path}: head_dim must be hidden_size / num_attention_heads "
                          f"({width // heads}) for our attention (d_k = n_embd / n_head), got "
                          f"{head_dim!r}")
    if (width // heads) % 2:
        raise FormatError(f"{path}: RoPE rotates pairs of dimensions: the head size hidden_size /"
                          f" num_attention_heads = {width // heads} must be even")
    act = fields.option("hidden_act", "silu")
    if act != "silu":
        raise FormatError(f"{path}: hidden_act must be 'silu' (SwiGLU, our model.mlp=swiglu), got "
                          f"{act!r}")
    eps = fields.option("rms_norm_eps", arch.rms_norm_eps)
    if not _number(eps) or not 0 < eps < 1:
        raise FormatError(f"{path}: rms_norm_eps must be a number in (0, 1), got {eps!r}")
    theta = _rope_theta(config, path)
    attention_bias = bool(fields.option("attention_bias", False))  # null: the default
    mlp_bias = bool(fields.option("mlp_bias", False)) if arch.mlp_bias else False
    if attention_bias is not mlp_bias:
        raise FormatError(
            f"{path}: attention_bias ({str(attention_bias).lower()}) and "
            + (f"mlp_bias ({str(mlp_bias).lower()}) differ" if arch.mlp_bias
               else f"{arch.name}'s MLP (no biases) differ")
            + ": our model.bias is one switch for every linear layer")
    if arch is QWEN3:
        if fields.option("use_sliding_window", False) is not False:
            raise FormatError(f"{path}: use_sliding_window must be false (our attention sees "
                              f"the whole context)")
        layers = config.get("layer_types")
        if layers is not None and (not isinstance(layers, list)
                                   or any(t != "full_attention" for t in layers)):
            raise FormatError(f"{path}: layer_types must all be 'full_attention' (our attention "
                              f"sees the whole context), got {layers!r:.80}")
    init_std = fields.option("initializer_range", 0.02)
    init_std = float(init_std) if _number(init_std) and init_std > 0 else 0.02
    cfg = ModelConfig(
        n_layer=sizes["num_hidden_layers"], n_head=heads, n_embd=width,
        block_size=sizes["max_position_embeddings"], dropout=0.0, bias=attention_bias,
        init_std=init_std, positions=Positions.rope, rope_theta=theta, norm=Norm.rmsnorm,
        norm_eps=float(eps), mlp=MLPKind.swiglu, mlp_hidden=sizes["intermediate_size"],
        n_kv_head=None if kv == heads else kv, qk_norm=arch.qk_norm,
        tie_embeddings=bool(fields.option("tie_word_embeddings", False)))
    return cfg, sizes["vocab_size"]


def _is_ignored(name: str) -> bool:
    """`model.layers.N.self_attn.rotary_emb.inv_freq`, stored by older Llama checkpoints: a
    constant our rotary computes from rope_theta."""
    return name.endswith(".rotary_emb.inv_freq")


def llama_state(path: PathLike, cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our state dict (with the head when it is untied) from a Llama or Qwen3 folder on disk whose
    config.json read as (cfg, vocab_size) (llama_model_config), once the caller has checked that
    shape (guard/run_dir.py: its values and size, before any shape is computed). Raises
    FormatError, with one clear sentence, for anything we cannot compute."""
    _, _, weights_path = open_folder(path)
    layout = _layout(cfg, vocab_size)
    expected = dict(part for parts in layout.values() for part in parts)
    extra = cfg.n_layer * cfg.head_dim  # old checkpoints' inv_freq buffers
    names = tensor_names(weights_path, size_limit({**expected, HEAD: (vocab_size, cfg.n_embd)},
                                                  extra))
    body = {k for k in names if not _is_ignored(k)}
    stored_head = cfg.tie_embeddings and HEAD in body  # a tied head some files store anyway
    missing = sorted(set(expected) - body)
    unexpected = sorted(body - set(expected) - ({HEAD} if stored_head else set()))
    if missing or unexpected:
        hint = ("; tie_word_embeddings is false, so transformers would start from a random head"
                if missing == [HEAD] else " (another architecture, or a different "
                                          "num_hidden_layers?)")
        raise FormatError(f"{weights_path} does not match {CONFIG}: missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]}{hint}")
    wanted = {**expected, **({HEAD: (vocab_size, cfg.n_embd)} if stored_head else {})}
    tensors = read_tensors(weights_path, wanted)
    state = {ours: torch.cat([tensors[theirs] for theirs, _ in parts], dim=0)
             for ours, parts in layout.items()}
    if stored_head and not torch.equal(tensors[HEAD], state["tok_emb.weight"]):
        raise FormatError(f"{weights_path}: lm_head.weight differs from the token embedding, but "
                          f"{CONFIG} says tie_word_embeddings: transformers would use the "
                          f"embedding and ignore it")
    return state
