"""Check your own attention layer against the cheat sheet's checklist.

    python -m scripts.check_attention path/to/file.py:Name [key=value ...]

Name is a causal self-attention nn.Module class, built as Name(d_model, n_head) (or with the
usual spellings: n_embd, num_heads, embed_dim, head_size, a nanoGPT-style config, ...), a
zero-argument factory returning one, or a scaled dot-product function f(q, k, v, mask). Prints
one PASS / FAIL line per checklist item, then causality and "matches the equation", a
diagnosis naming the mistake, and a verdict. Exit status: 0 every check passes, 1 a check fails
or could not be judged, 2 the file or object cannot be used (one `error:` line). The file runs
in a sandboxed child process; see docs/check_attention.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

from scripts.check_attention.options import (DTYPES, HELP, MASKS, MAX_PROBE_BYTES, RANGES,
                                             Options, probe_bytes)

USAGE = "usage: python -m scripts.check_attention FILE.py:NAME [key=value ...]"
# (an argument ending in .py:NAME is the file, even with '=' in its path)


class UsageError(Exception):
    pass


def is_target(arg: str) -> bool:
    """FILE.py:NAME, whatever the path holds ('=' included); every other argument with '=' is an
    option."""
    file, sep, name = arg.rpartition(":")
    return "=" not in arg or bool(sep and file.endswith(".py") and name.isidentifier())


def number(key: str, value: str):
    """The option's value, within RANGES[key], or a UsageError saying the range."""
    lo, hi = RANGES[key]
    kind = type(getattr(Options(), key))
    words = (f"{key} must be a number of seconds above 0 and at most {hi:,g}" if kind is float
             else f"{key} must be a whole number from {lo:,} to {hi:,}")
    try:
        got = kind(value)
    except ValueError:
        raise UsageError(f"{words}, got {value!r}") from None
    if not (lo < got <= hi if kind is float else lo <= got <= hi):  # also refuses nan and inf
        raise UsageError(f"{words}, got {value}")
    return got


def parse_args(argv: list[str]):
    """FILE.py:NAME and key=value options -> (file, name, Options). Raises UsageError."""
    targets = [a for a in argv if is_target(a)]
    if len(targets) != 1:
        raise UsageError(("give one FILE.py:NAME" if not targets else
                          f"one FILE.py:NAME at a time, got {len(targets)}: "
                          + " ".join(targets)) + f" ({USAGE})")
    file, sep, name = targets[0].rpartition(":")
    if not sep or not file or not name.isidentifier():
        raise UsageError(f"the target must be FILE.py:NAME, got {targets[0]!r}")
    path = Path(file)
    if path.suffix != ".py":
        raise UsageError(f"{file} is not a .py file")
    if not path.is_file():
        raise UsageError(f"{file}: no such file")
    opts = Options()
    for arg in argv:
        if arg == targets[0]:
            continue
        key, _, value = arg.partition("=")
        if key not in HELP:
            raise UsageError(f"unknown key {key!r} (known: {', '.join(HELP)})")
        if key == "dtype":
            if value not in DTYPES:
                raise UsageError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
        elif key == "mask":
            if value not in (*MASKS, "auto"):
                raise UsageError(f"mask must be keep, drop, add or auto, got {value!r}")
        elif key == "device":
            if not value:
                raise UsageError("device must be cpu, cuda or cuda:N")
        else:
            value = number(key, value)
        setattr(opts, key, value)
    if opts.d_model % opts.n_head:
        raise UsageError(f"d_model ({opts.d_model}) must be divisible by n_head ({opts.n_head})")
    need = probe_bytes(opts)
    if need > MAX_PROBE_BYTES:
        raise UsageError(f"seq_len={opts.seq_len}, batch={opts.batch} and d_model={opts.d_model} "
                         f"need about {need / 2**30:.1f} GiB for the causality probes "
                         f"(seq_len^2 x batch x d_model x 32 bytes); the limit is "
                         f"{MAX_PROBE_BYTES / 2**30:g} GiB: lower one of them")
    return str(path), name, opts


def fail(exc: Exception) -> int:
    """The one error path: a single `error:` line on stderr, exit status 2."""
    print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip().split("\n\n")[0] + "\n\n" + USAGE)
        for key, words in HELP.items():
            default = getattr(Options(), key)
            lo, hi = RANGES.get(key, (None, None))
            limits = ("" if lo is None else f" (above 0, at most {hi:,g})" if isinstance(lo, float)
                      else f" ({lo:,} to {hi:,})")
            print(f"  {key + '=' + ('as_built' if default is None else str(default)):<18} {words}"
                  f"{limits}")
        return 0
    try:
        file, name, opts = parse_args(argv)
    except UsageError as exc:
        return fail(exc)
    from scripts.check_attention.sandbox import Sandbox

    sandbox = Sandbox(gpu=opts.device != "cpu")  # imports torch while we do
    try:
        from scripts.check_attention.checks import CheckError, check
        report = check(file, name, opts, sandbox=sandbox)
    except CheckError as exc:
        return fail(exc)
    finally:
        sandbox.close()
    print("\n".join(report.lines()))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
