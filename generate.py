"""Sample text from a trained run, streaming it to stdout.

    python generate.py                                   # the newest run (runs/latest names it)
    python generate.py run=runs/<dir> prompt="ROMEO:" max_new_tokens=500 temperature=0.8 top_k=40

Same key=value style as train.py. Everything comes from the run directory alone: config.yaml
(model shape), tokenizer.json and the checkpoint's model.safetensors (no pickle is loaded).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.tokenizer import load_tokenizer, unknown_characters
from model.gpt import GPT
from training.checkpoint import CheckpointError, find_weights, load_weights
from training.config import Config
from training.device import pick_device
from training.run_dir import resolve_latest

USAGE = "usage: python generate.py [run=DIR] [prompt=TEXT] [max_new_tokens=N] [key=value ...]"


@dataclass
class GenerateConfig:
    run: str = "runs/latest"
    prompt: str = "\n"
    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    greedy: bool = False           # always the most likely token (temperature etc. ignored)
    seed: int = 1337
    num_samples: int = 1
    weights: str = "best"          # best (lowest validation loss) | latest
    device: str = "auto"
    use_cache: bool = True         # KV cache; false recomputes the whole context every token


class GenerateError(RuntimeError):
    pass


def parse_args(argv: list[str]) -> GenerateConfig:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE + "\n\nkeys and defaults:\n" + OmegaConf.to_yaml(OmegaConf.structured(GenerateConfig)))
        sys.exit(0)
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise GenerateError(f"arguments must be key=value, got {bad[0]!r}. {USAGE}")
    # String-valued keys keep their text verbatim (prompt=ROMEO: must not be read as YAML).
    text_keys = {f.name for f in fields(GenerateConfig) if f.type == "str"}
    raw = {k: v for k, v in (a.split("=", 1) for a in argv) if k in text_keys}
    parsed = OmegaConf.from_dotlist([a for a in argv if a.split("=", 1)[0] not in text_keys])
    cfg = OmegaConf.merge(OmegaConf.structured(GenerateConfig), parsed, raw)
    return OmegaConf.to_object(cfg)


def load_run(run_dir: Path, which: str, device: torch.device):
    """(model, tokenizer, run config) from a run directory; checks that the parts belong together."""
    if not run_dir.is_dir():
        raise GenerateError(f"run directory {run_dir} does not exist")
    for name in ("config.yaml", "tokenizer.json"):
        if not (run_dir / name).is_file():
            raise GenerateError(f"{run_dir} has no {name}: is it a run directory of train.py?")
    if which not in ("best", "latest"):
        raise GenerateError(f"weights must be best or latest, got {which!r}")
    # The saved config is data, merged into the typed schema: nothing in it is instantiated.
    try:
        run_cfg: Config = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml")))
    except Exception as exc:  # YAML syntax, or keys/values that do not fit the schema
        raise GenerateError(f"{run_dir / 'config.yaml'} is not a valid run config: "
                            f"{_first_line(exc)}") from exc
    try:
        tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    except Exception as exc:  # tokenizers raises plain Exception
        raise GenerateError(f"cannot read {run_dir / 'tokenizer.json'}: {_first_line(exc)}") from exc
    model = GPT(run_cfg.model, tokenizer.get_vocab_size(), run_cfg.attention)
    load_weights(model, find_weights(run_dir, which))
    return model.to(device).eval(), tokenizer, run_cfg


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def check(cfg: GenerateConfig, vocab_size: int) -> None:
    if cfg.temperature <= 0 and not cfg.greedy:
        raise GenerateError(f"temperature must be > 0, got {cfg.temperature} (use greedy=true "
                            "for the most likely token)")
    if cfg.top_k is not None and not 1 <= cfg.top_k <= vocab_size:
        raise GenerateError(f"top_k must be between 1 and the vocabulary size {vocab_size}, got {cfg.top_k}")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise GenerateError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.max_new_tokens < 0:
        raise GenerateError(f"max_new_tokens must be >= 0, got {cfg.max_new_tokens}")
    if cfg.num_samples < 1:
        raise GenerateError(f"num_samples must be >= 1, got {cfg.num_samples}")


def stream(model: GPT, tokenizer, prompt_ids: list[int], cfg: GenerateConfig, out=None) -> str:
    """Generate one sample, writing text as it appears (to stdout by default); returns it all."""
    out = sys.stdout if out is None else out
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(cfg.seed)
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    shown = tokenizer.decode(ids)
    out.write(shown)
    for token in model.generate(torch.tensor([ids], device=device), cfg.max_new_tokens,
                                cfg.temperature, cfg.top_k, cfg.top_p, gen, cfg.greedy, cfg.use_cache):
        ids.append(int(token))
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # a multi-byte character is still incomplete (byte BPE)
            continue
        out.write(text[len(shown):])
        out.flush()
        shown = text
    out.write("\n")
    return shown


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
        device = pick_device(cfg.device)
        model, tokenizer, run_cfg = load_run(resolve_latest(Path(cfg.run)), cfg.weights, device)
        check(cfg, tokenizer.get_vocab_size())
        unknown = unknown_characters(tokenizer, cfg.prompt)
        if unknown:
            raise GenerateError(f"the prompt contains characters this char tokenizer never saw in "
                                f"training: {''.join(unknown)!r}; remove or replace them")
        prompt_ids = tokenizer.encode(cfg.prompt).ids
        if not prompt_ids:
            raise GenerateError("the prompt is empty; give at least one character, e.g. prompt='\\n'")
        block = run_cfg.model.block_size
        if len(prompt_ids) > block:
            print(f"warning: prompt has {len(prompt_ids)} tokens, more than the context of {block}; "
                  f"only its last {block} tokens are used", file=sys.stderr)
            prompt_ids = prompt_ids[-block:]
    except (GenerateError, CheckpointError, OmegaConfBaseException, ValueError, RuntimeError,
            OSError) as exc:
        message, key = _first_line(exc), getattr(exc, "full_key", None)
        print(f"error: {key + ': ' if key and key not in message else ''}{message}", file=sys.stderr)
        return 2
    try:
        for i in range(cfg.num_samples):
            if i:
                print("\n" + "-" * 40)
            cfg_i = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), {"seed": cfg.seed + i}))
            stream(model, tokenizer, prompt_ids, cfg_i)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet flush at exit
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
