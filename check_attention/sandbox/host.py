"""Run someone else's attention code where it cannot touch the project, or us.

The checker never imports the user's file into its own process: the file could patch
`torch.softmax`, or our `scaled_dot_product_attention`, and every reference we compute would
then agree with it. Instead a *host* process (this file, run as a script) starts once, confines
itself and imports torch; for each layer to check it forks a fresh child, which imports the
user's file and answers our requests (build, forward, call) over a pipe. So:

- the user's code shares no memory with the checker: whatever it patches, it patches in its own
  process, and every reference is computed in ours;
- the host shuts itself in before it imports anything (confine.py), each child further before
  it imports the file; where Landlock is missing the checker also compares the project's files
  before and after, refusing the result if anything changed (`Sandbox.writes_confined`);
- what comes back is read with `torch.load(weights_only=True)`, which builds tensors, numbers,
  strings and containers and never runs code;
- when a child ends, or is killed at its deadline, everything it started is killed too.

Protocol: frames of an 8-byte little-endian length and a `torch.save`d dict. Requests go over
the host's stdin, answers come over its stdout; the host answers `fork` with the child's pid and
then sleeps until the child exits; meanwhile the child owns those two pipes and answers one
frame per request. The host's own frames (ready, the pid, the child's exit) go over a third pipe
that no child holds, so a child cannot forge them.
"""
from __future__ import annotations

import io
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Optional

MAX_FRAME = 1 << 30  # a frame larger than 1 GiB is not an answer to anything we asked
MAX_PROCESSES = 64   # processes one check may run at once (a fork bomb is stopped at this)
HEADER = struct.Struct("<Q")
# Where the project's files live, and the parts of it that are not the project (outputs,
# caches): a child that changed anything else would have changed the project.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
NOT_PROJECT = {".git", "runs", "outputs", "multirun", ".cache", "__pycache__", ".pytest_cache",
               ".venv", "venv"}
# Where programs keep their files: each check's own directory, removed after it, so that nothing
# one check leaves is there for the next.
PRIVATE_DIRS = ("HOME", "TMPDIR", "TMP", "TEMP", "XDG_CACHE_HOME", "XDG_CONFIG_HOME",
                "TRITON_CACHE_DIR", "MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR")
# The checker's environment variables the sandbox keeps (finding programs and libraries, the
# locale, the GPU, torch's and the thread libraries' settings, the tests' own); the rest (tokens,
# keys, whatever the instructor's shell holds) are not the file's to read.
KEPT_ENV = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "LANG", "LANGUAGE", "TZ")
KEPT_ENV_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TORCH_", "PYTORCH_", "OMP_", "KMP_", "MKL_",
                     "OPENBLAS_", "CHECK_ATTENTION_")


class SandboxError(RuntimeError):
    """The user's code could not be run, or its process misbehaved (one sentence)."""


# ----------------------------------------------------------------------------- frames


def write_frame(fd: int, obj) -> None:
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = HEADER.pack(len(buf.getbuffer())) + buf.getvalue()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: Optional[float] = None):
    import torch
    (n,) = HEADER.unpack(_read_exact(fd, HEADER.size, deadline))
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes")
    return torch.load(io.BytesIO(_read_exact(fd, n, deadline)), weights_only=True)


# ----------------------------------------------------------------------------- the host


def _descendants() -> list[int]:
    """Every process below this one, from /proc's parent links (empty where there is no /proc)."""
    parent = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        parent[int(entry)] = int(stat[stat.rindex(b")") + 2:].split()[1])
    below, frontier = [], {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier}
        below += frontier
    return below


def _end_all(child: int) -> None:
    """Kill the child and everything it started: its group, then, round by round, every process
    below us. A process that left the group (setsid) or lost its parent is still below us (we
    are a subreaper, confine.py); one forked while we kill is killed the next round."""
    for _ in range(10_000):
        for kill, pid in [(os.killpg, child)] + [(os.kill, pid) for pid in _descendants()]:
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:  # reap the dead, ours and those re-parented to us
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                return
        time.sleep(0.001)


