"""Every command in README.md and docs/*.md still works when pasted, and every link resolves.

The commands are read out of the ```bash blocks (and the `python ...` spans in the text), the way
a reader copies them. The fast tests run nothing: each module or script a command names exists,
each repository path it mentions is there, each `train.py` override names a key of the typed
config (or an option file of a group), each `key=value` of generate.py, the scripts and the
benches is a key of that script's dataclass (or, for a bench, a train.py override). The slow
ones compose every `train.py` command with Hydra, as train.py would before its first step, and
run every script's `--help`. Placeholders such as `<date>` stand for a path the reader fills in.
A block that starts with `git checkout <commit>` (a past round of docs/budget.md) runs at that
commit: its commands are checked only for the commit being in the history.
"""
from __future__ import annotations

import ast
import dataclasses
import re
import shlex
import subprocess
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from helpers import REPO_ROOT, SCRIPT_ENV
from training.config import CONF_DIR, Config

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
# A token whose first part is one of these is a path in the repository, and must exist.
TOP_DIRS = {"bench", "conf", "data", "docs", "guard", "lessons", "model", "scripts", "tests",
            "tools", "training", "train.py", "generate.py", "requirements.txt",
            "requirements-dev.txt", "requirements-lessons.txt", "requirements-cluster.txt"}
PLACEHOLDER = re.compile(r"<[^<>\s]*>")
FENCE = re.compile(r"^\s*```(\w*)\s*$")


@dataclass(frozen=True)
class Command:
    where: str           # page:line, for the failure message
    argv: tuple          # one command, as the shell splits it
    fenced: bool         # from a ```bash block (else an inline `python ...` span)
    at: Optional[str] = None  # the commit a `git checkout` earlier in its block moved to


def _lines_outside_code(path: Path):
    """(line number, line) of the page's prose: fenced blocks left out."""
    inside = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            yield n, line


def _split(text: str) -> list[list[str]]:
    """One shell line as commands: comments dropped, `&&` and `;` separate commands."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, current = [], []
    for token in lexer:
        if token in ("&&", ";", "||", "|", "&"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*commands, current] if c]


def fenced_commands(path: Path) -> list[Command]:
    lines, lang, heredoc = [], None, None  # lines: (line number, text, block) of the bash blocks
    block = 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if lang is None:
            match = FENCE.match(line)
            lang = match.group(1) if match else None
            block += 1
            continue
        if line.strip() == "```":
            lang = None
        elif lang != "bash":
            continue
        elif heredoc:  # a here-document's lines are its program's input, not commands
            heredoc = None if line.strip() == heredoc else heredoc
        elif lines and lines[-1][1].endswith("\\"):  # a continued line
            lines[-1] = (lines[-1][0], lines[-1][1][:-1] + " " + line.strip(), block)
        else:
            lines.append((n, line.strip(), block))
            match = re.search(r"<<-?'?(\w+)'?", line)
            heredoc = match.group(1) if match else None
    out, at = [], {}  # at: block -> the commit its `git checkout` moved to
    for n, text, block in lines:
        for argv in _split(re.sub(r"<<-?'?\w+'?", "", text)):
            out.append(Command(f"{path.name}:{n}", tuple(argv), True, at.get(block)))
            if argv[:2] == ["git", "checkout"] and len(argv) == 3:
                at[block] = argv[2]
    return out


def inline_commands(path: Path) -> list[Command]:
    out = []
    for n, line in _lines_outside_code(path):
        for span in re.findall(r"`((?:\.venv/bin/)?python3? [^`]+)`", line):
            try:
                commands = _split(span)
            except ValueError:  # a span cut in the middle of a quote: not a whole command
                continue
            out += [Command(f"{path.name}:{n}", tuple(argv), False) for argv in commands]
    return out


def all_commands() -> list[Command]:
    return [c for page in PAGES for c in (*fenced_commands(page), *inline_commands(page))]


# What a command runs ------------------------------------------------------------------------

@dataclass
class Target:
    kind: str                 # "module", "script", "bash", "other"
    name: str                 # the module, the script's path or the program
    args: list


def target(argv: tuple) -> Target:
    argv = list(argv)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):  # VAR=value prefixes
        argv.pop(0)
    program = Path(argv[0]).name
    if program == "torchrun":
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        return Target("script", argv[script], argv[script + 1:])
    if program == "bash":
        return Target("bash", argv[1], argv[2:])
    if re.fullmatch(r"python3?", program):
        if argv[1] == "-m":
            return Target("module", argv[2], argv[3:])
        if argv[1] in ("-", "-c"):
            return Target("other", "python " + argv[1], argv[2:])
        return Target("script", argv[1], argv[2:])
    return Target("other", program, argv[1:])


def module_file(module: str) -> Optional[Path]:
    """The repository file `python -m module` runs, None for a module from elsewhere."""
    base = REPO_ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__main__.py"):
        if candidate.is_file():
            return candidate
    return None


def source_of(t: Target) -> Optional[Path]:
    if t.kind == "module":
        return module_file(t.name)
    if t.kind == "script" and t.name.endswith(".py"):
        return REPO_ROOT / t.name
    return None


# The projects' own scripts; pytest, venv and torch's launcher come from elsewhere.
FOREIGN_MODULES = {"pytest", "venv", "pip", "torch.distributed.run"}


def key_value_schema(path: Path) -> Optional[tuple[list[str], bool]]:
    """The keys of a script that reads `key=value` arguments with safeio.cli.parse_key_values,
    read from its source (nothing is imported), and whether it passes the other keys on to
    train.py's config (a bench: `overrides=True`)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "parse_key_values":
            forwards = any(k.arg == "overrides" and ast.literal_eval(k.value)
                           for k in node.keywords)
            return dataclass_fields(node.args[1].id, tree), forwards
    return None


