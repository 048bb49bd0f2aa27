"""A file that leaves something for the next check to find (issue 48): a file in its HOME, its
TMPDIR, tempfile's directory and its working directory, and one beside them. Checked twice in one
sandbox, the second check must find nothing of the first.

What it finds from an earlier check, and where it could write beside its own directory, is named
in the error raised at import. Otherwise `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
import os
import tempfile

from fused import CausalSelfAttention as Layer  # noqa: F401

MARK = "check-attention-leftover"
places = {os.environ.get("HOME", ""), os.environ.get("TMPDIR", ""), tempfile.gettempdir(),
          os.getcwd()}
places = sorted(p for p in places if p)
worked = [f"found {os.path.join(p, MARK)}" for p in places if os.path.exists(os.path.join(p, MARK))]
for place in places:
    try:
        with open(os.path.join(place, MARK), "w") as f:
            f.write("left by an earlier check")
    except OSError:
        pass
beside = os.path.join(os.path.dirname(os.getcwd()), MARK)
try:
    with open(beside, "x") as f:
        f.write("left beside")
    worked.append(f"wrote {beside}")
except OSError:
    pass
if worked:
    raise RuntimeError("escaped: " + "; ".join(worked))
