"""One student's submission graded for a course platform: Gradescope's results.json,
PrairieLearn's results.json, or JUnit XML, with points and visibility per check (weights.py).
The results file is written first, saying the grader did not finish, then replaced, so that it
exists whatever happens; a grader started as root (as both platforms run it) runs the check
again as `nobody`, handed only the submission's path (`as_unprivileged`). Scores and what the
student reads: docs/grading.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import fields
from pathlib import Path
from typing import Optional

from safeio.cli import UserError
from safeio.files import read_json, read_text, write_output
from check_attention import costs
from check_attention.checklist import words
from check_attention.grading.grade import Graded, judge
from check_attention.grading.submission import several_students
from check_attention.grading.weights import MAX_WEIGHTS_BYTES, Weight, load_weights
from check_attention.options import Options
from check_attention.report import Report

# Where each platform reads the result (and the folder that says the grader runs in its layout).
PLACES = {"gradescope": Path("/autograder/results/results.json"),
          "prairielearn": Path("/grade/results/results.json")}
# PrairieLearn reads at most 1 MB; a results file stays below it with room to spare.
MAX_RESULTS_BYTES = 900_000
UNPRIVILEGED_USER = "nobody"
AS_USER_ENV = "CHECK_ATTENTION_UNPRIVILEGED"  # set in the re-run, which must not re-run again
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _text(status: str, detail: str) -> str:
    """What the student reads under a check's name."""
    if status == "N/A":
        return f"Not applicable to this submission, so counted as passed: {detail}"
    if status == "SKIP":
        return f"Could not be judged, so no points: {detail}"
    return f"{'Passed' if status == 'PASS' else 'Failed'}: {detail}".rstrip(": ")


def summary(graded: Graded, weights: dict[str, Weight]) -> str:
    """The text above the tests, what a student reads: the verdict, the mistake and its fix,
    its measured cost in a sentence, what does not apply and why, what the notebook reader left
    out, and the seed that reproduces the run."""
    r = graded.report
    out = [f"check_attention on {graded.student}: `{graded.name}`"
           + (f" in {graded.file}" if graded.file else "")]
    if r.error is not None:
        out.append(f"Not graded: {r.error}")
    else:
        table = costs.load()
        out += [f"Verdict: {r.verdict}"] + [f"Diagnosis: {d}" for d in graded.told()]
        out += filter(None, (costs.plain(s, table) for s in r.mistakes))
        out += [f"Not applicable ({key}), counted as passed: {detail}"
                for key, status, detail, *_ in graded.lines(weights) if status == "N/A"]
    out += [f"Notebook: {n}" for n in graded.notes]
    out.append(f"Random probes seeded with seed={graded.seed} "
               f"(python -m check_attention FILE:{graded.name} seed={graded.seed} reproduces them)")
    return "\n".join(out)


# ----------------------------------------------------------------------------- the formats


def gradescope(graded: Graded, weights: dict[str, Weight]) -> dict:
    """Gradescope's results.json (autograder_samples docs/specs.md): the score is the tests' sum,
    out of the assignment's full total."""
    earned, full = graded.score(weights)
    out = {"score": earned, "output": summary(graded, weights),
           "execution_time": round(graded.seconds),
           "extra_data": {"seed": graded.seed, "verdict": graded.report.outcome}}
    if graded.report.error is not None:
        out["extra_data"]["gradable"] = graded.gradable
        out["tests"] = [{"name": "The submission can be checked", "score": 0.0,
                         "max_score": full, "status": "failed", "output": graded.report.error,
                         "visibility": "visible"}]
        return out
    kind = graded.report.kind
    out["tests"] = [{"name": words(key, kind), "number": str(i), "score": got, "max_score": points,
                     "status": "passed" if status in ("PASS", "N/A") else "failed",
                     "output": _text(status, detail), "tags": [key],
                     "visibility": weights[key].visibility}
                    for i, (key, status, detail, got, points) in enumerate(
                        graded.lines(weights), 1)]
    return out


