"""A file that looks for root's powers (issue 28): run by root, it would keep CAP_SYS_ADMIN,
CAP_CHOWN, module loading and raw I/O unless the sandbox drops them. It names the capabilities
it holds in the error raised at import (it uses none). Otherwise `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
from fused import CausalSelfAttention as Layer  # noqa: F401

with open("/proc/self/status") as f:
    held = {k: v.strip() for k, v in (line.split(":", 1) for line in f)
            if k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")}
if any(int(v, 16) for v in held.values()):
    raise RuntimeError("escaped: holds capabilities "
                       + ", ".join(f"{k} {v}" for k, v in held.items()))
