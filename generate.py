"""Sample text from a trained run, streaming it to stdout.

    python generate.py                                   # the newest run (runs/latest names it)
    python generate.py run=runs/<dir> prompt="ROMEO:" max_new_tokens=500 temperature=0.8 top_k=40

Same key=value style as train.py. Everything comes from the run directory alone: config.yaml
(model shape), tokenizer.json and the checkpoint's model.safetensors (no pickle is loaded); a
run directory may come from someone else, so `load_run` checks each file before use
(guard/run_dir.py). Every mistake ends in one `error:` line.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from data.tokenizer import IncrementalDecoder
from guard.cli import UserError, first_line, parse_key_values, run_cli
from guard.limits import check_sampling, check_top_k, parse_device, prompt_ids
from guard.run_dir import load_run, resolve_latest
from model.gpt import GPT
from training.checkpoint import LATEST
from training.config import Config, TrainConfig

USAGE = "usage: python generate.py [run=DIR] [prompt=TEXT] [max_new_tokens=N] [key=value ...]"


@dataclass
class GenerateConfig:
    """The defaults are those of the samples train.py logs."""

    run: str = str(LATEST)
    prompt: str = TrainConfig.sample_prompt
    max_new_tokens: int = 500
    temperature: float = TrainConfig.sample_temperature
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    greedy: bool = False           # always the most likely token (temperature etc. ignored)
    seed: int = Config.seed
    num_samples: int = 1
    weights: str = "best"          # best (lowest validation loss) | latest
    device: str = "auto"
    use_cache: bool = True         # KV cache; false recomputes the whole context every token


def main(argv: list[str]) -> int:
    return run_cli(lambda: sample(argv))


def sample(argv: list[str]) -> int:
    cfg = parse_key_values(argv, GenerateConfig, USAGE)
    check_sampling(cfg)  # before anything is read
    device = parse_device(cfg.device)
    model, tokenizer, run_cfg = load_run(resolve_latest(Path(cfg.run)), cfg.weights, device)
    check_top_k(cfg.top_k, tokenizer.get_vocab_size())
    prompt = prompt_ids(tokenizer, cfg.prompt, run_cfg.model.block_size)
    try:
        for i in range(cfg.num_samples):
            if i:
                print("\n" + "-" * 40)
            stream(model, tokenizer, prompt, replace(cfg, seed=cfg.seed + i))
    except KeyboardInterrupt:  # the sample so far stays on screen
        print(file=sys.stderr)
        return 130
    return 0


def stream(model: GPT, tokenizer, prompt_ids: list[int], cfg: GenerateConfig, out=None) -> str:
    """Generate one sample, writing text as it appears (to stdout by default); returns it all.

    Decoding is incremental (data.tokenizer.IncrementalDecoder), so each token costs the same
    however long the sample grows."""
    out = sys.stdout if out is None else out
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    decoder = IncrementalDecoder(tokenizer, prompt_ids)
    pieces = [tokenizer.decode(list(prompt_ids))]
    out.write(pieces[0])
    tokens = model.generate(torch.tensor([prompt_ids], device=device), cfg.max_new_tokens,
                            cfg.temperature, cfg.top_k, cfg.top_p, gen, cfg.greedy, cfg.use_cache)
    try:
        for token in tokens:
            piece = decoder.add(int(token))
            if piece:
                out.write(piece)
                out.flush()
                pieces.append(piece)
    except RuntimeError as exc:  # e.g. probabilities that are not finite: weights that overflow
        out.write("\n")
        out.flush()
        raise UserError(f"sampling failed after {len(decoder.ids) - len(prompt_ids)} tokens: "
                        f"{first_line(exc)} (do the weights overflow?)") from None
    pieces.append(decoder.finish())
    out.write(pieces[-1] + "\n")
    return "".join(pieces)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
