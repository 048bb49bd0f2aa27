"""The checklist, each check once: its key, its line in a report, the words it passes with
(the sheet's four items, which the variant of ours reproducing a layer decides), its points and
who sees it on a course platform (weights.py; docs/grading.md shows the same table), and what
decides it. Reports print the checks in this order; docs/check_attention.md lists them.

The checklist and the two checks that decide whether a layer is attention at all are shown to
the student at once; the probes past the checklist count as much but are shown after the due
date, so that a student fixes the equation before chasing a gradient.
"""
from __future__ import annotations

from dataclasses import dataclass

LATER = "after_due_date"


@dataclass(frozen=True)
class Check:
    key: str
    words: str              # the report's line
    decided_by: str         # what decides it (checks.py, probes.py, diagnosis.py)
    passes: str = ""        # the sheet's items: the detail when it passes ({d_k}, {o}: filled in)
    points: float = 1
    visibility: str = "visible"
    function: str = ""      # its line for a scaled dot-product function, where that differs


CHECKS = (
    Check("scale", "The scaling divisor is the per-head d_k (d_model / h), not the full d_model",
          "the variant of ours that reproduces the output, else a fitted divisor",
          "divided by sqrt(d_k) = {sqrt_d_k}"),
    Check("w_o", "W_O is applied after concatenating heads, not skipped",
          "the reading of the weights that reproduces the output", "{o} mixes the heads"),
    Check("before_softmax", "The causal mask is added to the raw scores before softmax, not "
                            "applied to the weights after",
          "that variant, else the outputs alone (identical tokens, identical outputs)",
          "each row of weights sums to 1 over the visible keys"),
    Check("mask_value", "The mask value is a large negative number (or -inf), not 0",
          "that variant, else a fitted mask value, else the outputs alone",
          "future keys get weight 0"),
    Check("shape", "Output shape is [n, d_model] regardless of head count",
          "the output's shape for several head counts (and d_v != d_k for a function)",
          function="Output shape is [n, d_v] regardless of head count"),
    Check("causal", "Causality: no future position changes an earlier output",
          "each position changed in turn, then every 16th past 64", points=2),
    Check("equation", "Matches the equation: softmax(QK^T / sqrt(d_k) + M) V per head, "
                      "concatenated, then W_O",
          "a variant of ours without a mistake reproduces the output", points=2,
          function="Matches the equation: softmax(QK^T / sqrt(d_k) + M) V"),
    Check("backward", "Backward: the gradients match autograd on the equation in float64",
          "autograd through that reference, float64 and the layer's dtype", visibility=LATER),
    Check("lengths", "Lengths past one tile: the output is right at every length",
          "that reference at lengths 1 to 257", visibility=LATER),
    Check("large_scores", "Large scores: the mask still hides the future (a finite value like "
                          "-1e4 leaks)", "the last position changed at scores up to 1e6",
          visibility=LATER),
    Check("batch", "Batch independence: changing one sample moves no other sample's output",
          "sample 0 changed", visibility=LATER),
    Check("deterministic", "Eval mode is deterministic: identical calls give identical outputs",
          "one input under seeds 0, 0 and 1", visibility=LATER),
    Check("input_kept", "The inputs are left unmodified (no in-place writes)",
          "the inputs compared bit for bit after each call", visibility=LATER),
    Check("unequal", "Unequal query and key lengths (n_q != n_k, mask aligned bottom-right)",
          "a function taking a mask, at n_q = 1, n_k = 9 and 5, 12", visibility=LATER),
)
ITEM_WORDS = {c.key: c.words for c in CHECKS}


def words(key: str, kind: str = "module") -> str:
    """The check's line for a module or a function (no heads, no W_O), or the key itself."""
    c = next((c for c in CHECKS if c.key == key), None)
    return key if c is None else c.function if kind == "function" and c.function else c.words
SHEET = tuple(c.key for c in CHECKS if c.passes)  # the items a variant of ours decides
