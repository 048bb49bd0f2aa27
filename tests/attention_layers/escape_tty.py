"""A file that looks for a terminal to type into (issue 28): with one, ioctl(TIOCSTI) pushes a
command into the terminal's input and the user's shell runs it after the check.

At import it tries every way to a terminal it knows and raises, naming each that worked; it
injects nothing, so a failed sandbox leaves no command behind. Otherwise `Layer` is a correct
layer and the check passes.

Test material for tests/test_sandbox.py; not part of the package.
"""
import errno
import fcntl
import glob
import os
import termios

from fused import CausalSelfAttention as Layer  # noqa: F401  (a correct layer to check)

worked = []
try:
    os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
    worked.append("opened /dev/tty")
except OSError:
    pass
with open("/proc/self/stat") as f:
    if f.read().rsplit(")", 1)[1].split()[4] != "0":  # tty_nr: the controlling terminal
        worked.append("has a controlling terminal")
worked += [f"fd {fd} is a terminal" for fd in range(256) if os.isatty(fd)]
# Terminals by name (as root, any user's), and those other processes hold open (the checker's
# own terminal, as its /proc/PID/fd/N)
ttys = {f"/dev/pts/{n}" for n in range(64)} | {f"/dev/tty{n}" for n in range(8)}
for fds in glob.glob("/proc/[0-9]*/fd/*"):
    try:
        if os.readlink(fds).startswith(("/dev/pts/", "/dev/tty")):
            ttys.add(fds)
    except OSError:
        pass
for path in sorted(ttys):
    try:
        os.close(os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK))
        worked.append(f"opened {path}")
    except OSError:
        pass
# TIOCSTI on a file that is no terminal: the kernel's tty code answers ENOTTY; a sandbox that
# refuses the request itself answers EPERM before it reaches any terminal.
fd = os.open("/dev/null", os.O_RDONLY)
try:
    fcntl.ioctl(fd, termios.TIOCSTI, b" ")
    worked.append("TIOCSTI succeeded")
except OSError as exc:
    if exc.errno != errno.EPERM:
        worked.append(f"TIOCSTI reached the terminal code ({errno.errorcode[exc.errno]})")
finally:
    os.close(fd)
if worked:
    raise RuntimeError("escaped: " + "; ".join(worked))
