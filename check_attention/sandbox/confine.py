"""How the sandbox's host shuts itself in before it imports torch or anyone's file (Linux).

The design case is an instructor running the checker over student files: a file may try to type
into the instructor's terminal, leave a process behind, change files or their metadata, read
what it should not, send data out, or leave something in a shared place. Each promise rests on a
kernel mechanism (a new session, a child subreaper, Landlock, seccomp through libseccomp,
network and IPC namespaces, dropped capabilities), used through the kernel's own interfaces or a
maintained library, never on checking what the file did; each check adds a Landlock layer of its
own (`confine_check`). docs/check_attention.md ("The sandbox, and why") has the table: what the
file cannot do, what stops it, and the test that holds it. Where a mechanism is missing (another
OS, an older kernel, no libseccomp) the others still hold and `confine` leaves its words out of
the `sandbox:` line.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import os
import sys

_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT = 1, 24, 38, 47
_PR_SET_CHILD_SUBREAPER = 36
_CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWNET = 0x08000000, 0x10000000, 0x40000000


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def confine(root: str, gpu: bool) -> str:
    """Shut this process (and all it will start) in; returns what is in force, in words. Call it
    first thing, while the process is single-threaded (unshare and Landlock need that)."""
    words = ["new session, no terminal"]  # the checker's doing: Sandbox starts us so
    if not sys.platform.startswith("linux"):
        return words[0] + "; no Linux confinement on this system"
    libc = _libc()
    die_with_parent()
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
        words.append("subreaper (every process ends with its check)")
    namespaces = _unshare(libc)
    if namespaces:
        words.append(namespaces)
    if _drop_capabilities(libc):
        words.append("capabilities dropped")
    abi = _landlock(libc, root, gpu)
    if abi:
        reads = ("reads not confined with a GPU" if gpu else "reads only Python, its packages "
                 "and the submission's folder")
        words.append(f"Landlock ABI {abi} (writes only to the check's own directory, {reads}, "
                     f"no /dev but null and random{' and the GPU' if gpu else ''})")
    filtered = _seccomp()
    if filtered:
        words.append(filtered)
    return ", ".join(words)


def die_with_parent() -> None:
    """SIGKILL this process when its parent ends (the host when the checker does, the child when
    the host does). Not inherited by fork: each sets it."""
    if sys.platform.startswith("linux"):
        _libc().prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0)


# ----------------------------------------------------------------------------- namespaces


def _unshare(libc) -> str:
    """A network namespace of our own (no way out, whatever the protocol) and an IPC one (System V
    objects die with it). Root may make them; others through a user namespace, where allowed."""
    for flags in (_CLONE_NEWNET | _CLONE_NEWIPC, _CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWIPC):
        if libc.unshare(flags) == 0:
            return "network and IPC namespaces"
    return ""


def _drop_capabilities(libc) -> bool:
    """Empty the bounding, ambient, effective, permitted and inheritable sets: a root user keeps
    uid 0 and its files, but not the powers beyond them (mount, modules, raw I/O, chown)."""
    with open("/proc/self/status") as f:
        if int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16) == 0:
            return False
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    libc.prctl(_PR_CAP_AMBIENT, 4, 0, 0, 0)  # PR_CAP_AMBIENT_CLEAR_ALL
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()                  # two {effective, permitted, inheritable}
    return libc.capset(header, data) == 0


# ----------------------------------------------------------------------------- Landlock

# linux/landlock.h: the filesystem rights, and the ABI version that introduced each.
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_RIGHTS = {1: (1 << 13) - 1, 2: 1 << 13, 3: 1 << 14, 5: 1 << 15}  # REFER, TRUNCATE, IOCTL_DEV
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | (1 << 14) | (1 << 15)
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_NET_TCP = (1 << 0) | (1 << 1)             # BIND_TCP, CONNECT_TCP (ABI 4)
_SCOPE = (1 << 0) | (1 << 1)               # ABSTRACT_UNIX_SOCKET, SIGNAL (ABI 6)
_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # the same on every architecture
_RULE_PATH_BENEATH, _O_PATH = 1, 0o10000000


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_rules(root: str, gpu: bool, every: int, reads=None) -> dict[str, int]:
    """Path -> rights. Reading is allowed beneath `reads` (None: everywhere but /dev, as the host
    needs to import torch); of /dev only the nodes Python and torch use, and the GPU's with a
    GPU; all rights beneath our own directory."""
    if reads is None:
        reads = [os.path.join("/", name) for name in os.listdir("/") if name != "dev"]
    rules = {path: _READ for path in reads}
    rules.update({f"/dev/{n}": _READ_FILE for n in ("zero", "full", "random", "urandom")})
    rules["/dev/null"] = _READ_FILE | _WRITE_FILE
    if gpu:
        rules.update({p: _FILE_RIGHTS for p in glob.glob("/dev/nvidia*") + glob.glob("/dev/dri/*")
                      if not os.path.isdir(p)})
    rules[root] = every
    return rules


def _landlock(libc, root: str, gpu: bool, reads=None) -> int:
    """Restrict this process and its descendants to `landlock_rules`; returns the ABI, 0 without.
    Each call adds a layer: what an earlier one refused stays refused."""
    abi = libc.syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return 0
    fs = sum(rights for version, rights in _FS_RIGHTS.items() if abi >= version)
    attr = _RulesetAttr(fs, _NET_TCP if abi >= 4 else 0, _SCOPE if abi >= 6 else 0)
    size = ctypes.sizeof(attr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    try:
        for path, rights in landlock_rules(root, gpu, fs, reads).items():
            if not os.path.isdir(path):
                rights &= _FILE_RIGHTS  # a rule on a file may grant only a file's rights
            try:
                fd = os.open(path, _O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a dangling link at the top of the tree: nothing to read there
            try:
                rule = _PathBeneath(rights & fs, fd)
                if libc.syscall(_SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule),
                                ctypes.c_uint32(0)) != 0:
                    return 0
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return 0
        if libc.syscall(_SYS_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
            return 0
    finally:
        os.close(ruleset)
    return abi


def check_reads() -> list[str]:
    """What a check needs to read beyond its submission's folder: the Python installation and
    every entry of the module search path (the standard library, site-packages, PYTHONPATH: the
    project, when it is there), this folder, the system's shared libraries (torch loads some of
    its own only when first used) with the loader's cache, the processor's description (torch
    reads it the first time it computes in float16), and its own process's files in /proc
    (/proc/self is opened by the check itself, so it is that process's, no other's)."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, here,
             *(p for p in sys.path if p), "/usr", "/lib", "/lib64", "/etc/ld.so.cache",
             "/proc/cpuinfo", "/sys/devices/system/cpu", "/proc/self"}
    return sorted(p for p in paths if os.path.exists(p))


