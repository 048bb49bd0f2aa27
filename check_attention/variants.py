"""Our attention, correct and with each classic mistake, as references to compare a layer with.

The variants are the project's own: `conf/attention/*.yaml` (each a diff on `AttentionConfig`),
plus the off-by-one masks, which the model has no switch for and which are built here from
`scaled_dot_product_attention`'s `visible` pattern: `mask_no_diagonal` (query i sees keys
0..i-1 only) and `mask_one_future` (query i also sees key i + 1). Of the switches, only those a
forward pass `layer(x)` can show are variants here (FORWARD_FIELDS: the scale, the mask, W_O,
the head split and the softmax's axis); the rotary and grouped-head ones are modern.py's, the
cache and padding ones need a cache. A layer with a sliding window (`windowed`) gets the window
as part of every variant's pattern, and `window_off_by_one` (w + 1 keys) besides. Mistakes that
touch different fields combine, so a layer with two of them is named with both.

Two references compute the same equation: `module_output` runs our `CausalSelfAttention` with
the user's weights (the layer the project trains), `attend` runs our
`scaled_dot_product_attention` on given q, k, v with any divisor, mask and head split, for the
step-by-step diagnosis.
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from model.attention import attention_layer, causal_pattern, scaled_dot_product_attention
from model.config import AttentionConfig, AttentionImpl, MaskMode, Scale
from model.pitfalls import masked_softmax

CONF = Path(__file__).resolve().parents[1] / "conf" / "attention"
PATTERNS = {"causal": 0, "mask_no_diagonal": -1, "mask_one_future": 1}  # tril diagonal offset
ITEMS = ("scale", "w_o", "before_softmax", "mask_value")  # the checklist items a variant decides
# The AttentionConfig fields whose pitfalls a forward pass layer(x) shows (module_output runs
# them through our own PitfallAttention).
FORWARD_FIELDS = {"scale", "mask_mode", "mask_value", "out_proj", "split_heads_no_transpose",
                  "softmax_over_queries"}


def pattern(name: str, n: int) -> torch.Tensor:
    """The boolean [n, n] visible pattern of a mask (True = query i may see key j)."""
    if name == "causal":
        return causal_pattern(n, n)
    return torch.ones(n, n, dtype=torch.bool).tril(diagonal=PATTERNS[name])


@dataclass(frozen=True)
class Variant:
    """One way to compute attention: our config (scale, mask, W_O) and the mask's pattern."""

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
        return {Scale.d_k: 1 / math.sqrt(d_k), Scale.d_model: 1 / math.sqrt(d_k * h),
                Scale.none: 1.0}[self.attn.scale]

    def fails(self) -> dict[str, bool]:
        """Which checklist items this variant gets wrong."""
        a = self.attn
        return {"scale": a.scale is not Scale.d_k, "w_o": not a.out_proj,
                "before_softmax": a.mask_mode is MaskMode.after_softmax,
                "mask_value": a.mask_mode is not MaskMode.after_softmax and a.mask_value > -1e3}

    @property
    def third_study(self) -> bool:
        """A mistake of the third study's (the head split, the softmax's axis, the window): tried
        only when none of the classic variants reproduces a layer, which keeps the common case
        (a correct layer, a classic mistake) as fast as before."""
        a = self.attn
        return a.split_heads_no_transpose or a.softmax_over_queries or a.window_off_by_one

    def behaviour(self) -> tuple:
        """Variants with equal behaviour compute the same thing (one of them is enough)."""
        a = self.attn
        value = None if a.mask_mode is MaskMode.after_softmax else a.mask_value
        return (a.scale, a.mask_mode, value, a.out_proj, self.pattern,
                a.split_heads_no_transpose, a.softmax_over_queries, a.window_off_by_one)


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
    """The study's switch (conf/attention/NAME.yaml) a mistake's name is, or None (the off-by-one
    masks and the fitted divisors have none)."""
    return name if name in dict(_pitfalls()) else None


