"""Our attention, correct and with each mistake the checker names, as references to compare a
layer or a function with.

The variants are the project's own: `conf/attention/*.yaml` (each a diff on `AttentionConfig`),
of which those a forward pass `layer(x)` shows (FORWARD_FIELDS: the scale, the mask, W_O, the
head split and the softmax's axis; the rotary and grouped-head switches are tried with rotary
positions, diagnosis.py; the cache and padding ones need a cache), plus the checker's own
mistakes, which the model has no switch for (CHECKER): masks off by one or inverted, the scores
K Q^T, the scale after the softmax, the heads joined without the transpose. A layer with a
sliding window gets the window as part of every variant's pattern, and `window_off_by_one`
(w + 1 keys) besides. Mistakes that touch different fields combine, so a layer with two of them
is named with both. WORDS says each in plain words, with its fix where it is not obvious.

Two references compute the equation: `layer_output` runs our `CausalSelfAttention` with a
layer's weights (a layouts.Reading) through torch.func.functional_call, so that it is
differentiable in them (the gradient probe), and `Variant.equation` runs our
`scaled_dot_product_attention` on given q, k, v (a function's reference). `fit` finds a divisor
or a mask value no variant has, for either.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from omegaconf import OmegaConf

from model.attention import attention_layer, causal_pattern, scaled_dot_product_attention
from model.config import AttentionConfig, AttentionImpl, MaskMode, Scale
from model.pitfalls import masked_softmax
from model.rotary import rotary_tables
from check_attention.compare import golden, rel_err

CONF = Path(__file__).resolve().parents[1] / "conf" / "attention"
PATTERNS = {"causal": 0, "mask_no_diagonal": -1, "mask_one_future": 1}  # tril diagonal offset
# The checker's own mistakes. The first two are patterns and combine; the rest are tried alone,
# after everything else (diagnosis.py's last tier).
CHECKER = ("mask_no_diagonal", "mask_one_future", "mask_inverted", "scores_kq",
           "scale_after_softmax", "join_no_transpose")
RARE = CHECKER[2:]
# The AttentionConfig fields whose pitfalls a forward pass layer(x) shows.
FORWARD_FIELDS = {"scale", "mask_mode", "mask_value", "out_proj", "split_heads_no_transpose",
                  "softmax_over_queries"}


def pattern(name: str, n: int) -> torch.Tensor:
    """The boolean [n, n] visible pattern of a mask (True = query i may see key j)."""
    if name in ("causal", "mask_inverted"):
        return causal_pattern(n, n) ^ (name == "mask_inverted")
    return torch.ones(n, n, dtype=torch.bool).tril(diagonal=PATTERNS[name])


@dataclass(frozen=True)
class Variant:
    """One way to compute attention: our config (scale, mask, W_O, ...), the mask's pattern and
    the checker's own mistakes."""

    name: str
    attn: AttentionConfig
    pattern: str = "causal"
    mistakes: tuple[str, ...] = ()
    window: Optional[int] = None   # the layer's sliding window w (keys, the query's own included)

    def visible(self, n: int) -> torch.Tensor:
        """The boolean [n, n] pattern this variant attends with: its mask, within its window (w
        keys, or w + 1 with window_off_by_one)."""
        keep = pattern(self.pattern, n)
        if self.window is None:
            return keep
        w = self.window + self.attn.window_off_by_one
        i = torch.arange(n)
        return keep & (i[None, :] > i[:, None] - w)

    def scale(self, d_k: int, h: int) -> float:
        """The factor of the scores (1: none, where the weights are scaled after the softmax)."""
        if "scale_after_softmax" in self.mistakes:
            return 1.0
        return {Scale.d_k: 1 / math.sqrt(d_k), Scale.d_model: 1 / math.sqrt(d_k * h),
                Scale.none: 1.0}[self.attn.scale]

    def fails(self) -> dict[str, bool]:
        """Which checklist items this variant gets wrong."""
        a = self.attn
        return {"scale": a.scale is not Scale.d_k or "scale_after_softmax" in self.mistakes,
                "w_o": not a.out_proj, "before_softmax": a.mask_mode is MaskMode.after_softmax,
                "mask_value": a.mask_mode is not MaskMode.after_softmax and a.mask_value > -1e3}

    @property
    def third_study(self) -> bool:
        """A mistake of the third study's (the head split, the softmax's axis, the window): tried
        only when none of the classic variants reproduces a layer, which keeps the common case
        (a correct layer, a classic mistake) as fast as before."""
        a = self.attn
        return a.split_heads_no_transpose or a.softmax_over_queries or a.window_off_by_one

    @property
    def rare(self) -> bool:
        return any(m in RARE for m in self.mistakes)

    def behaviour(self) -> tuple:
        """Variants with equal behaviour compute the same thing (one of them is enough)."""
        a = self.attn
        value = None if a.mask_mode is MaskMode.after_softmax else a.mask_value
        return (a.scale, a.mask_mode, value, a.out_proj, self.pattern, self.mistakes * self.rare,
                a.split_heads_no_transpose, a.softmax_over_queries, a.window_off_by_one)

    def equation(self, q, k, v, d_k: int, h: int, visible: Optional[torch.Tensor] = None,
                 scale: Optional[float] = None, mask: Optional[tuple] = None) -> torch.Tensor:
        """Our scaled_dot_product_attention as this variant computes it, in q's dtype: q [...,
        n, d_k], k, v [..., m, d] -> [..., n, d_v]. visible: the pattern (its own [n, n] by
        default); scale, mask (mode, value): a fitted divisor or mask value instead of its own."""
        mode, value = mask or (self.attn.mask_mode, self.attn.mask_value)
        if "scores_kq" in self.mistakes:
            q, k = k, q
        y, _ = scaled_dot_product_attention(
            q, k, v, self.visible(q.size(-2)) if visible is None else visible,
            scale=self.scale(d_k, h) if scale is None else scale,
            masked_softmax=masked_softmax(mode, value, -2 if self.attn.softmax_over_queries
                                          else -1))
        return y / math.sqrt(d_k) if "scale_after_softmax" in self.mistakes else y


