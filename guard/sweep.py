"""A `-m` sweep, planned whole before Hydra runs any of it.

Hydra's sweeper expands `python train.py -m optim.lr=3e-3,2e-3 seed=1,2` into one job per
combination (an "arm") and gives each the directory `hydra.sweep.dir/<hydra.sweep.subdir>`,
which train.py's configs set to `${run_name}`. Left alone, that goes wrong in three ways: arms
that differ only in a value run_name does not mention (optim.lr) share one directory, so the
second finds the first's checkpoint and its launch record overwrites the first's; an invalid arm
in the middle is found only when its turn comes, after Hydra has made its directory; and the
sweep's directory can be an existing run, which Hydra writes into.

So `plan_sweep` expands the arms as Hydra's basic sweeper will, composes each arm's config as its
launcher will, checks every arm's values and memory and its directory exactly as a single run's
(guard/preflight.py), and names the directories before anything is written:

- an arm's directory is `hydra.sweep.dir/<hydra.sweep.subdir>`, as configured (run_name);
- when that does not tell the arms apart, every arm's name also gets the swept values that
  differ among the arms that would share a directory, e.g. `correct_seed1337_lr3e-3` and
  `correct_seed1337_lr2e-3` (the key's last part, then its value; `-` joins them when the value
  starts with a letter: `attention-mask_zero`).

Hydra then runs the plan: its hydra.sweep.dir is the resolved directory, and its
hydra.sweep.subdir is `${sweep_arm:}`, which names each job's directory from the plan.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from guard.cli import UserError, first_line, hydra_string, one_line
from guard.run_dir import is_run, resolved

SUBDIR = "${sweep_arm:}"
BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
MAX_NAME = 200  # a directory name's characters (file systems allow 255 bytes)


@dataclass
class Arm:
    """One job of the sweep: its overrides as Hydra records them, and its settled run."""

    overrides: tuple[str, ...]
    settled: object                    # guard.preflight.Settled
    names_before: Optional[set] = None  # entries of its directory, if it existed


@dataclass
class SweepPlan:
    sweep_dir: Path
    arms: list[Arm]
    created: list = field(default_factory=list)  # directories made for the sweep, innermost first
    names_before: Optional[set] = None            # entries of sweep_dir, if it existed

    def arm_at(self, output_dir: Path) -> Optional[Arm]:
        return next((a for a in self.arms if a.settled.run_dir == output_dir), None)

    def undo(self, trained: Callable[[Path], bool]) -> None:
        """The sweep failed: remove the directories of arms that never trained (and the sweep's
        own, if nothing else is left in it)."""
        for arm in self.arms:
            path = arm.settled.run_dir
            if not path.is_dir() or trained(path):
                continue
            _remove_new(path, arm.names_before)
            parent = path.parent
            while parent != self.sweep_dir and self.sweep_dir in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent
        if self.sweep_dir.is_dir():
            leftovers = set(os.listdir(self.sweep_dir)) - (self.names_before or set())
            if leftovers <= {"multirun.yaml", ".lock"}:
                _remove_new(self.sweep_dir, self.names_before)
                for parent in self.created[1:]:
                    try:
                        parent.rmdir()
                    except OSError:
                        break


def _remove_new(path: Path, names_before: Optional[set]) -> None:
    """Remove path, or (if it existed before) what is new in it."""
    if names_before is None:
        shutil.rmtree(path, ignore_errors=True)
        return
    for name in set(os.listdir(path)) - names_before:
        entry = path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- naming the arms

_names: dict[tuple[str, ...], str] = {}  # an arm's overrides -> its directory name (the resolver)


def _overrides(job: DictConfig) -> tuple[str, ...]:
    """A job's overrides as Hydra records them (unresolved: `run_name=r${seed}` stays so)."""
    return tuple(OmegaConf.to_container(job.hydra.overrides.task, resolve=False))


def _arm_name(*, _root_: DictConfig) -> str:
    key = _overrides(_root_)
    if key not in _names:
        raise UserError(f"this sweep job ({' '.join(key)}) was not planned by train.py; "
                        f"hydra.sweep.subdir={SUBDIR} works only as train.py sets it")
    return _names[key]


