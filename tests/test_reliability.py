"""Reliability of train.py and generate.py: kills at any instant, signals, unsafe or broken
checkpoints, non-finite losses, and every user mistake reported in one line.

Starting `python train.py` costs seconds of imports on this machine, and these tests start it
dozens of times. So, besides one genuine `python train.py` run (the uninterrupted reference),
the runs go through a small fork server: a Python process that imports what train.py and
generate.py import, once, then for each run forks a child that executes the script with
runpy as __main__ (exactly what `python train.py ARGS` executes, imports already warm), with
its own stdout/stderr files, its own pid to signal, and its exit status. That the forked,
killed and resumed runs equal the genuine process's run bit for bit is part of the kill test.

Every run's cwd is a temporary directory (train.py finds conf/ next to itself), so the
repository's runs/latest link is left alone. No network: the corpora are local files.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import REPO_ROOT, shakespeare_like
from training.checkpoint import latest_checkpoint, load_state

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
       "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
ENV.pop("HYDRA_FULL_ERROR", None)
STEPS, EVERY = 60, 10  # the reference run: 60 steps, a checkpoint every 10, the last 2 kept

SERVER = r"""
import json, os, runpy, sys, traceback
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
for line in sys.stdin:
    req = json.loads(line)
    if req["cmd"] == "wait":
        _, status = os.waitpid(req["pid"], 0)
        proto.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        continue
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid:
        proto.write(json.dumps({"pid": pid}) + "\n")
        continue
    code = 1
    try:
        os.chdir(req["cwd"])
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
    def __init__(self, rc: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = rc, stdout, stderr

    def __repr__(self):
        return f"exit {self.returncode}\n--- stdout\n{self.stdout[-2000:]}\n--- stderr\n{self.stderr[-3000:]}"


class ForkServer:
    def __init__(self, workdir: Path):
        self.workdir, self.count = workdir, 0
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, str(REPO_ROOT)], cwd=REPO_ROOT,
                                     env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.outs: dict[int, str] = {}

    def _ask(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the fork server died"
        return json.loads(line)

    def start(self, script: str, argv: list[str]) -> int:
        self.count += 1
        out = str(self.workdir / f"proc{self.count}")
        pid = self._ask({"cmd": "start", "script": script, "argv": argv, "cwd": str(self.workdir),
                         "out": out})["pid"]
        self.outs[pid] = out
        return pid

    def wait(self, pid: int) -> Result:
        rc = self._ask({"cmd": "wait", "pid": pid})["rc"]
        out = self.outs.pop(pid)
        return Result(rc, Path(out + ".stdout").read_text(), Path(out + ".stderr").read_text())

    def run(self, script: str, argv: list[str]) -> Result:
        return self.wait(self.start(script, argv))

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def alive(pid: int) -> bool:
    """Running (a child of the server: once it exits it is a zombie until waited for)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def ok(result: Result) -> Result:
    assert result.returncode == 0, result
    return result


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tree(root: Path) -> dict[str, str]:
    """Every path under root with a hash of its bytes: equal trees are byte-for-byte equal."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file()
            else "<dir>" for p in sorted(root.rglob("*"))}


def assert_loads(run_dir: Path) -> int:
    """`latest` names a checkpoint, and it and every other checkpoint on disk is complete and
    readable; the step of `latest`."""
    ckpt = latest_checkpoint(run_dir)
    assert ckpt is not None, f"{run_dir}: `latest` names no complete checkpoint"
    for each in (run_dir / "checkpoints").glob("step_*"):
        assert "tok_emb.weight" in load_file(str(each / "model.safetensors"))
        assert each.name == f"step_{load_state(each / 'state.pt')['step']:08d}"
    return load_state(ckpt / "state.pt")["step"]


def targets(argv: list[str]) -> list[Path]:
    """The existing run directories a command names: to be left untouched."""
    return [Path(a.split("=", 1)[1]) for a in argv if a.startswith(("resume=", "run=", "hydra.run.dir="))
            and Path(a.split("=", 1)[1]).is_dir()]