def dataclass_fields(name: str, tree: ast.Module) -> list[str]:
    """The fields of the class `name` defined in `tree` or imported into it from the repository,
    those of its bases first."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            inherited = [key for base in node.bases for key in dataclass_fields(base.id, tree)]
            return inherited + [s.target.id for s in node.body if isinstance(s, ast.AnnAssign)]
        if isinstance(node, ast.ImportFrom) and name in (a.name for a in node.names) \
                and module_file(node.module or ""):
            return dataclass_fields(name, ast.parse(module_file(node.module).read_text()))
    raise AssertionError(f"no class {name} in the source")


def options_defined(path: Path) -> set[str]:
    """Every `--option` string in a script's source (a script with a parser of its own)."""
    return set(re.findall(r"""["'](--[a-z][\w-]*)["']""", path.read_text())) | {"--help"}


def repo_paths(args) -> list[str]:
    """The arguments (or key=values' values) that are paths in the repository."""
    out = []
    for arg in args:
        value = arg.partition("=")[2] if "=" in arg and not arg.startswith("-") else arg
        value = value.split(":")[0].strip("[]")
        if PLACEHOLDER.search(value) or "*" in value:
            continue
        if value.split("/")[0] in TOP_DIRS and "/" in value:
            out.append(value)
    return out


# train.py's overrides ------------------------------------------------------------------------

def _unwrap(hint):
    """Optional[X] -> X."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _top_level_values(value: str) -> list[str]:
    """A sweep's values, `a,b` -> [a, b] (commas inside [...] belong to one list value)."""
    out, depth, current = [], 0, ""
    for ch in value:
        depth += (ch in "[(") - (ch in "])")
        if ch == "," and depth == 0:
            out.append(current)
            current = ""
        else:
            current += ch
    return [*out, current]


