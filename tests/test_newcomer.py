"""A newcomer's first hour (issue 50): the README's Start here path followed as written, in a new
shell; the summary's figures labelled with what they cover; a misspelt key answered with the key
meant; `train.py --help` short, and describing the keys; TensorBoard opening on the losses; the
package installable. The slow test runs the path itself: a one-minute pitfall run, the command
its summary prints, its map, its log and scripts.runs, each in a shell as the README says.
"""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO_ROOT, corpus_args, write_corpus

README = REPO_ROOT / "README.md"
DOCS = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]


# ----------------------------------------------------------------------------- the README


def test_the_readme_is_short_and_leaves_machine_figures_to_results_md():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    for word in ("EPYC", "Xeon", "Zen", "x slower", "x faster", "AVX"):
        assert word not in text, f"README names {word!r}: machine figures live in docs/results.md"
    start = text.index("## Start here")
    assert "+arm=leak-mask_zero" in text[start:] and "tensorboard --logdir runs/pitfalls" in text


def test_the_readme_s_line_ranges_begin_where_it_says():
    """`model/attention.py` lines A-B: `name` must start at name's definition (a shift in the
    file would send a reader to the wrong lines)."""
    text = README.read_text()
    ranges = re.findall(r"`(model/\w+\.py)` lines (\d+)-(\d+): `(\w+)`", text)
    ranges += [(ranges[0][0], a, b, name)
               for a, b, name in re.findall(r"then lines (\d+)-(\d+):\s+`(\w+)`", text)]
    assert len(ranges) >= 2, ranges
    for path, first, last, name in ranges:
        lines = (REPO_ROOT / path).read_text().splitlines()
        assert re.match(rf"(def|class) {name}\b", lines[int(first) - 1]), (path, first, name)
        assert lines[int(last)].strip() == "", f"{path}: line {last} ends no definition"


def test_the_docs_run_commands_one_way_in_the_activated_environment():
    """The README says once how to enter the environment in a new shell, and no page mixes in
    `.venv/bin/python`-style commands, which would suggest the plain ones need no environment."""
    text = README.read_text()
    assert re.search(r"in a new shell[^`]*`\. \.venv/bin/activate`", text)
    for page in DOCS:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.search(r"\.venv/bin/(python|pip|tensorboard|pytest)", line), \
                f"{page.name}:{n}: {line.strip()}"


def test_a_hint_prints_the_interpreter_as_the_shell_finds_it(tmp_path, monkeypatch):
    from safeio.cli import python_command

    monkeypatch.setenv("PATH", str(tmp_path))  # a shell where `python` is not this interpreter
    monkeypatch.chdir(tmp_path)
    assert python_command() == sys.executable
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # an activated environment
    assert python_command() == "python"


# ----------------------------------------------------------------------------- figures and words


def test_the_summary_says_which_batches_each_loss_covers(caplog):
    import train

    metrics = {"steps": 400, "tokens_seen": 409600, "train_time_min": 0.2, "tokens_per_sec": 4e4,
               "train_loss": 0.09, "val_loss": 0.1, "causal_val_loss": 7.0,
               "cached_val_loss": 7.0, "cache_gap": 1e-7, "eval_batches": 20,
               "cached_batches": 4, "log_interval": 10, "leaky": False, "best_step": 400,
               "fewer_steps": "train.max_minutes=1 stopped it at step 400 of train.max_steps=800"}
    with caplog.at_level(logging.INFO, logger="train"):
        train.report(metrics, Path("runs/x"))
    text = caplog.text
    assert "causal val loss (20 eval batches)" in text
    assert "cached val loss (decoding; first 4 batches)" in text
    assert "cache gap (cached - causal, same 4)" in text
    assert "train loss (last 10 steps)" in text
    assert "fewer steps than configured: train.max_minutes=1 stopped it" in text


