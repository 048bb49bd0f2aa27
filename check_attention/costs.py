"""What each mistake the checker names costs, as the studies measured it: read from one file,
docs/pitfall_costs.json, which scripts/summarize_ablations.py writes from a study's runs (its
"the costs file" section gives the format) and nobody edits by hand. Where the file is missing,
or holds nothing for a switch, the report says nothing about cost: a figure is quoted from the
measurement or not at all.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
COSTS_FILE = REPO / "docs" / "pitfall_costs.json"
ARMS = REPO / "conf" / "arm"   # <regime>-<switch>.yaml: the one-command run of a study's arm
MAX_BYTES = 4 << 20            # the file holds a few dozen entries; anything bigger is not it
LOSSES = {"causal": "causal validation loss", "cached": "cached validation loss"}


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
    """x as a loss difference in nats per token, None where it cannot be one (beyond 100)."""
    return float(x) if isinstance(x, (int, float)) and -100 <= x <= 100 else None


def _entry_words(entry: dict) -> Optional[str]:
    """One measurement in words: the effect and its standard error on the loss that shows it,
    the study, the regime and its setting; None for one summarize_ablations would not write."""
    shows = entry.get("shows_in")
    metric = shows if isinstance(shows, str) and shows in LOSSES else "causal"
    c = entry.get(metric)
    if not isinstance(c, dict):
        return None
    effect, se = _number(c.get("effect")), _number(c.get("se"))
    setting = entry.get("setting")
    if effect is None or se is None or se < 0 or not isinstance(setting, (str, type(None))):
        return None
    seeds = c.get("seeds")
    paired = f", {seeds} paired seeds" if isinstance(seeds, int) else ""
    if shows is None:
        low, high = _number(c.get("low")), _number(c.get("high"))
        interval = f", 95% interval [{low:+.4f}, {high:+.4f}]" if None not in (low, high) else ""
        how = (f"{LOSSES[metric]} {effect:+.4f} nats per token, SE {se:.4f}{interval}{paired}: "
               f"no loss of the study can tell it from the correct layer")
    else:
        sigmas = f" ({abs(effect) / se:.0f} SE)" if se > 1e-9 else ""
        how = f"{LOSSES[metric]} {effect:+.4f} nats per token, SE {se:.4f}{sigmas}{paired}"
    where = f"the {entry.get('study', '?')} study, regime {entry.get('regime', '?')}"
    return f"{how} ({where}{': ' + setting if setting else ''})"


def words(switch: str, costs: dict) -> Optional[str]:
    """`switch`'s measured cost as a diagnosis line, with the command that reproduces it, or
    None when the costs file has no measurement of it."""
    found = costs.get(switch)
    entries = [e for e in found if isinstance(e, dict)] if isinstance(found, list) else []
    said = [(e, w) for e in entries if (w := _entry_words(e))]
    if not said:
        return None
    arms = [f"python train.py +arm={e['regime']}-{switch}" for e, _ in said
            if isinstance(e.get("regime"), str)
            and (ARMS / f"{e['regime']}-{switch}.yaml").is_file()]
    return (f"measured cost of attention={switch}: " + "; ".join(w for _, w in said)
            + (f"; the study's run of it: {arms[0]}" if arms else "")
            + " (docs/pitfall_costs.json)")
