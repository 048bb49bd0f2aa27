"""What does the KV cache buy at sampling time? Tokens/s with it and without it.

    python bench/generate.py            # 1000 new tokens
    python bench/generate.py --quick    # seconds: 100 new tokens

With the cache (`GPT.generate(use_cache=True)`) each step runs the model on one new token and
attends to the stored keys and values: O(T) work per token. Without it (use_cache=False, what
nanoGPT does) each step reruns the whole prefix: O(T^2) attention and O(T) of everything else
per token, so the speed-up grows with the number of tokens generated.

The model has the default size (conf/model/small.yaml) with random weights and a block_size of
prompt + new tokens, so that neither path ever crops its context (cropping would make them
compute different things). Decoding is greedy, hence deterministic: the two paths must produce
the very same tokens, which is checked (exit status 1 if not). Headline: cached tokens/s over
recomputed tokens/s.
"""
from __future__ import annotations

import sys
from pathlib import Path

# `python bench/generate.py` puts bench/ first on sys.path, where bench/data.py would shadow
# the project's `data` package: put the repository root there instead.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(_ROOT)] + [p for p in sys.path
                              if Path(p or ".").resolve() not in (_ROOT, _ROOT / "bench")]

from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from bench.common import (REPO_ROOT, fmt, interleaved_medians, make_parser,  # noqa: E402
                          print_header, print_headline, print_table, resolve_repetitions, setup)
from model.config import ModelConfig  # noqa: E402
from model.gpt import GPT  # noqa: E402

VOCAB_SIZE = 4096           # the default tokenizer, conf/tokenizer/bpe.yaml
DEFAULT_MODEL = "small"     # conf/config.yaml's model group default
PROMPT_LEN = 16
N_TOKENS, QUICK_N_TOKENS = 1000, 100
WARMUP_TOKENS = 16          # a short generation per path warms up kernels and allocator
REPS, QUICK_REPS = 3, 3     # full generations are long: few repetitions suffice
SEED = 0


def build_model(n_tokens: int, device: torch.device) -> GPT:
    """The default model, random weights, with room for prompt + n_tokens (no cropping)."""
    merged = OmegaConf.merge(OmegaConf.structured(ModelConfig),
                             OmegaConf.load(REPO_ROOT / "conf" / "model" / f"{DEFAULT_MODEL}.yaml"))
    cfg = replace(OmegaConf.to_object(merged), block_size=PROMPT_LEN + n_tokens)
    torch.manual_seed(SEED)
    return GPT(cfg, VOCAB_SIZE).to(device).eval()


def sample(model: GPT, prompt: torch.Tensor, n_tokens: int, use_cache: bool) -> list[int]:
    steps = model.generate(prompt, n_tokens, greedy=True, use_cache=use_cache)
    return torch.cat(list(steps), dim=1)[0].tolist()


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def top2_margin(model: GPT, prompt: torch.Tensor, tokens: list[int]) -> float:
    """Gap between the two largest logits before the given continuation: a near-zero gap means
    the two paths disagreed on a near-tie (rounding), a large one means a real bug."""
    context = torch.cat([prompt, torch.tensor([tokens], device=prompt.device)], dim=1)
    logits, _ = model(context)
    top = logits[0, -1].topk(2).values
    return (top[0] - top[1]).item()


def main() -> int:
    parser = make_parser(__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"new tokens per generation (default {N_TOKENS}, "
                             f"--quick {QUICK_N_TOKENS})")
    args = parser.parse_args()
    device = setup(args)
    reps, _ = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS)
    n_tokens = args.tokens or (QUICK_N_TOKENS if args.quick else N_TOKENS)

    model = build_model(n_tokens, device)
    gen = torch.Generator(device=device).manual_seed(SEED)
    prompt = torch.randint(0, VOCAB_SIZE, (1, PROMPT_LEN), device=device, generator=gen)
    cfg = model.cfg
    print_header(
        "greedy sampling: KV cache vs recomputing the whole prefix every step",
        device,
        f"model {DEFAULT_MODEL} (n_layer {cfg.n_layer}, n_head {cfg.n_head}, n_embd "
        f"{cfg.n_embd}), random weights, fp32, batch 1, vocab {VOCAB_SIZE}",
        f"prompt {PROMPT_LEN} + {n_tokens} new tokens, block_size {cfg.block_size} (no cropping); "
        f"median of {reps} generations after a {WARMUP_TOKENS}-token warm-up per path",
    )

    for use_cache in (True, False):
        sample(model, prompt, WARMUP_TOKENS, use_cache)
    outputs: dict[str, list[list[int]]] = {"cache": [], "recompute": []}
    times = interleaved_medians(
        {"cache": lambda: outputs["cache"].append(sample(model, prompt, n_tokens, True)),
         "recompute": lambda: outputs["recompute"].append(sample(model, prompt, n_tokens, False))},
        device, reps, warmup=0)

    tok_s = {mode: n_tokens / seconds for mode, seconds in times.items()}
    print_table(["mode", "new tokens", "median s", "tokens/s", "ms/token"],
                [[f"{mode} (use_cache={mode == 'cache'})", n_tokens, fmt(times[mode], ".3f"),
                  fmt(tok_s[mode], ",.1f"), fmt(1e3 * times[mode] / n_tokens, ".2f")]
                 for mode in times])

    cached, recomputed = outputs["cache"][0], outputs["recompute"][0]
    repeatable = all(o == cached for o in outputs["cache"]) and all(
        o == recomputed for o in outputs["recompute"])
    identical = cached == recomputed
    if identical and repeatable:
        print(f"tokens identical: yes ({n_tokens} of {n_tokens}, every repetition)")
    else:
        i = first_difference(cached, recomputed)
        print(f"tokens identical: NO (first difference at new token {i}"
              + (f", top-2 logit margin there {top2_margin(model, prompt, recomputed[:i]):.2e}"
                 if not identical else "")
              + ("" if repeatable else "; a path differs between its own repetitions") + ")")
    print("headline: cached tokens/s over recomputed tokens/s")
    print_headline(tok_s["cache"] / tok_s["recompute"])
    return 0 if identical and repeatable else 1


if __name__ == "__main__":
    sys.exit(main())