def test_a_leak_too_short_to_show_says_so(caplog):
    import train

    metrics = {"steps": 60, "causal_val_loss": 3.17, "leaky": True, "best_step": 60,
               "attention": "mask_zero"}
    with caplog.at_level(logging.INFO, logger="train"):
        train.report(metrics, Path("runs/x"))
    assert "60 steps were too few to show it" in caplog.text
    assert "train.py +arm=leak-mask_zero" in caplog.text


def test_a_misspelt_key_is_answered_with_the_key_meant():
    from guard.compose import compose
    from safeio.cli import UserError

    for given, meant in [("model.n_layers=2", "model.n_layer"), ("n_layers=2", "model.n_layer"),
                         ("+model.n_layers=2", "model.n_layer"),
                         ("train.max_step=5", "train.max_steps")]:
        with pytest.raises(UserError) as info:
            compose([given])
        message = str(info.value)
        assert f"did you mean {meant}?" in message, message
        assert "+model" not in message and "To append" not in message, message  # no wrong advice
    with pytest.raises(UserError, match=r"^xyz is not a key of the config \("):
        compose(["xyz=1"])


def _help(form: str = "short") -> str:
    from guard.compose import compose_with_hydra, composing, help_text

    with composing():
        return help_text(compose_with_hydra([]), form)


def test_train_help_is_short_and_describes_the_keys_from_the_dataclasses():
    from guard.compose import COMMON_KEYS, config_keys

    short = _help()
    assert len(short.splitlines()) <= 45  # it was 140 lines of raw config
    assert "  attention: " in short and "correct*" in short and "+arm: " in short  # the groups
    assert re.search(r"train\.max_steps=2500 +Steps to train, the same on every machine", short)
    assert re.search(r"model\.n_layer=4 +transformer blocks", short)
    for key in COMMON_KEYS:
        row = next(line for line in short.splitlines() if line.startswith(f"  {key}="))
        assert len(row.split(None, 1)) == 2, f"{key} has no description"
    every = _help("all")
    keys = config_keys()
    assert all(f"  {key}=" in every for key in keys) and len(keys) > 90
    assert all(words for words in keys.values())  # a comment, an enum's values, or a type
    assert "train.max_steps=2500\n      Steps to train" in every
    assert "model.n_layer" not in _help("train")


def test_scripts_runs_ranks_char_and_bpe_runs_per_character(monkeypatch, tmp_path):
    """A char run's 1.5 nats/token is 1.5 nats/char; a BPE run's 3.9 nats/token at 3 characters a
    token is 1.3 nats/char, the better run."""
    import scripts.runs as runs

    char, bpe = tmp_path / "char", tmp_path / "bpe"
    scores = {char: {("causal val", "nats/token"): 1.5, ("causal val", "nats/char"): 1.5},
              bpe: {("causal val", "nats/token"): 3.9, ("causal val", "nats/char"): 1.3}}
    for run in scores:
        run.mkdir()
        scores[run].update(attention="correct", tokenizer=run.name, corpus="shakespeare")
    monkeypatch.setattr(runs, "find_runs", lambda root: [char, bpe])
    monkeypatch.setattr(runs, "read_scores", lambda run: scores[run])
    table = runs.list_runs(tmp_path, "score").splitlines()
    assert table[2].startswith("bpe") and table[3].startswith("char"), table


def test_scripts_runs_puts_each_corpus_in_a_table_of_its_own(monkeypatch, tmp_path):
    """Lesson 04's made-up play scores 0.45 nats/char where Shakespeare scores 2.2: one table
    would rank a lesson's run first; a table per corpus, each run's corpus named."""
    import scripts.runs as runs

    corpora = {"play": "runs/lesson04/corpus/train.txt", "shake": "shakespeare",
               "play2": "runs/lesson04/corpus/train.txt"}
    scores = {tmp_path / name: {("causal val", "nats/char"): 0.45 if "play" in name else 2.2,
                                "attention": "correct", "tokenizer": "char", "corpus": corpus}
              for name, corpus in corpora.items()}
    for run in scores:
        run.mkdir()
    monkeypatch.setattr(runs, "find_runs", lambda root: list(scores))
    monkeypatch.setattr(runs, "read_scores", lambda run: scores[run])
    first, second = runs.list_runs(tmp_path, "score").split("\n\n")
    assert [row.split()[:2] for row in first.splitlines()[2:]] == \
        [["play", corpora["play"]], ["play2", corpora["play"]]]
    assert [row.split()[:2] for row in second.splitlines()[2:-1]] == [["shake", "shakespeare"]]
    assert second.splitlines()[-1].endswith("on 2 corpora (a table each: scores compare within one)")


