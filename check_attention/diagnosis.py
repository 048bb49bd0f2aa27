"""White-box diagnosis: which of our variants, under which reading of the layer's weights,
reproduces its output; and when none does, the first step where the layer's own intermediate
results part from ours."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from model.config import MaskMode
from check_attention import layouts
from check_attention.compare import PROBES, golden, rel_err
from check_attention.report import Report
from check_attention.variants import (ITEMS, Variant, all_variants, attend,
                                              divisor_words, mistake_words, module_output, num,
                                              split_words, switch_of, variant_attend_kwargs)


@dataclass
class Match:
    mapping: layouts.Mapping
    variant: Variant
    err: float
    unresolved: dict   # item -> the variant it cannot be told from


def match(maps: list, xs: list, ys: list, tol: float, window: Optional[int] = None
          ) -> Optional[Match]:
    """The simplest (mapping, variant) whose output equals the layer's (window: the layer's
    sliding window, when it has one)."""
    x, y = torch.cat(xs), torch.cat(ys)
    variants = all_variants(window=window)
    best, refs_of = None, {}
    for group in ([v for v in variants if not v.third_study],
                  [v for v in variants if v.third_study]):
        for i, m in enumerate(maps):
            if best is not None and m.prior > maps[i - 1].prior:
                break  # a less plausible reading is tried only when the likelier ones explain nothing
            refs = refs_of.get(id(m), {})
            for v in group:
                if v.attn.out_proj != (m.weights.wo is not None):
                    continue
                ref = module_output(m.weights, m.h, v, x)
                refs[v.name] = ref
                err = rel_err(y, ref, skip_first=v.pattern == "mask_no_diagonal", probes=len(xs))
                key = (len(v.mistakes), m.prior, err)
                if err <= tol and (best is None or key < best[0]):
                    best = (key, m, v, err)
            refs_of[id(m)] = refs
            if best is not None and best[1] is m and not best[2].mistakes and m.prior == 0:
                break  # a correct, name-confirmed match: nothing simpler exists
        if best is not None:
            break
    if best is None:
        return None
    _, m, v, err = best
    refs, unresolved = refs_of[id(m)], {}
    for other in variants:
        if other.name == v.name or other.name not in refs:
            continue
        if rel_err(refs[other.name], refs[v.name], True, len(xs)) <= 2 * tol:
            for item in ITEMS:
                if other.fails()[item] != v.fails()[item]:
                    unresolved.setdefault(item, other.name)
    return Match(m, v, err, unresolved)


def report_match(report: Report, found: Match, D: int, tol: float, info: dict,
                  captures: dict) -> None:
    m, v = found.mapping, found.variant
    d_k = D // m.h
    report.header["layout"] = f"{m.words}; {m.h} heads, d_k = {d_k}" + (
        f"; a sliding window of {v.window} keys" if v.window is not None else "")
    words = mistake_words(v, d_k, m.h)
    by_item = {item: w for item, w in words if item}
    if "w_o" in by_item:
        unused = [e["name"] for e in info["linears"] if layouts.role_of(e["name"]) == "o"
                  and captures.get(e["name"], {}).get("calls") == 0]
        if unused:
            by_item["w_o"] = f"{unused[0]} is defined but never applied: the concatenated " \
                             f"heads are the output"
    passes = {"scale": f"divided by sqrt(d_k) = {num(math.sqrt(d_k))}",
              "w_o": f"{m.names.get('o')} mixes the heads",
              "before_softmax": "each row of weights sums to 1 over the visible keys",
              "mask_value": "future keys get weight 0"}
    if v.attn.softmax_over_queries:  # the mask comes before the softmax; its axis is wrong
        passes["before_softmax"] = "the mask is added to the scores before the softmax"
    for item in ITEMS:
        if item in by_item:
            report.set(item, "FAIL", by_item[item])
        elif item in found.unresolved:
            report.set(item, "SKIP", f"at this precision the probes cannot tell the layer from "
                                     f"our variant {found.unresolved[item]}")
        else:
            report.set(item, "PASS", passes[item])
    report_equation(report, v, words, "our CausalSelfAttention with the layer's weights",
                    "this layer", f"max relative difference {found.err:.1e}, tolerance {tol:.0e}",
                    f"max relative difference {found.err:.1e}")


def report_equation(report, variant, words: list, ours: str, what: str, fit: str,
                    exact: str) -> None:
    """The equation item once a variant of ours reproduces the target (a layer or a function):
    PASS for the correct variant, else FAIL with the mistakes' words, the diagnosis naming the
    variant (`fit`: how closely) and the switches that reproduce it."""
    if not variant.mistakes:
        report.set("equation", "PASS", f"{ours}: {exact}")
        return
    report.set("equation", "FAIL", "; ".join(w for _, w in words))
    report.diagnosis.append(f"{ours} reproduces {what} as attention={variant.name} "
                            f"({unlisted(words)}{fit})")
    report.named(*filter(None, map(switch_of, variant.mistakes)))


def unlisted(words: list) -> str:
    """The mistakes no checklist line names (the head split, the softmax's axis, a mask or
    window off by one), said in the diagnosis too, so that a grading table's one-line diagnosis
    names the cause: 'words; ' or ''."""
    said = [w for item, w in words if not item]
    return "".join(w + "; " for w in said)


def first_difference(maps: list, captures: list, xs: list, ys: list, tol: float, D: int):
    """No variant reproduces the layer under any reading: follow its own intermediate results
    (the Linears' inputs and outputs) to the first step that differs from ours. Returns
    (mapping, words, {item: (ok, detail)}, the switches that name it) or None when no reading
    can be followed."""
    for m in [m for m in maps if m.prior == 0][:6] or maps[:3]:
        acts = [m.activations(c) for c in captures]
        if any(a is None for a in acts):
            continue
        found = _core(m, acts, captures, xs, ys, tol, D)
        if found is not None:
            return (m, *found)
    return None


def _core(m, acts, captures, xs, ys, tol, D):
    """(words, {item: (ok, detail)}, switches) for the first step of the layer that differs from
    ours, or None if this reading of the layer explains nothing."""
    h, d_k = m.h, D // m.h
    for role in ("qkv", "q", "k", "v"):
        for name in ([m.names[role]] if isinstance(m.names.get(role), str) else
                     m.names.get(role) or []):
            for cap, x in zip(captures, xs):
                inp = cap[name].get("input")
                if inp is not None and rel_err(inp, x) > tol:
                    return (f"{name} is applied to something other than the layer's input x", {},
                            ())
    o = m.out_input
    if o and captures[0][o]["calls"] == 0:
        return None  # this reading's W_O never runs: the reading without one explains it
    concat = [cap[o]["input"].double() for cap in captures] if o else ys
    target = torch.cat(concat)
    q, k, v = (torch.cat([a[i] for a in acts]) for i in range(3))
    ok_o = (True, f"{o} mixes the heads") if o else (False, "there is no output Linear: the "
                                                            "concatenated heads are the output")
    if o and not all(rel_err(y, cap[o]["output"]) <= tol for y, cap in zip(ys, captures)):
        return (f"the layer's output is not {o}'s output: something changes it after W_O", {},
                ())
    best = closest = None
    for split, merge in (("heads", "heads"), ("mixed", "heads"), ("heads", "mixed"),
                         ("mixed", "mixed")):
        for var in [v_ for v_ in all_variants() if v_.attn.out_proj
                    and not v_.attn.split_heads_no_transpose]:  # the split is tried here
            ref = attend(q, k, v, h, split=split, merge=merge, pattern_name=var.pattern,
                         **variant_attend_kwargs(var, d_k, h))
            err = rel_err(target, ref, skip_first=var.pattern == "mask_no_diagonal",
                          probes=PROBES)
            key = ((split, merge) != ("heads", "heads"), len(var.mistakes), err)
            if err <= tol and (best is None or key < best[0]):
                best = (key, split, merge, var, err)
            if closest is None or err < closest[-1]:
                closest = (None, split, merge, var, err)
        if best is not None:
            break
    best = best or closest
    _, split, merge, var, err = best
    if err <= tol:
        words = []
        if split == "mixed":
            words.append(split_words(h, d_k))
        if merge == "mixed":
            words.append(f"heads are joined with .reshape(B, T, {D}) without first transposing "
                         f"[B, h, T, d_k] back, which mixes positions and heads")
        mistakes = mistake_words(var, d_k, h)
        words += [w for _, w in mistakes]
        verdicts = {"w_o": ok_o}
        fails = dict(mistakes)
        for item in ("scale", "before_softmax", "mask_value"):
            verdicts[item] = (False, fails[item]) if item in fails else (True, "")
        switches = (("split_heads_no_transpose",) if split == "mixed" else ()) + tuple(
            filter(None, map(switch_of, var.mistakes)))
        return "; ".join(words), verdicts, switches
    # fits: a divisor, then a finite mask value, that no variant has
    heads_kw = dict(split="heads", merge="heads")

    def scale_err(log_s):
        return rel_err(target, attend(q, k, v, h, scale=math.exp(log_s), **heads_kw),
                       probes=PROBES)
    log_s, e = golden(scale_err, math.log(1e-3), math.log(10.0))
    if e <= tol:
        words = divisor_words(math.exp(log_s), d_k, h, tol)
        return words, {"scale": (False, words), "w_o": ok_o, "before_softmax": (True, ""),
                       "mask_value": (True, "")}, ()
    for mode in (MaskMode.add, MaskMode.fill):
        def mask_err(value, mode=mode):
            return rel_err(target, attend(q, k, v, h, scale=1 / math.sqrt(d_k), mask_mode=mode,
                                          mask_value=value, **heads_kw), probes=PROBES)
        value, e = golden(mask_err, -60.0, 0.0)
        if e <= tol:
            how = "added to" if mode is MaskMode.add else "written into"
            words = (f"the mask value is {value:.3g}, {how} the future scores: too small to hide "
                     f"them (exp({value:.3g}) = {math.exp(value):.2g} of a visible key's weight)")
            return words, {"scale": (True, ""), "w_o": ok_o, "before_softmax": (True, ""),
                           "mask_value": (False, words)}, ()
    src = "the input of " + o if o else "the output"
    return (f"the attention itself: from the layer's own q, k, v, no variant of ours gives "
            f"{src} ({closest_words(var, err)})", {"w_o": ok_o}, ())


def closest_words(var: Variant, err: float) -> str:
    if not math.isfinite(err):
        return "its output has NaN where every variant of ours has numbers"
    return f"the closest, attention={var.name}, differs by {err:.2g} relative"