@functools.lru_cache(maxsize=1)
def _pitfalls() -> tuple[tuple[str, dict], ...]:
    """(name, the fields it sets) for every conf/attention/*.yaml but the correct one."""
    out = []
    for path in sorted(CONF.glob("*.yaml")):
        diff = OmegaConf.to_container(OmegaConf.load(path)) or {}
        diff.pop("name", None)
        if diff:
            out.append((path.stem, diff))
    return tuple(out)


def switch_of(name: str) -> Optional[str]:
    """The study's switch (conf/attention/NAME.yaml) a mistake's name is, or None (the checker's
    own mistakes and the fitted divisors have none)."""
    return name if name in dict(_pitfalls()) else None


def all_variants(max_mistakes: int = 3, window: Optional[int] = None) -> list[Variant]:
    """correct, each mistake a forward pass can show, and each combination of mistakes that
    touch different fields; fewest mistakes first, the checker's rare ones (alone) last.
    window: the layer's sliding window, which every variant then has, and whose off-by-one is
    one more mistake."""
    return list(_variants(max_mistakes, window))


@functools.lru_cache(maxsize=8)
def _variants(max_mistakes: int, window: Optional[int]) -> tuple[Variant, ...]:
    base = OmegaConf.structured(AttentionConfig)
    forward = {"window_off_by_one"} if window is not None else set()
    singles = [(name, diff) for name, diff in _pitfalls() if set(diff) <= FORWARD_FIELDS | forward]
    singles += [(name, {"mask_mode": None, "mask_value": None, "pattern": name})
                for name in PATTERNS if name != "causal"]
    combos = [c for count in range(max_mistakes + 1) for c in
              itertools.combinations(singles, count)]
    combos += [((name, {"pattern": name} if name == "mask_inverted" else {}),) for name in RARE]
    out, seen = [], set()
    for combo in combos:
        keys = [set(diff) for _, diff in combo]
        if any(a & b for a, b in itertools.combinations(keys, 2)):
            continue
        merged = {k: v for _, diff in combo for k, v in diff.items() if v is not None}
        pat = merged.pop("pattern", "causal")
        attn = OmegaConf.to_object(OmegaConf.merge(base, merged))
        attn = replace(attn, impl=AttentionImpl.reference, query_block=0,
                       name="+".join(n for n, _ in combo) or "correct")
        variant = Variant(attn.name, attn, pat, tuple(n for n, _ in combo), window)
        if variant.behaviour() not in seen:
            seen.add(variant.behaviour())
            out.append(variant)
    return tuple(out)


