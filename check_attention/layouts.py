"""Find a layer's W_Q, W_K, W_V, W_O among its parameters, in the layouts people write.

    fused     one Linear d -> 3d for q, k, v (in some order; or interleaved per head, as
              GPT-NeoX does) plus an output Linear: nanoGPT and minGPT (c_attn, c_proj), our own
              layer (qkv, out_proj), nn.MultiheadAttention (in_proj_weight, out_proj)
    separate  one Linear d -> d each: Llama and CS336 (q_proj, k_proj, v_proj, o_proj /
              output_proj), query / key / value / out, wq / wk / wv / wo
    per_head  one module per head holding key / query / value Linears d -> d_k, plus a
              projection: the lecture's Head and MultiHeadAttention

A "Linear" is anything holding one 2-D weight and maybe a bias (nn.Linear, GPT-2's Conv1D, a
course's hand-written Linear) or a bare 2-D nn.Parameter. Names propose a role for each; shapes
and the order in which modules were registered fill in what names leave open. Each way of
reading the layer becomes a `Mapping` (weights in our layout, see variants.Weights), and the
checker keeps the one under which one of our variants reproduces the layer's output: so a
wrong guess here costs time, never a wrong verdict.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from check_attention.variants import Weights

ROLE_TOKENS = {"q": {"q", "query", "queries", "qry"}, "k": {"k", "key", "keys"},
               "v": {"v", "value", "values", "val"}, "o": {"o", "out", "output", "outs"}}
NOISE = {"w", "proj", "projection", "to", "lin", "linear", "layer", "fc", "c", "self", "weight",
         "mat", "matrix", "net", "head", "heads", "attn", "attention", "in", "layers", "fn",
         "bias", "dense", "map", "transform"}
FUSED_NAMES = {"c_attn", "in_proj", "in_proj_weight", "attn", "qkv", "wqkv", "w_qkv", "to_qkv",
               "qkv_proj", "query_key_value", "c_qkv", "qkv_linear", "qkv_layer", "w_in"}
OUT_NAMES = {"proj", "c_proj", "dense", "projection", "out_proj", "o_proj", "output_proj",
             "to_out", "fc_out", "wo", "w_o", "out", "o", "output", "linear_out", "out_linear",
             "proj_out", "attn_out", "output_dense"}


@dataclass
class Lin:
    """One weight matrix found in the layer: W [out, in] (oriented), its bias, its role."""

    name: str
    w: torch.Tensor
    b: Optional[torch.Tensor]
    role: Optional[str]
    order: int
    calls: Optional[int] = None   # times it ran on the first probe (None: cannot be observed)
    oriented: bool = True         # False: a bare Parameter, read as [out, in] or [in, out]

    def shape(self) -> str:
        return f"{self.w.size(1)} -> {self.w.size(0)}"


@dataclass
class Mapping:
    """One reading of the layer: its weights in our layout, h heads, and where the layer's own
    q, k, v and the input of its W_O can be read off the forward hooks (for the diagnosis)."""

    layout: str
    words: str
    h: int
    weights: Weights
    names: dict = field(default_factory=dict)   # role -> module name(s)
    prior: int = 0                               # 0: names agree with every role
    activations: Optional[Callable] = None       # captures -> (q, k, v) [B, T, D], or None
    out_input: Optional[str] = None              # the module whose input is the concat


def role_of(name: str) -> Optional[str]:
    """'q', 'k', 'v', 'o', 'qkv', 'kv' or None, from a module or parameter name."""
    leaf = name.split(".")[-1]
    if leaf in ("weight", "bias") and "." in name:
        leaf = name.split(".")[-2]
    low = leaf.lower()
    tokens = [t[1:] if len(t) > 1 and t[0] == "w" and t[1:] in {"q", "k", "v", "o", "qkv"} else t
              for t in re.split(r"[^a-z]+", re.sub(r"([a-z])([A-Z])", r"\1_\2", leaf).lower()) if t]
    words = set(tokens) - NOISE
    if low in FUSED_NAMES or "qkv" in words or words >= {"query", "key", "value"}:
        return "qkv"
    if "kv" in words or words == {"key", "value"} or words == {"k", "v"}:
        return "kv"
    hits = [role for role, names in ROLE_TOKENS.items() if words & names]
    if len(hits) == 1 and words <= ROLE_TOKENS[hits[0]] | {"_"}:
        return hits[0]
    if low in OUT_NAMES or (not words and "proj" in tokens):
        return "o"
    return hits[0] if len(hits) == 1 else None


def orient(w: torch.Tensor, b: Optional[torch.Tensor], cls: str, capture: Optional[dict]
           ) -> Optional[torch.Tensor]:
    """W as [out, in]: from what the module computed when it ran, else from its class. None when
    it computes something else than a linear map (then it is no projection of ours)."""
    if capture and "input" in capture:
        x, y = capture["input"].double(), capture["output"].double()
        bias = 0 if b is None else b
        for cand in (w, w.t()):
            if x.size(-1) == cand.size(1) and y.size(-1) == cand.size(0):
                ref = x @ cand.t() + bias
                both = torch.isnan(ref) & torch.isnan(y)  # a NaN row (a query seeing no key)
                diff = (ref - y).abs().masked_fill(both, 0)
                if not diff.isnan().any() and \
                        diff.max() <= 1e-2 * (ref.nan_to_num(0).abs().max() + 1e-6):
                    return cand
        return None
    return w.t() if cls == "Conv1D" else w


def find_linears(info: dict, captures: dict) -> list[Lin]:
    """Every weight matrix of the layer, oriented [out, in], with a role from its name."""
    params = {n: p.double() for n, p in info["params"].items()}
    out, used = [], set()
    for i, entry in enumerate(info["linears"]):
        name = entry["name"]
        prefix = f"{name}." if name else ""
        w, b = params.get(prefix + "weight"), params.get(prefix + "bias")
        used |= {prefix + "weight", prefix + "bias"}
        oriented = orient(w, b, entry["cls"], captures.get(name))
        if oriented is None:
            continue
        calls = captures[name]["calls"] if name in captures else None
        out.append(Lin(name, oriented, b, role_of(name), i, calls))
    # bare 2-D Parameters (self.W_q = nn.Parameter(...)): orientation unknown
    for j, (name, p) in enumerate(params.items()):
        if name in used or p.dim() != 2 or name.endswith("bias"):
            continue
        stem = name[: -len("_weight")] if name.endswith("_weight") else name
        bias = params.get(stem + "_bias")
        if bias is None and name.endswith("weight"):
            bias = params.get(name[: -len("weight")] + "bias")
        out.append(Lin(name, p, bias, role_of(stem), len(info["linears"]) + j, None, False))
    return out


def _fused_splits(lin: Lin, D: int, h: int):
    """(words, {role: (W rows, b rows)}, how to cut the fused output) for each q/k/v order."""
    d_k = D // h
    bias = lin.b if lin.b is not None else None
    for order in itertools.permutations("qkv"):
        blocks = lin.w.split(D)
        bblocks = bias.split(D) if bias is not None else (None,) * 3
        parts = {r: (blocks[i], bblocks[i]) for i, r in enumerate(order)}
        cut = (lambda t, order=order: dict(zip(order, t.split(D, dim=-1))))
        yield "".join(order), parts, cut
        if h > 1:  # per head: [h, 3, d_k] rows (GPT-NeoX's query_key_value)
            w3 = lin.w.view(h, 3, d_k, D)
            b3 = bias.view(h, 3, d_k) if bias is not None else None
            parts = {r: (w3[:, i].reshape(D, D), b3[:, i].reshape(D) if b3 is not None else None)
                     for i, r in enumerate(order)}

            def cut_heads(t, order=order):
                t = t.view(*t.shape[:-1], h, 3, d_k)
                return {r: t[..., i, :].reshape(*t.shape[:-3], D) for i, r in enumerate(order)}
            yield "".join(order) + " per head", parts, cut_heads


def _outs(lins: list[Lin], D: int, taken: set) -> list[tuple[Optional[Lin], int]]:
    """Candidates for W_O (with a prior: 0 when the name says so) and None (no W_O)."""
    square = [l for l in lins if l.w.shape == (D, D) and l.name not in taken]
    named = [l for l in square if l.role == "o"]
    if named:
        return [(l, 0) for l in named] + [(None, 0)]
    return [(l, 1) for l in square] + [(None, 0 if not square else 1)]


def mappings(info: dict, captures: dict, D: int, heads: list[int]) -> list[Mapping]:
    """Every plausible reading of the layer, most plausible first."""
    lins = find_linears(info, captures)
    out: list[Mapping] = []
    for bare in (False, True):  # bare Parameters: read as [out, in], then as [in, out]
        pool = [l if l.oriented or not bare else Lin(l.name, l.w.t(), l.b, l.role, l.order,
                                                         l.calls, False) for l in lins]
        if bare and all(l.oriented for l in lins):
            break
        out += _fused(pool, D, heads) + _separate(pool, D, heads) + _per_head(pool, D)
    out.sort(key=lambda m: m.prior)
    return out


def _fused(lins, D, heads) -> list[Mapping]:
    out = []
    for lin in [l for l in lins if l.w.shape == (3 * D, D)]:
        prior = 0 if lin.role == "qkv" else 1
        for h in heads:
            for o, o_prior in _outs(lins, D, {lin.name}):
                for order, parts, cut in _fused_splits(lin, D, h):
                    w = Weights(*(parts[r][0] for r in "qkv"), *(parts[r][1] for r in "qkv"),
                                o.w if o else None, o.b if o else None)
                    kind = "Linear" if lin.oriented else "weight"
                    words = (f"fused q/k/v {kind} {lin.name} [{lin.shape()}] (order {order})"
                             + (f" + output Linear {o.name} [{o.shape()}]" if o else
                                ", no output Linear"))
                    out.append(Mapping(
                        "fused", words, h, w, {"qkv": lin.name, "o": o.name if o else None},
                        prior + o_prior + (order != "qkv"),
                        (lambda c, lin=lin, cut=cut: _cut(c, lin.name, cut)),
                        o.name if o else None))
    return out


def _cut(captures, name, cut):
    if "input" not in captures.get(name, {}):
        return None
    parts = cut(captures[name]["output"].double())
    return parts["q"], parts["k"], parts["v"]


def _separate(lins, D, heads) -> list[Mapping]:
    square = [l for l in lins if l.w.shape == (D, D)]
    named = {r: [l for l in square if l.role == r] for r in "qkv"}
    if all(len(named[r]) == 1 for r in "qkv"):
        choices = [((named["q"][0], named["k"][0], named["v"][0]), 0)]
    else:  # names leave roles open: the registration order decides, then every order
        pool = sorted(square, key=lambda l: l.order)[:5]
        choices = [(trio, 1 + (i > 0)) for i, trio in enumerate(itertools.permutations(pool, 3))]
    out = []
    for (q, k, v), prior in choices:
        for o, o_prior in _outs(lins, D, {q.name, k.name, v.name}):
            for h in heads:
                w = Weights(q.w, k.w, v.w, q.b, k.b, v.b, o.w if o else None, o.b if o else None)
                kind = "Linears" if q.oriented and k.oriented and v.oriented else "weights"
                words = (f"separate {kind} {q.name}, {k.name}, {v.name} [{q.shape()}]"
                         + (f" + output {o.name}" if o else ", no output Linear"))
                out.append(Mapping(
                    "separate", words, h, w, {"q": q.name, "k": k.name, "v": v.name,
                                              "o": o.name if o else None}, prior + o_prior,
                    (lambda c, q=q, k=k, v=v: _outputs(c, [q.name], [k.name], [v.name])),
                    o.name if o else None))
    return out


def _outputs(captures, qs, ks, vs):
    if not all("input" in captures.get(n, {}) for n in qs + ks + vs):
        return None
    return tuple(torch.cat([captures[n]["output"].double() for n in names], dim=-1)
                 for names in (qs, ks, vs))


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _per_head(lins, D) -> list[Mapping]:
    """Heads as modules: group the d -> d_k Linears by their parent module."""
    groups: dict[str, dict] = {}
    for l in lins:
        if l.w.size(1) == D and l.w.size(0) < D and "." in l.name and l.role in ("q", "k", "v"):
            groups.setdefault(l.name.rsplit(".", 1)[0], {})[l.role] = l
    heads = [g for _, g in sorted(groups.items(), key=lambda kv: _natural(kv[0]))
             if set(g) == {"q", "k", "v"}]
    if not heads or sum(g["q"].w.size(0) for g in heads) != D:
        return []
    h = len(heads)
    cat = {r: torch.cat([g[r].w for g in heads]) for r in "qkv"}
    bias = {r: (torch.cat([g[r].b for g in heads]) if all(g[r].b is not None for g in heads)
                else None) for r in "qkv"}
    names = {r: [g[r].name for g in heads] for r in "qkv"}
    out = []
    for o, o_prior in _outs(lins, D, set()):
        w = Weights(cat["q"], cat["k"], cat["v"], bias["q"], bias["k"], bias["v"],
                    o.w if o else None, o.b if o else None)
        parent = heads[0]["q"].name.rsplit(".", 2)[0]
        words = (f"{h} head modules ({parent}.*) with {heads[0]['q'].name.rsplit('.', 1)[1]}/"
                 f"{heads[0]['k'].name.rsplit('.', 1)[1]}/{heads[0]['v'].name.rsplit('.', 1)[1]}"
                 f" Linears [{heads[0]['q'].shape()}]"
                 + (f" + projection {o.name} [{o.shape()}]" if o else ", no projection"))
        out.append(Mapping("per_head", words, h, w, {**names, "o": o.name if o else None},
                           o_prior, (lambda c, n=names: _outputs(c, n["q"], n["k"], n["v"])),
                           o.name if o else None))
    return out


def describe_linears(info: dict) -> str:
    """What the layer holds, for a report that could not map it."""
    shapes = {n: tuple(p.shape) for n, p in info["params"].items() if p.dim() == 2}
    return ", ".join(f"{n} {list(s)}" for n, s in list(shapes.items())[:8]) or "no weight matrices"
