"""Modern layers: rotary positions, grouped-query and multi-query key/value heads, QK-norm.

The sheet's equation is the core of a Llama-style layer, with three additions the classic
layouts (layouts.py) do not read: W_K and W_V of n_kv_head * d_k rows (query head i reads
key/value head i // (n_head / n_kv_head); 1 key/value head is multi-query), an RMSNorm or
LayerNorm of each head's q and k (gains read from the layer), and q and k turned by rotary
positions before the scores. Our own layer has all three (model/attention.py, as the project
trains them), so the reference is again our CausalSelfAttention with the layer's weights, now
with n_kv_head, the QK-norm and the rotary tables.

What is not in the weights is found by trying: the rotary layout (rotate-half, as Llama and our
model pair dimensions (j, j + d_k/2), or interleaved, (2j, 2j + 1), as GPT-J and CS336 do;
either is correct when used for q and k alike) and theta (the layer's own attribute or
inv_freq buffer if it has one, else 10,000 and 500,000; failing those, fitted). Mistakes are
the second study's switches (scripts/llama_pitfalls.py, model/pitfalls.py) where one reproduces
the layer: `rope_on_values` (v rotated too) and `gqa_repeat_mismatch` (query head i reads
key/value head i % n_kv_head: another group's keys), alone or with the checklist's own variants.
Positions restarting on a cached call need a cache, which a layer called as layer(x) has not:
not probed.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn

from model.attention import attention_layer
from model.rotary import rotary_tables
from check_attention import costs, layouts
from check_attention.compare import golden, rel_err
from check_attention.report import Report
from check_attention.variants import all_variants, mistake_words, num, switch_of

THETAS = (10000.0, 500000.0)      # Llama 2 / GPT-NeoX, and Llama 3
THETA_NAMES = {"theta", "rope_theta", "base", "rope_base", "rotary_base", "rotary_emb_base"}
PITFALLS = {  # the second study's switches a layer called as layer(x) can show
    "rope_on_values": "values are rotated too (rotary positions applied to v as well as q and "
                      "k): the output then carries each key's absolute position",
    "gqa_repeat_mismatch": "query head i reads key/value head i % n_kv_head instead of "
                           "i // (n_head / n_kv_head): each query head reads another group's keys"
                           " (with weights trained in Llama's order, llama_weights=true)",
}
# Tiled key/value heads on weights the layer trains itself: a relabelling of the query heads
# (the second study's gqa_repeat_mismatch arm trains as well as the correct one), so correct.
TILED = ("the key/value heads are tiled (query head i reads key/value head i % n_kv_head, "
         "torch's repeat), where Llama's repeat_interleave gives it head i // (n_head / "
         "n_kv_head): a relabelling of the query heads, which a model trained from scratch "
         "absorbs, so the layer is judged correct; its weights are not interchangeable with "
         "Llama's (Llama's weights loaded into it, or its weights into Llama, read other "
         "groups' keys): check it with llama_weights=true if it holds weights trained that way")


@dataclass
class Reading:
    """A modern layer's weights in our layout: W_Q [D, D], W_K, W_V [n_kv * d_k, D], W_O, and
    the QK-norm (kind, gains and biases per head dimension, eps), or none."""

    words: str
    h: int
    h_kv: int
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    b: tuple          # (bq, bk, bv), each a tensor or None
    wo: Optional[torch.Tensor]
    bo: Optional[torch.Tensor]
    o_name: Optional[str] = None
    norm: Optional[dict] = None   # {"cls": RMSNorm | LayerNorm, "q": (w, b), "k": (w, b), "eps"}


@dataclass(frozen=True)
class Rotary:
    layout: Optional[str]   # None (no rotary positions), "rotate-half" or "interleaved"
    theta: float = 0.0
    fitted: bool = False    # theta is none the layer shows nor ours: fitted to its output

    def words(self) -> str:
        if self.layout is None:
            return "no rotary positions"
        theta = f"{self.theta:.0f}" if self.theta == round(self.theta) else f"{self.theta:g}"
        return (f"rotary positions ({self.layout} pairs, theta {theta}"
                + (", fitted)" if self.fitted else ")"))


@dataclass
class Found:
    reading: Reading
    rotary: Rotary
    variant: object      # variants.Variant
    pitfalls: tuple
    err: float


# ----------------------------------------------------------------------------- reading


def readings(info: dict, captures: dict, D: int, h: Optional[int]) -> list[Reading]:
    """Separate (q_proj [D, D], k_proj and v_proj [r, D]) or fused (one [D + 2r, D], q, k, v in
    that order) projections, r = n_kv_head * d_k, with an output Linear if one is named."""
    lins = layouts.find_linears(info, captures)
    named = {r: [l for l in lins if l.role == r and l.w.size(1) == D] for r in ("q", "k", "v",
                                                                               "qkv", "o")}
    outs = [l for l in named["o"] if l.w.shape == (D, D)]
    o = outs[0] if outs else None
    heads = [h] if h else [c for c in range(1, D + 1) if D % c == 0]
    found = []
    for hh in heads:
        d_k = D // hh
        for q, k, v in itertools.product(named["q"], named["k"], named["v"]):
            r = k.w.size(0)
            if q.w.size(0) == D and v.w.size(0) == r and r % d_k == 0 and hh % (r // d_k) == 0:
                found.append(Reading(
                    f"separate Linears {q.name} [{q.shape()}], {k.name}, {v.name} [{k.shape()}]"
                    + (f" + output {o.name}" if o else ", no output Linear"),
                    hh, r // d_k, q.w, k.w, v.w, (q.b, k.b, v.b), o.w if o else None,
                    o.b if o else None, o.name if o else None))
        for f in named["qkv"]:
            rows = f.w.size(0) - D
            if rows > 0 and rows % 2 == 0 and (rows // 2) % d_k == 0 \
                    and hh % (rows // 2 // d_k) == 0:
                r = rows // 2
                w = f.w.split([D, r, r])
                b = f.b.split([D, r, r]) if f.b is not None else (None,) * 3
                found.append(Reading(
                    f"fused q/k/v Linear {f.name} [{f.shape()}] (q, then k and v of {r} rows)"
                    + (f" + output {o.name}" if o else ", no output Linear"),
                    hh, r // d_k, *w, tuple(b), o.w if o else None, o.b if o else None,
                    o.name if o else None))
    norm = qk_norm(info, D)
    return [replace(r, norm=norm) for r in found if norm is None or norm["d"] == D // r.h]


def qk_norm(info: dict, D: int) -> Optional[dict]:
    """The norms of q and k (modules whose names say q and k, e.g. q_norm / k_norm), or None."""
    by_role = {}
    for entry in info.get("norms", []):
        role = layouts.role_of(entry["name"])
        w = info["params"].get(entry["name"] + ".weight")
        if role in ("q", "k") and w is not None and w.dim() == 1:
            by_role[role] = (entry, w.double(), info["params"].get(entry["name"] + ".bias"))
    if set(by_role) != {"q", "k"} or by_role["q"][1].numel() != by_role["k"][1].numel():
        return None
    entry = by_role["q"][0]
    return {"cls": "LayerNorm" if "layer" in entry["cls"].lower() else "RMSNorm",
            "eps": entry["eps"], "d": by_role["q"][1].numel(),
            "names": (by_role["q"][0]["name"], by_role["k"][0]["name"]),
            **{r: (by_role[r][1], by_role[r][2]) for r in ("q", "k")}}


def thetas(info: dict, d_k: int) -> list[float]:
    """The layer's own theta (an attribute, or read off an inv_freq-like buffer), then ours."""
    own = [float(v) for k, v in info["attrs"].items() if k.lower() in THETA_NAMES and v > 1]
    for name, buf in info.get("buffers", {}).items():
        if buf.numel() == d_k // 2 and d_k >= 4 and ("freq" in name.lower()) \
                and 0 < float(buf[1]) < 1 and float(buf[0]) == 1.0:
            own.append(round(float(buf[1]) ** (-d_k / 2)))  # inv_freq_1 = theta^(-2/d_k)
    return list(dict.fromkeys(own + list(THETAS)))