def layer_output(r, rotary, variant: Variant, switches: tuple, x: torch.Tensor,
                 dtype=torch.float64, grad: bool = False, seen: Optional[dict] = None,
                 scale: Optional[float] = None, mask: Optional[tuple] = None) -> torch.Tensor:
    """Our CausalSelfAttention (in `dtype`, float64 unless the probes ask for the layer's own)
    with the reading r's weights (layouts.Reading), its rotary positions (layouts.Rotary) and
    QK-norm, as `variant` with the second study's `switches` on: x [B, T, D] -> y. The weights
    enter by torch.func.functional_call, not by copying, so that with grad the output is
    differentiable in them. seen: gets the q and k the scores are made of (after QK-norm and
    rotary positions); scale, mask (mode, value): a fitted divisor or mask value."""
    D, T, d_k = r.wq.size(1), x.size(1), r.wq.size(1) // r.h
    attn = replace(variant.attn, out_proj=r.wo is not None,
                   rotary_interleaved=rotary.layout == "interleaved",
                   **{p: True for p in switches})
    if mask is not None:
        attn = replace(attn, mask_mode=mask[0], mask_value=mask[1])
    eps = (r.norm or {}).get("eps")
    layer = attention_layer(D, r.h, block_size=T, attn=attn, bias=True, n_kv_head=r.h_kv,
                            qk_norm=r.norm is not None,
                            norm_eps=eps if eps is not None else 1e-6).to(dtype).eval()
    weights = r.weights()
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
    if dtype != torch.float64:  # in the layer's dtype: q, k and v by a matmul each, as layers
        rows = (D, r.wk.size(0), r.wk.size(0))  # write them, rounded as theirs are

        def separate(x, qkv=layer.qkv):
            return torch.cat([F.linear(x, w, b) for w, b in zip(qkv.weight.split(rows),
                                                                qkv.bias.split(rows))], -1)
        layer.qkv.forward = separate
    if scale is not None or "scale_after_softmax" in variant.mistakes:
        layer.scale = lambda: variant.scale(d_k, r.h) if scale is None else scale
    attend = layer.attend

    def attend_as_variant(q, k, *rest):
        if "scores_kq" in variant.mistakes:
            q, k = k, q
        if seen is not None:
            seen.update(q=q, k=k)
        y, w = attend(q, k, *rest)  # [B, h, T, d_k]
        if "join_no_transpose" in variant.mistakes:  # so that the layer's join is y.reshape
            y = y.reshape(y.size(0), y.size(2), y.size(1), -1).transpose(1, 2)
        return (y / math.sqrt(d_k) if "scale_after_softmax" in variant.mistakes else y), w
    layer.attend = attend_as_variant
    tables = None if rotary.layout is None else rotary_tables(torch.arange(T), d_k,
                                                              rotary.theta, dtype)
    with torch.set_grad_enabled(grad):
        y, _ = torch.func.functional_call(layer, {n: w.to(dtype) for n, w in weights.items()},
                                          (x.to(dtype),), {"rotary": tables})
    return y