def one_error_line(result: Result) -> str:
    text = result.stdout + result.stderr
    assert "Traceback" not in text, result
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result
    assert result.stderr.strip().splitlines()[-1] == errors[0], result  # the last word, alone
    return errors[0]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The corpus, the fork server, and the uninterrupted reference run (a genuine process)."""
    root = tmp_path_factory.mktemp("reliability")
    (root / "corpus").mkdir()
    (root / "corpus" / "train.txt").write_text(shakespeare_like(50_000, seed=1))
    (root / "corpus" / "val.txt").write_text(shakespeare_like(8_000, seed=2))
    data = ["data=text_files", f"data.train_files=[{root / 'corpus' / 'train.txt'}]",
            f"data.val_files=[{root / 'corpus' / 'val.txt'}]", f"data.cache_dir={root / 'cache'}"]
    common = ["+experiment=smoke", *data, "train.threads=1", f"train.max_steps={STEPS}",
              f"train.eval_interval={EVERY}", "train.keep_checkpoints=2"]
    reference = root / "reference"
    proc = subprocess.Popen([sys.executable, str(REPO_ROOT / "train.py"), *common,
                             f"hydra.run.dir={reference}"], cwd=root, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server = ForkServer(root)  # imports while the reference trains
    out, err = proc.communicate(timeout=300)
    ok(Result(proc.returncode, out, err))
    yield dict(root=root, data=data, common=common, reference=reference, server=server,
               reference_tree=tree(reference))
    server.close()


@pytest.fixture(scope="module")
def reference(env):
    """The reference run dir, checked to be byte-for-byte as the reference run left it."""
    yield env["reference"]
    assert tree(env["reference"]) == env["reference_tree"]


# ----------------------------------------------------------------------------- kills and signals


def _new_entry(directory: Path, pattern: str, since_ns: int) -> bool:
    try:
        return any(p.stat().st_ctime_ns >= since_ns for p in directory.glob(pattern))
    except FileNotFoundError:  # gone between glob and stat
        return False


def test_kills_at_any_moment_and_sigint_resume_bit_exactly(env, reference):
    """Interrupt one run again and again, resuming it each time, until it has done its steps:
    its final weights and curves equal the uninterrupted reference run's exactly."""
    server, run_dir = env["server"], env["root"] / "interrupted"
    ckpts = run_dir / "checkpoints"
    rng = random.Random(20240605)
    # "random": a seeded random delay after training started (its event file appeared);
    # "saving": the moment a checkpoint's .tmp-step_* directory exists, i.e. mid-write.
    # SIGINT and SIGTERM must finish the step, save, and exit cleanly; SIGKILL can't be caught.
    plan = ["KILL random", "KILL saving", "INT random", "KILL random", "TERM random",
            "KILL saving", "KILL random"]
    log = []
    for what in plan:
        signame, trigger = what.split()
        signum = getattr(signal, "SIG" + signame)
        resume = latest_checkpoint(run_dir) is not None
        argv = ([f"resume={run_dir}", "train.threads=1"] if resume
                else [*env["common"], f"hydra.run.dir={run_dir}"])
        since = time.time_ns() - 1_000_000
        pid = server.start("train.py", argv)
        deadline = time.monotonic() + 60
        delay = rng.uniform(0.0, 0.3)
        fired = False
        while alive(pid) and time.monotonic() < deadline:
            if trigger == "saving" and _new_entry(ckpts, ".tmp-step_*", since):
                fired = True
            elif trigger == "random" and _new_entry(run_dir, "events.out.tfevents.*", since):
                time.sleep(delay)
                fired = alive(pid)
                if not fired:
                    break
            if fired:
                os.kill(pid, signum)
                break
            time.sleep(0.0005)
        if not fired and alive(pid):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{what}: the moment never came in 60 s\n{server.wait(pid)}")
        result = server.wait(pid)
        entry = dict(signal=signame, trigger=trigger, resumed=resume, rc=result.returncode)
        if trigger == "random":
            entry["delay_s"] = round(delay, 3)
        if trigger == "saving":
            entry["mid_write"] = [p.name for p in ckpts.glob(".tmp-step_*")]
        stopped = (result.returncode == -signal.SIGKILL if signame == "KILL"
                   else f"resume={run_dir}" in result.stderr)
        if not stopped:  # it finished before the signal came: allowed, but said
            ok(result)
            entry["finished_first"] = True
            log.append(entry)
            break
        if signame != "KILL":
            assert result.returncode in (0, 128 + signum), result
            assert "Traceback" not in result.stdout + result.stderr, result
        entry["latest_after"] = assert_loads(run_dir) if latest_checkpoint(run_dir) else None
        if signame != "KILL":
            # it saved where it stopped: the step it was at, not the last periodic checkpoint
            assert f"at step {entry['latest_after']};" in result.stderr, result
        log.append(entry)

    if not log[-1].get("finished_first"):
        final = ok(server.run("train.py", [f"resume={run_dir}", "train.threads=1"]))
        assert "resuming" in final.stderr
    kills = [e for e in log if e["signal"] == "KILL" and not e.get("finished_first")]
    print("\ninterruptions (latest_after = step of the checkpoint `latest` names afterwards):")
    for e in log:
        print("  ", e)
    assert len(kills) >= 4, log
    assert any(e.get("mid_write") for e in kills), log  # at least one kill mid-checkpoint
    assert any(e["signal"] == "INT" and not e.get("finished_first") for e in log), log

    last = f"step_{STEPS:08d}"
    a = load_file(str(reference / "checkpoints" / last / "model.safetensors"))
    b = load_file(str(ckpts / last / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (reference / "checkpoints" / last / "model.safetensors").read_bytes() == \
           (ckpts / last / "model.safetensors").read_bytes()
    assert load_file(str(reference / "checkpoints" / "best" / "model.safetensors")).keys() == a.keys()
    assert (reference / "checkpoints" / "best" / "model.safetensors").read_bytes() == \
           (ckpts / "best" / "model.safetensors").read_bytes()
    ev_a, ev_b = scalars(reference), scalars(run_dir)
    expected = [(s, v) for s, v in ev_a["train/loss"]]
    assert [s for s, _ in expected] == list(range(EVERY, STEPS + 1, EVERY))
    assert ev_b["train/loss"] == expected  # no duplicates, no gaps, same values
    for tag in ("val/loss", "lr", "grad_norm"):
        assert ev_b[tag] == ev_a[tag], tag
    # Keep the newest 2 + best, and no leftovers of interrupted writes. A caught signal saves
    # where it stopped (say step 51), and that checkpoint is newer than the periodic one before
    # it, so which 2 survive depends on where the signals landed: the newest 2 of all saved.
    saved = set(range(EVERY, STEPS + 1, EVERY))
    saved |= {e["latest_after"] for e in log if e["signal"] != "KILL" and e.get("latest_after")}
    newest = sorted(saved)[-2:]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(
        ["best", "latest", *(f"step_{s:08d}" for s in newest)])
    assert sorted(p.name for p in (reference / "checkpoints").iterdir()) == sorted(
        ["best", "latest", *[f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)][-2:]])


def test_resuming_a_finished_run_says_so(env, reference):
    result = ok(env["server"].run("train.py", [f"resume={reference}"]))
    assert "already finished" in result.stderr and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- non-finite losses


def test_nan_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(env):
    run_dir = env["root"] / "nan-stop"
    result = env["server"].run("train.py", [*env["common"], f"hydra.run.dir={run_dir}",
                                            "train.max_steps=40", "train.inject_nan_at_step=25"])
    assert result.returncode != 0
    line = one_error_line(result)
    assert "non-finite loss at step 25" in line and "step 20" in line, line
    assert assert_loads(run_dir) == 20
    assert not (run_dir / "checkpoints" / "step_00000030").exists()


def test_nan_loss_is_skipped_and_counted_when_configured(env):
    run_dir = env["root"] / "nan-skip"
    result = ok(env["server"].run("train.py", [*env["common"], f"hydra.run.dir={run_dir}",
                                               "train.max_steps=40", "train.inject_nan_at_step=25",
                                               "train.on_nonfinite=skip"]))
    assert "step 25: non-finite loss, step skipped" in result.stdout + result.stderr
    assert assert_loads(run_dir) == 40
    ev = scalars(run_dir)
    assert ev["train/skipped_steps"] == [(26, 1.0)]
    assert [s for s, _ in ev["train/loss"]] == [10, 20, 30, 40]
    assert all(v == v for _, v in ev["train/loss"])  # finite: the NaN never entered a mean
    assert load_state(latest_checkpoint(run_dir) / "state.pt")["skipped"] == 1


# ----------------------------------------------------------------------------- unsafe checkpoints


class _RunsCode:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.mark.parametrize("fmt", ["torch.save", "plain pickle"])
def test_checkpoint_whose_pickle_would_run_code_is_refused(env, reference, tmp_path, fmt):
    evil = tmp_path / "evil"
    shutil.copytree(reference, evil)
    marker = tmp_path / "pwned"
    state = {"step": 60, "optimizer": _RunsCode(f"touch {marker}")}
    target = latest_checkpoint(evil) / "state.pt"
    if fmt == "torch.save":
        torch.save(state, target)
    else:
        target.write_bytes(pickle.dumps(state))
    before = tree(evil)
    result = env["server"].run("train.py", [f"resume={evil}", "train.max_steps=80"])
    assert result.returncode != 0
    line = one_error_line(result)
    assert "refusing" in line and "posix.system" in line, line
    assert not marker.exists()
    assert tree(evil) == before


# ----------------------------------------------------------------------------- user mistakes


def _copy(reference: Path, tmp: Path) -> Path:
    shutil.copytree(reference, tmp / "copy")
    return tmp / "copy"


def _latest(run: Path) -> Path:
    return latest_checkpoint(run)


def _no_checkpoints(ref, tmp):
    run = _copy(ref, tmp)
    shutil.rmtree(run / "checkpoints")
    return run


def _dangling_latest(ref, tmp):
    run = _copy(ref, tmp)
    shutil.rmtree(_latest(run))
    return run


def _truncated_state(ref, tmp):
    run = _copy(ref, tmp)
    path = _latest(run) / "state.pt"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return run


def _truncated_weights(ref, tmp):
    run = _copy(ref, tmp)
    path = _latest(run) / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    return run


def _garbage_state(ref, tmp):
    run = _copy(ref, tmp)
    (_latest(run) / "state.pt").write_bytes(random.Random(0).randbytes(5000))
    return run


def _other_vocabulary(ref, tmp):
    """The latest (and best) weights swapped for ones of a 7-token-larger vocabulary."""
    run = _copy(ref, tmp)
    for path in (_latest(run) / "model.safetensors", run / "checkpoints" / "best" / "model.safetensors"):
        tensors = load_file(str(path))
        emb = tensors["tok_emb.weight"]
        tensors["tok_emb.weight"] = torch.cat([emb, torch.zeros(7, emb.shape[1])])
        save_file(tensors, str(path))
    return run


def _other_shape(ref, tmp):
    """config.yaml of a wider model than the weights."""
    run = _copy(ref, tmp)
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("n_embd: 32", "n_embd: 64"))
    return run