def _wait(pid: int, deadline: float) -> tuple[int, str]:
    """The child's exit status, and why it was stopped: "timed_out" (past its deadline), "forked"
    (more than MAX_PROCESSES processes: a fork bomb, which would starve the next check) or ""."""
    why, polls = "", 0
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        polls += 1  # /proc is read every 20 polls (about 0.1 s): 2 ms, for a hundred processes
        why = "timed_out" if time.monotonic() > deadline else "forked" if (
            polls % 20 == 0 and len(_descendants()) > MAX_PROCESSES) else ""
        if why:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            break
        time.sleep(0.005)
    _end_all(pid)
    return os.waitstatus_to_exitcode(status), why


def limit_memory(extra: Optional[int]) -> None:
    """Let this process map at most `extra` bytes more than it holds now (RLIMIT_AS): a layer
    that allocates without bound gets a MemoryError (torch: "can't allocate memory") instead of
    exhausting the machine. The base is what the host had mapped when it forked us (torch's
    libraries, a few GiB of address space), so the limit is on what the layer adds. None: no
    limit; 0 means nothing more."""
    if extra is None:
        return
    import resource
    try:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc (another OS): the limit counts the libraries too
        mapped = 0
    limit = mapped + int(extra)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _host(root: str, user_cwd: str, how: str, ctl: int, *extra_reads: str) -> None:
    """The host's loop: confine, import torch, then fork one child per `fork` request. What only
    the host may say (ready, the child's pid, its exit) goes over `ctl`, a pipe no child holds."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, here)
    from confine import confine, confine_check, die_with_parent, check_reads  # this folder's
    confinement = confine(root, gpu=how == "gpu") if how != "open" else "new session, no terminal"
    current = [0]  # the child being served, if any

    def stop(*_):  # the checker ends us (SIGTERM): the child and all it started go first
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a repeat must not cut it short
        if current[0]:
            _end_all(current[0])
        os._exit(0)
    signal.signal(signal.SIGTERM, stop)
    import runner  # noqa: E402
    import torch
    import torch.fx.experimental.symbolic_shapes  # noqa: F401  (sympy: some first backwards
    # import it, 2 to 3 s; once here rather than in every child the gradient probe runs in)

    torch.set_num_threads(1)  # the probes are tiny; one thread is fastest and shares the machine
    sys.path.pop(0)
    reads = check_reads() + [str(PROJECT_ROOT), *extra_reads]  # a file may import our model

    def shut_in(workdir: str, folder: str) -> None:
        """Called by the child before it imports the file in `folder` (runner.Session.load)."""
        if how != "open" and not confine_check(workdir, reads + [folder], gpu=how == "gpu") \
                and "Landlock" in confinement:
            raise RuntimeError("the check's own Landlock layer could not be added")
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # a stray print cannot corrupt the protocol
    write_frame(ctl, {"ready": True, "confinement": confinement})
    while True:
        try:
            req = read_frame(proto_in)
        except EOFError:
            return
        if req.get("cmd") != "fork":
            continue  # a request the last child did not live to read
        workdir = tempfile.mkdtemp(prefix="check-", dir=root)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(ctl)
                limit_memory(req.get("memory"))
                die_with_parent()
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.setpgid(0, 0)  # its group dies with it where there is no /proc to walk
                os.chdir(workdir)
                os.environ.update(dict.fromkeys(PRIVATE_DIRS, workdir))
                tempfile.tempdir = None  # tempfile's cached choice was the host's directory
                log = os.open(os.path.join(workdir, "output.log"), os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(log, 1), os.dup2(log, 2)  # the user's prints go to a file we ignore
                runner.serve(proto_in, proto_out, user_cwd, read_frame, write_frame,
                             lambda folder: shut_in(workdir, folder))
            except MemoryError:  # reading or writing a frame, past memory=
                code = 4
            except BaseException:
                code = 3
            finally:
                os._exit(code)
        current[0] = pid
        write_frame(ctl, {"pid": pid})
        rc, why = _wait(pid, time.monotonic() + float(req["timeout"]))
        current[0] = 0
        shutil.rmtree(workdir, ignore_errors=True)
        write_frame(ctl, {"exited": rc, "timed_out": why == "timed_out", "forked": why == "forked"})


# ----------------------------------------------------------------------------- the checker's side


def project_snapshot(root: Path = PROJECT_ROOT) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every project file: equal snapshots, nothing written."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in NOT_PROJECT]
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return out


class Child:
    """One forked child serving one user file: `ask` sends a request and returns the answer.

    Answers come over the data pipe, which the child holds; its pid and its exit come from the
    host over `ctl`, which it does not. A child that ends before we ask it to, or answers
    anything we did not ask for, spoils the host (what it left in the pipes, or started, could
    speak for the next file): closing such a child restarts the host."""

    def __init__(self, sandbox: "Sandbox", timeout: float):
        self.sandbox, self.deadline, self.timeout = sandbox, time.monotonic() + timeout, timeout
        self.exit: Optional[dict] = None
        self.spoiled = False
        sandbox._send({"cmd": "fork", "timeout": timeout, "memory": sandbox.memory})
        self.pid = sandbox._recv(time.monotonic() + 30, sandbox.ctl)["pid"]

    def ask(self, cmd: str, **fields) -> dict:
        if self.exit is not None:
            raise SandboxError(self._exit_words())
        box = self.sandbox
        try:
            box._send({"cmd": cmd, **fields})
        except SandboxError:  # the host is gone: did the child end first, reading the request?
            if not select.select([box.ctl], [], [], 0)[0]:
                raise
        ready, _, _ = select.select([box.data, box.ctl], [], [],
                                    max(0.0, self.deadline + 5 - time.monotonic()))
        if box.ctl in ready:  # it ended without answering (its host may have ended after it)
            self.exit, self.spoiled = box._recv(self.deadline + 5, box.ctl), True
            raise SandboxError(self._exit_words())
        from check_attention.sandbox.answers import BadAnswer, check_answer  # the checker's side
        try:
            answer = box._recv(self.deadline + 5, box.data)
            check_answer(cmd, fields, answer)
        except (SandboxError, BadAnswer) as exc:
            self.spoiled = True
            raise SandboxError(f"the layer's process sent a malformed answer to {cmd!r}: {exc}") \
                from None
        return answer

    def _exit_words(self) -> str:
        if self.exit["timed_out"]:
            return f"the layer's code took more than {self.timeout:g} s (timeout=) and was stopped"
        if self.exit.get("forked"):
            return f"the layer's code started more than {MAX_PROCESSES} processes and was stopped"
        rc = self.exit["exited"]
        if rc < 0:
            return f"the layer's process was killed by signal {-rc} ({signal.Signals(-rc).name})"
        if rc == 4:
            return "the layer's process ran out of memory between two calls (MemoryError)"
        return f"the layer's code ended its process (exit status {rc})"

    def close(self, abandon: bool = False) -> None:
        """Ask the child to end and read its exit; abandon: end its host at once instead (the
        checker is being stopped: Ctrl-C, SIGTERM), not after the layer's current call."""
        box = self.sandbox
        if abandon:
            self.exit = self.exit or {"exited": -signal.SIGKILL, "timed_out": False}
            box.close()
            return
        if self.exit is None and not self.spoiled:
            try:
                box._send({"cmd": "exit"})
                self.exit = box._recv(self.deadline + 5, box.ctl)
                if self.exit["exited"] != 0 or select.select([box.data], [], [], 0)[0]:
                    self.spoiled = True  # it failed at the end, or left a frame behind
            except (SandboxError, OSError):
                self.spoiled = True
        if self.spoiled:
            box.restart()
        self.exit = self.exit or {"exited": 0, "timed_out": False}

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        self.close(abandon=kind is not None and not issubclass(kind, Exception))