def override_problem(arg: str) -> Optional[str]:
    """Why `arg` is no override of `python train.py`, or None: a group's option must be a file
    of conf/<group>/, any other key a field of the typed config (training/config.py)."""
    if arg in ("-m", "--multirun"):
        return None
    key, sep, value = arg.partition("=")
    if not sep:
        return f"{arg!r} is not key=value"
    key = key.lstrip("+~")
    if key.startswith("hydra.") or key.startswith("hydra/"):
        return None
    if "." not in key and (CONF_DIR / key).is_dir():
        for option in _top_level_values(value):
            if not (CONF_DIR / key / f"{option}.yaml").is_file():
                return f"{key}={option}: no conf/{key}/{option}.yaml"
        return None
    node = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(node):
            return f"{key}: {part!r} is inside a value that has no keys"
        hints = typing.get_type_hints(node)
        if part not in hints:
            return f"{key}: no key {part!r} in {node.__name__}"
        node = _unwrap(hints[part])
    return None


def without_help(args) -> list[str]:
    """train.py's arguments less `--help` and the form it may take (`--help all`, `--help train`)."""
    from guard.compose import HELP_FORMS

    out, after_help = [], False
    for arg in args:
        if arg in ("-h", "--help") or (after_help and arg in HELP_FORMS):
            after_help = arg in ("-h", "--help")
            continue
        out.append(arg)
        after_help = False
    return out


def train_overrides(args: list[str]) -> list[str]:
    """The overrides as `compose` takes them: -m and --help dropped, each sweep at its first
    value, each placeholder a plain word."""
    out = []
    for arg in without_help(args):
        if arg in ("-m", "--multirun"):
            continue
        key, _, value = arg.partition("=")
        first = _top_level_values(value)[0] if "=" in arg else ""
        out.append(PLACEHOLDER.sub("x", f"{key}={first}"))
    return out


# The fast tests --------------------------------------------------------------------------------

COMMANDS = all_commands()
HERE = [c for c in COMMANDS if c.at is None]  # the commands that run at this commit


def test_the_docs_have_commands_to_check():
    fenced = [c for c in COMMANDS if c.fenced]
    assert len(fenced) > 100, len(fenced)
    assert any(c.argv[:2] == ("python", "train.py") for c in fenced)


@pytest.mark.parametrize("command", HERE, ids=lambda c: c.where)
def test_each_command_names_what_exists(command):
    t = target(command.argv)
    where = f"{command.where}: {shlex.join(command.argv)}"
    if t.kind == "module" and t.name not in FOREIGN_MODULES:
        assert module_file(t.name), f"{where}: no module {t.name} in the repository"
    if t.kind in ("script", "bash"):
        assert (REPO_ROOT / t.name).is_file(), f"{where}: no file {t.name}"
    for path in repo_paths(t.args):
        assert (REPO_ROOT / path).exists(), f"{where}: no {path} in the repository"


@pytest.mark.parametrize("command", HERE, ids=lambda c: c.where)
def test_each_argument_is_one_its_command_takes(command):
    t = target(command.argv)
    where = f"{command.where}: {shlex.join(command.argv)}"
    source = source_of(t)
    if source is None or not source.is_file() or t.name == "check_attention":
        return  # its own parser (docs/check_attention.md), or a program from elsewhere
    if t.name.endswith("train.py"):
        for arg in without_help(t.args):
            problem = override_problem(arg)
            assert problem is None, f"{where}: {problem}"
        return
    schema = key_value_schema(source)
    if schema:
        keys, forwards = schema
        for arg in t.args:
            key, sep, _ = arg.partition("=")
            if arg in ("--help", "-h"):
                continue
            assert sep, f"{where}: {arg!r} is not key=value"
            if key not in keys:
                assert forwards, f"{where}: {key!r} is not one of {keys}"
                problem = override_problem(arg)  # a bench's train.py override
                assert problem is None, f"{where}: {problem}"
        return
    defined = options_defined(source)
    for arg in t.args:
        if arg.startswith("--"):
            assert arg.partition("=")[0] in defined, f"{where}: {arg} is not an option of {t.name}"


