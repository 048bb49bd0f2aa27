"""The checker's sandbox (check_attention/sandbox/host.py, confine.py) against files that try
to get out of it (tests/attention_layers/escape_*.py, issue 28). Each hostile file tries every
way it knows at import and raises naming each one that worked; here each must import cleanly,
and what it aimed at (a terminal, a listener, a file's metadata, a shared place, a process left
behind) must show nothing.

The files run in the sandbox's children exactly as a checked file does (a `load` request); one
slow test runs the command under a pseudo-terminal, as a user at a shell runs it.
"""
from __future__ import annotations

import ctypes
import os
import pty
import select
import socket
import sys
import time

import pytest

from helpers import REPO_ROOT, SCRIPT_ENV
from check_attention.sandbox.host import Sandbox

LAYERS = REPO_ROOT / "tests" / "attention_layers"
TARGETS = "CHECK_ATTENTION_ESCAPE_TARGETS"
LINUX = sys.platform.startswith("linux")


@pytest.fixture(scope="module")
def listeners(tmp_path_factory):
    """A UDP port, a TCP port and a unix socket on this machine, named to the sandbox through the
    environment it inherits, so escape_network.py knows where to send."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path_factory.mktemp("listen") / "s")
    for s, address in ((udp, ("127.0.0.1", 0)), (tcp, ("127.0.0.1", 0)), (unix, path)):
        s.bind(address)
        s.setblocking(False)
    tcp.listen(4), unix.listen(4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TARGETS, f"{udp.getsockname()[1]} {tcp.getsockname()[1]} {path}")
        yield udp, tcp, unix
    for s in (udp, tcp, unix):
        s.close()


@pytest.fixture(scope="module")
def sandbox(listeners):
    with Sandbox() as box:
        yield box


def escapes(sandbox, file: str):
    """What the hostile file says got out (its import error), or None."""
    with sandbox.child(timeout=60) as child:
        answer = child.ask("load", file=str(LAYERS / file), name="Layer", d_model=64, n_head=4,
                           block_size=8, dtype=None, device="cpu", seed=0)
    return answer.get("error")


def needs(sandbox, *mechanisms: str) -> None:
    """Skip where the promise rests on a mechanism this system lacks (the docs say what is
    weaker there); on Linux with libseccomp and Landlock, as on CI, nothing is skipped."""
    missing = [m for m in mechanisms if m not in sandbox.confinement]
    if missing:
        pytest.skip(f"not in force here: {', '.join(missing)}")


def orphans() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "ca-orphan":
                    found.append(int(pid))
        except OSError:
            pass
    return found


needs_linux = pytest.mark.skipif(not LINUX, reason="the sandbox's mechanisms are Linux's")


@needs_linux
def test_the_sandbox_line_says_what_is_in_force(sandbox):
    words = sandbox.confinement
    assert words.startswith("new session, no terminal, subreaper"), words
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1:  # Landlock's ABI
        assert "Landlock ABI" in words, words
    try:
        import pyseccomp  # noqa: F401  (raises OSError without libseccomp.so.2)
        assert "seccomp" in words, words
    except (ImportError, OSError):
        pass


@needs_linux
def test_no_terminal_can_be_reached_and_tiocsti_is_refused(sandbox):
    needs(sandbox, "Landlock", "seccomp")
    assert escapes(sandbox, "escape_tty.py") is None


@needs_linux
def test_no_process_outlives_the_check(sandbox):
    try:
        assert escapes(sandbox, "escape_procs.py") is None
        assert orphans() == []  # the check has ended: nothing it started is left
    finally:
        for pid in orphans():  # should the sandbox ever fail, leave nothing running
            os.kill(pid, 9)


@needs_linux
def test_no_metadata_changes_outside_the_sandbox(sandbox):
    needs(sandbox, "seccomp")
    target = LAYERS / "escape_metadata.py"
    before = os.stat(target)
    assert escapes(sandbox, "escape_metadata.py") is None
    after = os.stat(target)
    assert (after.st_mode, after.st_uid, after.st_mtime_ns, after.st_ctime_ns) == \
        (before.st_mode, before.st_uid, before.st_mtime_ns, before.st_ctime_ns)


@needs_linux
def test_no_network_by_any_protocol(sandbox, listeners):
    needs(sandbox, "seccomp")
    udp, tcp, unix = listeners
    said = escapes(sandbox, "escape_network.py")
    received = []
    for s in listeners:
        try:
            received.append(s.recv(64) if s is udp else s.accept())
        except (BlockingIOError, OSError):
            pass
    assert received == [] and said is None, (said, received)


@needs_linux
def test_nothing_is_left_in_shared_places(sandbox):
    needs(sandbox, "Landlock", "seccomp")
    assert escapes(sandbox, "escape_shared.py") is None
    assert not os.path.exists("/dev/shm/check-attention-escape")
    assert not os.path.exists("/tmp/check-attention-escape")


@needs_linux
def test_no_capabilities_are_left(sandbox):
    assert escapes(sandbox, "escape_root.py") is None


@needs_linux
@pytest.mark.slow
def test_the_command_under_a_terminal_cannot_type_into_it():
    """As a user runs it from a shell: the checker's own process has a controlling terminal (a
    pseudo-terminal here). The checked file must find none, and the verdict is PASS."""
    argv = [sys.executable, "-m", "check_attention",
            "tests/attention_layers/escape_tty.py:Layer"]
    pid, master = pty.fork()
    if pid == 0:  # the child: pty.fork made the pseudo-terminal its controlling terminal
        os.chdir(REPO_ROOT)
        os.execve(sys.executable, argv, SCRIPT_ENV)
    output, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            output += chunk
    _, status = os.waitpid(pid, 0)
    os.close(master)
    text = output.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "verdict: PASS" in text and "escaped" not in text
