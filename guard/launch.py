"""Starting what `python train.py <argv>` asks for, once every check has passed: each run's
directory made, its logging and its record, and the run trained; a `-m` sweep's arms, every one
checked first, handed to Hydra's launcher (guard/sweep.py).

What `@hydra.main` would do for a run is done by `Launch._begin`: its directory, its logging
(conf/hydra/job_logging) and the `.hydra/` record of its config and overrides. A resume writes no
`.hydra/` record. A new run that fails before it trained leaves nothing (`Launch.undo`); so does
a sweep none of whose runs trained.
"""
from __future__ import annotations

import json
import logging.config
import os
import shutil
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, read_write

from guard.compose import (compose_with_hydra, composing, help_text, parse_command,
                           select_path, task_config)
from guard.preflight import (SWEEP_RECORD, Job, check_new_run_dir, check_run, check_sweep_dir,
                             finished, recorded_sweep, resumed, started_training,
                             sweep_to_continue)
from guard.run_dir import check_resumable, refuse_folder_overrides, resolved, resume_target
from guard.sweep import MAX_NAME, STOP, Sweep, arm_names, expand, launch_sweep
from safeio.cli import UserError, exit_with, hydra_string, one_line, run_cli
from safeio.run_lock import lock_run, release_locks, remember_command
from safeio.system import parse_launch
from training.checkpoint import holds_checkpoints


@dataclass
class CreatedDir:
    """A directory this command created, or entered (names_before: what it held), to take back
    if its run fails before training; parents: the directories created above it, innermost
    first."""

    path: Path
    names_before: Optional[set] = None
    parents: list = field(default_factory=list)

    def undo(self) -> None:
        if not self.path.is_dir() or started_training(self.path):
            return
        if self.names_before is None:
            shutil.rmtree(self.path, ignore_errors=True)
            return self._remove_parents()
        for name in set(os.listdir(self.path)) - self.names_before:
            entry = self.path / name
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def _remove_parents(self) -> None:
        for parent in self.parents:  # only if left empty
            try:
                parent.rmdir()
            except OSError:
                break


