"""Old run directories and records/ keep loading after their switches left the code
(guard/retired.py): a retired key at its off value is dropped where a saved config is read, and
at any other value the run is refused in one line naming the commit that reads it; a command
line that sets one is refused the same way (tests/test_cli_errors.py, retired_switch)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from guard.retired import RETIRED, RETIRED_AFTER
from guard.run_dir import saved_config
from helpers import REPO_ROOT
from safeio.cli import FormatError
from training.config import Config

RECORDS = sorted((REPO_ROOT / "records").glob("*/seed*/config.yaml"))
ON = {False: True, 0.0: 0.5, 0: 64, None: "gelu", 1.0: 2.0}  # a value other than each off one


def written(tmp_path: Path, extra: dict) -> Path:
    """The default run's config.yaml (a record's), with `extra` set on top."""
    config = yaml.safe_load(RECORDS[0].read_text())
    for key, value in extra.items():
        group, name = key.split(".")
        config[group][name] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_there_are_records_and_each_holds_retired_keys_at_their_off_values():
    assert len(RECORDS) >= 8
    assert "value_residual: false" in RECORDS[0].read_text()


@pytest.mark.parametrize("path", RECORDS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_record_s_config_still_loads(path):
    cfg = saved_config(path)
    OmegaConf.to_object(cfg)
    for key in RETIRED:
        group, name = key.split(".")
        assert name not in cfg[group], key


def test_a_retired_key_at_its_off_value_is_dropped_and_changes_nothing(tmp_path):
    plain = OmegaConf.to_object(saved_config(written(tmp_path, {})))
    every_off = OmegaConf.to_object(saved_config(written(
        tmp_path, {key: off for key, (off, _) in RETIRED.items()})))
    assert isinstance(every_off, Config) and every_off == plain


@pytest.mark.parametrize("key", list(RETIRED))
def test_a_retired_key_at_another_value_is_refused_naming_the_commit(tmp_path, key):
    off, commit = RETIRED[key]
    with pytest.raises(FormatError) as refused:
        saved_config(written(tmp_path, {key: ON[off]}))
    message = str(refused.value)
    assert f"{key}=" in message and f"`git checkout {commit}`" in message
    assert "\n" not in message


@pytest.mark.parametrize("commit", list(RETIRED_AFTER))
def test_each_named_commit_has_its_retired_keys(commit):
    """Where the history is there (a clone, not an archive), the commit's schema holds each key
    it is named for."""
    try:
        schema = subprocess.run(
            ["git", "show", f"{commit}:model/config.py", f"{commit}:training/config.py",
             f"{commit}:data/config.py"], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=30)
    except OSError:
        pytest.skip("no git here")
    if schema.returncode != 0:
        pytest.skip(f"{commit} is not in this checkout's history")
    for key in RETIRED_AFTER[commit]:
        assert f"    {key.split('.')[1]}: " in schema.stdout, key
