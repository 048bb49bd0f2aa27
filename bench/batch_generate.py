"""What does sampling several prompts in one batch buy? Tokens/s of a left-padded batch against
the same prompts sampled one at a time.

    python -m bench.batch_generate                 # 1, 4, 16 and 64 prompts, 100 new tokens each
    python -m bench.batch_generate quick=true      # seconds: 1, 4 and 16 prompts, 20 tokens
    python -m bench.batch_generate threads=2 prompts=1,8   # any counts; threads, as every bench

For each count N: N prompts of different lengths (4 to 32 tokens), greedy, through the KV cache,
    batch           one GPT.generate call: the prompts left-padded to the longest, with each
                    row's positions counted from its first real token and its pad keys hidden
                    (what generate.py prompts=FILE does);
    one at a time   N calls, one prompt each (what prompt= does N times).
Each row of the batch must give the tokens of its prompt alone (exit status 1 if not). The model
is the default config's with random weights, nothing cropped (as bench.generate's). Headline:
the batch's tokens/s over one at a time's, at the largest N.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from bench.common import (BenchArgs, bench_main, compose_config, fmt, interleaved_medians,
                          print_header, print_headline, print_table, resolve_repetitions, setup)
from model.gpt import GPT
from safeio.cli import UserError

N_TOKENS, QUICK_N_TOKENS = 100, 20
COUNTS, QUICK_COUNTS = [1, 4, 16, 64], [1, 4, 16]
REPS, QUICK_REPS = 3, 2
LONGEST = 32
SEED = 0
MAX_TOKENS, MAX_CACHE_BYTES = 100_000, 4 << 30  # a bench, not a test of the machine's memory


@dataclass
class BatchArgs(BenchArgs):
    prompts: Optional[list[int]] = field(default=None)  # prompt counts (null: 1,4,16,64)
    tokens: Optional[int] = None  # new tokens per prompt (null: 100, 20 with quick=true)


def prompt_lengths(n: int) -> list[int]:
    """n lengths between 4 and LONGEST, spread (not sorted), the same for every bench run."""
    return [4 + (7 * i) % (LONGEST - 3) for i in range(n)]


def main(argv: list[str]) -> int:
    return bench_main(argv, BatchArgs, "bench.batch_generate", __doc__, measure_all)


def measure_all(args: BatchArgs, overrides: list[str]) -> int:
    device = setup(args)
    reps, warmup = resolve_repetitions(args, reps=REPS, quick_reps=QUICK_REPS, warmup=1,
                                       quick_warmup=1)
    n_tokens = (QUICK_N_TOKENS if args.quick else N_TOKENS) if args.tokens is None else args.tokens
    counts = args.prompts or (QUICK_COUNTS if args.quick else COUNTS)
    if min(counts) < 1 or not 1 <= n_tokens <= MAX_TOKENS:
        raise UserError(f"prompts must be positive counts and tokens from 1 to {MAX_TOKENS:,}, "
                        f"got prompts={counts} and tokens={n_tokens}")
    cfg = compose_config(overrides + [f"model.block_size={LONGEST + n_tokens}"])
    cache = max(counts) * (LONGEST + n_tokens) * cfg.model.n_layer * 2 * cfg.model.n_embd * 4
    if cache > MAX_CACHE_BYTES:  # the batch's KV cache, in float32
        raise UserError(f"{max(counts):,} prompts of up to {LONGEST + n_tokens:,} tokens: a KV "
                        f"cache of {cache / 2**30:,.1f} GiB, over {MAX_CACHE_BYTES >> 30} GiB")
    torch.manual_seed(SEED)
    model = GPT(cfg.model, cfg.tokenizer.planned_vocab_size, cfg.attention).to(device).eval()
    m = model.cfg
    print_header(
        "greedy sampling of N prompts: one left-padded batch vs one prompt at a time (KV cache)",
        device,
        f"model {' '.join(overrides) or 'default'} (n_layer {m.n_layer}, n_head {m.n_head}, "
        f"n_embd {m.n_embd}), random weights, fp32, vocab {model.vocab_size}",
        f"prompts of 4 to {LONGEST} tokens + {n_tokens} new tokens each; median of {reps} after "
        f"{warmup} warm-up, the two ways alternating",
    )
    gen = torch.Generator().manual_seed(SEED)
    rows, identical, ratio = [], True, float("nan")
    for n in counts:
        prompts = [torch.randint(0, model.vocab_size, (length,), generator=gen).tolist()
                   for length in prompt_lengths(n)]
        longest = max(map(len, prompts))
        pad = torch.tensor([longest - len(p) for p in prompts], device=device)
        idx = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=device)
        outputs: dict[str, list] = {"batch": [], "alone": []}

        def batch() -> None:
            steps = model.generate(idx, n_tokens, greedy=True, use_cache=True, pad=pad)
            outputs["batch"] = torch.cat(list(steps), dim=1).tolist()

        def alone() -> None:
            outputs["alone"] = [torch.cat(list(model.generate(
                torch.tensor([p], device=device), n_tokens, greedy=True, use_cache=True)),
                dim=1)[0].tolist() for p in prompts]

        times = interleaved_medians({"batch": batch, "alone": alone}, device, reps, warmup)
        same = outputs["batch"] == outputs["alone"]
        identical &= same
        tok_s = {name: n * n_tokens / seconds for name, seconds in times.items()}
        ratio = tok_s["batch"] / tok_s["alone"]
        rows.append([n, longest, fmt(tok_s["batch"], ",.0f"), fmt(tok_s["alone"], ",.0f"),
                     fmt(ratio, ".2f"), "yes" if same else "NO"])
    print_table(["prompts", "longest", "batch tokens/s", "one at a time tokens/s",
                 "batch / one at a time", "rows = alone"], rows)
    print(f"tokens identical: {'yes, every row of every count' if identical else 'NO'}")
    print(f"headline: batch tokens/s over one at a time's, {counts[-1]} prompts")
    print_headline(ratio)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