@dataclass
class Launch:
    """What `python train.py <argv>` is to do, and what it created (to undo a failure)."""

    argv: list[str]
    rank: int = 0  # torchrun's (set by jobs): a rank > 0 checks what rank 0 does, writes nothing
    created: list = field(default_factory=list)
    sweep: Optional[Sweep] = None
    sweep_dir: Optional[CreatedDir] = None

    def undo(self) -> None:
        """Take back the directories of runs that never trained (and a sweep's own directory,
        if nothing but its records and lock are left in it)."""
        for created in reversed(self.created):
            created.undo()
        d = self.sweep_dir
        if d is not None and d.path.is_dir() and set(os.listdir(d.path)) - \
                (d.names_before or set()) <= {"multirun.yaml", SWEEP_RECORD, ".lock", STOP}:
            d.undo()

    def run(self, train: Callable[[Job], Optional[dict]], interrupted: str) -> None:
        """Train each job (train), every mistake one `error:` line, undoing what a failed new
        run created (HYDRA_FULL_ERROR=1 shows the traceback); exits with the status."""
        remember_command([sys.argv[0], *self.argv])  # the lock's holder, as the user typed it
        code = run_cli(lambda: self._train_all(train), undo=self.undo,
                       trace=os.environ.get("HYDRA_FULL_ERROR") == "1", interrupted=interrupted)
        release_locks()
        if self.sweep is None:
            exit_with(code)
        sys.exit(code)  # (at exit, a launcher's workers are shut down: loky's, Ray's)

    def _train_all(self, train: Callable[[Job], Optional[dict]]) -> Optional[int]:
        """Train the runs: one here, or a sweep's through Hydra's launcher."""
        jobs = self.plan()
        if self.sweep is not None:
            return launch_sweep(self.sweep, train)
        for job in jobs or ():
            if self.rank == 0:
                self._begin(job)
            train(job)
        return None

    def plan(self) -> Optional[list[Job]]:
        """Every run of the command, composed and checked, and the directories created that are
        created before the first trains (a sweep's own); None for --help and --cfg."""
        self.rank = parse_launch(os.environ).rank
        args, overrides = parse_command(self.argv)
        if self.rank == 0:
            refuse_folder_overrides(overrides)  # init_from= gives the shape and the tokenizer
        with composing():
            if args.multirun:
                if self.rank > 0:
                    raise UserError("a -m sweep cannot run under torchrun; run each arm with it")
                return self._plan_sweep(overrides)
            cfg = compose_with_hydra(overrides)
            if args.help or args.cfg:
                print(help_text(cfg, args.help) if args.help else OmegaConf.to_yaml(
                    {"job": task_config(cfg), "hydra": {"hydra": cfg.hydra}, "all": cfg}[
                        args.cfg or "all"], resolve=args.resolve))
                return None
            task = task_config(cfg)
            sweep = task.resume and self.rank == 0 and sweep_to_continue(task.resume)
            if sweep:
                return self._plan_sweep(recorded_sweep(sweep, overrides), continuing=sweep)
            return [self._plan_run(cfg)]

    def _plan_run(self, cfg: DictConfig) -> Job:
        task, overrides = task_config(cfg), list(cfg.hydra.overrides.task)
        given = {o.split("=", 1)[0] for o in cfg.hydra.overrides.hydra}
        if self.rank > 0:  # rank 0's directory: broadcast when training starts
            return Job(check_run(task, overrides, Path(".")), cfg, None)
        if task.resume:
            run = resume_target(task.resume)
            check_resumable(run)
            if "hydra.run.dir" in given and \
                    resolved(Path(select_path(cfg, "hydra.run.dir"))) != run:
                raise UserError(f"resume={task.resume} continues {run} in place; leave "
                                f"hydra.run.dir out (it names {cfg.hydra.run.dir})")
            checked = check_run(task, overrides, run)
            lock_run(run)  # after every check, before anything is written
            return Job(checked, cfg, None)
        path = resolved(Path(select_path(cfg, "hydra.run.dir")))
        unique = "hydra.run.dir" not in given
        check_new_run_dir(path, cfg.hydra.output_subdir, unique)
        checked = check_run(task, overrides, path)
        created = create_dir(path, unique)
        self.created.append(created)
        lock_run(created.path)
        return Job(replace(checked, run_dir=created.path), cfg, cfg.hydra.output_subdir)

    def _plan_sweep(self, overrides: list[str], continuing: Optional[Path] = None) -> list[Job]:
        """Every arm composed and checked, and the sweep's directory created (self.sweep: what
        Hydra's launcher is handed). continuing: the directory of this sweep, started before
        (resume=): its finished runs are left out, its started ones resumed, and the others
        start afresh."""
        parsed = [o for arg in overrides for o in OverridesParser.create().parse_overrides([arg])]
        hydra_lines = [o.input_line for o in parsed if o.is_hydra_override()]
        swept_hydra = [o.input_line for o in parsed
                       if o.is_hydra_override() and o.is_sweep_override()]
        if swept_hydra:
            raise UserError(f"sweeping over Hydra's own configuration ({swept_hydra[0]}) is not "
                            f"supported")
        master = compose_with_hydra([o.input_line for o in parsed if not o.is_sweep_override()])
        if master.hydra.runtime.choices.get("hydra/sweeper") != "basic":
            raise UserError("train.py runs sweeps with Hydra's basic sweeper (each arm checked "
                            "before the first trains); leave hydra/sweeper out")
        params = [f"{k}={v}" for k, v in (master.hydra.sweeper.params or {}).items()]
        try:
            task_lines = [o.input_line for o in parsed if not o.is_hydra_override()]
            arms, swept = expand(params + task_lines, GlobalHydra.instance().config_loader())
        except UserError:
            raise
        except Exception as exc:
            raise UserError(one_line(exc)) from exc
        if "resume" in swept or any(a.split("=", 1)[0] == "resume" for arm in arms for a in arm):
            raise UserError("resume= continues one run in place and cannot be part of a -m sweep; "
                            "resume each run with python train.py resume=<run>")
        root = resolved(Path(select_path(master, "hydra.sweep.dir")))
        if not continuing:
            check_sweep_dir(root)
        if len(arms) > 4:
            print(f"checking the {len(arms)} arms of this sweep before the first one starts ...",
                  file=sys.stderr)
        composed = []
        for i, arm in enumerate(arms):
            cfg = compose_with_hydra(hydra_lines + arm)
            OmegaConf.copy_cache(from_config=master, to_config=cfg)  # the same ${now:...}
            with read_write(cfg.hydra.job):
                cfg.hydra.job.num = cfg.hydra.job.id = i
            composed.append(cfg)
        configured = []
        for cfg in composed:
            HydraConfig.instance().set_config(cfg)
            configured.append(select_path(cfg, "hydra.sweep.subdir"))
        names = arm_names(arms, configured, swept)
        given = {a.split("=", 1)[0] for a in hydra_lines}
        shared = next((n for n in names if names.count(n) > 1), None)
        if shared or "hydra.sweep.subdir" in given and names != configured:
            raise UserError(f"several arms of this sweep would write to "
                            f"{root / (shared or configured[0])}; set hydra.sweep.subdir so that "
                            f"it tells them apart (e.g. '${{run_name}}_${{optim.lr}}')")
        jobs, launched = [], []
        for cfg, arm, name in zip(composed, arms, names):
            if not name or len(name) > MAX_NAME:
                raise UserError(f"hydra.sweep.subdir gives the arm {' '.join(arm)} the directory "
                                f"name {name[:60]!r}: it must be 1 to {MAX_NAME} characters")
            path = resolved(root / name)
            if root not in path.parents:
                raise UserError(f"the arm {' '.join(arm)} would write to {path}, outside the "
                                f"sweep's directory {root} (hydra.sweep.subdir={name!r})")
            if continuing and holds_checkpoints(path):  # a run of this sweep, started before
                if not finished(path):
                    jobs.append(Job(resumed(task_config(cfg), path), cfg, None, single=False))
                    launched.append(arm + [f"hydra.sweep.subdir={hydra_string(name)}"])
                continue
            check_new_run_dir(path, cfg.hydra.output_subdir)
            jobs.append(Job(check_run(task_config(cfg), arm, path), cfg, single=False))
            launched.append(arm + [f"hydra.sweep.subdir={hydra_string(name)}"])
        for a in jobs:
            for b in jobs:
                if a.checked.run_dir in b.checked.run_dir.parents:
                    raise UserError(f"the arm in {b.checked.run_dir} would lie inside the arm in "
                                    f"{a.checked.run_dir}; give hydra.sweep.subdir a flat name")
        self.sweep_dir = create_dir(root, unique="hydra.sweep.dir" not in given)
        lock_run(self.sweep_dir.path)
        path = self.sweep_dir.path
        if not continuing:
            OmegaConf.save(master, path / "multirun.yaml")
            record = {"overrides": overrides, "continue": "python train.py resume=<this directory>"}
            (path / SWEEP_RECORD).write_text(json.dumps(record, indent=1) + "\n")
        for job in jobs:  # the name was taken a moment ago: the arms move with it
            job.checked.run_dir = path / job.checked.run_dir.relative_to(root)
        with read_write(master.hydra.sweep):
            master.hydra.sweep.dir = str(path)  # where the launcher and each arm put their files
        where = f"hydra.sweep.dir={hydra_string(str(path))}"
        self.sweep = Sweep(master, path, jobs, [arm + [where] for arm in launched])
        return jobs

    def _begin(self, job: Job) -> None:
        """What @hydra.main would do for the run: its logging (train.log in its directory) and
        its record (.hydra/: config, hydra config, overrides)."""
        cfg, run_dir = job.composed, job.checked.run_dir
        with read_write(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = str(run_dir)
        HydraConfig.instance().set_config(cfg)
        logging.config.dictConfig(OmegaConf.to_container(cfg.hydra.job_logging, resolve=True))
        if job.record is not None:
            record = run_dir / job.record
            record.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(task_config(cfg), record / "config.yaml")
            OmegaConf.save({"hydra": cfg.hydra}, record / "hydra.yaml")
            OmegaConf.save(cfg.hydra.overrides.task, record / "overrides.yaml")


def create_dir(path: Path, unique: bool) -> CreatedDir:
    """Create a run's (or a sweep's) directory, recording what was created. With unique (the
    default timestamped name), a directory another run created in the same second is not shared:
    this one takes the name with _2, _3, ... appended."""
    missing = []
    parent = path.parent
    while not parent.exists():
        missing.append(parent)
        parent = parent.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for i in range(1, 1000):
            candidate = path if i == 1 else path.with_name(f"{path.name}_{i}")
            try:
                candidate.mkdir()
                return CreatedDir(candidate, parents=missing)
            except FileExistsError:
                if not unique:
                    return CreatedDir(candidate, names_before=set(os.listdir(candidate)))
    except OSError as exc:
        raise UserError(f"cannot create the run directory {path}: {exc.strerror}") from exc
    raise UserError(f"cannot create the run directory {path}: too many runs of that name")
