"""A `-m` sweep's arms, and the name of each arm's directory.

`python train.py -m optim.lr=3e-3,2e-3 seed=1,2` trains one run per combination (an "arm"), as
Hydra's basic sweeper would: the swept values of the config (`hydra.sweeper.params`, e.g.
+experiment=ablations) and then of the command line, a key given twice keeping its first place and
its last values. guard/preflight.py composes and checks every arm before the first one trains.

An arm's directory is `hydra.sweep.dir/<hydra.sweep.subdir>`, by default its run_name. Arms that
differ only in a value run_name does not mention (optim.lr) would share one directory, so when the
configured names do not tell the arms apart, every arm's name also gets the swept values that
differ among the arms that would share a directory, e.g. `correct_seed1337_lr0.003` and
`correct_seed1337_lr0.002` (the key's last part, then its value; `-` joins them when the value
starts with a letter: `attention-mask_zero`).
"""
from __future__ import annotations

import itertools
import re
from collections import defaultdict

from hydra.core.override_parser.overrides_parser import OverridesParser

from safeio.cli import UserError

MAX_NAME = 200  # a directory name's characters (file systems allow 255 bytes)


def expand(overrides: list[str], config_loader) -> tuple[list[list[str]], list[str]]:
    """(each arm's overrides, the keys swept) of a sweep's overrides, in Hydra's order. The config
    loader lists a group's options for `glob(*)`."""
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(overrides)
    values = {}  # key -> ["key=value", ...]: a later override of a key keeps its first place
    for o in parsed:
        key = o.get_key_element()
        if o.is_sweep_override() and not o.is_discrete_sweep():
            raise UserError(f"{o.input_line}: a sweep over an interval cannot be listed; give the "
                            f"values (key=a,b,c) or range(start,stop,step)")
        values[key] = [f"{key}={v}" for v in o.sweep_string_iterator()] \
            if o.is_sweep_override() else [f"{key}={o.get_value_element_as_str()}"]
    swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    return [list(arm) for arm in itertools.product(*values.values())], list(dict.fromkeys(swept))


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
