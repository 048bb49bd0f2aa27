"""A file that reads what it has no business reading (issue 48), to put it in the grading table
through an exception message: another process's environment, the system's password and host
files, the home directories, the folder above the project, the file that
CHECK_ATTENTION_ESCAPE_SECRET names when a test plants one outside the submission's folder, and
the checker's own environment (INSTRUCTOR_TOKEN, when a test sets it).

Each file, folder or variable it could read is named in the error raised at import (the text it
read is left out). Otherwise `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
import os

from fused import CausalSelfAttention as Layer  # noqa: F401

FILES = ["/etc/passwd", "/etc/hostname", "/proc/1/environ", "/proc/1/cmdline",
         os.environ.get("CHECK_ATTENTION_ESCAPE_SECRET", "")]
PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ["/root", "/home", "/tmp", os.path.dirname(PROJECT)]
worked = ["read $INSTRUCTOR_TOKEN"] if "INSTRUCTOR_TOKEN" in os.environ else []
for path in filter(None, FILES):
    try:
        with open(path, "rb") as f:
            f.read(64)
        worked.append(f"read {path}")
    except OSError:
        pass
for path in FOLDERS:
    try:
        os.listdir(path)
        worked.append(f"listed {path}")
    except OSError:
        pass
if worked:
    raise RuntimeError("escaped: " + "; ".join(worked))