OmegaConf.register_new_resolver("sweep_arm", _arm_name, replace=True)


def _short(key: str) -> str:
    return key.lstrip("+~").split("@", 1)[0].rsplit(".", 1)[-1].rsplit("/", 1)[-1]


def _piece(key: str, value: str) -> str:
    value = re.sub(r"[^A-Za-z0-9._-]", "-", value) or "-"
    return f"{key}{value}" if value[0] in "0123456789.-" else f"{key}-{value}"


def arm_names(arms: list[list[str]], configured: list[str], swept: list[str]) -> list[str]:
    """The directory name of each arm: its configured subdir, and when two arms share one, also
    the swept values that differ among the arms sharing a name (the same keys for every arm)."""
    groups = defaultdict(list)
    for i, name in enumerate(configured):
        groups[name].append(i)
    values = [dict((o.split("=", 1) + [""])[:2] for o in arm) for arm in arms]  # (~key: "")
    keys = [k for k in swept if any(len({values[i].get(k) for i in group}) > 1
                                    for group in groups.values() if len(group) > 1)]
    if not keys:
        return configured
    shorts = [_short(k) for k in keys]
    labels = [s if shorts.count(s) == 1 else k.lstrip("+~") for s, k in zip(shorts, keys)]
    return ["_".join([name] + [_piece(label, values[i][k]) for label, k in zip(labels, keys)])
            for i, name in enumerate(configured)]


# ----------------------------------------------------------------------------- the plan


