"""Check anyone's causal self-attention against the cheat sheet: `python -m check_attention
FILE.py[:NAME]` (__main__.py), a course's submissions as one table or a platform's results
(grading/), or from a course's own tests:

    from check_attention import check
    report = check("path/file.py:Name")          # or check(TheClass), check(the_function)
    assert report.passed, report.text

checklist.py holds the checks, one table. sandbox/ runs the file in a child that it shuts in
(a function wrapped as a layer), and checks what the child sends back; layouts.py, variants.py
and diagnosis.py read its weights onto our layer and name the mistake; checks.py runs the
checklist and probes.py the deeper probes, over target.py's one interface to the object;
compare.py and report.py judge and print; costs.py quotes what each mistake it names measurably
costs (docs/pitfall_costs.json, the studies' own file); inert.py makes every text a submission
chose (names, messages) inert before it is shown or written; notebook.py reads notebooks and
a lesson's exercise.

May import: safeio, model, training, guard. (The checker judges against the project's own
equation and pitfall table; your_layer.py puts a learner's layer into the project's GPT and its
runs; sandbox/ imports nothing of the project.)
"""
from __future__ import annotations

import atexit
import inspect
import os
import sys
import threading
from dataclasses import replace
from pathlib import Path

_boxes: dict = {}  # one sandbox host per process and kind, started by the first check()
_boxes_lock = threading.Lock()


def check(target, *, sandbox=None, reads: tuple = (), **options):
    """Check a layer or a scaled dot-product function against the cheat sheet, sandboxed as the
    command does, and return its Report (`.passed`, `.items`, `.diagnosis`, `.text`).

        report = check("path/to/file.py:Name", seq_len=16)   # or check(TheClass)
        assert report.passed, report.text

    options: the command's keys (d_model=, n_head=, dtype=, ...); an unknown key or a value out
    of range is a ValueError (safeio.cli.UserError), a target or a sandbox of the wrong type a
    TypeError. A file or object that cannot be used gives a report whose `.error` says why.
    Checks share one sandbox host per process unless one is given; calls from several threads
    take their turns (checks.check), and the caller's random states are left as they were.
    reads: folders the checked code may read beyond its file's (check_exercise: the kernel's).
    Imports torch when called, so that `--help` and a mistyped command never wait for it."""
    from safeio.cli import UserError
    from check_attention.checks import check_file, sandbox_for
    from check_attention.options import Options, check_options
    from check_attention.report import Report
    from check_attention.sandbox.host import Sandbox
    file, name, fingerprint = resolve(target)
    unknown = sorted(set(options) - set(Options.__dataclass_fields__))
    if unknown:
        raise UserError(f"unknown option {unknown[0]!r} (known: "
                        f"{', '.join(Options.__dataclass_fields__)})")
    given = next((k for k in ("workers", "out", "format", "weights")
                  if options.get(k) is not None), None)
    if given:
        raise UserError(f"{given}= is for grading a folder (python -m check_attention FOLDER NAME "
                        f"...); check() checks one object and returns the report")
    if sandbox is not None and not isinstance(sandbox, Sandbox):
        raise TypeError(f"sandbox= takes a check_attention.sandbox.host.Sandbox or None, got "
                        f"{type(sandbox).__name__}")
    opts = check_options(replace(Options(), **options))
    if not Path(file).is_file():
        return Report(f"{file}:{name}", error=f"{file}: no such file").made_inert()
    if sandbox is None:
        key = (opts.device != "cpu", opts.memory, tuple(reads))
        with _boxes_lock:  # the process's host for that device, memory and reads
            sandbox = _boxes.get(key)
            if sandbox is None or sandbox.closed:
                sandbox = _boxes[key] = sandbox_for(opts, reads)
                atexit.register(sandbox.close)
    return check_file(file, name, opts, sandbox, fingerprint)


def resolve(target) -> tuple[str, str, object]:
    """"path/file.py:Name", or the class or function itself -> (file, name, fingerprint). An
    object is looked up by identity among its module's top-level names (its `__name__` is only
    what someone set: a wrong class may carry a right one's), and its fingerprint (what it is
    made of: runner.fingerprint) goes with it, so that the sandbox judges that very object or
    says it found another under that name."""
    if isinstance(target, (str, os.PathLike)):
        file, sep, name = str(target).rpartition(":")
        if not sep or not file.endswith(".py") or not name.isidentifier():
            raise ValueError(f"check() takes 'path/file.py:Name' or the class or function "
                             f"itself, got {str(target)!r}")
        return file, name, None
    obj = target
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        raise TypeError(f"check() takes a class, a function or 'path/file.py:Name', got "
                        f"{type(obj).__name__} (the checker builds the layer itself: pass its "
                        f"class, or a factory function)")
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    bound = [n for n, v in list(vars(module).items()) if v is obj] if module else []
    if not bound:
        raise ValueError(f"{obj.__qualname__} is not bound at the top level of its file; the "
                         f"checker imports the file and looks the object up there by name")
    file = getattr(module, "__file__", None)
    if not file or not file.endswith(".py"):
        raise ValueError(f"{obj.__qualname__} has no .py file the checker could import")
    from check_attention.sandbox.runner import fingerprint
    return file, obj.__name__ if obj.__name__ in bound else bound[0], fingerprint(obj)