_open: "weakref.WeakSet[Sandbox]" = weakref.WeakSet()  # this process's hosts, for close_all


def close_all() -> None:
    """End every sandbox host of this process, and the check each is running, and remove their
    directories (a grading worker told to stop)."""
    for box in list(_open):
        box.close()


class Sandbox:
    """The host process. `child(timeout)` forks a fresh child for one user file; a Sandbox can
    serve many files one after the other (the tests check dozens with one host)."""

    def __init__(self, user_cwd: Optional[str] = None, project_root: Path = PROJECT_ROOT,
                 confine: bool = True, gpu: bool = False, memory: Optional[int] = None,
                 reads: tuple = ()):
        """confine=False skips confine.py (as on a system without its mechanisms); project_root
        is the tree the checker watches for changes when writes are not confined; gpu grants
        the GPU's device nodes; memory: the bytes each child may map beyond what the host holds
        (None: no limit; CUDA reserves far more address space than it uses, so none with gpu);
        reads: folders each check may also read."""
        self.project_root, self.reads = Path(project_root), [os.path.abspath(r) for r in reads]
        self.memory = None if gpu else memory
        self.user_cwd = os.path.abspath(user_cwd or os.getcwd())
        self.how = "open" if not confine else "gpu" if gpu else "cpu"
        self.gpu = gpu or not confine  # may the children use the GPU
        try:
            self._start()  # now: it imports torch while the checker does
        except SandboxError:
            pass  # said when it is first used (`confinement`), where a check reports it

    def _start(self) -> None:
        """Start the host in a directory of its own; a host that cannot start leaves nothing."""
        self.root = tempfile.mkdtemp(prefix="check_attention-")
        self.closed, self.proc, self._ready = False, None, None
        _open.add(self)
        env = {k: v for k, v in os.environ.items()  # PYTHONPATH kept: a file imports neighbours
               if k in KEPT_ENV or k.startswith(KEPT_ENV_PREFIXES)}
        env.update(dict.fromkeys(PRIVATE_DIRS, self.root), PYTHONDONTWRITEBYTECODE="1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        self.ctl, ctl = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-B", os.path.abspath(__file__), self.root, self.user_cwd,
                 self.how, str(ctl), *self.reads], pass_fds=(ctl,),
                cwd=self.root, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, start_new_session=True)  # no terminal to type into
        except OSError as exc:  # an interpreter we may not run, say
            self.close()
            raise SandboxError(f"the sandbox process could not start: {exc.strerror or exc} "
                               f"({sys.executable})") from None
        finally:
            os.close(ctl)
        self.data = self.proc.stdout.fileno()

    @property
    def confinement(self) -> str:
        """How the children are confined, in words (the `sandbox:` line)."""
        if self.closed:
            self._start()
        if self._ready is None:
            try:
                self._ready = self._recv(time.monotonic() + 120, self.ctl)
            except SandboxError as exc:
                self.close()  # its directory goes now, not when the process ends
                raise SandboxError(f"the sandbox process did not start ({exc})") from None
        return self._ready["confinement"]

    @property
    def writes_confined(self) -> bool:
        """Whether the kernel holds writes to the temporary directory (else the checker compares
        the project's files before and after)."""
        return "Landlock" in self.confinement

    def child(self, timeout: float) -> Child:
        self.confinement  # wait until the host is ready
        return Child(self, timeout)

    def _send(self, obj) -> None:
        try:
            write_frame(self.proc.stdin.fileno(), obj)
        except (BrokenPipeError, OSError):
            raise SandboxError("the sandbox process is gone") from None

    def _recv(self, deadline: float, fd: int) -> dict:
        try:
            answer = read_frame(fd, deadline)
        except TimeoutError:
            raise SandboxError("the sandbox process stopped answering") from None
        except EOFError:
            raise SandboxError("the sandbox process is gone") from None
        except Exception as exc:  # torch.load refused it: not a frame we could have asked for
            raise SandboxError(f"not a frame ({type(exc).__name__})") from None
        if not isinstance(answer, dict):
            raise SandboxError("not a dict")
        return answer

    def restart(self) -> None:
        """A new host for the next file; the old one ends with everything it started."""
        self.close()
        try:
            self._start()
        except SandboxError:
            pass  # as in __init__

    def close(self) -> None:
        """End the host (it kills its child and all below it first) and remove its directory.
        Closing twice is closing once; the next check starts a new host."""
        if self.closed:
            return
        self.closed = True
        _open.discard(self)
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                f.close()
        os.close(self.ctl)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CheckError(Exception):
    """A file or object the checker cannot use (the CLI prints it as one `error:` line)."""


def ask(child, cmd: str, **fields) -> dict:
    """child's answer to one request; CheckError with the child's own words when it has none."""
    try:
        answer = child.ask(cmd, **fields)
    except SandboxError as exc:
        raise CheckError(str(exc)) from None
    if "error" in answer:
        raise CheckError(answer["error"])
    return answer


if __name__ == "__main__":
    _host(*sys.argv[1:4], int(sys.argv[4]), *sys.argv[5:])