# ----------------------------------------------------------------------------- reference


def output(r: Reading, rotary: Rotary, variant, pitfalls: tuple, x: torch.Tensor,
           dtype=torch.float64, grad: bool = False, seen: Optional[dict] = None
           ) -> torch.Tensor:
    """Our CausalSelfAttention (in `dtype`, float64 unless the probes ask for the layer's own)
    with the reading's weights, as `variant` with the second study's `pitfalls` switched on:
    x [B, T, D] -> y. The weights enter by torch.func.functional_call, not by copying, so that
    with grad the output is differentiable in them (the gradient probe, probes.py). seen: gets
    the q and k the scores are made of (after QK-norm and rotary positions)."""
    D, T, d_k = r.wq.size(1), x.size(1), r.wq.size(1) // r.h
    attn = replace(variant.attn, out_proj=r.wo is not None,
                   rotary_interleaved=rotary.layout == "interleaved",
                   **{p: True for p in pitfalls})
    eps = (r.norm or {}).get("eps")
    layer = attention_layer(D, r.h, block_size=T, attn=attn, bias=True, n_kv_head=r.h_kv,
                            qk_norm=r.norm is not None,
                            norm_eps=eps if eps is not None else 1e-6).to(dtype).eval()
    zeros = torch.zeros(D + 2 * r.wk.size(0), dtype=torch.float64).split(
        [D, r.wk.size(0), r.wk.size(0)])
    weights = {"qkv.weight": torch.cat([r.wq, r.wk, r.wv]),
               "qkv.bias": torch.cat([z if b is None else b.double() for b, z in zip(r.b, zeros)])}
    if r.wo is not None:
        weights["out_proj.weight"] = r.wo
        weights["out_proj.bias"] = r.bo.double() if r.bo is not None else torch.zeros(D)
    if r.norm is not None:
        for role in ("q", "k"):
            w, b = r.norm[role]
            norm = nn.LayerNorm(d_k, eps=eps or 1e-5, bias=b is not None) \
                if r.norm["cls"] == "LayerNorm" else nn.RMSNorm(d_k, eps=eps)
            setattr(layer, f"{role}_norm", norm.to(dtype))
            weights[f"{role}_norm.weight"] = w
            if b is not None:
                weights[f"{role}_norm.bias"] = b.double()
    layer.causal = variant.visible(T)
    if seen is not None:
        attend = layer.attend
        layer.attend = lambda q, k, *rest: (seen.update(q=q, k=k), attend(q, k, *rest))[1]
    tables = None
    if rotary.layout is not None:
        tables = rotary_tables(torch.arange(T), d_k, rotary.theta, dtype)
    with torch.set_grad_enabled(grad):
        y, _ = torch.func.functional_call(layer, {n: w.to(dtype) for n, w in weights.items()},
                                          (x.to(dtype),), {"rotary": tables})
    return y


