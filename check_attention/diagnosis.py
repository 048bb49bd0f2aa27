"""White-box diagnosis: which of our variants, under which reading of the layer's weights and
which rotary positions, reproduces its output, and the report of what it names.

`match` tries the candidates in tiers, from the likeliest: the classic variants on the classic
layouts; the third study's (the head split, the softmax's axis, the window); rotary positions
(each pair layout, the layer's theta and ours), grouped key/value heads and QK-norm with the
classic variants and the second study's switches (scripts/llama_pitfalls.py: `rope_on_values`,
`gqa_repeat_mismatch`); a fitted theta; the checker's own rare mistakes (a mask inverted, the
scores K Q^T, the scale after the softmax, the heads joined without the transpose); last, a
divisor or a mask value fitted to the closest reading (variants.fit). Where nothing reproduces
the layer, its own Linears may still say why (an input other than x, an output changed after
W_O), and the black-box checks judge the rest.

Tiled key/value heads (query head i reads head i % n_kv_head) and interleaved rotary pairs are
correct on weights a layer trains itself: mistakes only for weights trained in transformers'
Llama layout (llama_weights=true); tiled heads that pass get a note saying why.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from check_attention import costs, layouts
from check_attention.compare import PROBES, golden, rel_err
from check_attention.layouts import Reading, Rotary
from check_attention.report import Report
from check_attention.variants import (Variant, all_variants, fit, layer_output, mistake_words,
                                      num, switch_of)

# Tiled key/value heads on weights the layer trains itself: a relabelling of the query heads
# (the second study's gqa_repeat_mismatch arm trains as well as the correct one), so correct.
TILED = ("the key/value heads are tiled (query head i reads key/value head i % n_kv_head, "
         "torch's repeat), where Llama's repeat_interleave gives it head i // (n_head / "
         "n_kv_head): a relabelling of the query heads, which a model trained from scratch "
         "absorbs, so the layer is judged correct; its weights are not interchangeable with "
         "Llama's (Llama's weights loaded into it, or its weights into Llama, read other "
         "groups' keys): check it with llama_weights=true if it holds weights trained that way")


@dataclass
class Match:
    """What reproduced the target: a reading of a layer's weights (None for a function), its
    rotary positions, our variant, the second study's switches; or a fit on top of them."""

    reading: Optional[Reading]
    rotary: Rotary
    variant: Variant
    switches: tuple = ()
    err: float = math.inf
    unresolved: dict = field(default_factory=dict)  # item -> the variant it cannot be told from
    fitted: Optional[tuple] = None                  # (item, words) of a fitted divisor or mask


# ----------------------------------------------------------------------------- the search