def fit(ref: Callable, y: torch.Tensor, d_k: int, h: int, tol: float, probes: int,
        how: bool = False) -> Optional[tuple[str, str]]:
    """A divisor, then a finite mask value (added, then written into the scores), that no
    variant has but reproduces y: ref(scale=..., mask=(mode, value)) -> our output with it.
    Returns (the item it fails, its words) or None. how: the words say how the mask is put."""
    log_s, e = golden(lambda ls: rel_err(y, ref(scale=math.exp(ls)), probes=probes),
                      math.log(1e-3), math.log(10.0))
    if e <= tol:
        return "scale", divisor_words(math.exp(log_s), d_k, h, tol)
    for mode in (MaskMode.add, MaskMode.fill):
        value, e = golden(lambda m, mode=mode: rel_err(y, ref(mask=(mode, m)), probes=probes),
                          -60.0, 0.0)
        if e <= tol:
            put = (", added to" if mode is MaskMode.add else ", written into") + \
                " the future scores: too small to hide them" if how else \
                ": too small to hide the future"
            return "mask_value", (f"the mask value is {value:.3g}{put} (exp({value:.3g}) = "
                                  f"{math.exp(value):.2g} of a visible key's weight)")
    return None


# ----------------------------------------------------------------------------- words


# The words for each mistake a variant can make, in the order a report says them, with the
# checklist item it fails ('' where no checklist line names it). Filled in with the layer's sizes.
WORDS = {
    "split_heads_no_transpose": ("", "heads are split by reshaping to (B, {h}, T, {d_k}), which "
                                     "mixes positions and heads, instead of .view(B, T, {h}, "
                                     "{d_k}).transpose(1, 2)"),
    "scale_d_model": ("scale", "scores are divided by sqrt(d_model) = {sqrt_d_model}, not "
                               "sqrt(d_k) = {sqrt_d_k}"),
    "no_scale": ("scale", "scores QK^T are not divided at all; they should be divided by "
                          "sqrt(d_k) = {sqrt_d_k}"),
    "no_out_proj": ("w_o", "the concatenated heads are the output: W_O is never applied"),
    "mask_after_softmax": ("before_softmax", "softmax runs over every key and the future weights "
                           "are zeroed afterwards: rows sum to less than 1, and the future still "
                           "shapes the past through the softmax's denominator"),
    "mask_fill_zero": ("mask_value", "future scores are set to {value:g} instead of -inf: "
                                     "exp({value:g}) = {exp_value:.3g} still competes with the "
                                     "real scores"),
    "mask_zero": ("mask_value", "the mask adds {value:g} to the future scores, which does not "
                                "hide them: every query attends to the future"),
    "mask_no_diagonal": ("", "the mask also hides each query's own position (diagonal "
                             "excluded): position i sees only 0..i-1, and position 0 sees no "
                             "key at all"),
    "mask_one_future": ("", "the mask is off by one: position i also sees position i + 1"),
    "mask_inverted": ("", "the boolean mask is read inverted (True = masked out taken as True = "
                          "may attend, or the reverse): each query sees the keys after it and "
                          "none before, the last query none at all; fill the scores where the "
                          "mask hides a key (masked_fill(~visible, -inf) for a True = may "
                          "attend mask), or build it as the other triangle"),
    "scores_kq": ("", "the scores are K Q^T, not Q K^T: row i holds key i against every query, "
                      "so each query is weighted by another query's scores; compute "
                      "Q @ K.transpose(-2, -1)"),
    "scale_after_softmax": ("scale", "the weights are divided by sqrt(d_k) = {sqrt_d_k} after "
                                     "the softmax, not the scores before it: the softmax sees "
                                     "unscaled scores and each row sums to 1 / {sqrt_d_k}; "
                                     "divide QK^T by sqrt(d_k) before the softmax"),
    "join_no_transpose": ("", "heads are joined with .reshape(B, T, d_model) without first "
                              "transposing [B, h, T, d_k] back, which mixes positions and "
                              "heads; y.transpose(1, 2).reshape(B, T, d_model) belongs"),
    "softmax_over_queries": ("", "softmax runs over the queries (dim=-2) instead of the keys "
                                 "(dim=-1): each key's column of weights sums to 1, not each "
                                 "query's row, and a query's weights are divided by the scores "
                                 "of the queries after it"),
    "window_off_by_one": ("", "the sliding window holds {w1} keys, not {w}: query i sees keys "
                              "i - {w} .. i (j >= i - {w}) where i - {w_1} .. i (j > i - {w}), "
                              "its own included, belongs"),
    "own_out_proj": ("w_o", "each head has its own output projection ({own} [{d_k} -> {d_k}]) "
                            "and the heads are only concatenated: nothing mixes them; apply one "
                            "W_O [{d_model} -> {d_model}] to the concatenated heads"),
    # the second study's switches a layer called as layer(x) can show (diagnosis.py)
    "rope_on_values": ("", "values are rotated too (rotary positions applied to v as well as q "
                           "and k): the output then carries each key's absolute position"),
    "gqa_repeat_mismatch": ("", "query head i reads key/value head i % n_kv_head instead of "
                                "i // (n_head / n_kv_head): each query head reads another "
                                "group's keys (with weights trained in Llama's order, "
                                "llama_weights=true)"),
    "rotary_interleaved": ("", "rotary pairs are interleaved, (2j, 2j + 1), where the weights "
                               "were trained with rotate-half pairs (j, j + d_k / 2), as "
                               "transformers' Llama weights are (llama_weights=true): each "
                               "dimension is turned with the wrong partner; pair dimension j "
                               "with j + d_k / 2 (rotate_half)"),
}