def test_scripts_runs_names_a_run_s_corpus(monkeypatch, tmp_path):
    from data.config import DataConfig, Source
    from scripts.runs import corpus_name

    monkeypatch.chdir(tmp_path)
    assert corpus_name(DataConfig()) == "shakespeare"
    assert corpus_name(DataConfig(source=Source.hub, hub_name="roneneldan/TinyStories")) == \
        "hub roneneldan/TinyStories"
    files = DataConfig(source=Source.text_files, train_files=[str(tmp_path / "c" / "a.txt"), "b"])
    assert corpus_name(files) == "c/a.txt +1"


def test_tensorboard_s_first_two_sections_are_the_losses():
    """TensorBoard's Time Series tab (where it opens) sorts the cards by tag, groups them by the
    tag's first part and expands the first two groups: those must be train/ and val/."""
    from training.tb import MAP_GROUP

    tags = ["train/loss", "val/causal_loss", f"{MAP_GROUP}/attention_layer0",
            f"{MAP_GROUP}/decoding_layer0", "weights/entropy/layer0"]
    assert tensorboard_groups(tags)[:2] == ["train", "val"]


def test_each_run_carries_the_leak_layout_the_readme_opens(tmp_path):
    """The README's TensorBoard address opens the Custom Scalars tab, which shows the layout each
    run writes with its config: train/loss and val/causal_loss, each chart matching its tag only."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from torch.utils.tensorboard import SummaryWriter

    from tools.tensorboard_screenshots import LEAK_PAGE
    from training.config import Config
    from training.tb import write_config

    assert f"http://localhost:6006{LEAK_PAGE}" in README.read_text()
    writer = SummaryWriter(str(tmp_path))
    write_config(writer, Config())
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    [event] = events.Tensors("custom_scalars__config__")
    layout = layout_pb2.Layout.FromString(event.tensor_proto.string_val[0])
    [category] = layout.category
    charts = [list(chart.multiline.tag) for chart in category.chart]
    tags = ["train/loss", "val/causal_loss", "val/loss", "val/causal_loss_full", "train/lr"]
    assert [[t for t in tags if any(re.search(p, t) for p in chart)] for chart in charts] == \
        [["train/loss"], ["val/causal_loss"]]


def tensorboard_groups(tags: list[str]) -> list[str]:
    """The Time Series tab's sections, in its order (its tags sorted, numbers as numbers)."""
    def natural(tag):
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]
    return list(dict.fromkeys(tag.split("/", 1)[0] for tag in sorted(tags, key=natural)))


# ----------------------------------------------------------------------------- the package


def test_pyproject_installs_the_library_with_the_requirements_list():
    """`pip install -e .` makes every floor of tests/test_layers.py importable (check_attention
    among them), its dependencies read from requirements-core.txt, the one list, which must hold
    requirements only (setuptools refuses a pip option there); torch==2.13.0 as pinned there (the
    CPU wheel, 2.13.0+cpu, satisfies it: nothing else is pulled)."""
    from test_layers import FLOORS

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    listed = project["tool"]["setuptools"]["dynamic"]["dependencies"]["file"]
    assert listed == ["requirements-core.txt"]
    found = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert set(FLOORS) <= set(found) and "check_attention.*" in found
    assert (REPO_ROOT / "check_attention" / "sandbox" / "__init__.py").is_file()
    lines = [line.split("#")[0].strip() for line in (REPO_ROOT / listed[0]).read_text().splitlines()]
    assert "torch==2.13.0" in lines and not any(line.startswith("-") for line in lines)
    assert "pip install -e ." in README.read_text()


