"""What a check can be told: the options, their defaults, their ranges, and what each means (the
comment on each field is its line of `--help`, guard/key_help.py). No torch here, so that a
mistyped command is refused at once."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

from safeio.cli import UserError

DTYPES = ("float32", "float64", "bfloat16", "float16")
MASKS = {"keep": "boolean, True = may attend", "drop": "boolean, True = masked out",
         "add": "additive, 0 or -inf added to the scores"}
OUTPUTS = (".md", ".csv", ".json")  # the formats of a grading table, by out='s extension
# one submission's results for a course platform (platforms.py), and the file each writes
FORMATS = {"gradescope": ".json", "prairielearn": ".json", "junit": ".xml"}


@dataclass
class Options:
    # width the layer is built with and fed (read from the layer if it takes none), 1 to 8,192
    d_model: int = 64
    # heads the layer is built with (dividing d_model); the shape check also tries other counts
    n_head: int = 4
    # positions per probe sequence (also passed as block_size / context length), 2 to 512; the
    # causality check runs the layer once per position, so time and memory grow with its square
    seq_len: int = 8
    batch: int = 2           # sequences per probe batch, 1 to 64
    # seed of the random probe inputs and of the layer's initial weights, 0 to 2^64 - 1
    seed: int = 0
    # cast the layer to float32, float64, bfloat16 or float16 (null: as built); the tolerance
    # follows the dtype
    dtype: Optional[str] = None
    device: str = "cpu"      # where the layer runs: cpu, cuda, cuda:1, ...
    # a function's mask convention: keep (True = may attend), drop (True = masked), add (0 / -inf
    # added to the scores), or auto (found by trying all three)
    mask: str = "auto"
    # the layer holds weights trained in transformers' Llama layout (query head i reads key/value
    # head i // (n_head / n_kv_head); rotary pairs (j, j + d_k/2)): tiled heads and interleaved
    # pairs then fail
    llama_weights: bool = False
    # seconds the layer's code may take in all before it is stopped (above 0, at most 86,400)
    timeout: float = 120.0
    # GiB of memory the layer's process may map beyond what the sandbox's host already holds
    # (above 0, at most 1,024; null: no limit; on cpu only: CUDA maps more than it uses)
    memory: Optional[float] = 4.0
    # grading a folder: processes checking files at once (null: one per CPU core), 1 to 256
    workers: Optional[int] = None
    # grading a folder: also write the table to this .md, .csv or .json file (with format=:
    # where the results go, .json or .xml)
    out: Optional[str] = None
    overwrite: bool = False    # replace out= if it exists (as every script: safeio/files.py)
    # grade one submission (a folder, a .py file or a notebook) for a platform: gradescope,
    # prairielearn or junit, written to out= or where the platform reads it (docs/grading.md)
    format: Optional[str] = None
    # grading: a file of `check = points [visibility]` lines (default: docs/grading.md's table)
    weights: Optional[str] = None
    verbose: bool = False      # one file's report: also how the sandbox shuts the code in


# The range of each number, and why its ends are where they are. The causality check runs the
# layer once per position, so its probes hold seq_len^2 x batch x d_model numbers: seq_len 256
# took 60 s and 0.44 GB on a busy 2-core machine (2026-12-02), and both grow with its square.
RANGES = {"d_model": (1, 8192), "n_head": (1, 8192), "seq_len": (2, 512), "batch": (1, 64),
          "seed": (0, 2**64 - 1),  # what torch.manual_seed takes
          "workers": (1, 256),
          "timeout": (0.0, 86400.0),  # seconds, above 0: a day at most
          "memory": (0.0, 1024.0)}  # GiB, above 0
MAX_PROBE_BYTES = 2 << 30
GRADING_ONLY = ("workers", "out", "weights")  # keys that mean something only for grading


def probe_bytes(opts: Options) -> int:
    """About what the causality probes need: seq_len inputs of [batch, seq_len, d_model] and the
    outputs, in float64, held by the checker and by the layer's process (4 copies)."""
    return 4 * 8 * opts.seq_len ** 2 * opts.batch * opts.d_model


def check_options(opts: Options) -> Options:
    """Each value within its real bound (RANGES and the choices above), or a UserError saying the
    bound; checked before anything runs."""
    for key, (lo, hi) in RANGES.items():
        got = getattr(opts, key)
        if got is None and key in ("memory", "workers"):
            continue
        if isinstance(lo, float):  # also refuses nan and inf
            if not (isinstance(got, (int, float)) and not isinstance(got, bool)
                    and math.isfinite(got) and lo < got <= hi):
                unit = "seconds" if key == "timeout" else "GiB"
                raise UserError(f"{key} must be a number of {unit} above 0 and at most {hi:,g}, "
                                f"got {got}")
        elif not (isinstance(got, int) and not isinstance(got, bool) and lo <= got <= hi):
            raise UserError(f"{key} must be a whole number from {lo:,} to {hi:,}, got {got}")
    if opts.dtype is not None and opts.dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {opts.dtype!r}")
    if opts.mask not in (*MASKS, "auto"):
        raise UserError(f"mask must be keep, drop, add or auto, got {opts.mask!r}")
    if not (isinstance(opts.device, str) and re.fullmatch(r"cpu|cuda(:\d+)?|mps", opts.device)):
        raise UserError(f"device must be cpu, cuda, cuda:N or mps, got {opts.device!r}")
    for key in ("overwrite", "llama_weights", "verbose"):
        if not isinstance(getattr(opts, key), bool):
            raise UserError(f"{key} must be true or false, got {getattr(opts, key)!r}")
    if opts.format is not None and opts.format not in FORMATS:
        raise UserError(f"format must be one of {', '.join(FORMATS)}, got {opts.format!r}")
    endings = (FORMATS[opts.format],) if opts.format else OUTPUTS
    if opts.out is not None and not (isinstance(opts.out, str)
                                     and opts.out.lower().endswith(endings)):
        raise UserError(f"out must name a {', '.join(endings)} file"
                        + (f" with format={opts.format}" if opts.format else "")
                        + f", got {opts.out!r}")
    if opts.d_model % opts.n_head:
        raise UserError(f"d_model ({opts.d_model}) must be divisible by n_head ({opts.n_head})")
    need = probe_bytes(opts)
    if need > MAX_PROBE_BYTES:
        raise UserError(f"seq_len={opts.seq_len}, batch={opts.batch} and d_model={opts.d_model} "
                        f"need about {need / 2**30:.1f} GiB for the causality probes "
                        f"(seq_len^2 x batch x d_model x 32 bytes); the limit is "
                        f"{MAX_PROBE_BYTES / 2**30:g} GiB: lower one of them")
    return opts
