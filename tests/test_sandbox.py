"""The checker's sandbox (check_attention/sandbox/host.py, confine.py) against files that try
to get out of it (tests/attention_layers/escape_*.py, issues 28 and 48). Each hostile file tries
every way it knows at import and raises naming each one that worked; here each must import
cleanly, and what it aimed at (a terminal, a listener, a file's metadata, a shared place, a
process left behind, a file outside, what an earlier check left) must show nothing. A sandbox
that cannot start, and a checker stopped by Ctrl-C or SIGTERM, leave nothing behind.

The files run in the sandbox's children exactly as a checked file does (a `load` request); one
slow test runs the command under a pseudo-terminal, as a user at a shell runs it.
"""
from __future__ import annotations

import ctypes
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from helpers import REPO_ROOT, SCRIPT_ENV
from check_attention.sandbox.host import Sandbox, SandboxError

LAYERS = REPO_ROOT / "tests" / "attention_layers"
TARGETS = "CHECK_ATTENTION_ESCAPE_TARGETS"
LINUX = sys.platform.startswith("linux")


@pytest.fixture(scope="module")
def listeners(tmp_path_factory):
    """A UDP port, a TCP port and a unix socket on this machine, named to the sandbox through the
    environment it inherits, so escape_network.py knows where to send; and a secret for
    escape_read.py to try, in a file outside its folder and in the checker's environment."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path_factory.mktemp("listen") / "s")
    for s, address in ((udp, ("127.0.0.1", 0)), (tcp, ("127.0.0.1", 0)), (unix, path)):
        s.bind(address)
        s.setblocking(False)
    tcp.listen(4), unix.listen(4)
    secret = tmp_path_factory.mktemp("instructor") / "solution.py"
    secret.write_text("SOLUTION = 42\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TARGETS, f"{udp.getsockname()[1]} {tcp.getsockname()[1]} {path}")
        mp.setenv("CHECK_ATTENTION_ESCAPE_SECRET", str(secret))
        mp.setenv("INSTRUCTOR_TOKEN", "hf_not_for_submissions")
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
def test_nothing_outside_what_a_check_needs_can_be_read(sandbox):
    """Not another process's environment, /etc, the home directories, a file outside the
    submission's folder, or the checker's environment variables (so none of it can reach the
    grading table through an exception message)."""
    needs(sandbox, "Landlock")
    assert escapes(sandbox, "escape_read.py") is None
    assert "reads only Python, its packages and the submission's folder" in sandbox.confinement


@needs_linux
def test_nothing_one_check_writes_is_there_for_the_next(sandbox):
    """Each check has its own HOME, TMPDIR and working directory, removed after it, and can
    write nowhere beside them."""
    needs(sandbox, "Landlock")
    for _ in range(2):
        assert escapes(sandbox, "escape_leftovers.py") is None
        assert os.listdir(sandbox.root) == []


@pytest.mark.parametrize("interpreter", [
    "#!/bin/sh\nexit 0\n",  # mode 0o644 below: an interpreter it may not run
    "#!/bin/sh\nexit 1\n",  # runs, and ends before it is ready
])
def test_a_sandbox_that_cannot_start_leaves_nothing(tmp_path, monkeypatch, interpreter):
    fake, tmp = tmp_path / "python", tmp_path / "tmp"
    fake.write_text(interpreter)
    fake.chmod(0o644 if "exit 0" in interpreter else 0o755)
    tmp.mkdir()
    monkeypatch.setattr(sys, "executable", str(fake))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    box = Sandbox()
    with pytest.raises(SandboxError, match="could not start|did not start"):
        box.confinement
    assert os.listdir(tmp) == []
    box.close()


def sandbox_processes(tmp: str) -> list[int]:
    """Processes whose command line names a directory under tmp: sandbox hosts and children."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if os.fsencode(tmp) in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


FOREVER = ("from fused import CausalSelfAttention\n\n"
           "class Attn(CausalSelfAttention):\n    def forward(self, x):\n"
           "        while True:\n            pass\n")
# 256 processes that wait (bounded, so that a checker without the limit only waits for them)
FORK_BOMB = ("import os, time\nfrom fused import CausalSelfAttention\n\n"
             "class Attn(CausalSelfAttention):\n    def forward(self, x):\n"
             "        for _ in range(8):\n            os.fork()\n        time.sleep(60)\n")


@needs_linux
@pytest.mark.slow
@pytest.mark.parametrize("how, workers", [("SIGINT", 1), ("SIGINT", 2), ("SIGTERM", 2),
                                          ("SIGINT to the checker alone", 2)])
def test_ctrl_c_and_sigterm_stop_every_check_at_once(tmp_path, how, workers):
    """Grading layers that never return (one starts processes without end): Ctrl-C (SIGINT to
    the terminal's process group), SIGINT to the checker's process alone, or SIGTERM ends the
    command within 2 s, not at the 120 s timeout, prints no table, and leaves no sandbox
    directory, no process and nothing in /dev/shm behind."""
    folder, tmp = tmp_path / "subs", tmp_path / "tmp"
    folder.mkdir(), tmp.mkdir()
    shutil.copy(LAYERS / "fused.py", folder / "fused.py")
    for name, text in (("a.py", FOREVER), ("b.py", FORK_BOMB if workers == 2 else FOREVER),
                       ("c.py", FOREVER)):
        (folder / name).write_text(text)
    shm = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "check_attention", str(folder), "Attn", f"workers={workers}"],
        cwd=REPO_ROOT, env={**SCRIPT_ENV, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(tmp.glob("check_attention-*/check-*"))) < workers:  # each in a layer
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1)  # inside forward by now
        start = time.monotonic()
        if how == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C at a terminal does
        else:
            os.kill(proc.pid, getattr(signal, how.split()[0]))
        proc.wait(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out, err = (f.read().decode() for f in (proc.stdout, proc.stderr))
    assert proc.returncode == 128 + getattr(signal, how.split()[0]), err
    assert "error: interrupted" in err and "| student |" not in out
    assert took < 2, took
    time.sleep(0.5)  # a process killed as the checker ended is gone by now
    assert os.listdir(tmp) == [] and sandbox_processes(str(tmp)) == []
    assert set(os.listdir("/dev/shm")) <= shm


@needs_linux
@pytest.mark.slow
def test_a_fork_bomb_is_stopped_and_changes_no_other_verdict(tmp_path):
    """Round five's fork bomb under workers=2 made its neighbour ERROR ("the sandbox process did
    not start"): a check may run MAX_PROCESSES processes at once, and one that starts more is
    stopped at once, the grading going on beside it."""
    from check_attention.sandbox.host import MAX_PROCESSES
    folder = tmp_path / "subs"
    folder.mkdir()
    shutil.copy(LAYERS / "fused.py", folder / "fused.py")
    (folder / "bomb.py").write_text(FORK_BOMB)
    result = subprocess.run(
        [sys.executable, "-m", "check_attention", str(folder), "Attn", "CausalSelfAttention",
         "workers=2", "timeout=60"], cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True,
        text=True, timeout=600)
    rows = {line.split(" | ")[0][2:]: line for line in result.stdout.splitlines()
            if line.startswith("| ") and ".py" in line}
    assert "| CausalSelfAttention | 16.00 | PASS |" in rows["fused.py"], result.stdout
    assert f"started more than {MAX_PROCESSES} processes and was stopped" in rows["bomb.py"]
    bomb = next(line for line in result.stderr.splitlines() if "bomb.py" in line)
    assert float(bomb.rpartition("(")[2].split()[0]) < 20, bomb  # not its 60 s timeout


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
