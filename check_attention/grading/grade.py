"""Grade submissions: `judge` checks one (a .py file, a notebook, a student's folder) into a
`Graded`, whatever happens (a submission the checker cannot use is a row that says why), and
`grade` a course's export into one table (Markdown, CSV or JSON), one row per student with its
score and diagnosis, spread over `workers=` processes, each with its own sandbox host: the
references are computed in the checker's process, so threads would wait on each other.
"""
from __future__ import annotations

import atexit
import contextlib
import csv
import io
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from safeio.cli import FileRefused
from safeio.files import write_output
from check_attention.checklist import ITEM_WORDS, words
from check_attention.checks import check_file, sandbox_for
from check_attention.costs import PREFIX
from check_attention.grading.submission import NotGradable, locate, outside_link, submissions
from check_attention.grading.weights import Weight, load_weights
from check_attention.inert import NAME_LIMIT, csv_cell, inert, markdown_cell
from check_attention.options import Options
from check_attention.report import Report


@dataclass
class Graded:
    """What grading one submission came to."""

    student: str           # how every table and result names it: its file or folder, or the
    name: str              # names its platform's metadata gives; the object looked for
    report: Report         # `error`: why nothing could be checked
    file: str = ""         # the file checked, as the student knows it ("hw3/attn.py")
    gradable: bool = True  # False: nothing could be imported (PrairieLearn's meaning)
    notes: list = field(default_factory=list)  # what a notebook's reader left out
    seed: int = 0
    seconds: float = 0.0

    def __post_init__(self):
        """Only inert text (inert.py), and the exact names for the JSON table."""
        self.exact = (self.student, self.name)
        self.student, self.name = inert(self.student, NAME_LIMIT), inert(self.name, NAME_LIMIT)
        self.file, self.notes = inert(self.file), [inert(n) for n in self.notes]
        self.report = self.report.made_inert()

    @property
    def diagnosis(self) -> str:
        """Why, in one line: the error, else the diagnosis lines, else the first item that
        failed or could not be judged."""
        r = self.report
        if r.error is not None:
            return r.error
        if r.diagnosis:
            return "; ".join(r.diagnosis)
        return next((f"{key}: {item.detail}" for status in ("FAIL", "SKIP")
                     for key, item in r.items.items() if item.status == status), "")

    def told(self) -> list[str]:
        """What the student reads: the diagnosis, without the studies' statistics."""
        return [d for d in self.report.diagnosis if not d.startswith(PREFIX)]

    def lines(self, weights: dict[str, Weight]) -> list[tuple]:
        """(key, status, detail, points earned, points) for each weighted check, in the
        checklist's order. A check that does not apply to this submission (N/A) earns its
        points and says why: the total is the same for every kind of submission."""
        items, out = self.report.items, []
        for key, w in weights.items():
            if w.points > 0:
                item = items.get(key)
                status, detail = (item.status, item.detail) if item else (
                    "N/A", f"the checker does not run this check on a {self.report.kind}")
                out.append((key, status, detail, float(w.points) * (status in ("PASS", "N/A")),
                            float(w.points)))
        return out

    def score(self, weights: dict[str, Weight]) -> tuple[float, float]:
        """(points earned, rounded to two decimals; the full total)."""
        rows = self.lines(weights) if self.report.error is None else []
        return round(sum(r[3] for r in rows), 2), sum(float(w.points) for w in weights.values())


def judge(submission, names: tuple[str, ...], opts: Options, sandbox=None,
          student: str = "") -> Graded:
    """Find a NAME in the submission and check it (no NAME: the one the file defines); never
    raises (a grader bug is a Graded too)."""
    start, path = time.monotonic(), Path(submission)
    report = Report(f"{path.name}:{names[0] if names else '?'}")
    graded = dict(student=student or path.name, name=names[0] if names else "?",
                  report=report, seed=opts.seed)
    try:
        if student and (refused := outside_link(path)):  # a course's: only its folder's files
            raise FileRefused(refused)
        # the sandbox's host imports torch while the submission is read
        with contextlib.nullcontext(sandbox) if sandbox else sandbox_for(opts) as box, \
                contextlib.ExitStack() as stack:  # a notebook's module: in a folder of its own
            found = locate(path, names, lambda: stack.enter_context(tempfile.TemporaryDirectory(
                prefix="check_attention-submission-")))
            graded.update(name=found.name, file=found.shown, notes=found.notes)
            graded["report"] = report = check_file(str(found.file), found.name, opts, box)
            report.target = f"{found.shown}:{found.name}"
            if report.error is not None:  # nothing imported: PrairieLearn uses no attempt
                graded["gradable"] = not report.error.startswith(("importing ",
                                                                  found.file.name))
                report.error = found.where(report.error)
    except (NotGradable, FileRefused) as exc:
        report.error, graded["gradable"] = str(exc), False
    except Exception as exc:  # noqa: BLE001  (a grader bug: the student still gets a result)
        report.error = f"the grader failed: {type(exc).__name__}: {exc}"
        graded["gradable"] = False
    return Graded(**graded, seconds=time.monotonic() - start)


# ----------------------------------------------------------------------------- a course


_worker_box = None


def _start_worker(opts: Options) -> None:
    """A worker process of grade(): Ctrl-C is the checker's to handle (it ends the workers), and
    SIGTERM ends the worker's sandbox (its host, the check under way and its directory) first."""
    global _worker_box
    from check_attention.sandbox.host import close_all

    def stop(signum, frame):
        # The pool sends SIGTERM again to every worker once one has ended (it counts the pool
        # broken); a second stop inside this one would exit before the sandbox's directory goes.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        close_all()
        os._exit(128 + signum)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    _worker_box = sandbox_for(opts)
    atexit.register(_worker_box.close)


