"""Issue 28's hostile inputs to the scripts and to what they read: each class checked in process
(the checking function itself, fast), with one command per class run as a user would
(`@pytest.mark.slow`), which must end with exit code 2 and one `error:` line, in seconds.

    HANGS        a FIFO (or a device) named like a TensorBoard events file in a run directory
    CHECK_FIRST  scripts that wrote (or replaced) files before finding a mistake in their input;
                 values without the real bound (a layer past the last one)
    TRACEBACKS   a retired key (model.activation); scripts.llama_pitfalls' values
    FOLDERS      overrides that cannot apply to an imported model folder (init_from=)
    TENSORBOARD  the requirements allow only a TensorBoard whose command starts
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from safeio.cli import FileRefused, UserError
from helpers import REPO_ROOT, SCRIPT_ENV, one_error_line

TIMEOUT_S = 60  # a refusal takes a few seconds (imports); one that needs this long is hanging


def script(module: str, *args: str, cwd: Path, env: dict | None = None):
    """`python -m module args` in cwd, as a user would start it."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd,
                          env={**SCRIPT_ENV, "PYTHONPATH": str(REPO_ROOT), **(env or {})},
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def refused(result) -> str:
    assert result.returncode == 2, result
    return one_error_line(result)


# ----------------------------------------------------------------------------- hangs


