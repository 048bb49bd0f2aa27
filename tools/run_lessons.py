"""Run the lessons (lessons/*.ipynb) top to bottom in a fresh kernel, and write their outputs back,
or compare them with the outputs committed.

    python -m tools.run_lessons                       # every lesson, outputs written back
    python -m tools.run_lessons lessons=01,03         # some of them
    python -m tools.run_lessons write=false           # compare only: exit 1 if any output moved

The notebooks are committed with their outputs, so that a learner reads them on the code host
without running anything; this regenerates those outputs, and tests/test_lessons.py fails when
they are not what the current code produces (`differences`). Each lesson runs with nbclient in a
fresh kernel whose folder is lessons/, as `jupyter lab lessons/` would run it, no timing kept.
Outputs compare as a person reads them: text with integers equal and other numbers within
NUMBER_TOLERANCE (float digits differ between CPU kinds), pictures of the same size within
PIXEL_TOLERANCE per pixel on average.
"""
from __future__ import annotations

import base64
import io
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from safeio.cli import UserError, parse_key_values, run_cli

ROOT = Path(__file__).resolve().parents[1]
LESSONS_DIR = ROOT / "lessons"
# |fresh - committed| <= ABS + REL * |committed| for each number in a text output
NUMBER_TOLERANCE = (0.01, 0.02)
PIXEL_TOLERANCE = 0.01  # mean absolute difference of RGB values in [0, 1]
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def lessons(which: Optional[list[str]] = None) -> list[Path]:
    """The lesson notebooks (NN_name.ipynb), in order; `which` keeps those whose number or name
    is listed."""
    found = sorted(LESSONS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if which:
        wanted = {str(w).zfill(2) if str(w).isdigit() else str(w) for w in which}  # 1 or 01
        found = [p for p in found if p.name[:2] in wanted or p.stem in wanted]
    return found


def execute(path: Path, cell_timeout: int = 300):
    """The notebook at path, run top to bottom in a fresh kernel (its folder lessons/): the
    nbformat object with its new outputs. Raises UserError, in one line, on a cell that fails
    or a kernel that dies (Ctrl-C while it starts kills it)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, DeadKernelError
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=cell_timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}},
                            record_timing=False)
    try:
        client.execute(stderr=subprocess.DEVNULL)  # the kernel's own log (its death included)
    except (CellExecutionError, DeadKernelError, AssertionError) as exc:
        failed = exc.__context__ if isinstance(exc, AssertionError) else exc  # nbclient's cleanup
        if not isinstance(failed, (CellExecutionError, DeadKernelError)):  # fails on a dead kernel
            raise
        raise UserError(f"{path.name}: " + (f"a cell raised {failed.ename}: {failed.evalue}" if
                        isinstance(failed, CellExecutionError) else "its kernel died (Ctrl-C?)"))
    for cell in nb.cells:  # what differs from run to run and says nothing to a reader
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    return nb


# ----------------------------------------------------------------------------- comparing


@dataclass
class Output:
    """One output of a code cell as a reader sees it: text, or a picture."""

    kind: str   # "text" or "image/png"
    data: str   # the text, or the PNG base64


def outputs_of(cell) -> list[Output]:
    out = []
    for o in cell.get("outputs", []):
        if o["output_type"] == "stream":
            text = o["text"]
            if out and out[-1].kind == "text":  # one stream may arrive in several pieces
                out[-1] = Output("text", out[-1].data + text)
            else:
                out.append(Output("text", text))
        elif o["output_type"] in ("execute_result", "display_data"):
            data = o["data"]
            if "image/png" in data:
                out.append(Output("image/png", data["image/png"]))
            elif "text/plain" in data:
                out.append(Output("text", data["text/plain"]))
        elif o["output_type"] == "error":
            out.append(Output("text", f"{o['ename']}: {o['evalue']}"))
    return out


def _numbers_agree(a: str, b: str) -> bool:
    """b (committed) and a (fresh) are the same text with numbers that agree within tolerance."""
    if NUMBER.sub("#", a) != NUMBER.sub("#", b):
        return False
    absolute, relative = NUMBER_TOLERANCE
    for x, y in zip(NUMBER.findall(a), NUMBER.findall(b)):
        if x.lstrip("+-").isdigit() and y.lstrip("+-").isdigit():
            if int(x) != int(y):  # a count, a shape, a step: exact
                return False
        elif abs(float(x) - float(y)) > absolute + relative * abs(float(y)):
            return False
    return True


def _pixels(png_base64: str):
    import matplotlib.image
    return matplotlib.image.imread(io.BytesIO(base64.b64decode(png_base64)), format="png")


def _pictures_agree(a: str, b: str) -> tuple[bool, str]:
    pa, pb = _pixels(a), _pixels(b)
    if pa.shape != pb.shape:
        return False, f"a picture of {pa.shape[1]}x{pa.shape[0]} pixels where " \
                      f"{pb.shape[1]}x{pb.shape[0]} is committed"
    diff = float(abs(pa[..., :3] - pb[..., :3]).mean())
    return diff <= PIXEL_TOLERANCE, f"a picture whose pixels differ by {diff:.3f} on average " \
                                    f"(tolerance {PIXEL_TOLERANCE})"


def differences(fresh, committed) -> list[str]:
    """What a reader would see differ between two runs of one notebook: one line for each code
    cell whose outputs are not the same (see the module docstring); [] when none is."""
    found = []
    code = [(f, c) for f, c in zip(fresh.cells, committed.cells) if c.cell_type == "code"]
    if [c.source for c in fresh.cells] != [c.source for c in committed.cells]:
        found.append("the cells themselves differ (not the same notebook)")
    for n, (f, c) in enumerate(code, 1):
        new, old = outputs_of(f), outputs_of(c)
        if [o.kind for o in new] != [o.kind for o in old]:
            found.append(f"code cell {n}: outputs {[o.kind for o in new]}, committed "
                         f"{[o.kind for o in old]}")
            continue
        for a, b in zip(new, old):
            if a.kind == "text" and not _numbers_agree(a.data, b.data):
                found.append(f"code cell {n}: prints\n{a.data}\nwhere the committed output is\n"
                             f"{b.data}")
            elif a.kind == "image/png":
                same, words = _pictures_agree(a.data, b.data)
                if not same:
                    found.append(f"code cell {n}: {words}")
    return found


# ----------------------------------------------------------------------------- the command


@dataclass
class RunArgs:
    lessons: Optional[list[str]] = None  # lesson numbers or names (01,03); null: every lesson
    write: bool = True        # write the outputs into the notebooks (false: compare only)
    cell_timeout: int = 300   # seconds one cell may run


def run(args: RunArgs) -> int:
    import nbformat
    paths = lessons(args.lessons)
    if not paths:
        raise UserError(f"no lesson matches lessons={','.join(args.lessons or [])} (there are: "
                        f"{', '.join(p.stem for p in lessons())})")
    moved = 0
    for path in paths:
        start = time.monotonic()
        fresh = execute(path, args.cell_timeout)
        seconds = time.monotonic() - start
        found = differences(fresh, nbformat.read(path, as_version=4))
        moved += bool(found)
        print(f"{path.relative_to(ROOT)}: ran in {seconds:.0f} s; "
              + ("outputs as committed" if not found else f"{len(found)} cells' outputs moved"))
        for line in found:
            print("  " + line.replace("\n", "\n    "))
        if args.write:
            nbformat.write(fresh, path)
    return 1 if moved and not args.write else 0


def main(argv: list[str]) -> int:
    usage = "usage: python -m tools.run_lessons [lessons=01,02] [write=false] [cell_timeout=S]"
    return run_cli(lambda: run(parse_key_values(argv, RunArgs, usage,
                                                about=__doc__.split("\n\n")[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