def match(rs: list[Reading], info: dict, xs: list, ys: list, tol: float,
          window: Optional[int] = None) -> tuple[Optional[Match], Optional[Match]]:
    """(the simplest reading, rotary positions and variant that reproduce the layer, or None;
    the closest correct one). Within a tier the likeliest reading wins, then the fewest
    mistakes, then the smallest difference; a tier is tried only when the ones before it
    explain nothing."""
    x, y, n = torch.cat(xs), torch.cat(ys), len(xs)
    variants = all_variants(window=window)
    classic = [v for v in variants if not v.third_study and not v.rare]
    plain = Rotary(None)

    def turns(r, also_plain):  # the rotary positions tried on r
        return [t for t in layouts.rotaries(info, r.wq.size(1) // r.h) if t.layout or also_plain]
    found, near = _search([(r.prior, r, v, plain, ()) for r in rs if r.classic for v in classic],
                          x, y, tol, n, classic)
    found = found or _search([(r.prior, r, v, plain, ()) for r in rs if r.classic
                              for v in variants if v.third_study and not v.rare], x, y, tol, n,
                             [v for v in variants if not v.rare])[0]
    if found:
        return found, near
    found, turned = _search([(len(v.mistakes) + len(sw), r, v, t, sw) for r in rs if r.modern
                             for t in turns(r, not r.classic) for v in classic
                             for sw in ((), ("rope_on_values",), ("gqa_repeat_mismatch",),
                                        ("rope_on_values", "gqa_repeat_mismatch"))
                             if len(v.mistakes) + len(sw) <= 2
                             and (t.layout or "rope_on_values" not in sw)
                             and (1 < r.h_kv < r.h or "gqa_repeat_mismatch" not in sw)],
                            x, y, tol, n)
    nears = [m for m in (near, turned) if m is not None]  # without rotary positions, then with
    if not found and turned is not None and turned.rotary.layout:
        found = fit_theta(turned, x, y, tol, n)
    found = found or _search([(r.prior, r, v, t, ()) for r in rs for t in turns(r, True)
                              if t.layout is None or r.modern for v in variants
                              if (v.rare and (r.h_kv == r.h or "scores_kq" not in v.mistakes))
                              or (t.layout and v.third_study and len(v.mistakes) == 1)],
                             x, y, tol, n)[0]
    return found or fit_layer(nears, info, x, y, tol, n), (nears or [None])[0]


def _search(cands: list, x, y, tol: float, probes: int, alike: tuple = ()
            ) -> tuple[Optional[Match], Optional[Match]]:
    """(the match, the closest correct candidate): candidates (key, reading, variant, rotary,
    switches), tried by key; the first key with a match, and in it the smallest difference.
    alike: the variants whose items are left unjudged (SKIP) where the match's output cannot be
    told from theirs."""
    best = closest = None
    outs = {}
    for key, r, v, rot, sw in sorted((c for c in cands if c[2].attn.out_proj ==
                                      (c[1].wo is not None)), key=lambda c: c[0]):
        if best is not None and key > best[0]:
            break
        out = outs[id(r), v.name] = layer_output(r, rot, v, sw, x)
        err = rel_err(y, out, skip_first=v.pattern == "mask_no_diagonal", probes=probes)
        if set(v.mistakes) <= {"no_out_proj"} and not sw and (closest is None
                                                               or err < closest.err):
            closest = Match(r, rot, v, sw, err)
        if err <= tol and (best is None or err < best[1].err):
            best = (key, Match(r, rot, v, sw, err))
    if best is None:
        return None, closest
    found = best[1]
    r, v = found.reading, found.variant
    for other in alike:  # the variants it cannot be told from at this precision
        if other is not v and other.attn.out_proj == (r.wo is not None):
            out = outs.get((id(r), other.name))
            out = layer_output(r, found.rotary, other, (), x) if out is None else out
            if rel_err(out, outs[id(r), v.name], True, probes) <= 2 * tol:
                for item, wrong in other.fails().items():
                    if wrong != v.fails()[item]:
                        found.unresolved.setdefault(item, other.name)
    return found, closest


def fit_theta(near: Match, x, y, tol: float, probes: int) -> Optional[Match]:
    """A theta none of ours (Qwen's 1,000,000, say), fitted in log space for the nearest correct
    reading's pair layout: the match if one fits within the tolerance."""
    def err(log_theta):
        return rel_err(y, layer_output(near.reading, Rotary(near.rotary.layout,
                                                            math.exp(log_theta)),
                                       near.variant, (), x), probes=probes)
    log_theta, e = golden(err, math.log(100.0), math.log(1e8))
    if e > tol:
        return None
    theta = float(f"{math.exp(log_theta):.3g}")  # said as the layer most likely wrote it
    e = min(e, err(math.log(theta)))
    return Match(near.reading, Rotary(near.rotary.layout, theta, fitted=True), near.variant, (),
                 e)


def fit_layer(nears: list, info: dict, x, y, tol: float, probes: int) -> Optional[Match]:
    """A divisor or a mask value fitted to the closest correct readings, under their rotary
    positions (and the others, where rotary positions are in play): the match, or None."""
    for near in nears:
        r = near.reading
        for turn in [near.rotary] + [t for t in layouts.rotaries(info, r.wq.size(1) // r.h)
                                     if t != near.rotary and (near.rotary.layout or not r.classic)]:
            found = fit(lambda **kw: layer_output(r, turn, near.variant, (), x, **kw), y,
                        r.wq.size(1) // r.h, r.h, tol, probes, how=True)
            if found:
                return Match(r, turn, near.variant, (), near.err, fitted=found)
    return None


def match_function(q, k, v, y, d_k: int, h: int, tol: float) -> Optional[tuple]:
    """(key, variant, err) of the variant of ours closest to a function's outputs y (q, k, v:
    the probes stacked), fewest mistakes first among those within tol; None without y."""
    best = None
    for var in all_variants() if y is not None else []:
        if not var.attn.out_proj or var.attn.split_heads_no_transpose or \
                "join_no_transpose" in var.mistakes:
            continue  # its heads come split and joined, and it has no W_O
        err = rel_err(y, var.equation(q, k, v, d_k, h),
                      skip_first=var.pattern == "mask_no_diagonal", probes=PROBES)
        key = (err > tol, len(var.mistakes), err)
        if best is None or key < best[0]:
            best = (key, var, err)
    return best


# ----------------------------------------------------------------------------- the report


def layout_words(f: Match, D: int) -> str:
    r = f.reading
    if r.classic and f.rotary.layout is None:
        words = f"{r.words}; {r.h} heads, d_k = {D // r.h}"
    else:
        kv = ("; multi-query: 1 key/value head" if r.h_kv == 1 < r.h else
              f"; {r.h_kv} key/value heads for {r.h} query heads" if r.h_kv < r.h else "")
        norm = "" if r.norm is None else (f"; QK-norm: {r.norm['cls']} of each head's q and k "
                                          f"({', '.join(r.norm['names'])})")
        words = f"{r.modern_words}; {r.h} heads, d_k = {D // r.h}{kv}; {f.rotary.words()}{norm}"
    w = f.variant.window
    return words + ("" if w is None else f"; a sliding window of {w} keys")


def report_found(rep: Report, f: Match, d_k: int, h: int, tol: float, info: dict,
                 captures: Optional[dict] = None, llama_weights: bool = False) -> None:
    """The checklist's items and the diagnosis from a match, a layer's or a function's: the
    mistakes its variant, its reading, its switches or its fit name (variants.WORDS)."""
    r, v = f.reading, f.variant
    switches = tuple(s for s in f.switches if s != "gqa_repeat_mismatch" or llama_weights) + (
        ("rotary_interleaved",) * (llama_weights and f.rotary.layout == "interleaved"))
    own = ("own_out_proj",) if r is not None and r.own_o else ()
    words = mistake_words(v, d_k, h, own + switches, r and r.own_o) + (
        [(None, *f.fitted)] if f.fitted else [])
    fails, over = {}, {}
    for _, item, w in words:
        if item:
            fails.setdefault(item, w)
    if v.attn.softmax_over_queries:  # the mask is before the softmax; the softmax's axis is wrong
        over["before_softmax"] = "the mask is added to the scores before the softmax"
    if r is None:
        ours, over["scale"] = "our scaled_dot_product_attention", \
            f"divided by sqrt(d_k) = {num(math.sqrt(d_k))}, d_k = q.size(-1)"
    else:
        rep.header["layout"] = layout_words(f, d_k * h)
        ours = "our CausalSelfAttention with the layer's weights" + (
            f", {r.h_kv} key/value head{'s' * (r.h_kv > 1)}" if r.h_kv < r.h else "") + (
            ", QK-norm" if r.norm else "") + ("" if f.rotary.layout is None else
                                              f", {f.rotary.layout} rotary positions")
        over["o"] = r.names.get("o")
        unused = [e["name"] for e in info["linears"] if layouts.role_of(e["name"]) == "o"
                  and (captures or {}).get(e["name"], {}).get("calls") == 0]
        if "w_o" in fails and unused:
            fails["w_o"] = f"{unused[0]} is defined but never applied: the concatenated " \
                           f"heads are the output"
    rep.sheet(fails, f.unresolved, sqrt_d_k=num(math.sqrt(d_k)), **over)
    if "gqa_repeat_mismatch" in f.switches and not llama_weights:
        cost = costs.words("gqa_repeat_mismatch", costs.load())
        rep.diagnosis.append(TILED + (f"; {cost}" if cost else ""))
        ours += ", its key/value heads tiled"
    if v.window is not None:
        rep.diagnosis.append(f"a sliding window of {v.window} keys: query i sees keys "
                             f"i - {v.window - 1} .. i, not all of 0 .. i as the sheet's mask "
                             f"has it; judged against our layer with the same window")
    err = f"max relative difference {f.err:.1e}"
    if not words:
        rep.set("equation", "PASS", f"{ours}: {err}")
        return
    rep.set("equation", "FAIL", "; ".join(w for *_, w in words))
    if f.fitted:
        rep.diagnosis.append(f"no variant of ours reproduces it; a fitted "
                             f"{'divisor' if f.fitted[0] == 'scale' else 'mask value'} does"
                             + ("" if r is None else f" ({ours})") + f": {f.fitted[1]}")
    else:  # said: what no checklist line names, and the checker's own mistakes
        said = "".join(w + "; " for name, item, w in words if not item or not switch_of(name))
        rep.diagnosis.append(
            f"{ours} reproduces {'it' if r is None else 'this layer'} as attention="
            f"{'+'.join(([v.name] if v.mistakes else []) + list(own + switches))} ("
            + "the second study's switches: scripts/llama_pitfalls.py; " * bool(switches)
            + f"{said}{err}" + ("" if r is None else f", tolerance {tol:.0e}") + ")")
    rep.named(*filter(None, map(switch_of, v.mistakes)), *switches)


def no_match(rep: Report, near: Match, D: int, captures: list, xs: list, ys: list,
             tol: float) -> None:
    """Nothing reproduces the layer: what its own Linears show, if they show why (an input other
    than x, an output changed after W_O), else what was tried and the closest."""
    r, o = near.reading, near.reading.names.get("o")
    rep.header["layout"] = f"{layout_words(near, D)}? (no variant of ours reproduces it)"
    names = [n for role in ("qkv", "q", "k", "v") for n in (
        [r.names[role]] if isinstance(r.names.get(role), str) else r.names.get(role) or [])]
    why = next((f"{n} is applied to something other than the layer's input x" for n in names
                for c, x in zip(captures, xs) if "input" in c.get(n, {})
                and rel_err(c[n]["input"], x) > tol), None)
    if why is None and o and any("output" in c.get(o, {}) and rel_err(y, c[o]["output"]) > tol
                                 for y, c in zip(ys, captures)):
        why = f"the layer's output is not {o}'s output: something changes it after W_O"
    if why:
        rep.diagnosis.append(why)
    elif r.classic:  # its output is its W_O's, applied to the heads (or it has none)
        rep.sheet({} if o else {"w_o": "there is no output Linear: the concatenated heads are "
                                       "the output"}, only=("w_o",), o=o)
    rep.set("equation", "FAIL", why or (
        f"no variant of ours reproduces it, with or without rotary positions (rotate-half, "
        f"interleaved; theta {', '.join(f'{t:g}' for t in layouts.THETAS)} or the layer's own); "
        f"the closest correct reading, with {near.rotary.words()}, differs by {near.err:.2g} "
        f"relative"))


def closest_words(var: Variant, err: float) -> str:
    if not math.isfinite(err):
        return "its output has NaN where every variant of ours has numbers"
    return f"the closest, attention={var.name}, differs by {err:.2g} relative"
