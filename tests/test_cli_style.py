"""One command style for every script: key=value (the older `--key value` and positional
spellings are refused, naming the key=value form), `--help` with a line per key, and a wrong type
refused in our words."""
from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Optional

import pytest
from omegaconf import MISSING

from safeio.cli import UserError, check_choices, parse_key_values
from safeio.key_help import help_text, key_help
from helpers import REPO_ROOT, SCRIPT_ENV


@dataclass
class Example:
    sweep: str = MISSING           # the study's directory
    # where the files go
    # (null: beside the study)
    out: Optional[str] = None
    layer: int = 0                 # a layer, from 0
    rate: float = 0.5
    quick: bool = False            # a flag


def parse(*argv: str) -> Example:
    return parse_key_values(list(argv), Example, "usage: x")


def test_help_has_a_line_per_key_with_its_default_and_the_comment_that_describes_it():
    assert key_help(Example) == {"sweep": "the study's directory",
                                 "out": "where the files go (null: beside the study)",
                                 "layer": "a layer, from 0", "rate": "", "quick": "a flag"}
    lines = help_text(Example, "usage: x").splitlines()
    keys = [line.split()[0] for line in lines if line.startswith("  ")]
    assert keys == ["sweep=(required)", "out=null", "layer=0", "rate=0.5", "quick=false"]
    assert any(line.startswith("  layer=0") and line.endswith("a layer, from 0") for line in lines)


def test_the_older_spellings_are_refused_naming_the_key_value_form():
    want = Example(sweep="runs/s", out="docs", layer=2, quick=True)
    assert parse("sweep=runs/s", "out=docs", "layer=2", "quick=true") == want
    for argv, words in [(("sweep=x", "--out", "docs"), "write out=..., not '--out'"),
                        (("sweep=x", "--layer=2"), "write layer=..., not '--layer=2'"),
                        (("sweep=x", "--no-compile"), "write no_compile=..., not '--no-compile'"),
                        (("runs/s",), "arguments must be key=value, got 'runs/s'")]:
        with pytest.raises(UserError) as err:
            parse(*argv)
        assert words in str(err.value) and str(err.value).endswith("usage: x"), err.value


@pytest.mark.parametrize("arg, message", [
    ("layer=1e9", "layer must be an integer, got '1e9' (write it as 1000000000)"),
    ("layer=abc", "layer must be an integer, got 'abc'"),
    ("layer=1.5", "layer must be an integer, got '1.5'"),
    ("rate=fast", "rate must be a number, got 'fast'"),
    ("quick=maybe", "quick must be true or false, got 'maybe'"),
])
def test_a_value_of_the_wrong_type_is_refused_in_our_words(arg, message):
    with pytest.raises(UserError) as err:
        parse("sweep=x", arg)
    assert str(err.value) == message


def test_a_required_key_and_an_unknown_key_are_named():
    with pytest.raises(UserError, match="sweep= is required"):
        parse("layer=1")
    with pytest.raises(UserError, match="unknown key 'colour'"):
        parse("sweep=x", "colour=red")


@dataclass
class Bench:
    sizes: list[int] = field(default_factory=lambda: [1, 2])  # sizes
    names: Optional[list[str]] = None                          # names


def test_a_list_is_written_with_commas_and_a_bench_passes_other_keys_on():
    parse = lambda *argv: parse_key_values(list(argv), Bench, "usage: b", overrides=True)  # noqa
    assert parse() == (Bench(sizes=[1, 2]), [])
    assert parse("sizes=3,4", "model=baby", "names=a", "+experiment=gpu") == \
        (Bench(sizes=[3, 4], names=["a"]), ["model=baby", "+experiment=gpu"])
    assert parse("sizes=[5]")[0].sizes == [5]  # Hydra's spelling too
    assert parse("names=null")[0].names is None
    with pytest.raises(UserError) as err:
        parse("sizes=3,x")
    assert str(err.value) == "sizes must be an integer or several, separated by commas, got '3,x'"
    with pytest.raises(UserError, match="unknown key 'model'"):  # not a bench: refused
        parse_key_values(["model=baby"], Bench, "usage: b")
    check_choices(Bench(names=["a", "b"]), names=("a", "b", "c"), sizes=(1, 2))
    with pytest.raises(UserError) as err:
        check_choices(Bench(names=["a", "d"]), names=("a", "b"))
    assert str(err.value) == "names must be among a, b, got 'd'"


SCRIPTS = [["generate.py"], ["-m", "scripts.attention_map"], ["-m", "scripts.export_hf"],
           ["-m", "scripts.summarize_ablations"], ["scripts/summarize_ablations.py"],
           ["-m", "tools.tensorboard_screenshots"], ["-m", "scripts.runs"],
           ["-m", "scripts.llama_pitfalls"], ["-m", "tools.kernel_report"],
           ["-m", "bench.attention"], ["-m", "bench.train_step"], ["-m", "bench.generate"],
           ["-m", "bench.batch_generate"], ["-m", "scripts.mask_values"],
           ["-m", "tools.sampling_threads"], ["-m", "tools.startup"],
           ["-m", "tools.freed_memory"]]


# A script that imports torch takes 4-5 s to start on 2 cores: its --help is in the slow tier.
IMPORTS_TORCH = {"generate.py", "scripts.attention_map", "scripts.export_hf", "scripts.runs",
                 "scripts.llama_pitfalls", "bench.attention", "bench.train_step",
                 "bench.generate", "bench.batch_generate", "scripts.mask_values",
                 "tools.sampling_threads", "tools.startup", "tools.freed_memory"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s[-1] in IMPORTS_TORCH
                                    else s for s in SCRIPTS], ids=" ".join)
def test_every_script_describes_each_of_its_keys(script):
    proc = subprocess.run([sys.executable, *script, "--help"], cwd=REPO_ROOT, env=SCRIPT_ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = re.sub(r"\n {4,}(?=\S)", " ", proc.stdout)  # a long key's description: the next line
    rows = [line for line in text.splitlines() if line.startswith("  ") and "=" in line]
    assert rows and all(len(line.split(None, 1)) == 2 for line in rows), proc.stdout