def _judge_in_worker(path: str, names: tuple, opts: Options, student: str) -> Graded:
    return judge(path, names, opts, _worker_box, student)


def grade(folder: str, names: tuple[str, ...], opts: Options, progress=None) -> list[Graded]:
    """A Graded for every submission of the folder (grading/submission.py's layouts), in name
    order, checked `opts.workers` at a time (one per CPU core by default). progress(graded,
    done, total) is called as each is made."""
    found, _ = submissions(Path(folder))
    workers = min(opts.workers or os.cpu_count() or 1, len(found)) or 1
    rows: list = [None] * len(found)

    def record(i: int, row: Graded) -> None:
        rows[i] = row
        if progress:
            progress(row, sum(r is not None for r in rows), len(found))

    if workers == 1:
        with sandbox_for(opts) as box:
            for i, (student, path) in enumerate(found):
                record(i, judge(path, names, opts, box, student))
        return rows
    # spawn: a fresh interpreter per worker (forking a process that holds torch's threads can
    # hang the copy)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_start_worker, initargs=(opts,))
    try:
        futures = {pool.submit(_judge_in_worker, str(path), names, opts, student): i
                   for i, (student, path) in enumerate(found)}
        for future in as_completed(futures):
            i = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # noqa: BLE001  (a worker that died: the row says so)
                row = Graded(found[i][0], names[0] if names else "?", Report(
                    found[i][0], error=f"the checker's worker failed: {type(exc).__name__}: "
                                       f"{exc}"), seed=opts.seed)
            record(i, row)
    except BaseException:  # Ctrl-C, SIGTERM: stop now, not after the submissions still queued
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()  # its sandbox host and child die with it (PR_SET_PDEATHSIG)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return rows


def progress_line(row: Graded, done: int, total: int) -> None:
    print(f"[{done}/{total}] {row.student}: {row.name} {row.report.outcome} "
          f"({row.seconds:.1f} s)", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the table


def item_keys(rows: list[Graded]) -> list[str]:
    """The checklist's items in its order, then any other item a report has."""
    seen = [k for row in rows for k in row.report.items]
    return [k for k in ITEM_WORDS if k in seen] + sorted(set(seen) - set(ITEM_WORDS))


def table(rows: list[Graded], weights: dict) -> tuple[list[str], list[list[str]]]:
    """The header and the cells: student, file, name, score, verdict, each item, diagnosis."""
    keys, full = item_keys(rows), rows[0].score(weights)[1] if rows else 0
    head = ["student", "file", "name", f"score (of {full:g})", "verdict", *keys, "diagnosis"]
    return head, [[r.student, r.file, r.name, f"{r.score(weights)[0]:.2f}", r.report.outcome,
                   *(r.report.items[k].status if k in r.report.items else "" for k in keys),
                   r.diagnosis] for r in rows]


def markdown(rows: list[Graded], weights: dict) -> str:
    """The table in Markdown, each cell through inert.markdown_cell."""
    head, cells = table(rows, weights)
    lines = ["| " + " | ".join(map(markdown_cell, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(map(markdown_cell, row)) + " |" for row in cells]
    counts = sorted(Counter(row.report.outcome for row in rows).items())
    lines += ["", f"{len(rows)} submission{'s' * (len(rows) != 1)}: "
              + ", ".join(f"{n} {outcome}" for outcome, n in counts), ""]
    kinds = {row.report.kind for row in rows if row.report.error is None} or {"module"}
    lines += [f"- {key}: {' / '.join(dict.fromkeys(words(key, k) for k in sorted(kinds)))}"
              for key in item_keys(rows)]
    return "\n".join(lines)


def csv_text(rows: list[Graded], weights: dict) -> str:
    """The table as CSV, each cell through inert.csv_cell (never a formula)."""
    head, cells = table(rows, weights)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows(map(csv_cell, row) for row in [head, *cells])
    return buf.getvalue()


def json_text(rows: list[Graded], folder: str, names: tuple[str, ...], opts: Options,
              weights: dict) -> str:
    """The table as JSON: every row's items with their details, the scores, the verdicts, the
    seconds, and the options used; every text inert (Graded holds only such), but the names
    exact (JSON escapes)."""
    keys = item_keys(rows)
    return json.dumps({
        "folder": inert(folder), "names": [inert(n, NAME_LIMIT) for n in names],
        "options": {k: inert(v) if isinstance(v, str) else v for k, v in vars(opts).items()},
        "items": {k: ITEM_WORDS.get(k, k) for k in keys},
        "rows": [{"student": r.exact[0], "file": r.file, "name": r.exact[1],
                  "score": r.score(weights)[0], "of": r.score(weights)[1],
                  "verdict": r.report.outcome, "summary": r.report.verdict,
                  "error": r.report.error, "items": {k: {"status": i.status, "detail": i.detail}
                                                     for k, i in r.report.items.items()},
                  "diagnosis": r.diagnosis, "seconds": round(r.seconds, 2)} for r in rows]},
        indent=2) + "\n"


def write_table(rows: list[Graded], out: str, folder: str, names: tuple[str, ...],
                opts: Options) -> None:
    """out= in the format its extension names (.md, .csv, .json), written whole and never
    through a symbolic link (safeio.files.write_output: the folder's submitters may have planted
    one at that name)."""
    path, weights = Path(out), load_weights(opts.weights)
    text = {".csv": lambda: csv_text(rows, weights), ".md": lambda: markdown(rows, weights) + "\n",
            ".json": lambda: json_text(rows, folder, names, opts, weights)}[path.suffix.lower()]()
    write_output(path, text, "out=", opts.overwrite)
