"""What a check can be told: the options, their defaults and what each means (no torch here,
so that a mistyped command is refused at once)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DTYPES = ("float32", "float64", "bfloat16", "float16")
MASKS = {"keep": "boolean, True = may attend", "drop": "boolean, True = masked out",
         "add": "additive, 0 or -inf added to the scores"}


@dataclass
class Options:
    d_model: int = 64
    n_head: int = 4
    seq_len: int = 8
    batch: int = 2
    seed: int = 0
    dtype: Optional[str] = None
    device: str = "cpu"
    mask: str = "auto"
    timeout: float = 120.0


# The range of each number, and why its ends are where they are. The causality check runs the
# layer once per position, so its probes hold seq_len^2 x batch x d_model numbers: seq_len 256
# took 60 s and 0.44 GB on a busy 2-core machine (2026-12-02), and both grow with its square.
RANGES = {"d_model": (1, 8192), "n_head": (1, 8192), "seq_len": (2, 512), "batch": (1, 64),
          "seed": (0, 2**64 - 1),  # what torch.manual_seed takes
          "timeout": (0.0, 86400.0)}  # seconds, above 0: a day at most
MAX_PROBE_BYTES = 2 << 30


def probe_bytes(opts: Options) -> int:
    """About what the causality probes need: seq_len inputs of [batch, seq_len, d_model] and the
    outputs, in float64, held by the checker and by the layer's process (4 copies)."""
    return 4 * 8 * opts.seq_len ** 2 * opts.batch * opts.d_model


HELP = {
    "d_model": "width the layer is built with and fed (read from the layer if it takes none)",
    "n_head": "heads the layer is built with; the shape check also tries other counts",
    "seq_len": "positions per probe sequence (also passed as block_size / context length); "
               "time and memory grow with its square",
    "batch": "sequences per probe batch",
    "seed": "seed of the random probe inputs",
    "dtype": f"cast the layer to {', '.join(DTYPES)} (default: as built); the tolerance "
             f"follows the dtype",
    "device": "where the layer runs: cpu, cuda, cuda:1, ...",
    "mask": "a function's mask convention: keep (True = may attend), drop (True = masked), "
            "add (0 / -inf added to the scores), or auto (found by trying all three)",
    "timeout": "seconds the layer's code may take in all before it is stopped",
}
