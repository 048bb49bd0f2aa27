"""Start train.py and generate.py in well under a second: a fork server.

Starting `python train.py` costs seconds of imports on a small machine, and the reliability and
bad-input tests start it hundreds of times. The fork server is a Python process that imports what
train.py and generate.py import, once; for each run it forks a child that executes the script
with runpy as __main__ (exactly what `python train.py ARGS` executes, imports already warm), in
the given working directory, with its own stdout/stderr files, its own pid (and process group) to
signal, and its exit status. A run that outlives its timeout is killed with its whole process
group and reported as timed out. That forked runs equal genuine ones bit for bit is checked by
tests/test_reliability.py, which compares them with a genuine `python train.py` run.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Optional

from helpers import REPO_ROOT, SCRIPT_ENV

SERVER = r"""
import json, os, runpy, signal, sys, time, traceback
repo = sys.argv[1]
sys.path.insert(0, repo)
os.chdir(repo)
import datasets, torch.utils.tensorboard  # what train.py / generate.py import, warm once
import train, generate
import torch, torch._dynamo  # lazily imported by the first optimizer: warm it too
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
from hydra import compose, initialize_config_dir  # and Hydra's parsers, by one composition
from hydra.core.global_hydra import GlobalHydra
with initialize_config_dir(config_dir=os.path.join(repo, "conf"), version_base="1.3"):
    compose("config", overrides=["+experiment=smoke"], return_hydra_config=True)
GlobalHydra.instance().clear()
proto = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # stray prints cannot corrupt the protocol

def wait(pid, timeout):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return {"rc": os.waitstatus_to_exitcode(status), "timed_out": False}
        if time.monotonic() > deadline:
            for kill in (os.killpg, os.kill):  # the group, or the child not yet in its own
                try:
                    kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _, status = os.waitpid(pid, 0)
            return {"rc": os.waitstatus_to_exitcode(status), "timed_out": True}
        time.sleep(0.002)

for line in sys.stdin:
    req = json.loads(line)
    if req["cmd"] == "wait":
        proto.write(json.dumps(wait(req["pid"], req.get("timeout"))) + "\n")
        continue
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid:
        proto.write(json.dumps({"pid": pid}) + "\n")
        continue
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills whatever it started too
        os.chdir(req["cwd"])
        for key, value in req.get("env", {}).items():  # None unsets
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, suffix in ((1, ".stdout"), (2, ".stderr")):
            os.dup2(os.open(req["out"] + suffix, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        script = os.path.join(repo, req["script"])
        sys.argv = [script, *req["argv"]]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
"""


class Result:
    """What a run left: its exit status, its output, and whether it had to be killed."""

    def __init__(self, rc: int, stdout: str, stderr: str, timed_out: bool = False):
        self.returncode, self.stdout, self.stderr, self.timed_out = rc, stdout, stderr, timed_out

    def __repr__(self):
        return (f"exit {self.returncode}{' (killed: timed out)' if self.timed_out else ''}\n"
                f"--- stdout\n{self.stdout[-2000:]}\n--- stderr\n{self.stderr[-3000:]}")


class ForkServer:
    """Runs train.py / generate.py from a warm process. `outdir` receives each run's
    stdout/stderr files; each run's working directory is given per run (default: outdir)."""

    def __init__(self, outdir: Path):
        self.outdir, self.count = Path(outdir), 0
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(REPO_ROOT)], cwd=REPO_ROOT,
                                     env=SCRIPT_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.outs: dict[int, str] = {}

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def start(self, script: str, argv: list[str], cwd: Optional[Path] = None,
              env: Optional[dict] = None) -> int:
        """env: variables to set (None: to unset) in the run's environment."""
        self.count += 1
        out = str(self.outdir / f"proc{self.count}")
        pid = self._ask({"cmd": "start", "script": script, "argv": [str(a) for a in argv],
                         "cwd": str(cwd or self.outdir), "out": out, "env": env or {}})["pid"]
        self.outs[pid] = out
        return pid

    def wait(self, pid: int, timeout: Optional[float] = None) -> Result:
        reply = self._ask({"cmd": "wait", "pid": pid, "timeout": timeout})
        out = self.outs.pop(pid)
        texts = [Path(out + suffix).read_text(errors="replace") for suffix in (".stdout", ".stderr")]
        return Result(reply["rc"], *texts, timed_out=reply["timed_out"])

    def run(self, script: str, argv: list[str], cwd: Optional[Path] = None,
            timeout: Optional[float] = None, env: Optional[dict] = None) -> Result:
        return self.wait(self.start(script, argv, cwd, env), timeout)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def alive(pid: int) -> bool:
    """Running (a child of the server: once it exits it is a zombie until waited for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