def requirement_options(name: str) -> list[str]:
    """The pip options of a requirements file and of those it includes (-r), in order."""
    out = []
    for line in (REPO_ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            out += requirement_options(line[3:].strip())
        elif line.startswith("-"):
            out.append(line)
    return out


def test_every_install_the_docs_give_takes_pytorch_s_cpu_build():
    """On Linux, PyPI's torch==2.13.0 is the CUDA build (2.7 GB with its nvidia-* wheels); each
    requirements file the docs install reaches PyTorch's CPU index, where pip takes 2.13.0+cpu
    (192 MB), and requirements.txt, the README's first command, says so first."""
    index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-lessons.txt"):
        assert requirement_options(name) == [index], name
    first = next(line for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
                 if not line.startswith("#"))
    assert first == index


# ----------------------------------------------------------------------------- in a new shell


def new_shell(command: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """`command` in a fresh bash, as a learner opens one: no virtualenv on PATH, none active,
    then the README's line for a new shell."""
    activate = re.search(r"in a new shell[^`]*`([^`]+)`", README.read_text()).group(1)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != Path(sys.executable).parent.resolve())
    env = {"PATH": path, "HOME": os.environ.get("HOME", str(cwd)), "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(["bash", "-c", f"{activate} && {command}"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a 400-step pitfall run and five more commands: about a minute on 2 cores
def test_start_here_in_a_new_shell(tmp_path):
    """Start here, step 2 and 3, as written (the corpus a local one, as tests have no network):
    each command in a new shell; the sample command the summary prints runs as printed."""
    if not (REPO_ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the repository (the README's commands make one)")
    work = tmp_path / "clone"
    work.mkdir()
    for entry in REPO_ROOT.iterdir():  # the repository, as a learner's checkout: runs/ its own
        if entry.name not in (".git", "runs", ".cache", "outputs"):
            (work / entry.name).symlink_to(entry)
    corpus = write_corpus(tmp_path, 60_000, 10_000)
    data = " ".join(f"'{a}'" for a in corpus_args(corpus, tmp_path / "cache"))

    trained = new_shell(f"python train.py +arm=leak-mask_zero {data}", work)
    assert trained.returncode == 0, trained.stderr[-3000:]
    out = trained.stderr
    for label in ("causal val loss (20 eval batches)", "train loss (last 10 steps)",
                  "cached val loss (decoding; first 4 batches)"):
        assert label in out
    run_dir = Path(re.search(r"^run: (.*)$", out, re.M).group(1))
    assert run_dir.parent == work / "runs" / "pitfalls"  # a TensorBoard logdir of its own
    assert run_dir.name.startswith("leak-mask_zero_seed1337_")
    sample = re.search(r"^sample: (.*)$", out, re.M).group(1)
    assert sample.startswith("python generate.py ")  # as the activated shell finds it

    for command in (sample, "python -m scripts.attention_map run=runs/latest out=leak.png",
                    'tail -n 3 "$(cat runs/latest)/train.log"',
                    "python -m scripts.runs root=runs/pitfalls", "python generate.py --help",
                    "tensorboard --version"):
        done = new_shell(command, work)
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
    assert (work / "leak.png").is_file()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = events.Tags()["scalars"] + events.Tags()["images"]
    assert tensorboard_groups(tags)[:2] == ["train", "val"], tensorboard_groups(tags)


@pytest.mark.slow  # a smoke run: about 15 s
def test_a_run_cut_short_says_so_in_its_summary_and_its_config(tmp_path):
    corpus = write_corpus(tmp_path)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "+experiment=smoke",
         *corpus_args(corpus, tmp_path / "cache"), "train.max_steps=100000",
         "train.max_minutes=0.002", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["fewer_steps"]
    assert re.fullmatch(r"train\.max_minutes=0\.002 stopped it at step [\d,]+ of "
                        r"train\.max_steps=100,000", said), said
    assert f"fewer steps than configured: {said}" in done.stderr
