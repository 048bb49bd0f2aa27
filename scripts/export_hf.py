"""Export a training run as a Hugging Face folder that transformers loads offline.

    python -m scripts.export_hf run=runs/<dir> out=exports/<name> [weights=best|latest]
    python -m scripts.export_hf run=runs/latest out=exports/<name>     # the newest run

The folder is written as the transformers architecture that computes the run's model: GPT-2
for GPT-2's switches (`+arch=gpt2`; interop/hf.py), Llama for rope + rmsnorm + swiglu (grouped
key/value heads, tied head or not; interop/hf_llama.py), Qwen3 for that with qk_norm. It holds
config.json, model.safetensors, the run's tokenizer.json and a tokenizer_config.json; exporting
needs no transformers. It is written under a temporary name and renamed into place, so a failed
export leaves nothing at `out`. A run no architecture expresses is refused, naming what
(docs/huggingface.md); any mistake is one `error:` line and exit status 2.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import MISSING
from safetensors.torch import save

from data.tokenizer import EOS, UNK
from safeio.cli import FormatError, UserError, parse_key_values, run_cli
from safeio.corpus import MAX_TOKENIZER_BYTES
from safeio.files import read_bytes
from guard.run_dir import load_run, resolve_latest
from model.config import AttentionConfig, ModelConfig
from interop.hf import (CONFIG, TOKENIZER, TOKENIZER_CONFIG, WEIGHTS, check_exportable, gpt2_config,
                        gpt2_problems, to_gpt2_state_dict, tokenizer_config)
from interop.hf_llama import (LLAMA, QWEN3, Architecture, check_llama_exportable, llama_config,
                              llama_problems, to_llama_state_dict)
from guard.weights_choice import choose_weights

USAGE = "usage: python -m scripts.export_hf run=RUN_DIR out=OUT_DIR [weights=best|latest]"


@dataclass
class ExportArgs:
    run: str = MISSING      # a run directory of train.py (runs/latest: the newest run)
    out: str = MISSING      # the folder to write: new, or empty
    weights: str = "best"   # best (lowest validation loss) | latest (the last checkpoint)


def check_out_dir(out: Path) -> None:
    """The export goes to a new or empty directory: never over anything already there."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"out={out} exists and is not a directory")
        if any(out.iterdir()):
            raise UserError(f"out={out} exists and is not empty; give a new directory")
    parent = out.absolute().parent
    if parent.exists() and not parent.is_dir():
        raise UserError(f"out={out}: {parent} is not a directory")


GPT2 = "GPT-2"


def architecture_for(model_cfg: ModelConfig, attn_cfg: AttentionConfig) -> "str | Architecture":
    """GPT2, LLAMA or QWEN3: the transformers architecture that computes this model, checked
    (its attention variant too); when none does, FormatError in one line naming the switches
    that the nearest architectures (the fewest such switches) lack."""
    candidates = {GPT2: gpt2_problems(model_cfg), LLAMA: llama_problems(model_cfg, LLAMA),
                  QWEN3: llama_problems(model_cfg, QWEN3)}
    if not candidates[GPT2]:
        check_exportable(model_cfg, attn_cfg)  # GPT-2's own messages
        return GPT2
    for arch in (LLAMA, QWEN3):
        if not candidates[arch]:
            check_llama_exportable(model_cfg, attn_cfg, arch)
            return arch
    fewest = min(len(problems) for problems in candidates.values())
    nearest = [a for a, problems in candidates.items() if len(problems) == fewest]
    raise FormatError("no transformers architecture computes this model; the nearest: " + "; ".join(
        f"as {getattr(a, 'name', a)}, {', '.join(candidates[a])}" for a in nearest))


def export(run_dir: Path, out: Path, weights: str = "best") -> Path:
    """Write the folder (GPT-2, Llama or Qwen3) for run_dir's `weights` checkpoint at out;
    returns out."""
    check_out_dir(out)
    model, tokenizer, run_cfg = load_run(run_dir, weights, torch.device("cpu"))
    arch = architecture_for(run_cfg.model, run_cfg.attention)
    vocab = tokenizer.get_vocab()
    special = {name: token for name, token in (("eos_token", EOS), ("unk_token", UNK))
               if token in vocab}
    if arch == GPT2:
        config = gpt2_config(run_cfg.model, tokenizer.get_vocab_size(), vocab.get(EOS))
        tensors = to_gpt2_state_dict(model)
    else:
        config = llama_config(run_cfg.model, tokenizer.get_vocab_size(), vocab.get(EOS), arch)
        tensors = to_llama_state_dict(model, arch)
    files = {CONFIG: config, TOKENIZER_CONFIG: tokenizer_config(special, run_cfg.model.block_size)}

    payloads = {name: (json.dumps(content, indent=2) + "\n").encode("utf-8")
                for name, content in files.items()}
    payloads[WEIGHTS] = save(tensors, metadata={"format": "pt"})  # as transformers writes
    # the very file the run encoded with
    payloads[TOKENIZER] = read_bytes(run_dir / TOKENIZER, "tokenizer", MAX_TOKENIZER_BYTES)
    try:
        out.absolute().parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.absolute().parent))
    except OSError as exc:
        raise UserError(f"cannot write the export to {out}: {exc.strerror}") from None
    try:
        for name, payload in payloads.items():
            with open(tmp / name, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
        _usual_permissions(tmp)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except OSError as exc:  # a full disk, a quota, a read-only file system
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write the export to {out}: {exc.strerror or exc}; nothing was "
                        f"left there") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _usual_permissions(folder: Path) -> None:
    """mkdtemp makes a private (0700) directory: give it, and its files, the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def main(argv: list[str]) -> int:
    def body() -> None:
        args = parse_key_values(argv, ExportArgs, USAGE, about=__doc__.split("\n\n")[0])
        run = resolve_latest(Path(args.run))
        chosen = choose_weights(run, args.weights)
        out = export(run, Path(args.out), "best" if chosen.kind == "folder" else chosen.kind)
        print(f"exported {run}, {chosen.describe()}, to {out}")
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