def num(x: float) -> str:
    """8.0, 4.0, 2.83: a square root as the sheet writes it."""
    return f"{x:.1f}" if abs(x - round(x)) < 1e-9 else f"{x:.3g}"


def mistake_words(variant: Variant, d_k: int, h: int, more: tuple = (), own: str = ""
                  ) -> list[tuple[str, str, str]]:
    """(name, item, plain words) for each mistake of `variant` and the others named in `more`
    (the second study's switches, a reading's own), in WORDS's order."""
    w, value = variant.window or 0, variant.attn.mask_value
    sizes = dict(h=h, d_k=d_k, sqrt_d_k=num(math.sqrt(d_k)), sqrt_d_model=num(math.sqrt(d_k * h)),
                 d_model=d_k * h, value=value, exp_value=math.exp(min(value, 700)), w=w,
                 w1=w + 1, w_1=w - 1, own=own)
    return [(name, item, words.format(**sizes)) for name, (item, words) in WORDS.items()
            if name in variant.mistakes + more and (name != "window_off_by_one" or w)]


def split_words(h: int, d_k) -> str:
    """The head split without the transpose, in words."""
    return WORDS["split_heads_no_transpose"][1].format(h=h, d_k=d_k)


def divisor_words(scale: float, d_k: int, h: int, tol: float = 2e-3) -> str:
    """A fitted score multiplier, said as what the scores are divided by (named when it is
    within tol of a size the layer has)."""
    d_model = d_k * h
    named = [(math.sqrt(d_k), f"sqrt(d_k) = {num(math.sqrt(d_k))}"), (d_k, f"d_k = {d_k}"),
             (math.sqrt(d_model), f"sqrt(d_model) = {num(math.sqrt(d_model))}"),
             (d_model, f"d_model = {d_model}"), (1.0, "1 (not divided at all)"),
             (1 / math.sqrt(d_k), f"1 / sqrt(d_k): multiplied by sqrt(d_k) = {num(math.sqrt(d_k))} "
                                  f"instead of divided")]
    divisor = 1 / scale
    for value, words in named:
        if abs(divisor / value - 1) < max(tol, 2e-3):
            return f"scores are divided by {words}, not sqrt(d_k) = {num(math.sqrt(d_k))}"
    return f"scores are divided by {divisor:.4g}, not sqrt(d_k) = {num(math.sqrt(d_k))}"