def _write(tmp, name, payload) -> Path:
    path = tmp / name
    path.write_bytes(payload if isinstance(payload, bytes) else payload.encode())
    return path


def _train_files(env, train: Path) -> list[str]:
    return [f"data.train_files=[{train}]"]


# (id, argv builder(env, reference, tmp) -> argv, word the error line must contain)
TRAIN_CASES = [
    ("n_embd_not_divisible", lambda e, r, t: ["model.n_head=3"], "divisible"),
    ("n_layer_zero", lambda e, r, t: ["model.n_layer=0"], "n_layer"),
    ("n_embd_negative", lambda e, r, t: ["model.n_embd=-32"], "n_embd"),
    ("block_size_zero", lambda e, r, t: ["model.block_size=0"], "block_size"),
    ("max_steps_zero", lambda e, r, t: ["train.max_steps=0"], "max_steps"),
    ("batch_size_negative", lambda e, r, t: ["train.batch_size=-1"], "batch_size"),
    ("dropout_one", lambda e, r, t: ["model.dropout=1.0"], "dropout"),
    ("dropout_negative", lambda e, r, t: ["model.dropout=-0.1"], "dropout"),
    ("lr_zero", lambda e, r, t: ["optim.lr=0"], "optim.lr"),
    ("lr_negative", lambda e, r, t: ["optim.lr=-1e-3"], "optim.lr"),
    ("unknown_key", lambda e, r, t: ["model.n_embed=64"], "n_embed"),
    ("unknown_option", lambda e, r, t: ["model=huge"], "model/huge"),
    ("wrong_type", lambda e, r, t: ["model.n_embd=wide"], "n_embd"),
    ("empty_corpus", lambda e, r, t: _train_files(e, _write(t, "empty.txt", "")), "empty"),
    ("corpus_shorter_than_a_block",
     lambda e, r, t: _train_files(e, _write(t, "short.txt", "ROMEO: hi")), "block_size"),
    ("missing_data_file", lambda e, r, t: _train_files(e, t / "nope.txt"), "no such file"),
    ("undecodable_data_file",
     lambda e, r, t: _train_files(e, _write(t, "bad.txt", b"ROMEO\xff\xfe: \x80hi\n" * 50)), "decode"),
    ("bpe_vocab_below_bytes", lambda e, r, t: ["tokenizer=bpe", "tokenizer.vocab_size=100"],
     "vocab_size"),
    ("run_dir_under_a_file",
     lambda e, r, t: [f"hydra.run.dir={_write(t, 'a_file', 'x') / 'run'}"], "not a directory"),
    ("run_dir_holds_a_checkpoint", lambda e, r, t: [f"hydra.run.dir={r}"],
     "already holds a checkpoint"),
    ("run_dir_holds_checkpoints_latest_does_not_name",
     lambda e, r, t: [f"hydra.run.dir={_dangling_latest(r, t)}"], "already holds a checkpoint"),
    ("resume_missing_dir", lambda e, r, t: [f"resume={t / 'nope'}"], "does not exist"),
    ("resume_without_checkpoint", lambda e, r, t: [f"resume={_no_checkpoints(r, t)}"],
     "no checkpoint"),
    ("resume_dangling_latest", lambda e, r, t: [f"resume={_dangling_latest(r, t)}"], "latest"),
    ("resume_truncated_state", lambda e, r, t: [f"resume={_truncated_state(r, t)}"], "truncated"),
    ("resume_truncated_weights", lambda e, r, t: [f"resume={_truncated_weights(r, t)}"],
     "truncated"),
    ("resume_corrupt_state", lambda e, r, t: [f"resume={_garbage_state(r, t)}"], "corrupt"),
    ("resume_other_vocabulary_weights", lambda e, r, t: [f"resume={_other_vocabulary(r, t)}"],
     "vocabulary"),
    ("resume_other_model_shape", lambda e, r, t: [f"resume={r}", "model.n_embd=64"],
     "model shape"),
    ("resume_other_corpus_vocabulary",
     lambda e, r, t: [f"resume={r}", "train.max_steps=80",
                      *_train_files(e, _write(t, "other.txt", shakespeare_like(9000, 3) + "Zß€\n"))],
     "tokenizer"),
]
if not torch.cuda.is_available():
    TRAIN_CASES.append(("cuda_without_a_gpu", lambda e, r, t: ["train.device=cuda"], "cuda"))
