"""What a check found, item by item, and how it is printed: the checklist's own words, then
PASS / FAIL / SKIP (could not be judged) / N/A (does not apply) and the detail, a diagnosis and
the verdict. A file or object the checker could not use is a report too (`error`), so that a
folder of submissions (grading/) and a course's own tests (`check`) see every file the same way."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from check_attention.checklist import CHECKS, words
from check_attention.inert import TEXT_LIMIT, inert

HEADER = ("layer", "mask", "layout", "heads", "probes", "sandbox")


@dataclass
class Item:
    status: str      # PASS, FAIL, SKIP (could not judge) or N/A (does not apply)
    detail: str = ""


@dataclass
class Report:
    target: str
    header: dict = field(default_factory=dict)   # label -> what the checker saw
    kind: str = "module"
    items: dict = field(default_factory=dict)
    diagnosis: list = field(default_factory=list)
    error: Optional[str] = None  # why the file or object could not be used (then no items)
    # the studies' switches (conf/attention/NAME.yaml) that reproduce the mistakes it names, in
    # the order named: their measured costs follow the diagnosis (costs.py)
    mistakes: list = field(default_factory=list)

    def named(self, *switches: str) -> None:
        """Record that the report names the mistakes these switches reproduce."""
        self.mistakes += [s for s in switches if s not in self.mistakes]

    def set(self, key: str, status: str, detail: str = "") -> None:
        self.items[key] = Item(status, detail)

    def sheet(self, fails: dict, unresolved: Optional[dict] = None,
              only: Optional[tuple] = None, **fields) -> None:
        """The sheet's four items (or those in `only`) from what reproduced the output, the one
        verdict every route gives: FAIL with the mistake's words, SKIP where the probes cannot
        tell it from a variant that is judged otherwise, else PASS with the checklist's words,
        filled in from fields (sqrt_d_k; o, without which W_O is left to the caller; an item's
        key: its own words)."""
        for c in CHECKS:
            if not c.passes or (only is not None and c.key not in only) or (
                    c.key == "w_o" and "o" not in fields and c.key not in fails):
                continue
            if c.key in fails:
                self.set(c.key, "FAIL", fails[c.key])
            elif c.key in (unresolved or {}):
                self.set(c.key, "SKIP", f"at this precision the probes cannot tell the layer "
                                        f"from our variant {unresolved[c.key]}")
            else:
                self.set(c.key, "PASS", fields.get(c.key, c.passes.format(**fields)))

    def made_inert(self) -> "Report":
        """This report with every text in it made inert and bounded (inert.py): the names, the
        messages and the details a submission chose cannot act on a terminal or a file, whoever
        reads them. grade.check_file returns only such reports."""
        return replace(
            self, target=inert(self.target), header={k: inert(v) for k, v in self.header.items()},
            items={k: Item(inert(i.status), inert(i.detail)) for k, i in self.items.items()},
            diagnosis=[inert(d) for d in self.diagnosis],
            error=None if self.error is None else inert(self.error))

    @property
    def exit_code(self) -> int:
        if self.error is not None:
            return 2
        return 0 if all(i.status in ("PASS", "N/A") for i in self.items.values()) else 1

    @property
    def passed(self) -> bool:
        """Every applicable item passes (the command's exit status 0)."""
        return self.exit_code == 0

    @property
    def outcome(self) -> str:
        """PASS, FAIL, NOT VERIFIED or ERROR: the verdict's first words."""
        return "ERROR" if self.error is not None else self.verdict.split(" (")[0]

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "ERROR (the checker could not use it)"
        judged = [k for k, i in self.items.items() if i.status != "N/A"]
        failed = [k for k in judged if self.items[k].status == "FAIL"]
        skipped = [k for k in judged if self.items[k].status == "SKIP"]
        if failed:
            return f"FAIL ({len(failed)} of {len(judged)} checks fail)"
        if skipped:
            return (f"NOT VERIFIED (no check fails, but {len(skipped)} of {len(judged)} could "
                    f"not be judged)")
        return f"PASS (all {len(judged)} checks pass)"

    def lines(self, verbose: bool = False) -> list[str]:
        """The report as printed; the `sandbox:` line only when verbose or when it warns (no
        Landlock: writes were not confined, the project's files were compared instead)."""
        verbose = verbose or "no Landlock" in self.header.get("sandbox", "")
        out = [f"check_attention {self.target}"]
        if self.error is not None:
            out += [f"error: {self.error}"]
        else:
            out += self._item_lines(HEADER if verbose else HEADER[:-1])
        out.append(f"verdict: {self.verdict}")
        return [inert(line, 4 * TEXT_LIMIT) for line in out]  # whatever made the report

    def _item_lines(self, labels: tuple) -> list[str]:
        out = [f"  {label + ':':<8} {self.header[label]}"
               for label in labels if label in self.header]
        for key in (c.key for c in CHECKS if c.key in self.items):
            item = self.items[key]
            sep = ": " if item.status in ("FAIL", "SKIP") else ("  " if item.detail else "")
            detail = f"({item.detail})" if item.status in ("PASS", "N/A") and item.detail \
                else item.detail
            out.append(f"{item.status:<4}  {words(key, self.kind)}{sep}{detail}")
        return out + [f"diagnosis: {d}" for d in self.diagnosis]

    @property
    def text(self) -> str:
        """The report as the command prints it (a string: pytest shows an assertion message that
        is one in full, and any other object's repr cut to 240 characters)."""
        return "\n".join(self.lines())

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"<check_attention {inert(self.target)}: {self.verdict}>"