def test_each_commit_a_block_checks_out_is_in_the_history():
    """docs/budget.md runs each past round at the commit that wrote it up (`git checkout
    <commit>` first in its block); each must be a commit of this repository's history."""
    commits = {c.argv[2] for c in COMMANDS if c.argv[:2] == ("git", "checkout")}
    assert {c.at for c in COMMANDS} - {None} == commits and len(commits) >= 7
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=30)
    except OSError:
        pytest.skip("no git here")
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("not a clone with the whole history")
    for commit in commits:
        assert re.fullmatch(r"[0-9a-f]{7,40}", commit), commit
        ancestor = subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"],
                                  cwd=REPO_ROOT, capture_output=True, timeout=30)
        assert ancestor.returncode == 0, f"{commit} is not in the history of HEAD"


def test_a_heredoc_s_python_compiles_and_imports_what_exists():
    """docs/huggingface.md makes a tiny Llama with a `python - <<'PY'` program."""
    text = (REPO_ROOT / "docs" / "huggingface.md").read_text()
    programs = re.findall(r"<<'PY'\n(.*?)\nPY\n", text, re.S)
    assert programs
    for program in programs:
        tree = ast.parse(program)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and module_file(node.module):
                defined = ast.parse(module_file(node.module).read_text())
                names = {n.name for n in ast.walk(defined)
                         if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                names |= {t.id for n in ast.walk(defined) if isinstance(n, ast.Assign)
                          for t in n.targets if isinstance(t, ast.Name)}
                for alias in node.names:
                    assert alias.name in names, f"{node.module} has no {alias.name}"


# Links ------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]{2,}|[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _lines_outside_code(path):
        match = re.match(r"#{1,6} (.*)", line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def links(path: Path) -> list[tuple[int, str]]:
    out = []
    for n, line in _lines_outside_code(path):
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        out += [(n, m) for m in re.findall(r"\]\(([^)\s]+)\)", line)]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for n, link in links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        file, _, anchor = link.partition("#")
        target_file = (page.parent / file).resolve() if file else page
        if not target_file.exists():
            broken.append(f"{page.name}:{n}: {link} (no such file)")
        elif anchor and target_file.suffix == ".md" and anchor not in anchors(target_file):
            broken.append(f"{page.name}:{n}: {link} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_link_checker_sees_a_broken_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A `code` heading: here\n\n[ok](#a-code-heading-here) [bad](#nowhere)\n")
    assert anchors(page) == {"a-code-heading-here"}
    assert [link for _, link in links(page)] == ["#a-code-heading-here", "#nowhere"]


def test_the_override_checker_refuses_a_misspelt_key_and_a_missing_option():
    assert override_problem("model.n_layer=6") is None
    assert override_problem("+experiment=budget") is None
    assert "n_layers" in override_problem("model.n_layers=6")
    assert "conf/experiment/nope.yaml" in override_problem("+experiment=nope")


# The slow tests: compose and run --help -----------------------------------------------------

def _distinct(items):
    return list(dict.fromkeys(items))


TRAIN_COMMANDS = _distinct(tuple(train_overrides(target(c.argv).args)) for c in HERE
                           if target(c.argv).name.endswith("train.py"))
HELP_TARGETS = _distinct((t.kind, t.name) for t in map(target, (c.argv for c in HERE))
                         if t.kind in ("module", "script") and t.name not in FOREIGN_MODULES
                         and source_of(t) is not None)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", TRAIN_COMMANDS, ids=" ".join)
def test_each_train_command_composes(overrides):
    from guard.compose import compose
    compose(list(overrides))


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", HELP_TARGETS, ids=lambda x: x)
def test_each_script_answers_help(kind, name):
    argv = ["-m", name] if kind == "module" else [name]
    done = subprocess.run([sys.executable, *argv, "--help"], cwd=REPO_ROOT, env=SCRIPT_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), f"{name} --help printed nothing"