if os.geteuid() != 0:  # permissions do not bind root
    def _unreadable(t):
        path = _write(t, "secret.txt", shakespeare_like(3000))
        path.chmod(0)
        return path

    def _read_only_dir(t):
        (t / "ro").mkdir()
        (t / "ro").chmod(0o555)
        return t / "ro" / "run"

    TRAIN_CASES += [
        ("unreadable_data_file", lambda e, r, t: _train_files(e, _unreadable(t)), "permission"),
        ("run_dir_not_writable", lambda e, r, t: [f"hydra.run.dir={_read_only_dir(t)}"],
         "not writable"),
    ]

GENERATE_CASES = [
    ("temperature_zero", lambda r, t: [f"run={r}", "temperature=0"], "temperature"),
    ("temperature_negative", lambda r, t: [f"run={r}", "temperature=-1"], "temperature"),
    ("top_k_zero", lambda r, t: [f"run={r}", "top_k=0"], "top_k"),
    ("top_k_above_vocab", lambda r, t: [f"run={r}", "top_k=100000"], "top_k"),
    ("top_p_zero", lambda r, t: [f"run={r}", "top_p=0"], "top_p"),
    ("top_p_above_one", lambda r, t: [f"run={r}", "top_p=1.5"], "top_p"),
    ("max_new_tokens_negative", lambda r, t: [f"run={r}", "max_new_tokens=-1"], "max_new_tokens"),
    ("unknown_characters", lambda r, t: [f"run={r}", "prompt=ROMEO: ß"], "never saw"),
    ("unknown_key", lambda r, t: [f"run={r}", "temprature=0.5"], "temprature"),
    ("wrong_type", lambda r, t: [f"run={r}", "top_k=many"], "top_k"),
    ("not_key_value", lambda r, t: [f"run={r}", "ROMEO"], "key=value"),
    *([("cuda_without_a_gpu", lambda r, t: [f"run={r}", "device=cuda"], "cuda")]
      if not torch.cuda.is_available() else []),
    ("missing_run_dir", lambda r, t: [f"run={t / 'nope'}"], "does not exist"),
    ("run_without_checkpoint", lambda r, t: [f"run={_no_checkpoints(r, t)}"], "no checkpoint"),
    ("other_vocabulary_weights", lambda r, t: [f"run={_other_vocabulary(r, t)}"], "vocabulary"),
    ("other_model_shape", lambda r, t: [f"run={_other_shape(r, t)}"], "model shape"),
    ("truncated_weights", lambda r, t: [f"run={_truncated_weights(r, t)}", "weights=latest"],
     "truncated"),
]


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_train_reports_a_mistake_in_one_line_and_touches_no_run(env, reference, tmp_path, case):
    _, build, word = case
    argv = build(env, reference, tmp_path)
    if not any(a.startswith("resume=") for a in argv):
        argv = [*env["common"], *argv]
        if not any(a.startswith("hydra.run.dir=") for a in argv):
            argv.append(f"hydra.run.dir={tmp_path / 'run'}")
    before = {d: tree(d) for d in targets(argv)}
    result = env["server"].run("train.py", argv)
    assert result.returncode not in (0, 1), result  # 1 would be Hydra's own (multi-line) report
    line = one_error_line(result)
    print(line)
    assert word.lower() in line.lower(), line
    assert tree(reference) == env["reference_tree"]
    assert {d: tree(d) for d in before} == before


