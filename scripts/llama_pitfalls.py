"""What the second study's pitfalls cost on imported weights: logits against transformers' Llama.
Needs transformers, which requirements.txt does not install: pip install -r requirements-dev.txt.

    python -m scripts.llama_pitfalls [seed=0] [batch=4] [tokens=32]

A mistake can be invisible in training: tiling the grouped key/value heads instead of
interleaving them, or rotating interleaved pairs instead of rotate-half, is a relabelling of
heads or of dimensions, which a model trained from scratch absorbs into its weights (the study's
intervals hold 0). On weights trained the other way it is wrong. This script copies a tiny random
float64 `LlamaForCausalLM` (no download) into our GPT (`gpt_from_llama`) and prints, for the
correct layer and each pitfall, the largest logit error against transformers, uncached and
through the KV cache (teacher forced), and the mean KL divergence of the next-token
distributions. The correct layer agrees to float64 rounding.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run as a file: the repository's packages still import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from safeio.cli import UserError, parse_key_values, run_cli  # noqa: E402
from guard.limits import check_values, llama_pitfalls_rows  # noqa: E402
from model.config import AttentionConfig, AttentionImpl, DECODING_SWITCHES, ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402

# The tiny Llama: 4 query heads of d_k = 8 sharing 2 key/value heads, SwiGLU of width 48.
LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
             rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             attention_bias=False, mlp_bias=False)


def tiny_llama(seed: int = 0, **changes):
    """A random LlamaForCausalLM in float64, weights spread far enough (std 0.2, norm gains
    1 +- 0.3) that every path carries signal."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA, **changes})
    config._attn_implementation = "eager"  # the plain softmax: no kernel choice in the oracle
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return model


def llama_model_config(config) -> ModelConfig:
    """Our ModelConfig of a LlamaConfig (the switches Llama has)."""
    theta = getattr(config, "rope_theta", None) or \
        (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return ModelConfig(n_layer=config.num_hidden_layers, n_head=config.num_attention_heads,
                       n_embd=config.hidden_size, block_size=config.max_position_embeddings,
                       positions="rope", rope_theta=float(theta), norm="rmsnorm",
                       norm_eps=config.rms_norm_eps, mlp="swiglu",
                       mlp_hidden=config.intermediate_size, n_kv_head=config.num_key_value_heads,
                       bias=False, tie_embeddings=config.tie_word_embeddings)


def gpt_from_llama(llama, attn: AttentionConfig = AttentionConfig()) -> GPT:
    """Our GPT holding a LlamaForCausalLM's tensors: W_Q, W_K, W_V stacked into qkv, gate and up
    into the MLP's fc, in the dtype of the Llama."""
    cfg = llama_model_config(llama.config)
    model = GPT(cfg, llama.config.vocab_size, replace(attn, impl=AttentionImpl.reference))
    src = llama.state_dict()
    ours = {"tok_emb.weight": src["model.embed_tokens.weight"],
            "ln_f.weight": src["model.norm.weight"], "lm_head.weight": src["lm_head.weight"]}
    for i in range(cfg.n_layer):
        layer = f"model.layers.{i}."
        a, m = layer + "self_attn.", layer + "mlp."
        ours |= {f"blocks.{i}.ln_1.weight": src[layer + "input_layernorm.weight"],
                 f"blocks.{i}.ln_2.weight": src[layer + "post_attention_layernorm.weight"],
                 f"blocks.{i}.attn.qkv.weight": torch.cat([src[a + "q_proj.weight"],
                                                           src[a + "k_proj.weight"],
                                                           src[a + "v_proj.weight"]]),
                 f"blocks.{i}.attn.out_proj.weight": src[a + "o_proj.weight"],
                 f"blocks.{i}.mlp.fc.weight": torch.cat([src[m + "gate_proj.weight"],
                                                         src[m + "up_proj.weight"]]),
                 f"blocks.{i}.mlp.proj.weight": src[m + "down_proj.weight"]}
    model = model.to(next(llama.parameters()).dtype)
    model.load_state_dict(ours, strict=not cfg.tie_embeddings)
    return model.eval()


def teacher_forced_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """[B, T, V]: the logits of each position through the KV cache, one token at a time."""
    cache = model.new_cache(idx.size(0))
    with torch.no_grad():
        return torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(idx.size(1))], 1)


def mean_kl(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || ours) of the next-token distributions, in nats."""
    log_p, log_q = F.log_softmax(reference, -1), F.log_softmax(logits, -1)
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()


def measure(seed: int = 0, batch: int = 4, tokens: int = 32) -> list[dict]:
    """For the correct layer and each pitfall: the largest |logit error| against transformers'
    Llama (uncached, and through the cache) and the mean KL of each."""
    llama = tiny_llama(seed)
    idx = torch.randint(0, LLAMA["vocab_size"], (batch, tokens),
                        generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        reference = llama(idx).logits
    rows = []
    for name in ("correct", *DECODING_SWITCHES):
        attn = AttentionConfig() if name == "correct" else AttentionConfig(name=name, **{name: True})
        model = gpt_from_llama(llama, attn)
        with torch.no_grad():
            full = model(idx)[0]
        cached = teacher_forced_logits(model, idx)
        rows.append({"variant": name, "max_error": (full - reference).abs().max().item(),
                     "cached_max_error": (cached - reference).abs().max().item(),
                     "kl": mean_kl(reference, full), "cached_kl": mean_kl(reference, cached)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| variant | max logit error (forward) | mean KL (forward) "
             "| max logit error (KV cache) | mean KL (KV cache) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['max_error']:.2e} | {r['kl']:.2e} "
                     f"| {r['cached_max_error']:.2e} | {r['cached_kl']:.2e} |")
    return "\n".join(lines)


@dataclass
class LlamaArgs:
    seed: int = 0      # the random weights and tokens
    batch: int = 4     # sequences of random tokens
    tokens: int = 32   # tokens per sequence (at most the tiny Llama's 32 positions)


def check_args(args: LlamaArgs) -> None:
    """The values (guard/limits.py's table), and transformers, before anything is built."""
    check_values(args, llama_pitfalls_rows(LLAMA["max_position_embeddings"]))
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UserError("scripts.llama_pitfalls compares against transformers' Llama, and "
                        "transformers is not installed: pip install -r requirements-dev.txt") \
            from None


def main(argv: list[str]) -> int:
    usage = "usage: python -m scripts.llama_pitfalls [seed=N] [batch=N] [tokens=N]"

    def body() -> None:
        args = parse_key_values(argv, LlamaArgs, usage, about=__doc__.split("\n\n")[0])
        check_args(args)
        print(f"tiny random LlamaForCausalLM ({LLAMA['num_hidden_layers']} layers, "
              f"{LLAMA['num_attention_heads']} heads sharing {LLAMA['num_key_value_heads']} "
              f"key/value heads, d_k {LLAMA['hidden_size'] // LLAMA['num_attention_heads']}), "
              f"float64, seed {args.seed}, {args.batch} x {args.tokens} random tokens; logits "
              f"of transformers vs ours\n")
        print(table(measure(args.seed, args.batch, args.tokens)))
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
