"""The attention checker against hostile submissions and careless callers, round five (issue 48):
no text a submission chooses (its file's name, the names it defines, its exception messages)
reaches a terminal, a Markdown, CSV or JSON table as anything but inert text; the table is never
written through a link planted at its name; and a submission that links out of the graded
folder is refused.

The fast tests build tables and reports here, or check small files in one shared sandbox host;
the slow ones run the command as an instructor does.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from safeio.cli import FileRefused, UserError
from safeio.files import check_outputs
from helpers import REPO_ROOT, SCRIPT_ENV
from check_helpers import LAYERS, sandbox  # noqa: F401 (a fixture)
from check_attention.grade import (Row, _grade_one, check, csv_text, json_text, markdown,
                                   progress_line, write_table)
from check_attention.options import Options
from check_attention.report import Report

# Unicode's categories of what is not text to show: controls, format characters (bidi overrides,
# zero-width), surrogates (bytes of a name that are not UTF-8), private, unassigned, separators
HIDDEN = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}
LIMIT = 2000  # the longest text of a report (inert.LIMIT)

# What a terminal acts on: ESC moves the cursor and writes PASS over the row, then hides the rest
ANSI_PASS = "\x1b[25GPASS \x1b[72G\x1b[K\x1b[8m"
HOSTILE_NAMES = ["\x1b[2J\x1b[H.py",                        # clears the screen
                 "x.py:Layer PASS (1.0 s)\n[2:2] y.py",     # prints a forged progress line
                 "\u202egnp.py",                            # right-to-left override
                 "=HYPERLINK(\"http:x\",\"ok\").py",        # a formula in a spreadsheet
                 "@SUM(1+1).py", "-2+3.py", "+cmd.py",
                 os.fsdecode(b"\xff\xfe.py"),               # not UTF-8
                 "a|b<script>&`.py"]                        # Markdown and HTML


def shown_raw(text: str) -> list[str]:
    """The characters of text that are not printable text (newlines between lines allowed)."""
    return [c for c in text if c != "\n" and unicodedata.category(c) in HIDDEN]


def hostile_rows() -> list[Row]:
    rows = []
    for i, name in enumerate(HOSTILE_NAMES):
        r = Report(f"{name}:Layer", error=f"importing {name} failed: RuntimeError: {ANSI_PASS}"
                   if i % 2 else None)
        if not i % 2:
            r.set("scale", "FAIL", f"{ANSI_PASS} named {name}")
            r.diagnosis = [f"reproduced \n[9/9] forged.py:Layer PASS {name}" + "x" * 10**6]
        rows.append(Row(name, "Layer" + "\u200f" * 3, r, 1.0))
    return rows


# ----------------------------------------------------------------------------- inert text


def test_inert_shows_each_character_that_is_not_text_as_its_escape():
    from check_attention.inert import csv_cell, inert, markdown_cell
    assert inert("a\x1b[2Jb\n\t\r\x7f\x85\u202e\u2066\u200b\u2028") == \
        "a\\x1b[2Jb\\n\\t\\r\\x7f\\x85\\u202e\\u2066\\u200b\\u2028"
    assert inert(os.fsdecode(b"caf\xc3\xa9 \xff.py")) == "café \\xff.py"  # UTF-8 kept, a byte shown
    assert inert("é漢字 ok") == "é漢字 ok"
    assert inert("x" * 5000) == "x" * (LIMIT - 3) + "..."
    assert inert(inert("\x1b" * 10)) == inert("\x1b" * 10)  # twice is once
    assert csv_cell("=1+2") == "'=1+2" and csv_cell("  @x") == "'  @x"
    assert csv_cell("\t=x") == "\\t=x" and csv_cell("PASS") == "PASS"
    assert markdown_cell("a|b<i>&`c\\") == "a\\|b\\<i\\>\\&\\`c\\\\"


def test_text_from_a_submission_reaches_no_table_raw(tmp_path):
    rows = hostile_rows()
    md = markdown(rows)
    assert shown_raw(md) == []
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the header and one line per row: no forged rows
    assert all(line.count(" | ") == table[0].count(" | ") for line in table)  # no forged cells
    assert "<script>" not in md and "\\<script\\>" in md
    parsed = list(csv.reader(io.StringIO(csv_text(rows))))
    assert len(parsed) == 1 + len(rows)
    for row in parsed:
        for cell in row:
            assert shown_raw(cell) == [] and len(cell) <= LIMIT + 1, cell[:80]
            assert not cell.lstrip(" ").startswith(("=", "+", "-", "@")), cell
    assert parsed[4][0] == "'=HYPERLINK(\"http:x\",\"ok\").py"
    data = json.loads(json_text(rows, "subs", ("Layer",), Options()))
    for row in data["rows"]:
        for text in (row["file"], row["name"], row["error"] or "", row["diagnosis"],
                     *(i["detail"] for i in row["items"].values())):
            assert shown_raw(text) == [] and len(text) <= LIMIT
    assert data["rows"][7]["file"] == "\\xff\\xfe.py"
    for suffix in (".md", ".csv", ".json"):  # a name that is not UTF-8 is written, not a traceback
        write_table(rows, str(tmp_path / f"grades{suffix}"), "subs", ("Layer",), Options())
        assert shown_raw((tmp_path / f"grades{suffix}").read_text()) == []


def test_text_from_a_submission_reaches_no_terminal_raw(capsys):
    for done, row in enumerate(hostile_rows(), 1):
        progress_line(row, done, len(HOSTILE_NAMES))
    err = capsys.readouterr().err
    assert shown_raw(err) == [] and len(err.splitlines()) == len(HOSTILE_NAMES)
    report = Report("x.py:Layer", error=ANSI_PASS)
    report_text = report.text
    report.error = None
    report.set("scale", "FAIL", ANSI_PASS)
    report.header["layer"] = f"{ANSI_PASS}(d_model=64)"
    report.diagnosis = ["a\nverdict: PASS"]
    assert shown_raw(report_text + report.text) == []
    assert report.text.splitlines()[-1] == "verdict: FAIL (1 of 1 checks fail)"
    clean = report.made_inert()  # what check() hands a course's test
    assert "\x1b" not in clean.items["scale"].detail + clean.header["layer"]


def test_an_exception_message_reaches_the_report_inert(sandbox, tmp_path):
    """Through the sandbox, as a submission raises it: the message is shown escaped."""
    (tmp_path / "ansi.py").write_text(f"raise RuntimeError({ANSI_PASS!r})\n")
    report = check(f"{tmp_path}/ansi.py:Layer", sandbox=sandbox)
    assert report.error.startswith("importing ansi.py failed: RuntimeError: \\x1b[25GPASS")
    assert shown_raw(report.error + report.text) == []


# ----------------------------------------------------------------------------- writing out=


@pytest.mark.parametrize("overwrite", [False, True])
def test_out_is_never_written_through_a_link(tmp_path, overwrite):
    """A submitter plants grades.csv in the graded folder as a link, dangling or to a file of
    theirs: the table is refused, before grading and when written, and the target untouched."""
    folder, outside = tmp_path / "subs", tmp_path / "outside"
    folder.mkdir(), outside.mkdir()
    (folder / "grades.csv").symlink_to(outside / "planted.csv")  # dangling
    (folder / "grades.md").symlink_to(outside / "theirs.md")
    (outside / "theirs.md").write_text("theirs\n")
    rows = hostile_rows()[:1]
    for name in ("grades.csv", "grades.md"):
        with pytest.raises(FileRefused, match="is a symbolic link"):
            check_outputs([folder / name], overwrite)
        with pytest.raises(FileRefused, match="is a symbolic link"):
            write_table(rows, str(folder / name), "subs", ("Layer",),
                        Options(overwrite=overwrite))
    assert sorted(p.name for p in outside.iterdir()) == ["theirs.md"]
    assert (outside / "theirs.md").read_text() == "theirs\n"
    assert sorted(p.name for p in folder.iterdir()) == ["grades.csv", "grades.md"]


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_link_planted_while_the_table_is_written_is_not_followed(tmp_path, monkeypatch,
                                                                   overwrite):
    """The race: the name is checked, then a link appears there before the table takes it. The
    table goes to a temporary file opened O_EXCL | O_NOFOLLOW, then takes the name by rename
    (which replaces the link itself) or by link (which refuses a taken name)."""
    import safeio.files as files
    from safeio.files import write_output
    out, target = tmp_path / "grades.csv", tmp_path / "victim.txt"
    target.write_text("victim\n")

    def plant_then_name(n):  # called once the name was found free, before the table is written
        out.symlink_to(target)
        return "0" * 2 * n
    monkeypatch.setattr(files.secrets, "token_hex", plant_then_name)
    if overwrite:
        write_output(out, "table\n", "out=", overwrite=True)
        assert not out.is_symlink() and out.read_text() == "table\n"  # the link was replaced
    else:
        with pytest.raises(UserError, match="appeared while it was written"):
            write_output(out, "table\n", "out=", overwrite=False)
    assert target.read_text() == "victim\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


# ----------------------------------------------------------------------------- submissions


def test_a_submission_linking_out_of_the_folder_is_refused(tmp_path):
    folder, solution = tmp_path / "subs", tmp_path / "solution.py"
    folder.mkdir()
    shutil.copy(LAYERS / "fused.py", solution)
    (folder / "alice.py").symlink_to(solution)
    (folder / "bob.py").symlink_to("../../" * 8 + "etc/passwd")
    shutil.copy(LAYERS / "fused.py", folder / "carol.py")
    (folder / "dave.py").symlink_to("carol.py")  # inside the folder: graded as carol's file
    for name in ("alice.py", "bob.py"):
        row = _grade_one(str(folder / name), ("CausalSelfAttention",), Options())
        assert row.report.outcome == "ERROR"
        assert "is a symbolic link to" in row.diagnosis and "outside the graded folder" in \
            row.diagnosis, row.diagnosis
    from check_attention.grade import outside_link
    assert outside_link(folder / "carol.py") is None and outside_link(folder / "dave.py") is None


# ----------------------------------------------------------------------------- the command (slow)


@pytest.mark.slow
def test_hostile_names_and_messages_through_the_command(tmp_path):
    """As an instructor grades a folder: the terminal (stdout, stderr) and the CSV carry every
    hostile name and message inert, one line per file."""
    folder = tmp_path / "subs"
    folder.mkdir()
    for name in HOSTILE_NAMES:
        shutil.copy(LAYERS / "fused.py", os.path.join(os.fsencode(folder), os.fsencode(name)))
    (folder / "ansi.py").write_text(f"raise RuntimeError({ANSI_PASS!r})\n")
    shutil.copy(LAYERS / "fused.py", folder / "fused.py")  # imported by the copies
    out = tmp_path / "grades.csv"
    result = subprocess.run(
        [sys.executable, "-m", "check_attention", str(folder), "CausalSelfAttention",
         "workers=1", f"out={out}"], cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True,
        timeout=600)
    stdout, stderr = (os.fsdecode(b) for b in (result.stdout, result.stderr))
    assert result.returncode == 1, stderr
    n = len(HOSTILE_NAMES) + 2
    assert shown_raw(stdout) == [] and shown_raw(stderr) == []
    assert len([line for line in stdout.splitlines() if line.startswith("| ")]) == 1 + n
    assert len([line for line in stderr.splitlines() if line.startswith("[")]) == n
    rows = {r["file"]: r for r in csv.DictReader(out.open(encoding="utf-8"))}
    assert rows["ansi.py"]["verdict"] == "ERROR" and rows["\\x1b[2J\\x1b[H.py"]["verdict"] == "PASS"
    assert "\\x1b[25GPASS" in rows["ansi.py"]["diagnosis"]
    assert rows["'=HYPERLINK(\"http:x\",\"ok\").py"]["verdict"] == "PASS"
    assert rows["\\xff\\xfe.py"]["verdict"] == "PASS"