@pytest.mark.parametrize("case", GENERATE_CASES, ids=[c[0] for c in GENERATE_CASES])
def test_generate_reports_a_mistake_in_one_line(env, reference, tmp_path, case):
    _, build, word = case
    argv = build(reference, tmp_path)
    if not any(a.startswith("max_new_tokens=") for a in argv):
        argv.append("max_new_tokens=5")
    before = {d: tree(d) for d in targets(argv)}
    result = env["server"].run("generate.py", argv)
    assert result.returncode != 0, result
    line = one_error_line(result)
    print(line)
    assert word.lower() in line.lower(), line
    assert result.stdout == ""
    assert {d: tree(d) for d in before} == before


def test_generate_crops_a_prompt_longer_than_the_context_with_a_warning(env, reference):
    prompt = "ROMEO: " * 20  # 140 characters, context 32
    result = ok(env["server"].run("generate.py", [f"run={reference}", f"prompt={prompt}",
                                                  "max_new_tokens=5"]))
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "context" in warnings[0], result
    assert result.stdout.startswith(prompt[-32:]) and len(result.stdout.rstrip("\n")) >= 32 + 5


# ----------------------------------------------------------------------------- in-process units


def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path):
    """A kill between renaming step_20 into place and pointing `latest` at it leaves a newer
    checkpoint than `latest`; the resumed run then saves step 15 (SIGINT): with keep=1, step_20
    must not count as the newest and push step_15 out."""
    from training.checkpoint import save_checkpoint
    model = torch.nn.Linear(2, 2)
    state = {"step": 0}
    save_checkpoint(tmp_path, 10, model, state, keep=1)
    save_checkpoint(tmp_path, 20, model, state, keep=1)
    (tmp_path / "checkpoints" / "latest").write_text("step_00000010")  # as if killed before
    (tmp_path / "checkpoints" / ".tmp-step_00000030").mkdir()  # a write killed half-way
    save_checkpoint(tmp_path, 15, model, state, keep=1)
    assert latest_checkpoint(tmp_path).name == "step_00000015"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_00000015"]


def test_rng_state_round_trips_every_generator_through_a_weights_only_load(tmp_path):
    import numpy as np

    import train
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    random.random(), np.random.rand(7), np.random.randn(1), torch.rand(2)  # mid-stream, cached gauss
    saved = train.rng_state()
    torch.save({"rng": saved}, tmp_path / "s.pt")
    first = (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist())
    random.random(), np.random.rand(50), torch.rand(50)
    train.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    assert (random.random(), np.random.randn(3).tolist(), torch.rand(3).tolist()) == first