def prairielearn(graded: Graded, weights: dict[str, Weight]) -> dict:
    """PrairieLearn's results.json (docs/externalGrading.md): score in [0, 1]; a submission that
    cannot be imported is `gradable: false` (no points lost, no attempt used). PrairieLearn has no
    visibility per test: a check not `visible` is listed with its points, its details withheld."""
    message = summary(graded, weights)
    if graded.report.error is not None:
        return {"gradable": False, "score": 0.0, "message": message,
                "format_errors": [graded.report.error]} if not graded.gradable else {
            "gradable": True, "score": 0.0, "message": message, "tests": []}
    earned, full = graded.score(weights)
    withheld = "Details are shown after the due date."
    return {"gradable": True, "score": round(earned / full, 6) if full else 0.0,
            "message": message,
            "tests": [{"name": words(key, graded.report.kind), "description": key, "points": got,
                       "max_points": points, "message": _text(status, detail)
                       if weights[key].visibility == "visible" or status == "N/A" else withheld}
                      for key, status, detail, got, points in graded.lines(weights)]}


def junit(graded: Graded, weights: dict[str, Weight]) -> str:
    """JUnit XML as `pytest --junitxml` writes it: a testcase per check (failure, skipped), or
    one error for a submission the checker could not use; the seed as a property."""
    error = graded.report.error
    rows = graded.lines(weights) if error is None else []
    suite = ET.Element("testsuite", name="check_attention", tests=str(max(len(rows), 1)),
                       failures=str(sum(r[1] == "FAIL" for r in rows)),
                       errors=str(int(error is not None)),
                       skipped=str(sum(r[1] in ("SKIP", "N/A") for r in rows)),
                       time=f"{graded.seconds:.2f}")
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="seed", value=str(graded.seed))
    ET.SubElement(props, "property", name="submission", value=graded.student)
    if error is not None:
        case = ET.SubElement(suite, "testcase", classname=f"check_attention.{graded.name}",
                             name="load")
        ET.SubElement(case, "error", message=error).text = error
    for key, status, detail, *_ in rows:
        case = ET.SubElement(suite, "testcase", classname=f"check_attention.{graded.name}",
                             name=key)
        if status == "FAIL":
            ET.SubElement(case, "failure", message=detail).text = _text(status, detail)
        elif status in ("SKIP", "N/A"):
            ET.SubElement(case, "skipped", message=_text(status, detail))
    top = ET.Element("testsuites")
    top.append(suite)
    return ET.tostring(top, encoding="unicode", xml_declaration=True) + "\n"


