"""A file that leaves processes behind (issue 28): one forked plainly, one that calls setsid()
to leave the process group; both would act after the check has ended.

Each names itself `ca-orphan` (its /proc/PID/comm) and sleeps 20 s, so the test can look for
it after the check. `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
import ctypes
import os
import time

from fused import CausalSelfAttention as Layer  # noqa: F401


def orphan(new_session: bool) -> None:
    if os.fork() == 0:
        if new_session:
            os.setsid()
        if os.fork() == 0:  # the grandchild: its parent exits, it is re-parented
            os.closerange(3, 4096)
            ctypes.CDLL(None).prctl(15, b"ca-orphan", 0, 0, 0)  # PR_SET_NAME
            time.sleep(20)
        os._exit(0)


orphan(False)
orphan(True)