def confine_check(workdir: str, reads: list[str], gpu: bool) -> bool:
    """Shut one check's process in further, on top of the host's layer: writes only beneath its
    own directory (so nothing one check writes is there for the next), reads only beneath
    `reads` and that directory (so no file outside, the instructor's solution or ~/.ssh, can be
    read and put in the report). With a GPU reads stay as the host's: the driver reads from
    /proc, /sys and /etc, which is not tested here. False where Landlock is missing."""
    if not sys.platform.startswith("linux"):
        return False
    return _landlock(_libc(), workdir, gpu, None if gpu else reads) > 0


# ----------------------------------------------------------------------------- seccomp

# Refused with EPERM, for every path and fd. Names libseccomp may not know yet (it learns each
# syscall a release or two after the kernel) have the same number on every architecture.
DENIED = (
    # metadata, which Landlock does not govern
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "utime", "utimes", "futimesat", "utimensat", "setxattr", "lsetxattr", "fsetxattr",
    "setxattrat", "removexattr", "lremovexattr", "fremovexattr", "removexattrat", "file_setattr",
    # the network, by any family; shared places outside the filesystem
    "socket", "shmget", "msgget", "semget", "mq_open", "add_key", "request_key", "keyctl",
    # io_uring runs opens, sockets and xattrs where no seccomp filter sees them
    "io_uring_setup",
)
_NEW_SYSCALLS = {"fchmodat2": 452, "setxattrat": 463, "removexattrat": 466, "file_setattr": 469}
# ioctl requests (compared on their low 32 bits, as the kernel reads them): typing into a terminal
# (TIOCSTI), the console's copy and paste (TIOCLINUX), chattr (FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR).
DENIED_IOCTLS = (0x5412, 0x541C, 0x40086602, 0x401C5820)


def _seccomp() -> str:
    try:
        import pyseccomp as sc
    except (ImportError, OSError):  # not installed, or no libseccomp.so.2 on this system
        return ""
    deny = sc.ERRNO(errno.EPERM)
    rules = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED:
        number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        if number < 0:
            number = _NEW_SYSCALLS.get(name, -1)
        if number >= 0:  # else this architecture has no such call (arm64 has no chmod)
            rules.add_rule(deny, number)
    for request in DENIED_IOCTLS:
        rules.add_rule(deny, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    rules.load()
    return "seccomp (no TIOCSTI, no socket(), no metadata changes)"