def candidates(r: Reading, info: dict, max_mistakes: int = 2):
    """(rotary, variant, pitfalls) to try, fewest mistakes first."""
    d_k = r.wq.size(1) // r.h
    rotaries = [Rotary(None)] + ([Rotary(layout, t) for layout in ("rotate-half", "interleaved")
                                  for t in thetas(info, d_k)] if d_k % 2 == 0 else [])
    switches = [()] + [(p,) for p in PITFALLS] + [tuple(PITFALLS)]
    out = []
    for variant in all_variants():
        if variant.attn.out_proj != (r.wo is not None) or variant.third_study:
            continue
        for rot, sw in itertools.product(rotaries, switches):
            if ("rope_on_values" in sw and rot.layout is None) or \
                    ("gqa_repeat_mismatch" in sw and not 1 < r.h_kv < r.h):
                continue
            mistakes = len(variant.mistakes) + len(sw)
            if mistakes <= max_mistakes:
                out.append((mistakes, rot, variant, sw))
    out.sort(key=lambda c: c[0])
    return [c[1:] for c in out]


def match(rs: list[Reading], info: dict, xs: list, ys: list, tol: float
          ) -> tuple[Optional[Found], Optional[Found]]:
    """(the simplest reading and variant that reproduce the layer, or None; the closest one)."""
    x, y = torch.cat(xs), torch.cat(ys)
    best = closest = None
    for r in rs:
        for rot, variant, sw in candidates(r, info):
            if best is not None and len(variant.mistakes) + len(sw) > \
                    len(best.variant.mistakes) + len(best.pitfalls):
                break
            err = rel_err(y, output(r, rot, variant, sw, x),
                          skip_first=variant.pattern == "mask_no_diagonal", probes=len(xs))
            found = Found(r, rot, variant, sw, err)
            if err <= tol and best is None:
                best = found
            if not variant.mistakes and not sw and (closest is None or err < closest.err):
                closest = found  # the nearest correct reading (its rotary positions, its theta)
    if best is None and closest is not None and closest.rotary.layout is not None:
        best = fit_theta(closest, x, y, tol, len(xs))
    return best, closest


def fit_theta(near: Found, x, y, tol: float, probes: int) -> Optional[Found]:
    """A theta none of ours (Qwen's 1,000,000, say), fitted in log space for the nearest correct
    reading's pair layout: the match if one fits within the tolerance."""
    def err(log_theta):
        return rel_err(y, output(near.reading, Rotary(near.rotary.layout, math.exp(log_theta)),
                                 near.variant, (), x), probes=probes)
    log_theta, e = golden(err, math.log(100.0), math.log(1e8))
    if e > tol:
        return None
    theta = float(f"{math.exp(log_theta):.3g}")  # said as the layer most likely wrote it
    e = min(e, err(math.log(theta)))
    return Found(near.reading, Rotary(near.rotary.layout, theta, fitted=True), near.variant, (), e)


