"""Check your own attention layer against the cheat sheet's checklist, or grade a course's.

    python -m check_attention path/to/file.py[:Name] [key=value ...]
    python -m check_attention lesson.ipynb[:Name] [key=value ...]
    python -m check_attention submissions/ Name [Name ...] [weights=FILE] [out=grades.csv]
    python -m check_attention SUBMISSION Name [Name ...] format=gradescope [weights=FILE]

Name: an nn.Module class built as Name(d_model, n_head) (or the usual spellings, a nanoGPT
config), a zero-argument factory, or a scaled dot-product function f(q, k, v, mask); without it,
the one class (else function) the file defines. A folder is a course's submissions, graded into
one table; format= grades one submission for a platform. Exit status: 0 every check passes, 1 a
check fails or could not be judged, 2 a mistake in the command or a file that cannot be used (one
`error:` line). docs/check_attention.md and docs/grading.md say the rest.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # `python -m` put the working folder first on the import path: a
    # graded folder's yaml.py would run here at the first import. It leaves the path (unless it
    # is the project's own folder), and the interpreters started here (a grading's workers) too.
    _here, _project = os.getcwd(), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:] = [p for p in sys.path if _here == _project or os.path.abspath(p or ".") != _here]
    os.environ["PYTHONSAFEPATH"] = "1"

from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402
from safeio.cli import UserError, parse_key_values, run_cli  # noqa: E402
from check_attention.options import GRADING_ONLY, Options, check_options  # noqa: E402

USAGE = ("usage: python -m check_attention FILE.py[:NAME] | NOTEBOOK.ipynb[:NAME] | FOLDER NAME "
         "[NAME ...] [key=value ...]")
SOURCES = (".py", ".ipynb")


def is_target(arg: str) -> bool:
    """FILE.py:NAME or NOTEBOOK.ipynb:NAME, whatever the path holds ('=' included), a folder or
    a NAME; every other argument with '=' (or starting with '-') is an option."""
    file, sep, name = arg.rpartition(":")
    if sep and file.endswith(SOURCES) and name.isidentifier():
        return True
    return "=" not in arg and not arg.startswith("-")


def platform_args(targets: list[str], opts: Options) -> tuple[str, tuple, Options]:
    """(SUBMISSION, (NAME, ...), options) for format=: the submission is a folder, a file, or
    FILE:NAME; it need not exist (the platform's results then say it holds nothing)."""
    if opts.workers is not None:
        raise UserError("workers= is for grading a folder of many files; format= grades one "
                        "submission")
    first, rest = targets[0], targets[1:]
    file, sep, name = first.rpartition(":")
    if sep and file.endswith(SOURCES) and name.isidentifier():
        first, rest = file, [name, *rest]
    if not rest:
        raise UserError(f"give the NAME to look for in {first} (several: the first found)")
    bad = next((n for n in rest if not n.isidentifier()), None)
    if bad is not None:
        raise UserError(f"after the submission come the NAMEs to look for, got {bad!r}")
    return first, tuple(rest), opts


def parse_args(argv: list[str]) -> tuple[str, object, Options]:
    """(FILE, NAME or None, options) for one file; (FOLDER, (NAME, ...), options) for a course's
    submissions or a platform's. Raises UserError (SystemExit(0) after --help)."""
    targets = [a for a in argv if is_target(a)]
    opts = check_options(parse_key_values([a for a in argv if not is_target(a)], Options, USAGE,
                                          about=__doc__.split("\n\n")[0]))
    if not targets:
        raise UserError(f"give one FILE.py[:NAME], or a FOLDER and the NAMEs to check ({USAGE})")
    if opts.format is not None:
        return platform_args(targets, opts)
    if Path(targets[0]).is_dir():
        folder, names = targets[0], tuple(targets[1:])
        if not names:
            raise UserError(f"give the NAME to check in each submission of {folder} (several: "
                            f"the first each defines) ({USAGE})")
        bad = next((n for n in names if not n.isidentifier()), None)
        if bad is not None:
            raise UserError(f"after the folder come the NAMEs to check in its submissions, got "
                            f"{bad!r}")
        if not any(p.suffix in SOURCES or p.is_dir() for p in Path(folder).iterdir()):
            raise UserError(f"{folder} holds no .py file, notebook or folder of submissions")
        return folder, names, opts
    if len(targets) != 1:
        raise UserError(f"one FILE.py:NAME at a time, got {len(targets)}: {' '.join(targets)} "
                        f"(a folder of files: FOLDER NAME ...) ({USAGE})")
    file, sep, name = targets[0].rpartition(":")
    if not (sep and file.endswith(SOURCES) and name.isidentifier()):
        file, name = targets[0], None  # FILE.py: the one class or function it defines
    path = Path(file)
    if path.suffix not in SOURCES:
        raise UserError(f"the target must be FILE.py[:NAME] (or a folder and NAMEs), got "
                        f"{targets[0]!r}")
    if not path.exists():  # a FIFO or a device is refused as what it is when it is read
        raise UserError(f"{file}: no such file")
    given = next((k for k in GRADING_ONLY if getattr(opts, k) is not None), None)
    if given:
        raise UserError(f"{given}= is for grading a folder (FOLDER NAME ...); one file's report "
                        f"is printed")
    return str(path), name, opts


def grade_folder(folder: str, names: tuple, opts: Options) -> int:
    from check_attention.grading.grade import grade, markdown, progress_line, write_table
    from check_attention.grading.submission import submissions
    from check_attention.grading.weights import load_weights
    from safeio.files import check_outputs
    if opts.out:
        check_outputs([Path(opts.out)], opts.overwrite)
    weights = load_weights(opts.weights)  # a mistyped file refused before anything runs
    for note in submissions(Path(folder))[1]:
        print(f"note: {note}", file=sys.stderr)
    rows = grade(folder, names, opts, progress=progress_line)
    print(markdown(rows, weights))
    if opts.out:
        write_table(rows, opts.out, folder, names, opts)
        print(f"wrote {opts.out}", file=sys.stderr)
    return 0 if all(row.report.passed for row in rows) else 1


def check_one(path: str, name: Optional[str], opts: Options) -> int:
    """One file's report (without NAME: the one class or function it defines); a notebook is
    checked as the module its code cells define (submission.locate), and its errors name the
    cell."""
    from check_attention.grading.grade import judge
    graded = judge(path, (name,) if name else (), opts)
    if graded.report.error is not None:
        raise UserError(graded.report.error)
    graded.report.target = f"{path}:{graded.name}"
    print(graded.report.text if not opts.verbose else "\n".join(graded.report.lines(True)))
    for note in graded.notes:
        print(f"notebook: {note}")  # inert: a cell's escape sequences shown, not run
    return graded.report.exit_code


def run(argv: list[str]) -> int:
    path, name, opts = parse_args(argv)
    if opts.format is not None:
        from check_attention.grading import platforms
        return platforms.run(path, name, opts)
    if isinstance(name, tuple):
        return grade_folder(path, name, opts)
    return check_one(path, name, opts)


def main(argv: list[str]) -> int:
    return run_cli(lambda: run(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