def capped(payload: dict, limit: int = MAX_RESULTS_BYTES) -> str:
    """The results as JSON text of at most `limit` bytes: the longest texts are cut (halved, with
    a note) until it fits. Each text is already cut at 2,000 characters (inert.py), so only an
    instructor's odd weights table or a huge notebook's notes could need this."""
    def text() -> str:
        return json.dumps(payload, indent=2, ensure_ascii=False) + "\n"
    out = text()
    while len(out.encode()) > limit:
        holders = [payload] + list(payload.get("tests", []))
        key, holder = max(((k, h) for h in holders for k, v in h.items() if isinstance(v, str)),
                          key=lambda kh: len(kh[1][kh[0]]))
        value = holder[key]
        if len(value) < 64:
            payload["tests"] = payload.get("tests", [])[: len(payload.get("tests", [])) // 2]
        else:
            holder[key] = value[: len(value) // 2] + " [cut: the results file stays below 1 MB]"
        out = text()
    return out


def render(graded: Graded, fmt: str, weights: dict[str, Weight]) -> str:
    if fmt == "junit":
        return junit(graded, weights)
    return capped((gradescope if fmt == "gradescope" else prairielearn)(graded, weights))


def failed_result(fmt: str, reason: str, seed: int) -> str:
    """The file written before anything else, and when the grader itself fails."""
    graded = Graded("submission", "?", Report("submission", error=reason), gradable=False,
                    seed=seed)
    return render(graded, fmt, load_weights(None))


# ----------------------------------------------------------------------------- the command


def results_path(opts: Options) -> Path:
    """out=, else the place the platform reads, when the grader runs in the platform's layout."""
    if opts.out:
        return Path(opts.out)
    if opts.format == "junit":
        return Path("junit.xml")
    place = PLACES[opts.format]
    if not place.parents[1].is_dir():
        raise UserError(f"format={opts.format} writes {place}, but {place.parents[1]} does not "
                        f"exist here (not the platform's layout): give out=results.json")
    return place


def run(submission: str, names: tuple[str, ...], opts: Options) -> int:
    """Grade one submission into the platform's file; the file exists whatever happens after the
    first write. An existing out= is replaced only with overwrite=true (the platform's own place
    always). Exit status: 0 when the results file holds a grade, 1 when it says why not."""
    path = results_path(opts)
    def write(text: str, overwrite: bool = True) -> None:
        write_output(path, text, "out=", overwrite)
    write(failed_result(opts.format, "the grader did not finish (killed, out of time or out of "
                                     "memory?)", opts.seed), opts.overwrite or not opts.out)
    try:
        weights = load_weights(opts.weights)
        if os.geteuid() == 0 and not os.environ.get(AS_USER_ENV):
            text, graded_ok = as_unprivileged(submission, names, opts)
        else:
            several = several_students(Path(submission), names)
            if several:
                raise UserError(
                    f"{submission} holds {len(several)} students' submissions ("
                    f"{', '.join(several[:3])}{', ...' * (len(several) > 3)}); format= grades "
                    f"one: give it one student's folder, or grade them all into a table with "
                    f"python -m check_attention {submission} {' '.join(names)} out=grades.csv")
            graded = judge(Path(submission), names, opts)
            print(graded.report.text if graded.report.error is None else
                  f"not graded: {graded.report.error}")
            text, graded_ok = render(graded, opts.format, weights), graded.report.error is None
    except UserError as exc:  # the instructor's weights file, say
        write(failed_result(opts.format, f"the grader is misconfigured: {exc}", opts.seed))
        raise
    except BaseException as exc:
        write(failed_result(opts.format, f"the grader failed: {type(exc).__name__}: {exc}",
                            opts.seed))
        raise
    write(text)
    print(f"wrote {path} (seed {opts.seed})", file=sys.stderr)
    return 0 if graded_ok else 1


def option_args(opts: Options, **override) -> list[str]:
    """opts as the command's key=value arguments (those that differ from the defaults)."""
    default, out = Options(), []
    for f in fields(Options):
        value = override.get(f.name, getattr(opts, f.name))
        if value == getattr(default, f.name):
            continue
        text = ("null" if value is None else str(value).lower() if isinstance(value, bool)
                else str(value))
        out.append(f"{f.name}={text}")
    return out


def as_unprivileged(submission: str, names: tuple[str, ...], opts: Options,
                    command: Optional[list] = None) -> tuple[str, bool]:
    """Run this grading again as `nobody`, handed the submission's path (root never opens, copies
    or follows anything of it), in a folder of its own (its HOME and TMPDIR); return the results
    it wrote (read without following a link, checked) and whether they hold a grade. command:
    what runs as nobody (default: `-m check_attention`), given the path, names and options."""
    user = pwd.getpwnam(UNPRIVILEGED_USER)
    with tempfile.TemporaryDirectory(prefix="check_attention-grading-") as work:
        weights = None
        if opts.weights:  # the instructor's file, which nobody may not read: handed over
            weights = Path(work) / "weights.txt"
            weights.write_text(read_text(Path(opts.weights), "weights=", MAX_WEIGHTS_BYTES))
            weights.chmod(0o644)
        os.chown(work, user.pw_uid, user.pw_gid)
        out = Path(work) / ("results.xml" if opts.format == "junit" else "results.json")
        env = dict(os.environ, HOME=work, TMPDIR=work, **{AS_USER_ENV: "1"})
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PROJECT_ROOT),
                                                        env.get("PYTHONPATH", "")] if p)
        args = option_args(opts, out=str(out), weights=None if weights is None else str(weights))
        proc = subprocess.Popen(
            [*(command or [sys.executable, "-m", "check_attention"]),
             str(Path(submission).absolute()), *names, *args], cwd=work,
            env=env, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        log = b""
        try:
            log, _ = proc.communicate(timeout=opts.timeout + 300)
        except BaseException as exc:
            # Out of time: killed (its first results say it did not finish). A signal to us:
            # SIGTERM first, so that its sandbox's host ends every check it runs, then SIGKILL.
            late = isinstance(exc, subprocess.TimeoutExpired)
            for sig in [signal.SIGKILL] if late else [signal.SIGTERM, signal.SIGKILL]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    log, _ = proc.communicate(timeout=1)
                    break
            if not late:
                raise
        sys.stdout.write(log.decode("utf-8", "replace")[-20_000:])  # instructors' log only
        try:
            if opts.format == "junit":
                text = read_text(out, "results", MAX_RESULTS_BYTES, follow=False)
                ET.fromstring(text)
                return text, proc.returncode == 0
            return capped(read_json(out, "results", MAX_RESULTS_BYTES, follow=False)), \
                proc.returncode == 0
        except (OSError, ValueError, ET.ParseError) as exc:
            return failed_result(opts.format, f"the grader's unprivileged run left no results "
                                              f"(exit status {proc.returncode}): {exc}",
                                 opts.seed), False