def plan_sweep(argv: list[str], settle: Callable, check_dir: Callable, create_dir: Callable
               ) -> tuple[list[str], SweepPlan]:
    """(the command line for Hydra, the plan) of `train.py -m <argv>`. settle(cfg, overrides,
    run_dir), check_dir(run_dir, output_subdir) and create_dir(path, unique) are preflight's,
    the checks a single run gets."""
    from hydra import initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    from training.config import CONF_DIR, register_configs

    register_configs()
    given = {a.split("=", 1)[0].lstrip("+~") for a in argv if "=" in a}
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration("config", list(argv), RunMode.MULTIRUN)
            h = master.hydra
            if h.sweeper._target_ != BASIC_SWEEPER or h.launcher._target_ != BASIC_LAUNCHER:
                raise UserError("train.py plans sweeps for Hydra's basic sweeper and launcher "
                                "only (hydra/sweeper=basic, hydra/launcher=basic)")
            params = [f"{k}={v}" for k, v in (h.sweeper.params or {}).items()]
            parser = OverridesParser.create(config_loader=loader)
            parsed = parser.parse_overrides(
                params + OmegaConf.to_container(h.overrides.task, resolve=False))
            swept = list(dict.fromkeys(o.get_key_element() for o in parsed
                                       if o.is_sweep_override()))
            arms = BasicSweeper.split_arguments(parsed, None)[0]
            HydraConfig.instance().set_config(master)
            sweep_dir = _resolve(master, "hydra.sweep.dir")
            if len(arms) > 4:
                print(f"checking the {len(arms)} arms of this sweep before the first one "
                      f"starts ...", file=sys.stderr)
            jobs = []
            for idx, arm in enumerate(arms):
                job = loader.load_sweep_config(master, list(arm))
                with open_dict(job):
                    job.hydra.job.id = idx
                    job.hydra.job.num = idx
                HydraConfig.instance().set_config(job)
                jobs.append((job, _resolve(job, "hydra.sweep.subdir")))
    except UserError:
        raise
    except Exception as exc:
        raise UserError(one_line(exc)) from exc
    if not sweep_dir:
        raise UserError("hydra.sweep.dir must be a directory path")
    if any(o.is_sweep_override() and o.key_or_group == "resume" for o in parsed) or any(
            job.get("resume") for job, _ in jobs):
        raise UserError("resume= continues one run in place and cannot be part of a -m sweep; "
                        "resume each run with python train.py resume=<run>")
    root = resolved(Path(sweep_dir))
    check_sweep_dir(root)
    names = arm_names([list(a) for a in arms], [s for _, s in jobs], swept)
    if len(set(names)) < len(names) or "hydra.sweep.subdir" in given and names != [s for _, s in jobs]:
        name = next(n for n in names if names.count(n) > 1) if len(set(names)) < len(names) \
            else next(s for (_, s), n in zip(jobs, names) if s != n)
        raise UserError(f"several arms of this sweep would write to {root / name}; set "
                        f"hydra.sweep.subdir so that it tells them apart (e.g. "
                        f"'${{run_name}}_${{optim.lr}}')")
    planned = []
    for (job, _), arm, name in zip(jobs, arms, names):
        if not name or len(name) > MAX_NAME:
            raise UserError(f"hydra.sweep.subdir gives the arm {' '.join(arm)} the directory "
                            f"name {name[:60]!r}: it must be 1 to {MAX_NAME} characters")
        path = resolved(root / name)
        if path == root or root not in path.parents:
            raise UserError(f"the arm {' '.join(arm)} would write to {path}, outside the sweep's "
                            f"directory {root} (hydra.sweep.subdir={name!r})")
        HydraConfig.instance().set_config(job)
        check_dir(path, job.hydra.output_subdir)
        task = job.copy()
        with open_dict(task):
            del task["hydra"]
        settled = settle(task, list(_overrides(job)), path)
        planned.append(Arm(_overrides(job), settled,
                           set(os.listdir(path)) if path.is_dir() else None))
    for a in planned:
        for b in planned:
            if a.settled.run_dir in b.settled.run_dir.parents:
                raise UserError(f"the arm in {b.settled.run_dir} would lie inside the arm in "
                                f"{a.settled.run_dir}; give hydra.sweep.subdir a flat name")
    made = create_dir(root, unique="hydra.sweep.dir" not in given)
    plan = SweepPlan(made.run_dir, planned, made.created, made.names_before)
    if plan.sweep_dir != root:  # the name was taken a moment ago: the arms move with it
        for arm in planned:
            arm.settled.run_dir = plan.sweep_dir / arm.settled.run_dir.relative_to(root)
    _names.clear()
    _names.update({arm.overrides: str(arm.settled.run_dir.relative_to(plan.sweep_dir))
                   for arm in planned})
    rest = [a for a in argv if a.split("=", 1)[0] not in ("hydra.sweep.dir", "hydra.sweep.subdir")]
    if "${" in str(plan.sweep_dir):
        raise UserError(f"the sweep directory {plan.sweep_dir} contains '${{', which Hydra would "
                        f"read as an interpolation; choose another hydra.sweep.dir")
    return ["-m", *rest, f"hydra.sweep.dir={hydra_string(str(plan.sweep_dir))}",
            f"hydra.sweep.subdir={SUBDIR}"], plan


def check_sweep_dir(path: Path) -> None:
    """A sweep's directory holds runs, and is none itself: not a run, not inside one, not another
    sweep's (its multirun.yaml would be overwritten)."""
    from training.checkpoint import holds_checkpoints

    if is_run(path) or holds_checkpoints(path):
        raise UserError(f"hydra.sweep.dir {path} is a run directory; a sweep goes into a "
                        f"directory of its own")
    for parent in path.parents:
        if is_run(parent) or holds_checkpoints(parent):
            raise UserError(f"hydra.sweep.dir {path} is inside the run {parent}; a sweep goes "
                            f"into a directory of its own")
    if os.path.lexists(path / "multirun.yaml"):
        raise UserError(f"hydra.sweep.dir {path} holds another sweep (its multirun.yaml); "
                        f"choose a new hydra.sweep.dir")
    if os.path.lexists(path) and not path.is_dir():
        raise UserError(f"cannot create the sweep directory {path}: it exists and is not a "
                        f"directory")


def _resolve(cfg: DictConfig, key: str) -> str:
    try:
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
    except Exception as exc:
        raise UserError(f"cannot resolve {key}: {first_line(exc)}") from None
    if not isinstance(value, (str, int)):
        raise UserError(f"{key} must be a directory path, got {value!r}")
    return str(value)
