"""What do the KV cache and its static form buy at sampling time? Tokens/s of each way to decode.

    python -m bench.generate                  # 1000 new tokens, batch 1
    python -m bench.generate quick=true       # seconds: 100 new tokens
    python -m bench.generate model=baby       # any train.py override picks the model

Three ways to produce the same tokens with `GPT.generate`:

    KV cache          use_cache=True, static_cache=False: each step runs the model on the one new
                      token and attends to the stored keys and values, O(T) work per token.
    static KV cache   static_cache=True: the same, but the cache writes at a position held in a
                      device tensor, so every decode step has the same shapes; on CUDA the
                      one-token step is captured once in a CUDA graph and replayed.
    recompute         use_cache=False (what nanoGPT does): each step reruns the whole prefix,
                      O(T^2) attention and O(T) of everything else per token, so the gap to the
                      cache grows with the number of tokens generated.

The model is the default config's (overrides on the command line) with random weights and a
block_size of prompt + new tokens, so that no path crops its context. Decoding is greedy: every
path must produce the very same tokens (exit status 1 if not). Headline: KV cache tokens/s over
recompute tokens/s.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from bench.common import (BenchArgs, bench_main, compose_config, fmt, interleaved_medians,
                          print_header, print_headline, print_table, resolve_repetitions, setup)
from model.fast_paths import trust_fused_attention
from model.gpt import GPT

PROMPT_LEN = 16
N_TOKENS, QUICK_N_TOKENS = 1000, 100
WARMUP_TOKENS = 16          # a short generation per path warms up kernels and allocator
REPS, QUICK_REPS = 3, 3     # full generations are long: few repetitions suffice
CACHE, STATIC, RECOMPUTE = "KV cache", "static KV cache", "recompute"
SEED = 0


def build_model(overrides: list[str], n_tokens: int, device: torch.device) -> GPT:
    """The configured model, random weights, with room for prompt + n_tokens (no cropping)."""
    cfg = compose_config(overrides + [f"model.block_size={PROMPT_LEN + n_tokens}"])
    torch.manual_seed(SEED)
    model = GPT(cfg.model, cfg.tokenizer.planned_vocab_size, cfg.attention).to(device).eval()
    trust_fused_attention(model, device, torch.float32)  # as generate.py: a checked kernel
    return model


# generate() keywords of each path. The plain KV cache asks for the dynamic cache explicitly:
# left to its default (auto), it would take the static one on CUDA.
PATHS = {CACHE: {"use_cache": True, "static_cache": False},
         STATIC: {"use_cache": True, "static_cache": True},
         RECOMPUTE: {"use_cache": False}}


def sample(model: GPT, prompt: torch.Tensor, n_tokens: int, **kwargs) -> list[int]:
    steps = model.generate(prompt, n_tokens, greedy=True, **kwargs)
    return torch.cat(list(steps), dim=1)[0].tolist()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def top2_margin(model: GPT, prompt: torch.Tensor, tokens: list[int]) -> float:
    """Gap between the two largest logits before the given continuation: a near-zero gap means
    two paths disagreed on a near-tie (rounding), a large one means a real bug."""
    context = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], dim=1)
    logits, _ = model(context)
    top = logits[0, -1].topk(2).values
    return (top[0] - top[1]).item()


@dataclass
class GenerateArgs(BenchArgs):
    tokens: Optional[int] = None   # new tokens per generation (null: 1000, 100 with quick=true)


def main(argv: list[str]) -> int:
    return bench_main(argv, GenerateArgs, "bench.generate", __doc__, measure_all)


def measure_all(args: GenerateArgs, overrides: list[str]) -> int:
    device = setup(args)
    reps, _ = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS)
    n_tokens = args.tokens or (QUICK_N_TOKENS if args.quick else N_TOKENS)

    model = build_model(overrides, n_tokens, device)
    gen = torch.Generator(device=device).manual_seed(SEED)
    prompt = torch.randint(0, model.vocab_size, (1, PROMPT_LEN), device=device, generator=gen)
    cfg = model.cfg
    print_header(
        "greedy sampling, batch 1: KV cache, static KV cache, recomputing the prefix every step",
        device,
        f"model {' '.join(overrides) or 'default'} (n_layer {cfg.n_layer}, n_head "
        f"{cfg.n_head}, n_embd {cfg.n_embd}), random weights, fp32, vocab {model.vocab_size}",
        f"prompt {PROMPT_LEN} + {n_tokens} new tokens, block_size {cfg.block_size} (no cropping); "
        f"median of {reps} generations after a {WARMUP_TOKENS}-token warm-up per path",
    )

    for kwargs in PATHS.values():
        sample(model, prompt, WARMUP_TOKENS, **kwargs)
    outputs: dict[str, list[list[int]]] = {name: [] for name in PATHS}

    def run(name: str) -> Callable[[], None]:
        return lambda: outputs[name].append(sample(model, prompt, n_tokens, **PATHS[name]))

    times = interleaved_medians({name: run(name) for name in PATHS}, device, reps, warmup=0)

    tok_s = {name: n_tokens / seconds for name, seconds in times.items()}
    print_table(["path", "generate() keywords", "new tokens", "median s", "tokens/s",
                 "ms/token", "x recompute"],
                [[name, ", ".join(f"{k}={v}" for k, v in PATHS[name].items()), n_tokens,
                  fmt(times[name], ".3f"), fmt(tok_s[name], ",.1f"),
                  fmt(1e3 * times[name] / n_tokens, ".2f"),
                  fmt(tok_s[name] / tok_s[RECOMPUTE], ".2f")]
                 for name in PATHS])

    reference = outputs[CACHE][0]
    repeatable = all(o == runs[0] for runs in outputs.values() for o in runs)
    differing = [name for name, runs in outputs.items() if runs[0] != reference]
    if not differing and repeatable:
        print(f"tokens identical: yes ({n_tokens} of {n_tokens}, every path, every repetition)")
    for name in differing:
        i = first_difference(reference, outputs[name][0])
        margin = top2_margin(model, prompt, reference[:i])
        print(f"tokens identical: NO, {name} departs from {CACHE} at new token {i} (top-2 logit "
              f"margin there {margin:.2e})")
    if not repeatable:
        print("tokens identical: NO, a path differs between its own repetitions")
    print(f"{STATIC} / {CACHE}: {tok_s[STATIC] / tok_s[CACHE]:.2f}x")
    print(f"headline: {CACHE} tokens/s over {RECOMPUTE} tokens/s")
    print_headline(tok_s[CACHE] / tok_s[RECOMPUTE])
    return 0 if repeatable and not differing else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