def all_variants(max_mistakes: int = 3, window: Optional[int] = None) -> list[Variant]:
    """correct, each mistake a forward pass can show, and each combination of mistakes that
    touch different fields; fewest mistakes first. window: the layer's sliding window, which
    every variant then has, and whose off-by-one is one more mistake."""
    return list(_variants(max_mistakes, window))


@functools.lru_cache(maxsize=8)
def _variants(max_mistakes: int, window: Optional[int]) -> tuple[Variant, ...]:
    base = OmegaConf.structured(AttentionConfig)
    forward = {"window_off_by_one"} if window is not None else set()
    singles = [(name, diff) for name, diff in _pitfalls() if set(diff) <= FORWARD_FIELDS | forward]
    singles += [(name, {"mask_mode": None, "mask_value": None, "pattern": name})
                for name in PATTERNS if name != "causal"]
    out, seen = [], set()
    for count in range(max_mistakes + 1):
        for combo in itertools.combinations(singles, count):
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


# ----------------------------------------------------------------------------- references


@dataclass
class Weights:
    """A layer's projections in our layout: W [out, in] as nn.Linear keeps them, heads
    contiguous (head i owns rows i*d_k .. (i+1)*d_k of W_Q, W_K, W_V); wo None: no W_O."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    bq: Optional[torch.Tensor]
    bk: Optional[torch.Tensor]
    bv: Optional[torch.Tensor]
    wo: Optional[torch.Tensor]
    bo: Optional[torch.Tensor]


def _bias(b: Optional[torch.Tensor], n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.float64) if b is None else b.double()


def module_output(w: Weights, h: int, variant: Variant, x: torch.Tensor) -> torch.Tensor:
    """Our CausalSelfAttention (float64) with these weights, as `variant`: x [B, T, D] -> y."""
    D, T = w.wq.size(1), x.size(1)
    attn = replace(variant.attn, out_proj=w.wo is not None)
    layer = attention_layer(D, h, block_size=T, attn=attn, bias=True).double().eval()
    with torch.no_grad():
        layer.qkv.weight.copy_(torch.cat([w.wq, w.wk, w.wv]))
        layer.qkv.bias.copy_(torch.cat([_bias(w.bq, D), _bias(w.bk, D), _bias(w.bv, D)]))
        if w.wo is not None:
            layer.out_proj.weight.copy_(w.wo)
            layer.out_proj.bias.copy_(_bias(w.bo, D))
        layer.causal = variant.visible(T)
        y, _ = layer(x.double())
    return y


# How a [B, T, D] projection becomes heads [B, h, T, d_k], and back: ours, and the classic
# slip of a reshape without the transpose, which mixes positions and heads.
SPLITS = {
    "heads": (lambda t, h: t.view(t.size(0), t.size(1), h, -1).transpose(1, 2),
              lambda y: y.transpose(1, 2).reshape(y.size(0), y.size(2), -1)),
    "mixed": (lambda t, h: t.reshape(t.size(0), h, t.size(1), -1),
              lambda y: y.reshape(y.size(0), y.size(2), -1)),
}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, h: int, *, scale: float,
           mask_mode: MaskMode = MaskMode.add, mask_value: float = float("-inf"),
           pattern_name: str = "causal", split: str = "heads", merge: str = "heads",
           dim: int = -1) -> torch.Tensor:
    """Concat_i softmax(q_i k_i^T * scale + M) v_i, before W_O: q, k, v [B, T, D] -> [B, T, D]."""
    cut, _ = SPLITS[split]
    _, join = SPLITS[merge]
    visible = pattern(pattern_name, q.size(1))
    y, _ = scaled_dot_product_attention(cut(q.double(), h), cut(k.double(), h), cut(v.double(), h),
                                        visible, scale=scale,
                                        masked_softmax=masked_softmax(mask_mode, mask_value, dim))
    return join(y)


def attend_heads(q, k, v, visible_name: str, *, scale: float, mask_mode: MaskMode,
                 mask_value: float, dim: int = -1) -> torch.Tensor:
    """The bare equation on [..., n, d] tensors (a scaled dot-product function's reference)."""
    y, _ = scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                        pattern(visible_name, q.size(-2)), scale=scale,
                                        masked_softmax=masked_softmax(mask_mode, mask_value, dim))
    return y


