"""What each mistake the checker names costs, as the studies measured it: read from one file,
docs/pitfall_costs.json, which scripts/summarize_ablations.py writes from a study's runs (its
"the costs file" section gives the format) and nobody edits by hand; the README's tables come
from the same runs, and tests/test_pitfall_costs.py holds them equal. Where the file is missing,
or holds nothing for a switch, nothing is said about cost: a figure is quoted from the
measurement or not at all.

Two forms: `words`, the report's diagnosis line with the statistics (standard error, paired
seeds, the regime and its setting) for whoever reads the report or grades a course, and `plain`,
one sentence a learner or a student reads. Both quote the causal loss (held-out text scored with
the correct mask, what training shows) wherever its interval leaves 0, else the loss the study
saw the mistake in (through the KV cache), in nats per character for the studies' char-level
models (per token otherwise).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
COSTS_FILE = REPO / "docs" / "pitfall_costs.json"
ARMS = REPO / "conf" / "arm"   # <regime>-<switch>.yaml: the one-command run of a study's arm
MAX_BYTES = 4 << 20            # the file holds a few dozen entries; anything bigger is not it
LOSSES = {"causal": "causal validation loss", "cached": "cached validation loss"}
PREFIX = "measured cost of attention="  # a report's cost lines start so


def load(path: Optional[Path] = None) -> dict:
    """The costs file's {switch: [entry]}, or {} where there is none (or it is not one)."""
    path = Path(path or COSTS_FILE)
    try:
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            return {}
        costs = json.loads(path.read_text(encoding="utf-8")).get("costs")
    except (OSError, ValueError, AttributeError, RecursionError):  # deep nesting, say
        return {}
    return costs if isinstance(costs, dict) else {}


def _number(x) -> Optional[float]:
    """x as a loss difference, None where it cannot be one (beyond 100)."""
    return float(x) if isinstance(x, (int, float)) and -100 <= x <= 100 else None


def measured(entry) -> Optional[tuple]:
    """(loss, effect, se, unit) of one entry as quoted (the loss None: no loss sees it), or
    None for an entry summarize_ablations would not write."""
    shows, setting = entry.get("shows_in"), entry.get("setting")
    if not isinstance(entry.get("causal"), dict) or not isinstance(setting, (str, type(None))) \
            or not (shows is None or isinstance(shows, str) and shows in LOSSES):
        return None
    causal = entry["causal"]
    seen = isinstance(causal.get("low"), (int, float)) and isinstance(causal.get("high"), (
        int, float)) and (causal["low"] > 0 or causal["high"] < 0)
    loss = "causal" if seen or shows is None else shows
    c = entry.get(loss)
    effect, se = (_number(c.get("effect")), _number(c.get("se"))) if isinstance(c, dict) else (
        None, None)
    if effect is None or se is None or se < 0:
        return None
    unit = "nats per character" if "char-level" in (setting or "") else "nats per token"
    return (None if shows is None else loss), effect, se, unit


def _entry_words(entry: dict) -> Optional[str]:
    """One measurement in words: the effect and its standard error on the loss quoted, the
    study, the regime and its setting; None for one summarize_ablations would not write."""
    got = measured(entry)
    if got is None:
        return None
    loss, effect, se, unit = got
    c = entry[loss or "causal"]
    paired = f", {c['seeds']} paired seeds" if isinstance(c.get("seeds"), int) else ""
    if loss is None:
        low, high = _number(c.get("low")), _number(c.get("high"))
        interval = f", 95% interval [{low:+.4f}, {high:+.4f}]" if None not in (low, high) else ""
        how = (f"{LOSSES['causal']} {effect:+.4f} {unit}, SE {se:.4f}{interval}{paired}: no loss "
               f"of the study can tell it from the correct layer")
    else:
        sigmas = f" ({abs(effect) / se:.0f} SE)" if se > 1e-9 else ""
        how = f"{LOSSES[loss]} {effect:+.4f} {unit}, SE {se:.4f}{sigmas}{paired}"
    setting = entry.get("setting")
    where = f"the {entry.get('study', '?')} study, regime {entry.get('regime', '?')}"
    return f"{how} ({where}{': ' + setting if setting else ''})"


def _entries(switch: str, costs: dict) -> list:
    found = costs.get(switch)
    return [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []


def words(switch: str, costs: dict) -> Optional[str]:
    """`switch`'s measured cost as a diagnosis line, with the command that reproduces it, or
    None when the costs file has no measurement of it."""
    said = [(e, w) for e in _entries(switch, costs) if (w := _entry_words(e))]
    if not said:
        return None
    arms = [f"python train.py +arm={e['regime']}-{switch}" for e, _ in said
            if isinstance(e.get("regime"), str)
            and (ARMS / f"{e['regime']}-{switch}.yaml").is_file()]
    return (PREFIX + f"{switch}: " + "; ".join(w for _, w in said)
            + (f"; the study's run of it: {arms[0]}" if arms else "")
            + " (docs/pitfall_costs.json)")


def plain(switch: str, costs: dict) -> Optional[str]:
    """`switch`'s measured cost in one plain sentence (the first study that measured it), or
    None."""
    for entry in _entries(switch, costs):
        got = measured(entry)
        if got is None:
            continue
        loss, effect, _, unit = got
        study = f"the project's {entry.get('study', '?')} study"
        if loss is None:
            return (f"Measured cost: none that training shows: in {study}, models trained with "
                    f"this mistake scored as well as the correct layer.")
        how = "worse" if effect > 0 else "better"
        seen = "held-out text" if loss == "causal" else "held-out text decoded through the KV cache"
        return (f"Measured cost: in {study}, models trained with this mistake scored "
                f"{abs(effect):.2f} {unit} {how} on {seen} than with the correct layer.")
    return None