def fifo_run(root: Path, name: str = "run") -> Path:
    """A run directory whose events file is a FIFO: reading it blocks until a writer comes."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    os.mkfifo(run / "events.out.tfevents.1700000000.host.1.0")
    return run


def test_an_events_fifo_is_refused_before_tensorboard_opens_it(tmp_path):
    from guard.run_dir import event_files, read_events

    run = fifo_run(tmp_path)
    with pytest.raises(FileRefused, match="FIFO"):
        read_events(run, {"scalars": 0})
    (run / "events.out.tfevents.1700000000.host.1.0").unlink()
    os.symlink("/dev/zero", run / "events.out.tfevents.2")  # a device never ends
    with pytest.raises(FileRefused, match="character device"):
        event_files(run)


@pytest.mark.slow
@pytest.mark.parametrize("module, arg", [("scripts.runs", "root"),
                                         ("scripts.summarize_ablations", "sweep")])
def test_scripts_reading_runs_refuse_an_events_fifo(tmp_path, module, arg):
    fifo_run(tmp_path / "study", "base-correct_seed0")
    line = refused(script(module, f"{arg}={tmp_path / 'study'}", cwd=tmp_path))
    assert "is a FIFO" in line and "events" in line


# ----------------------------------------------------------------------------- tracebacks


def test_a_retired_key_is_a_mistake_in_one_line(tmp_path):
    """model.activation (the old name of model.mlp) left the code with round 4's switches
    (guard/retired.py): a run directory that sets it reads as one line naming the commit."""
    from safeio.cli import FormatError
    from guard.run_dir import read_source

    (tmp_path / "config.yaml").write_text("model:\n  activation: gelu_tanh\n")
    with pytest.raises(FormatError, match=r"model.activation=gelu_tanh .*`git checkout \w+`"):
        read_source(tmp_path)


@pytest.mark.slow
def test_train_and_generate_with_a_retired_key_say_so_in_one_line(tmp_path):
    line = refused(subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "+experiment=smoke", "model.activation=gelu",
         f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=SCRIPT_ENV,
        capture_output=True, text=True, timeout=TIMEOUT_S))
    assert "model.activation is a switch train.py no longer has" in line and "git checkout" in line
    assert not (tmp_path / "run").exists()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.yaml").write_text("model:\n  activation: gelu\n")
    line = refused(subprocess.run(
        [sys.executable, str(REPO_ROOT / "generate.py"), f"run={tmp_path / 'old'}"], cwd=tmp_path,
        env=SCRIPT_ENV, capture_output=True, text=True, timeout=TIMEOUT_S))
    assert "config.yaml: model.activation=gelu is a switch" in line and "git checkout" in line


@pytest.mark.parametrize("arg, words", [
    ("seed=18446744073709551616", "seed must be an integer from 0 to 2**63 - 2"),
    ("seed=-1", "seed must be an integer from 0"),
    ("batch=1000000000", "batch must be at most 256, got 1,000,000,000"),
    ("batch=0", "batch must be from 1 to 256, got 0"),
    ("tokens=33", "tokens must be at most 32"),
])
def test_llama_pitfalls_values_have_their_real_bounds(arg, words):
    from safeio.cli import parse_key_values
    from scripts.llama_pitfalls import LlamaArgs, check_args

    with pytest.raises(UserError) as info:
        check_args(parse_key_values([arg], LlamaArgs, "usage"))
    assert words in str(info.value)


def test_llama_pitfalls_without_transformers_says_how_to_install_it(monkeypatch):
    from scripts.llama_pitfalls import LlamaArgs, check_args

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    with pytest.raises(UserError, match="pip install -r requirements-dev.txt"):
        check_args(LlamaArgs())
    # and says so up front: the first paragraph of its docstring is what --help prints first
    import scripts.llama_pitfalls as script
    assert "Needs transformers" in script.__doc__.split("\n\n")[0]


@pytest.mark.parametrize("module, args, words", [
    ("bench.batch_generate", ["quick=true", "tokens=-5", "prompts=[1]"], "tokens from 1 to"),
    ("bench.batch_generate", ["quick=true", "tokens=0"], "got prompts=[1, 4, 16] and tokens=0"),
    ("bench.batch_generate", ["quick=true", "tokens=1000000000"], "tokens from 1 to 100,000"),
    ("bench.batch_generate", ["quick=true", "prompts=[100000]"], "a KV cache of 19.8 GiB, over 4"),
    ("scripts.mask_values", ["eval_batches=1000000000"], "eval_batches from 1 to 1,000"),
])
def test_sizes_a_bench_or_script_would_allocate_are_bounded(module, args, words, capsys):
    """Round six's B01, B02, B04, B05, M05: a negative, zero or huge token count, 100,000 prompts
    in one batch, a billion evaluation batches gave tracebacks (a SIGSEGV for the last), or
    silently the default: each is one `error:` line before anything is allocated."""
    import importlib
    assert importlib.import_module(module).main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and words in err and "Traceback" not in err


@pytest.mark.slow
def test_llama_pitfalls_with_a_huge_seed_says_so_in_one_line(tmp_path):
    line = refused(script("scripts.llama_pitfalls", "seed=18446744073709551616", cwd=tmp_path))
    assert "2**63 - 2" in line


# ----------------------------------------------------------------------------- imported folders


@pytest.mark.parametrize("override", ["model.n_layer=8", "model.positions=rope", "+model.mlp=relu2",
                                      "tokenizer=char", "tokenizer.vocab_size=300", "+arch=gpt2",
                                      "model=tiny"])
def test_overrides_an_imported_folder_would_drop_are_refused_by_name(override):
    from guard.run_dir import refuse_folder_overrides

    with pytest.raises(UserError) as info:
        refuse_folder_overrides(["init_from=/models/llama", "train.max_steps=5", override])
    assert str(info.value).startswith(f"{override} cannot apply to an imported folder")


@pytest.mark.parametrize("argv", [
    ["init_from=/models/llama", "model.dropout=0.1", "model.attn_dropout=0", "train.max_steps=5"],
    ["model.n_layer=8", "tokenizer=char"],                       # no folder
    ["init_from=/models/llama", "resume=runs/x", "model.n_layer=8"],  # resume's own config
    ["init_from=null", "model.n_layer=8"],
])
def test_overrides_that_apply_are_let_through(argv):
    from guard.run_dir import refuse_folder_overrides

    refuse_folder_overrides(argv)


@pytest.mark.slow
def test_train_from_a_folder_with_a_model_override_says_which_in_one_line(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    line = refused(subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), f"init_from={folder}", "model.n_layer=8",
         f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=SCRIPT_ENV,
        capture_output=True, text=True, timeout=TIMEOUT_S))
    assert line.startswith("error: model.n_layer=8 cannot apply to an imported folder")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- check first


def test_attention_map_keeps_an_existing_picture_unless_told(tmp_path, capsys):
    """As every script (safeio/files.py): the refusal comes before the run is read."""
    from scripts.attention_map import main

    picture = tmp_path / "map.png"
    picture.write_bytes(b"committed")
    assert main([f"run={tmp_path / 'no_run'}", f"out={picture}"]) == 2
    assert "overwrite=true" in capsys.readouterr().err
    assert picture.read_bytes() == b"committed"
    assert main([f"run={tmp_path / 'no_run'}", f"out={picture}", "overwrite=true"]) == 2
    assert "does not exist" in capsys.readouterr().err  # past the check: the run is missing


# ----------------------------------------------------------------------------- a large corpus


def test_text_given_in_blocks_is_cut_as_the_whole_text():
    import random

    from data.tokenizer import ENCODE_CHUNK_CHARS, stream_chunks

    rng = random.Random(0)
    text = "".join(rng.choice(["word ", "\n", "\n\n", "é", "x" * 300]) for _ in range(20_000))
    whole = list(stream_chunks([text]))
    assert "".join(whole) == text and max(map(len, whole)) <= ENCODE_CHUNK_CHARS
    assert all(p.endswith("\n") for p in whole[:-1] if "\n" in p)  # cut after a line end
    for size in (1000, ENCODE_CHUNK_CHARS - 1, ENCODE_CHUNK_CHARS + 7, 10**6):
        blocks = [text[i:i + size] for i in range(0, len(text), size)]
        assert list(stream_chunks(blocks)) == whole, size


@pytest.mark.slow
def test_a_corpus_is_tokenized_in_memory_that_does_not_grow_with_it(tmp_path, monkeypatch):
    """Issue 28: a 300 MB text ended in MemoryError (one file, one Python string, then one Python
    list of its ids). Now a file is read in blocks and its ids written a call at a time: what
    Python holds at once is the same for a text 4 times longer (docs/data.md measures the whole
    process)."""
    import tracemalloc

    import data.corpus
    from data.config import DataConfig, Source, TokenizerConfig, TokenizerKind
    from data.prepare import prepare_corpus
    from helpers import shakespeare_like

    import data.prepare

    # blocks and calls far smaller than the texts (a call is 2 MB of text at full size)
    monkeypatch.setattr(data.corpus, "READ_BLOCK_CHARS", 1 << 16, raising=False)
    monkeypatch.setattr(data.prepare, "ENCODE_CALL_CHUNKS", 2, raising=False)  # (as it was)
    line = shakespeare_like(100_000, seed=4)
    (tmp_path / "val.txt").write_text(shakespeare_like(20_000, seed=5))

    def peak_bytes(copies: int) -> int:
        train = tmp_path / f"train{copies}.txt"
        train.write_text(line * copies)
        cfg = DataConfig(source=Source.text_files, train_files=[str(train)],
                         val_files=[str(tmp_path / "val.txt")], cache_dir=str(tmp_path / "cache"))
        tracemalloc.start()
        try:
            corpus = prepare_corpus(cfg, TokenizerConfig(kind=TokenizerKind.char))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert len(corpus.train) == corpus.n_chars["train"] == copies * len(line)
        assert corpus.tokenizer.decode(corpus.train[-len(line):].tolist()) == line
        return peak

    peak_bytes(1)  # (what is imported on first use is allocated once)
    small, large = peak_bytes(10), peak_bytes(40)  # 1 MB, 4 MB
    assert large < 1.5 * small and large < 4_000_000, \
        f"{small:,} bytes at once for 1 MB of text, {large:,} for 4 MB"


# ----------------------------------------------------------------------------- tensorboard


def test_the_requirements_pin_a_tensorboard_whose_command_starts():
    """TensorBoard 2.20's `tensorboard` command imports pkg_resources, which setuptools 82
    removed: it ended in a traceback. 2.21 starts."""
    from importlib.metadata import version

    line = next(r for r in (REPO_ROOT / "requirements-core.txt").read_text().splitlines()
                if r.startswith("tensorboard"))
    assert line.split("#")[0].strip() == "tensorboard>=2.21"
    assert tuple(int(p) for p in version("tensorboard").split(".")[:2]) >= (2, 21)


@pytest.mark.slow  # the command imports TensorBoard (seconds)
def test_the_tensorboard_command_starts():
    command = Path(sys.executable).with_name("tensorboard")
    result = subprocess.run([str(command), "--version"], capture_output=True, text=True,
                            timeout=TIMEOUT_S, env=SCRIPT_ENV)
    assert result.returncode == 0 and result.stdout.strip().startswith("2."), result.stderr
