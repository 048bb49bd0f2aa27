"""A file that changes metadata outside its temporary directory (issue 28): chmod, chown, utime,
extended attributes and inode flags (chattr) of this very file. Write rules (Landlock) do not
cover these calls.

Each call sets what is already there (the same mode, owner, times and flags; an xattr it removes
again), so a failed sandbox changes nothing that matters; each call that is allowed is named in
the error raised at import. Otherwise `Layer` is a correct layer.

Test material for tests/test_sandbox.py; not part of the package.
"""
import array
import fcntl
import os

from fused import CausalSelfAttention as Layer  # noqa: F401

FS_IOC_GETFLAGS, FS_IOC_SETFLAGS = 0x80086601, 0x40086602
target = os.path.abspath(__file__)
st = os.stat(target)
worked = []
for what, call in (
        ("chmod", lambda: os.chmod(target, st.st_mode & 0o7777)),
        ("chown", lambda: os.chown(target, st.st_uid, st.st_gid)),
        ("utime", lambda: os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))),
        ("setxattr", lambda: os.setxattr(target, "user.check_attention", b"1"))):
    try:
        call()
        worked.append(what)
    except OSError:
        pass
if "setxattr" in worked:
    os.removexattr(target, "user.check_attention")
fd = os.open(target, os.O_RDONLY)
try:
    flags = array.array("l", [0])
    fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
    fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
    worked.append("chattr (FS_IOC_SETFLAGS)")
except OSError:
    pass
finally:
    os.close(fd)
if worked:
    raise RuntimeError("escaped: " + ", ".join(worked) + " on a file outside the sandbox")