# ----------------------------------------------------------------------------- words


def layout_words(f: Found, D: int) -> str:
    r = f.reading
    kv = ("; multi-query: 1 key/value head" if r.h_kv == 1 < r.h else
          f"; {r.h_kv} key/value heads for {r.h} query heads" if r.h_kv < r.h else "")
    norm = "" if r.norm is None else (f"; QK-norm: {r.norm['cls']} of each head's q and k "
                                      f"({', '.join(r.norm['names'])})")
    return f"{r.words}; {r.h} heads, d_k = {D // r.h}{kv}; {f.rotary.words()}{norm}"


def report(rep: Report, f: Found, D: int, tol: float, llama_weights: bool = False) -> None:
    """The checklist's items from a match: the mistakes its variant and switches name. Tiled
    key/value heads are a mistake only for weights trained with Llama's order (llama_weights);
    otherwise a note says why they are not."""
    r, v = f.reading, f.variant
    d_k = D // r.h
    rep.header["layout"] = layout_words(f, D)
    words = mistake_words(v, d_k, r.h)
    by_item = {item: w for item, w in words if item}
    passes = {"scale": f"divided by sqrt(d_k) = {num(math.sqrt(d_k))}",
              "w_o": f"{r.o_name} mixes the heads",
              "before_softmax": "each row of weights sums to 1 over the visible keys",
              "mask_value": "future keys get weight 0"}
    for item, ok in passes.items():
        rep.set(item, "FAIL" if item in by_item else "PASS", by_item.get(item, ok))
    ours = "our CausalSelfAttention with the layer's weights" + (
        f", {r.h_kv} key/value head{'s' * (r.h_kv > 1)}" if r.h_kv < r.h else "") + (
        ", QK-norm" if r.norm else "") + ("" if f.rotary.layout is None else
                                          f", {f.rotary.layout} rotary positions")
    tiled = "gqa_repeat_mismatch" in f.pitfalls and not llama_weights
    pitfalls = [p for p in f.pitfalls if not (tiled and p == "gqa_repeat_mismatch")]
    if tiled:
        cost = costs.words("gqa_repeat_mismatch", costs.load())
        rep.diagnosis.append(TILED + (f"; {cost}" if cost else ""))
        ours += ", its key/value heads tiled"
    mistakes = [w for _, w in words] + [PITFALLS[p] for p in pitfalls]
    if not mistakes:
        rep.set("equation", "PASS", f"{ours}: max relative difference {f.err:.1e}")
        return
    rep.set("equation", "FAIL", "; ".join(mistakes))
    rep.named(*filter(None, map(switch_of, v.mistakes)), *pitfalls)
    name = "+".join(([v.name] if v.mistakes else []) + pitfalls)
    rep.diagnosis.append(f"{ours} reproduces this layer as attention={name} (the second "
                         f"study's switches: scripts/llama_pitfalls.py; max relative difference "
                         f"{f.err:.1e}, tolerance {tol:.0e})" if f.pitfalls else
                         f"{ours} reproduces this layer as attention={name} (max relative "
                         f"difference {f.err:.1e}, tolerance {tol:.0e})")


def no_match(rep: Report, closest: Found, D: int) -> None:
    """No reading reproduces it: say what was tried and the closest, and let the black-box
    checks (causality, shape, rows summing to 1) judge the rest."""
    rep.header["layout"] = f"{layout_words(closest, D)}? (no variant of ours reproduces it)"
    rep.set("equation", "FAIL", f"no variant of ours reproduces it, with or without rotary "
            f"positions (rotate-half, interleaved; theta {', '.join(f'{t:g}' for t in THETAS)} "
            f"or the layer's own); the closest correct reading, with "
            f"{closest.rotary.words()}, differs by {closest.err:.2g} relative")


def judge(rep: Report, info: dict, captures: dict, xs: list, ys: list, tol: float, D: int,
          h: Optional[int], classic: bool, llama_weights: bool = False):
    """Read the layer as a modern one and judge it. A Found: the match reported (the probes'
    reference, probes.py); False: a modern reading exists but nothing reproduces it (the
    equation line says so); None: no modern reading (or, with classic True, none that explains
    more than the classic layouts do)."""
    rs = readings(info, captures, D, h)
    if not rs:
        return None
    best, closest = match(rs, info, xs, ys, tol)
    if best is not None:
        report(rep, best, D, tol, llama_weights)
        return best
    modern = any(r.h_kv < r.h or r.norm is not None for r in rs)
    if classic and not modern:
        return None  # an ordinary layout: the classic diagnosis follows its steps
    no_match(rep, closest, D)
    return False
