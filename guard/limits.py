"""What a command may ask for: every value's range in one table, the rules that tie values
together, the device string (whether the model fits in memory: guard/memory.py).

Types were already checked (Hydra merges train.py's overrides into the dataclasses of */config.py,
`safeio.cli.parse_key_values` generate.py's); these are the values themselves. Each row says a
key's range as the user writes the key, so the message names what to change. Seeds, step counts
and token ids end up in torch's and numpy's 64-bit integers (a seed plus the step seeds each
evaluation's sample), so they stay well inside them.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from data.config import TokenizerKind
from data.shakespeare import check_package
from data.tokenizer import unknown_characters
from safeio.cli import UserError
from safeio.system import MAX_COUNT, MAX_SEED
from model.config import AttentionConfig, AttentionImpl, MLPKind, ModelConfig, Norm, Positions
from model.fast_paths import fused_refusal, trust_fused_attention
from training.config import COMPILE_MODES, DTYPE_CHOICES, Config

# Below this, logits / temperature overflow float32 and sampling yields NaN: use greedy instead.
MIN_TEMPERATURE = 1e-6
MAX_WORKERS = 1024  # threads or processes: more is a typo, and each one costs memory
MAX_SAMPLES = 1_000_000
MAX_MINUTES = 525_600  # a year: train.budget_minutes turns 60 x minutes into a step count


@dataclass(frozen=True)
class Limit:
    """key's value must lie in [low, high] (open at an end where `above` / `below`); a float
    must also be finite unless `infinite`; None passes when `optional`. `words` says the rule
    where the bounds alone would not say it well."""

    key: str
    low: float = -math.inf
    high: float = math.inf
    above: bool = False
    below: bool = False
    optional: bool = False
    infinite: bool = False
    words: str = ""

    def problem(self, value, key: Optional[str] = None) -> Optional[str]:
        """What is wrong with value, naming it as key (this row's key by default), or None."""
        key = key or self.key
        if value is None:
            return None if self.optional else f"{key} must be given"
        low_ok = value > self.low if self.above else value >= self.low
        high_ok = value < self.high if self.below else value <= self.high
        finite = self.infinite or not isinstance(value, float) or math.isfinite(value)
        if low_ok and high_ok and finite:
            return None
        if low_ok and not high_ok and not self.words and math.isfinite(self.high):
            return f"{key} must be at most {self.high:,}, got {value:,}"
        return f"{key} must be {self.words or self._range(value)}, got {value}"

    def _range(self, value) -> str:
        """The bounds in words, exact for the value's type: an integer above 0 is from 1."""
        if self.low == 0 and math.isinf(self.high):
            return "positive" if self.above else "non-negative"
        integer = isinstance(value, int) and not isinstance(value, bool)
        if integer and float(self.low).is_integer() and float(self.high).is_integer():
            low = self.low + 1 if self.above else self.low
            high = self.high - 1 if self.below else self.high
            return f"from {low:,} to {high:,}"
        low = f"above {self.low:,}" if self.above else f"at least {self.low:,}"
        high = f"below {self.high:,}" if self.below else f"at most {self.high:,}"
        return f"{low} and {high}"


def positive(key: str, high: float = math.inf, **kw) -> Limit:
    return Limit(key, 0, high, above=True, **kw)


def non_negative(key: str, high: float = math.inf, **kw) -> Limit:
    return Limit(key, 0, high, **kw)


def fraction(key: str, **kw) -> Limit:
    """[0, 1): dropout, betas, momentum."""
    return Limit(key, 0.0, 1.0, below=True, words="in [0, 1)" + (" or null" if kw.get("optional")
                                                                 else ""), **kw)


SEED = Limit("seed", 0, MAX_SEED, words="an integer from 0 to 2**63 - 1")


def temperature(key: str) -> Limit:
    return Limit(key, MIN_TEMPERATURE, words=f"a finite number of at least {MIN_TEMPERATURE:g} "
                                             f"(for the most likely token, sample greedily)")


# The table: train.py's keys (a run's config), then generate.py's. Sizes that are too big are
# "does not fit" (below), not a row.
TRAIN = [
    # model, attention
    positive("model.n_layer"), positive("model.n_head"), positive("model.n_embd"),
    positive("model.block_size"), positive("model.mlp_ratio"),
    fraction("model.dropout"), fraction("model.attn_dropout", optional=True),
    positive("model.init_std", words="a positive number"),
    Limit("model.rope_theta", 1, above=True, words="a finite number above 1"),
    Limit("model.norm_eps", 0, 1, above=True, below=True, words="in (0, 1)"),
    positive("model.mlp_hidden", optional=True, words="a positive integer or null"),
    positive("model.n_kv_head", optional=True, words="a positive integer or null"),
    positive("model.window", optional=True, words="a positive number of keys or null"),
    Limit("attention.mask_value", high=0, infinite=True, words="0, negative or -inf"),
    non_negative("attention.query_block", optional=True,
                 words="0 (off), a positive number of rows or null (by device)"),
    positive("attention.qk_init_std", optional=True, words="positive or null"),
    # optim
    positive("optim.lr"), non_negative("optim.min_lr"), non_negative("optim.warmup_steps", MAX_COUNT),
    non_negative("optim.weight_decay"), non_negative("optim.grad_clip"),
    Limit("optim.decay_fraction", 0, 1, above=True, words="in (0, 1]"),
    positive("optim.muon_ns_steps", 1000), positive("optim.muon_lr_scale"),
    fraction("optim.beta1"), fraction("optim.beta2"), fraction("optim.muon_momentum"),
    positive("optim.eps", words="a positive number"),
    # train
    *(positive(f"train.{key}", MAX_COUNT) for key in (
        "max_steps", "grad_accum", "eval_interval", "eval_batches", "log_interval",
        "keep_checkpoints")),
    positive("train.batch_size"), positive("train.attention_map_tokens"),
    non_negative("train.sample_tokens", MAX_COUNT), non_negative("train.cached_eval_batches", MAX_COUNT), non_negative("train.overfit_patience", MAX_COUNT),
    temperature("train.sample_temperature"),
    *(positive(f"train.{key}", MAX_MINUTES, optional=True)
      for key in ("max_minutes", "budget_minutes")),
    positive("train.threads", MAX_WORKERS, optional=True),
    # data, tokenizer, seed
    positive("data.max_documents", optional=True),
    non_negative("tokenizer.min_frequency", 2**32 - 1),
    positive("tokenizer.vocab_size", 2**32),  # ids are stored as uint32
    SEED,
]
SAMPLE = [
    non_negative("max_new_tokens", MAX_COUNT), positive("num_samples", MAX_SAMPLES),
    positive("threads", MAX_WORKERS, optional=True),
    positive("top_k", optional=True, words="between 1 and the vocabulary size"),
    Limit("top_p", 0, 1, above=True, optional=True, words="in (0, 1]"),
    SEED,
]
# scripts.llama_pitfalls: a tiny random Llama (float64, on a CPU); a relabelling shows on one
# sequence, and time grows with the batch (batch=4096: 8 minutes and 1.5 GB on 2 cores).
MAX_PITFALL_BATCH = 256


def llama_pitfalls_rows(positions: int) -> list[Limit]:
    """scripts.llama_pitfalls' values; positions: its tiny Llama's context."""
    return [Limit("seed", 0, MAX_SEED - 1, words="an integer from 0 to 2**63 - 2 (seed + 1 "
                                                 "draws the tokens)"),
            positive("batch", MAX_PITFALL_BATCH), Limit("tokens", 1, positions)]


CHOICES = {"train.compile_mode": COMPILE_MODES, "train.dtype": DTYPE_CHOICES,
           "weights": ("auto", "best", "latest")}


def _value(root, key: str):
    for part in key.split("."):
        root = getattr(root, part)
    return root


def _check(root, rows: list[Limit], prefix: str = "", shown: Optional[str] = None) -> None:
    """Raise UserError naming the first of the rows whose key starts with prefix that root
    breaks; keys are read without prefix, and named with `shown` in its place if given."""
    for row in rows:
        if row.key.startswith(prefix):
            key = row.key[len(prefix):]
            problem = row.problem(_value(root, key), None if shown is None else shown + key)
            if problem:
                raise UserError(problem)


def check_values(root, rows: list[Limit]) -> None:
    """A script's values (root: its dataclass of arguments) against its rows of the table."""
    _check(root, rows)


def check_choice(key: str, value) -> None:
    options = CHOICES[key]
    if value not in options:
        raise UserError(f"{key} must be {', '.join(options[:-1])} or {options[-1]}, got {value!r}")


# ----------------------------------------------------------------------------- the checks


def check_model(m: ModelConfig, prefix: str = "model.") -> None:
    """A model shape that can be built: a run's `model`, or a shape read from elsewhere whose
    keys are named with another prefix (a GPT-2 config.json's have none)."""
    _check(m, TRAIN, "model.", shown=prefix)
    if m.n_embd % m.n_head:
        raise UserError(f"{prefix}n_embd ({m.n_embd}) must be divisible by {prefix}n_head "
                        f"({m.n_head}): each head gets d_k = n_embd / n_head dimensions")
    for key, kind in (("positions", Positions), ("norm", Norm), ("mlp", MLPKind)):
        if getattr(m, key) not in list(kind):  # Hydra checks YAML values; this, ones from code
            raise UserError(f"{prefix}{key} must be one of {[a.value for a in kind]}, "
                            f"got {getattr(m, key)!r}")
    if m.n_kv_head is not None and m.n_head % m.n_kv_head:
        raise UserError(f"{prefix}n_kv_head must divide {prefix}n_head ({m.n_head}): each "
                        f"key/value head serves n_head / n_kv_head query heads; got {m.n_kv_head} "
                        f"(null = n_head, 1 = multi-query)")
    if m.positions == Positions.rope and m.head_dim % 2:
        raise UserError(f"{prefix}positions=rope rotates pairs of dimensions: the head size "
                        f"n_embd / n_head = {m.head_dim} must be even")


def check_attention(a: AttentionConfig) -> None:
    _check(a, TRAIN, "attention.")
    refusal = fused_refusal(a) if a.impl is AttentionImpl.fused else None
    if refusal:
        raise UserError(f"{refusal} (use attention.impl=auto)")


def check_pitfall_switches(m: ModelConfig, a: AttentionConfig, prefix: str = "model.") -> None:
    """The studies' pitfalls that would do nothing in this model are refused: a switch
    that changes nothing would measure nothing, and say nothing to whoever set it."""
    for key in ("rope_on_values", "rotary_interleaved"):
        if getattr(a, key) and m.positions != Positions.rope:
            raise UserError(f"attention.{key}=true is a pitfall of rotary positions; it needs "
                            f"{prefix}positions=rope (got {Positions(m.positions).value})")
    if a.gqa_repeat_mismatch and not 1 < m.kv_heads < m.n_head:
        raise UserError(f"attention.gqa_repeat_mismatch=true needs grouped heads, 1 < "
                        f"{prefix}n_kv_head < {prefix}n_head (got n_kv_head={m.n_kv_head}, "
                        f"n_head={m.n_head}): with one key/value head, or one per query head, "
                        f"tiling and interleaving map the heads alike")
    if a.split_heads_no_transpose and m.n_head == 1:
        raise UserError(f"attention.split_heads_no_transpose=true needs {prefix}n_head > 1: "
                        f"one head is split alike with and without the transpose")
    for key in ("window_off_by_one", "window_cache_trim"):
        if getattr(a, key) and m.window is None:
            raise UserError(f"attention.{key}=true is a pitfall of sliding windows; it needs "
                            f"{prefix}window=<keys> (got null)")


def check_fused_kernel(model, device: torch.device, dtype: torch.dtype) -> None:
    """The kernel's self-check on the run's device (model/fast_paths.py, trust_fused_attention):
    where it fails, impl=auto computes with the reference attention (one warning line), and
    impl=fused, asked for by name, is refused."""
    verdict = trust_fused_attention(model, device, dtype)
    if verdict is not None and not verdict.ok and model.attn_cfg.impl is AttentionImpl.fused:
        raise UserError(f"attention.impl=fused: the kernel failed its self-check on {device} "
                        f"({verdict.reason}); attention.impl=auto runs the reference attention")


def check_text(value: str, key: str) -> None:
    """Text from the command line is Unicode: bytes that are not UTF-8 arrive as lone surrogates
    (Python's surrogateescape), which no tokenizer encodes and no file can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UserError(f"{key} holds {value[exc.start:exc.end]!r} at character {exc.start}, "
                        f"which is not text (bytes that are not UTF-8?); give it as UTF-8 "
                        f"text") from None


def check_texts(node, key: str = "") -> None:
    """check_text on every string of a config (a dataclass of */config.py)."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            check_texts(value, f"{key}{f.name}" + ("." if dataclasses.is_dataclass(value) else ""))
    elif isinstance(node, (list, tuple)):
        for i, item in enumerate(node):
            check_texts(item, f"{key}[{i}]")
    elif isinstance(node, str):
        check_text(node, key)


def check_config(cfg: Config, device: Optional[torch.device] = None) -> None:
    """Every value of a run's config, and what ties them together; with the device it is to run
    on (train.device, parsed), also what depends on the device."""
    check_texts(cfg)
    check_model(cfg.model)
    check_attention(cfg.attention)
    check_pitfall_switches(cfg.model, cfg.attention)
    _check(cfg, [row for row in TRAIN if not row.key.startswith(("model.", "attention."))])
    for key in ("train.compile_mode", "train.dtype"):
        check_choice(key, _value(cfg, key))
    _check_device_name(cfg.train.device, "train.device")
    m = cfg.model
    if cfg.attention.impl is AttentionImpl.fused:
        refusal = fused_refusal(cfg.attention, m.head_dim,
                                m.dropout if m.attn_dropout is None else m.attn_dropout, device,
                                window=m.window)
        if refusal:
            raise UserError(f"{refusal}; model.n_embd / model.n_head = {m.n_embd} / {m.n_head} "
                            f"(or use attention.impl=auto)")
    if device is not None and device.type == "mps":
        check_mps(cfg)
    tok = cfg.tokenizer
    if tok.kind is TokenizerKind.file and not tok.path:
        raise UserError("tokenizer.kind=file needs tokenizer.path (a tokenizer.json)")
    if tok.kind is TokenizerKind.bpe and tok.vocab_size < 257:
        raise UserError("tokenizer.vocab_size must be at least 257 for byte-level BPE "
                        f"(256 bytes + 1 special token), got {tok.vocab_size}")
    check_package(cfg.data.package)  # it reaches pip and names files in the cache
    if cfg.your_layer is not None or cfg.attention.name == "yours":
        check_layer(cfg)


def check_layer(cfg: Config) -> None:
    """your_layer=FILE.py:NAME: a learner's layer in every block (check_attention/your_layer.py).
    It sees x alone: no rotary tables, no KV cache, no switch of ours, and returns no weights to
    map; so whatever of ours the run would need is refused, naming everything to set at once."""
    if cfg.your_layer is None:  # (conf/arm/*-yours.yaml)
        raise UserError("attention.name=yours trains your layer: give your_layer=FILE.py:NAME")
    file, sep, name = cfg.your_layer.rpartition(":")
    if not (sep and file.endswith(".py") and name.isidentifier()):
        raise UserError(f"your_layer={cfg.your_layer}: give FILE.py:NAME, a file and its class")
    m, a, t = cfg.model, cfg.attention, cfg.train
    ours = (m.positions is Positions.rope or m.n_kv_head is not None or m.qk_norm
            or m.attn_gate or m.window is not None)
    fixes = [fix for fix, wrong in (
        ("+arch=gpt2 (learned positions, none of our layer's switches)", ours),
        ("attention=correct", not a.is_correct() or a.qk_init_std is not None),
        ("train.cached_eval_batches=0", t.cached_eval_batches > 0),
        ("train.attention_maps=false", t.attention_maps), ("no init_from=", cfg.init_from))
        if wrong]
    if fixes:
        raise UserError(f"your_layer={cfg.your_layer} runs your layer on x alone, without our "
                        f"rotary positions, KV cache or attention maps: set {', '.join(fixes)} "
                        f"(+arm=leak-yours sets them)")


def check_sampling(g) -> None:
    """generate.py's values (a GenerateConfig), all that can be checked before a run is read;
    the vocabulary bounds top_k afterwards (`check_top_k`)."""
    if not g.greedy:
        if g.temperature <= 0:
            raise UserError(f"temperature must be > 0, got {g.temperature} (use greedy=true for "
                            f"the most likely token)")
        _check(g, [temperature("temperature")])
    _check(g, SAMPLE)  # (weights= is choose_weights', which every tool calls before reading)
    last = Limit("seed + num_samples - 1 (each sample's seed)", 0, MAX_SEED, words=SEED.words)
    problem = last.problem(g.seed + g.num_samples - 1)
    if problem:
        raise UserError(problem)


def check_top_k(top_k: Optional[int], vocab_size: int) -> None:
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise UserError(f"top_k must be between 1 and the vocabulary size {vocab_size}, got {top_k}")


def prompt_ids(tokenizer, prompt: str, block_size: int, over: Optional[list] = None) -> list[int]:
    """A prompt's token ids: at least one, no character a char tokenizer never saw, and at most
    the context's worth (the last block_size, with a warning; or its length added to `over`)."""
    check_text(prompt, "the prompt")
    unknown = unknown_characters(tokenizer, prompt)
    if unknown:
        raise UserError(f"the prompt contains characters this char tokenizer never saw in "
                        f"training: {''.join(unknown)!r}; remove or replace them")
    ids = tokenizer.encode(prompt).ids
    if not ids:
        raise UserError("the prompt is empty; give at least one character, e.g. prompt='\\n'")
    if len(ids) > block_size and over is not None:
        over.append(len(ids))
    elif len(ids) > block_size:
        print(f"warning: the prompt has {len(ids)} tokens, more than the context of "
              f"{block_size}; only its last {block_size} tokens are used", file=sys.stderr)
    return ids[-block_size:]


def parse_device(name: str, key: str = "device") -> torch.device:
    """The device a command runs on: auto (CUDA if there is one, else Apple's MPS, else the
    CPU), cpu, mps, cuda or cuda:N, which must exist here."""
    _check_device_name(name, key)
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        why = ("an Apple-silicon Mac" if torch.backends.mps.is_built()
               else "a PyTorch built with MPS (this one is not)")
        raise UserError(f"{key}=mps, but MPS is not available here: it needs {why}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{key}={name}, but no CUDA device is available")
    device = torch.device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UserError(f"{key}={name}, but there are {torch.cuda.device_count()} CUDA devices")
    return device


def _check_device_name(name: str, key: str) -> None:
    if not (name in ("auto", "cpu", "mps", "cuda")
            or (name.startswith("cuda:") and name[5:].isdigit())):
        raise UserError(f"{key} must be auto, cpu, mps, cuda or cuda:N, got {name!r}")


def check_mps(cfg: Config) -> None:
    """What a run cannot do on Apple's MPS (the fused kernel's refusal is `fused_refusal`'s):
    several processes, as torch.distributed has no MPS backend; CUDA graphs; bf16 before
    macOS 14, where MPS has no bf16 (Muon orthogonalises in the run's dtype: float32 in an fp32
    run, so that is not affected).
    torch.compile in
    its other modes is left to the user who asks for it (Inductor has an MPS backend)."""
    t = cfg.train
    world = os.environ.get("WORLD_SIZE", "1")
    if world.strip() not in ("", "1"):
        raise UserError(f"mps (train.device={t.device}) trains in one process only, as "
                        f"torch.distributed has no MPS backend, but WORLD_SIZE={world}: run "
                        f"python train.py without torchrun, or train.device=cpu for several "
                        f"processes")
    if t.compile and t.compile_mode in ("reduce-overhead", "max-autotune"):
        raise UserError(f"train.compile_mode={t.compile_mode} records CUDA graphs, which mps "
                        f"does not have: use train.compile_mode=default or "
                        f"max-autotune-no-cudagraphs")
    try:
        has_bf16 = torch.backends.mps.is_macos_or_newer(14, 0)
    except RuntimeError:  # no MPS in this torch (parse_device refuses mps there)
        has_bf16 = True
    if not has_bf16 and t.dtype == "bfloat16":
        raise UserError("train.dtype=bfloat16 on mps needs macOS 14 or newer: use "
                        "train.dtype=float32")
