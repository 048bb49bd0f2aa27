"""Loading a run directory's config.yaml, which may have been written by someone else.

A few hundred bytes of YAML anchors and aliases expand to gigabytes when composed (an "alias
bomb"); deep nesting exhausts the parser's recursion; a tag asks for a Python object; an
OmegaConf interpolation can expand exponentially or read the environment. train.py writes none of
these: its config.yaml is plain keys and values. So the tokens are read first, and anything else
is refused before a node is built.
"""
from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf._utils import get_yaml_loader

from data.files import KIB, FileRefused, read_text
from training.errors import UserError, first_line

# A saved config is about 2 KiB; anything this big was not written by train.py.
MAX_CONFIG_BYTES = 64 * KIB
MAX_DEPTH = 16

_OPENING = (yaml.BlockMappingStartToken, yaml.BlockSequenceStartToken,
            yaml.FlowMappingStartToken, yaml.FlowSequenceStartToken)
_CLOSING = (yaml.BlockEndToken, yaml.FlowMappingEndToken, yaml.FlowSequenceEndToken)
_REFUSED = {yaml.AnchorToken: "an anchor (&)", yaml.AliasToken: "an alias (*)",
            yaml.TagToken: "a tag (!)", yaml.DirectiveToken: "a directive (%)"}


def load_run_config(path: Path) -> DictConfig:
    """The mapping in path, a run's config.yaml, refusing anything train.py would not write."""
    try:
        text = read_text(path, "run config", MAX_CONFIG_BYTES)
    except FileRefused as exc:
        raise UserError(str(exc)) from None
    problem = _plain_yaml_problem(text)
    if problem:
        raise UserError(f"{path} is not a config that train.py wrote: it holds {problem}")
    try:
        cfg = OmegaConf.create(text) if text.strip() else None
    except Exception as exc:  # YAML syntax, duplicate keys
        raise UserError(f"{path} is not a readable run config: {_reason(exc)}") from None
    if not isinstance(cfg, DictConfig):
        raise UserError(f"{path} is not a run config: it holds no mapping of keys to values")
    return cfg


def _plain_yaml_problem(text: str) -> str:
    """What in text is not plain YAML keys and values, or '' if nothing."""
    depth = 0
    try:
        for token in yaml.scan(text, Loader=get_yaml_loader()):
            refused = _REFUSED.get(type(token))
            if refused:
                return f"{refused} at line {token.start_mark.line + 1}"
            if isinstance(token, _OPENING):
                depth += 1
                if depth > MAX_DEPTH:
                    return f"nesting deeper than {MAX_DEPTH} levels"
            elif isinstance(token, _CLOSING):
                depth -= 1
            elif isinstance(token, yaml.ScalarToken) and "${" in token.value:
                return (f"an interpolation ({token.value[:40]!r}) at line "
                        f"{token.start_mark.line + 1}")
    except yaml.YAMLError as exc:
        return f"invalid YAML ({_reason(exc)})"
    return ""


def _reason(exc: BaseException) -> str:
    """A YAML error as 'problem at line N' (its first line alone is often only context)."""
    problem, mark = getattr(exc, "problem", None), getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}"
    return first_line(exc)