def variant_attend_kwargs(variant: Variant, d_k: int, h: int) -> dict:
    """The equation's settings as `variant` has them; dim: the softmax's axis (-2: over the
    queries, softmax_over_queries)."""
    return {"scale": variant.scale(d_k, h), "mask_mode": variant.attn.mask_mode,
            "mask_value": variant.attn.mask_value,
            "dim": -2 if variant.attn.softmax_over_queries else -1}


# ----------------------------------------------------------------------------- words


def num(x: float) -> str:
    """8.0, 4.0, 2.83: a square root as the sheet writes it."""
    return f"{x:.1f}" if abs(x - round(x)) < 1e-9 else f"{x:.3g}"


def mistake_words(variant: Variant, d_k: int, h: int) -> list[tuple[str, str]]:
    """(item, plain words) for each mistake in `variant`; item '' when it is none of the
    checklist's five (the head split, the softmax's axis, the off-by-one masks and window)."""
    a, out = variant.attn, []
    if a.split_heads_no_transpose:
        out.append(("", split_words(h, d_k)))
    if a.scale is Scale.d_model:
        out.append(("scale", f"scores are divided by sqrt(d_model) = {num(math.sqrt(d_k * h))}, "
                             f"not sqrt(d_k) = {num(math.sqrt(d_k))}"))
    elif a.scale is Scale.none:
        out.append(("scale", f"scores QK^T are not divided at all; they should be divided by "
                             f"sqrt(d_k) = {num(math.sqrt(d_k))}"))
    if not a.out_proj:
        out.append(("w_o", "the concatenated heads are the output: W_O is never applied"))
    if a.mask_mode is MaskMode.after_softmax:
        out.append(("before_softmax", "softmax runs over every key and the future weights are "
                    "zeroed afterwards: rows sum to less than 1, and the future still shapes "
                    "the past through the softmax's denominator"))
    elif a.mask_value > -1e3:
        if a.mask_mode is MaskMode.fill:
            out.append(("mask_value", f"future scores are set to {a.mask_value:g} instead of "
                        f"-inf: exp({a.mask_value:g}) = {math.exp(a.mask_value):.3g} still "
                        f"competes with the real scores"))
        else:
            out.append(("mask_value", f"the mask adds {a.mask_value:g} to the future scores, "
                        f"which does not hide them: every query attends to the future"))
    if variant.pattern == "mask_no_diagonal":
        out.append(("", "the mask also hides each query's own position (diagonal excluded): "
                        "position i sees only 0..i-1, and position 0 sees no key at all"))
    elif variant.pattern == "mask_one_future":
        out.append(("", "the mask is off by one: position i also sees position i + 1"))
    if a.softmax_over_queries:
        out.append(("", "softmax runs over the queries (dim=-2) instead of the keys (dim=-1): "
                        "each key's column of weights sums to 1, not each query's row, and a "
                        "query's weights are divided by the scores of the queries after it"))
    if a.window_off_by_one and variant.window is not None:
        w = variant.window
        out.append(("", f"the sliding window holds {w + 1} keys, not {w}: query i sees keys "
                        f"i - {w} .. i (j >= i - {w}) where i - {w - 1} .. i (j > i - {w}), "
                        f"its own included, belongs"))
    return out


def split_words(h: int, d_k: int) -> str:
    """The head split without the transpose, in words (a variant, or found step by step)."""
    return (f"heads are split by reshaping to (B, {h}, T, {d_k}), which mixes positions and "
            f"heads, instead of .view(B, T, {h}, {d_k}).transpose(1, 2)")


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

