"""Sample text from a trained run, streaming it to stdout.

    python generate.py                                   # the newest run (runs/latest names it)
    python generate.py run=runs/<dir> prompt="ROMEO:" max_new_tokens=500 temperature=0.8 top_k=40

Same key=value style as train.py. Everything comes from the run directory alone: config.yaml
(model shape), tokenizer.json and the checkpoint's model.safetensors (no pickle is loaded). A run
directory may come from someone else, so each file is checked before use (kind, size, content:
plain YAML, a tokenizer without custom regular expressions, finite weights of the right shapes),
and the model's size against the memory there is. Every mistake ends in one `error:` line.
"""
from __future__ import annotations

import os
import sys
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.tokenizer import IncrementalDecoder, load_tokenizer, unknown_characters
from model.gpt import GPT
from model.hf import GPT2FormatError, gpt_from_gpt2_folder, load_folder_tokenizer
from training.checkpoint import CheckpointError, find_weights, load_weights
from training.config import MAX_COUNT, Config, check_seed, check_temperature, validate
from training.device import pick_device
from training.errors import UserError, first_line
from training.memory import check_fits, inference_bytes
from training.run_dir import resolve_latest
from training.safe_yaml import load_run_config

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
    hints = typing.get_type_hints(GenerateConfig)
    text_keys = {f.name for f in fields(GenerateConfig) if hints[f.name] is str}
    raw = {k: v for k, v in (a.split("=", 1) for a in argv) if k in text_keys}
    parsed = OmegaConf.from_dotlist([a for a in argv if a.split("=", 1)[0] not in text_keys])
    cfg = OmegaConf.merge(OmegaConf.structured(GenerateConfig), parsed, raw)
    return OmegaConf.to_object(cfg)


def load_run(run_dir: Path, which: str, device: torch.device):
    """(model, tokenizer, run config) from a run directory; checks that the parts belong together."""
    if not run_dir.is_dir():
        raise GenerateError(f"run directory {run_dir} does not exist" if not run_dir.exists()
                            else f"run directory {run_dir} is not a directory")
    if not (run_dir / "config.yaml").exists() and (run_dir / "config.json").exists():
        return load_gpt2_folder_run(run_dir, device)
    if not (run_dir / "config.yaml").exists():
        raise GenerateError(f"{run_dir} has no config.yaml: is it a run directory of train.py "
                            f"(or a GPT-2 folder with config.json)?")
    if which not in ("best", "latest"):
        raise GenerateError(f"weights must be best or latest, got {which!r}")
    # The saved config is data, merged into the typed schema: nothing in it is instantiated.
    try:
        run_cfg: Config = OmegaConf.to_object(
            OmegaConf.merge(OmegaConf.structured(Config), load_run_config(run_dir / "config.yaml")))
        validate(run_cfg)
    except UserError as exc:
        raise GenerateError(str(exc)) from None
    except (OmegaConfBaseException, ValueError) as exc:  # keys/values that do not fit the schema
        key = getattr(exc, "full_key", None)
        raise GenerateError(f"{run_dir / 'config.yaml'} is not a valid run config: "
                            f"{first_line(exc)}" + (f" ({key})" if key else "")) from None
    try:
        tokenizer = load_tokenizer(run_dir / "tokenizer.json")
    except (OSError, ValueError) as exc:
        raise GenerateError(f"cannot read the run's tokenizer: {first_line(exc)}") from None
    vocab = tokenizer.get_vocab_size()
    try:
        check_fits(inference_bytes(run_cfg.model, vocab), device, "sampling", run_cfg.model, vocab,
                   f"{run_dir / 'config.yaml'} describes a model too big for this machine")
    except ValueError as exc:
        raise GenerateError(str(exc)) from None
    model = GPT(run_cfg.model, vocab, run_cfg.attention)
    load_weights(model, find_weights(run_dir, which))
    return model.to(device).eval(), tokenizer, run_cfg


def load_gpt2_folder_run(folder: Path, device: torch.device):
    """(model, tokenizer, config) from a GPT-2-format folder (config.json, model.safetensors,
    tokenizer.json), e.g. one written by scripts/export_hf.py."""
    try:
        model = gpt_from_gpt2_folder(folder)
        tokenizer = load_folder_tokenizer(folder)
    except (GPT2FormatError, OSError) as exc:
        raise GenerateError(first_line(exc)) from None
    except Exception as exc:  # tokenizers raises plain Exception for an unreadable tokenizer.json
        raise GenerateError(f"cannot read {folder / 'tokenizer.json'}: {first_line(exc)}") from None
    if tokenizer is None:
        raise GenerateError(f"{folder} has no tokenizer.json: the weights need their tokenizer")
    if tokenizer.get_vocab_size() != model.vocab_size:
        raise GenerateError(f"{folder}: its tokenizer.json and its weights have different "
                            f"vocabulary sizes")
    return model.to(device).eval(), tokenizer, Config(model=model.cfg)


def check(cfg: GenerateConfig, vocab_size: int) -> None:
    if not cfg.greedy:
        if cfg.temperature <= 0:
            raise GenerateError(f"temperature must be > 0, got {cfg.temperature} (use greedy=true "
                                "for the most likely token)")
        try:
            check_temperature("temperature", cfg.temperature)
        except ValueError as exc:
            raise GenerateError(str(exc)) from None
    if cfg.top_k is not None and not 1 <= cfg.top_k <= vocab_size:
        raise GenerateError(f"top_k must be between 1 and the vocabulary size {vocab_size}, got {cfg.top_k}")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:  # also false for NaN
        raise GenerateError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if not 0 <= cfg.max_new_tokens <= MAX_COUNT:
        raise GenerateError(f"max_new_tokens must be between 0 and {MAX_COUNT:,}, got {cfg.max_new_tokens}")
    if not 1 <= cfg.num_samples <= 1_000_000:
        raise GenerateError(f"num_samples must be between 1 and 1,000,000, got {cfg.num_samples}")
    try:
        check_seed("seed", cfg.seed)
        check_seed("seed + num_samples - 1 (each sample's seed)", cfg.seed + cfg.num_samples - 1)
    except ValueError as exc:
        raise GenerateError(str(exc)) from None


def check_device(name: str) -> torch.device:
    if not (name in ("auto", "cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit())):
        raise GenerateError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise GenerateError(f"device={name}, but no CUDA device is available")
    device = pick_device(name)
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise GenerateError(f"device={name}, but there are {torch.cuda.device_count()} CUDA devices")
    return device


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
        raise GenerateError(f"sampling failed after {len(decoder.ids) - len(prompt_ids)} tokens: "
                            f"{first_line(exc)} (do the weights overflow?)") from None
    pieces.append(decoder.finish())
    out.write(pieces[-1] + "\n")
    return "".join(pieces)


def main(argv: list[str]) -> int:
    try:
        cfg = parse_args(argv)
        device = check_device(cfg.device)
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
        report(exc)
        return 2
    try:
        for i in range(cfg.num_samples):
            if i:
                print("\n" + "-" * 40)
            cfg_i = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), {"seed": cfg.seed + i}))
            stream(model, tokenizer, prompt_ids, cfg_i)
    except GenerateError as exc:
        report(exc)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # quiet flush at exit
        return 0
    return 0


def report(exc: BaseException) -> None:
    message, key = first_line(exc), getattr(exc, "full_key", None)
    print(f"error: {key + ': ' if key and key not in message else ''}{message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
