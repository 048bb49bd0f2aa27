"""Find a layer's W_Q, W_K, W_V, W_O among its parameters, in the layouts people write.

    fused     one Linear d -> 3d for q, k, v (in some order; or interleaved per head, as
              GPT-NeoX does) plus an output Linear: nanoGPT and minGPT (c_attn, c_proj), our own
              layer (qkv, out_proj), nn.MultiheadAttention (in_proj_weight, out_proj); with
              fewer key/value heads, q then k and v (a Llama-style qkv_proj), or LitGPT's `attn`
              (for each group its query heads, then its key and its value)
    separate  one Linear each: Llama and CS336 (q_proj, k_proj, v_proj, o_proj / output_proj),
              query / key / value / out, wq / wk / wv / wo; k and v may have fewer heads
    per_head  one module per head holding key / query / value Linears d -> d_k, plus a
              projection: the lecture's Head and MultiHeadAttention (or, a mistake, a
              projection of each head's own, d_k -> d_k, and none that mixes them)

A "Linear" is anything holding one 2-D weight and maybe a bias (nn.Linear, GPT-2's Conv1D, a
course's hand-written Linear) or a bare 2-D nn.Parameter. Names propose a role for each; shapes
and the order in which modules were registered fill in what names leave open. Each way of
reading the layer becomes a `Reading` (its weights in our layer's layout, with its QK-norm), and
the checker keeps the one under which one of our variants reproduces the layer's output: so a
wrong guess here costs time, never a wrong verdict. What is not in the weights, the rotary
positions (`Rotary`: the pair layout and theta), is found by trying (diagnosis.py).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from check_attention.compare import rel_err

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
    oriented: bool = True         # False: a bare Parameter, read as [out, in] or [in, out]

    def shape(self) -> str:
        return f"{self.w.size(1)} -> {self.w.size(0)}"


@dataclass
class Reading:
    """One reading of the layer: W_Q [D, D], W_K, W_V [h_kv * d_k, D] and W_O as our layer keeps
    them (heads contiguous: head i owns rows i*d_k .. (i+1)*d_k), its QK-norm, and the names of
    the modules it reads. words: as the classic layouts say it; modern_words: with the shapes of
    k and v (rotary positions, grouped heads, QK-norm)."""

    words: str
    modern_words: str
    h: int
    h_kv: int
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    b: tuple                                     # (bq, bk, bv), each a tensor or None
    wo: Optional[torch.Tensor]
    bo: Optional[torch.Tensor]
    names: dict = field(default_factory=dict)    # role -> module name(s); "o": W_O's
    prior: int = 0                               # 0: names agree with every role
    modern: bool = False                         # named as a modern layer's (rotary tried)
    own_o: Optional[str] = None                  # each head's own projection (never mixed)
    norm: Optional[dict] = None   # {"cls": RMSNorm | LayerNorm, "q": (w, b), "k": (w, b), "eps"}

    @property
    def classic(self) -> bool:
        return self.h_kv == self.h and self.norm is None

    def weights(self) -> dict:
        """Our layer's parameters holding this reading (float64; a missing bias is zeros)."""
        D, r = self.wq.size(0), self.wk.size(0)
        zeros = torch.zeros(D + 2 * r, dtype=torch.float64).split([D, r, r])
        out = {"qkv.weight": torch.cat([self.wq, self.wk, self.wv]),
               "qkv.bias": torch.cat([z if b is None else b.double()
                                      for b, z in zip(self.b, zeros)])}
        if self.wo is not None:
            out["out_proj.weight"] = self.wo
            out["out_proj.bias"] = torch.zeros(D) if self.bo is None else self.bo.double()
        return out


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


THETAS = (10000.0, 500000.0)      # Llama 2 / GPT-NeoX, and Llama 3
THETA_NAMES = {"theta", "rope_theta", "base", "rope_base", "rotary_base", "rotary_emb_base"}


def rotaries(info: dict, d_k: int) -> list[Rotary]:
    """No rotary positions, then each pair layout with each theta (thetas)."""
    return [Rotary(None)] + ([Rotary(layout, t) for layout in ("rotate-half", "interleaved")
                              for t in thetas(info, d_k)] if d_k % 2 == 0 else [])


def thetas(info: dict, d_k: int) -> list[float]:
    """The layer's own theta (an attribute, or read off an inv_freq-like buffer), then ours."""
    own = [float(v) for k, v in info["attrs"].items() if k.lower() in THETA_NAMES and v > 1]
    for name, buf in info.get("buffers", {}).items():
        if buf.numel() == d_k // 2 and d_k >= 4 and ("freq" in name.lower()) \
                and 0 < float(buf[1]) < 1 and float(buf[0]) == 1.0:
            own.append(round(float(buf[1]) ** (-d_k / 2)))  # inv_freq_1 = theta^(-2/d_k)
    return list(dict.fromkeys(own + list(THETAS)))


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
        return next((cand for cand in (w, w.t()) if x.size(-1) == cand.size(1)
                     and y.size(-1) == cand.size(0) and rel_err(
                         y, x @ cand.t() + (0 if b is None else b)) <= 1e-2), None)
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
        out.append(Lin(name, oriented, b, role_of(name), i))
    # bare 2-D Parameters (self.W_q = nn.Parameter(...)): orientation unknown
    for j, (name, p) in enumerate(params.items()):
        if name in used or p.dim() != 2 or name.endswith("bias"):
            continue
        stem = name[: -len("_weight")] if name.endswith("_weight") else name
        bias = params.get(stem + "_bias")
        if bias is None and name.endswith("weight"):
            bias = params.get(name[: -len("weight")] + "bias")
        out.append(Lin(name, p, bias, role_of(stem), len(info["linears"]) + j, False))
    return out




def readings(info: dict, captures: dict, D: int, heads: list[int]) -> list[Reading]:
    """Every plausible reading of the layer for each head count in heads, most plausible first
    (with the QK-norm it has, if its head size is the reading's)."""
    lins = find_linears(info, captures)
    out: list[Reading] = []
    for bare in (False, True):  # bare Parameters: read as [out, in], then as [in, out]
        pool = [l if l.oriented or not bare else replace(l, w=l.w.t()) for l in lins]
        if bare and all(l.oriented for l in lins):
            break
        out += _fused(pool, D, heads) + _separate(pool, D, heads) + _per_head(pool, D)
    out.sort(key=lambda r: r.prior)
    norm = qk_norm(info, D)
    return [replace(r, norm=norm) for r in out if norm is None or norm["d"] == D // r.h]


def _outs(lins: list[Lin], D: int, taken: set) -> list[tuple[Optional[Lin], int, bool]]:
    """Candidates for W_O (with a prior: 0 when the name says so) and None (no W_O); True for
    the one a modern layer's reading takes (the first named, or none)."""
    square = [l for l in lins if l.w.shape == (D, D) and l.name not in taken]
    named = [l for l in square if l.role == "o"]
    if named:
        return [(l, 0, i == 0) for i, l in enumerate(named)] + [(None, 0, False)]
    return [(l, 1, False) for l in square] + [(None, 0 if not square else 1, True)]


def _out_words(o: Optional[Lin], modern: bool) -> str:
    if o is None:
        return ", no output Linear"
    return f" + output {o.name}" if modern else f" + output Linear {o.name} [{o.shape()}]"


def _fused(lins, D, heads) -> list[Reading]:
    """One Linear for q, k and v: [3D, D] in any order, as blocks or per head; fewer key/value
    heads (a Linear named as fused): q, k, v as blocks, or per group (LitGPT)."""
    out = []
    for lin in lins:
        r = (lin.w.size(0) - D) // 2
        if lin.w.size(1) != D or r <= 0 or 2 * r + D != lin.w.size(0) or \
                (r != D and lin.role != "qkv"):
            continue
        for h in [h for h in heads if r % (D // h) == 0 and h % (r * h // D) == 0]:
            d_k, h_kv = D // h, r * h // D
            for o, o_prior, modern_o in _outs(lins, D, {lin.name}):
                for order in itertools.permutations("qkv") if r == D else ["qkv"]:
                    for grouped in (False, True) if h > 1 else (False,):
                        # rows: n groups of `per` heads of d_k, each role's heads at[role]
                        n, per = (h_kv, h // h_kv + 2) if grouped else (1, h + 2 * h_kv)
                        size = {"q": per - 2, "k": 1, "v": 1} if grouped else \
                            {"q": h, "k": h_kv, "v": h_kv}
                        at = {x: sum(size[y] for y in order[:order.index(x)]) for x in "qkv"}
                        w, b = ([None if t is None else t.unflatten(0, (n, per, d_k))[
                            :, at[x]:at[x] + size[x]].flatten(0, 2) for x in "qkv"]
                                for t in (lin.w, lin.b))
                        name = "".join(order) + (" per head" if grouped else "")
                        what = (f"for each of its {h_kv} groups: {h // h_kv} query heads, then "
                                f"a key and a value head" if grouped and r != D else
                                f"q, then k and v of {r} rows")
                        start = f"fused q/k/v {'Linear' if lin.oriented else 'weight'} " \
                                f"{lin.name} [{lin.shape()}] ("
                        out.append(Reading(
                            start + (f"order {name}" if r == D else what) + ")"
                            + _out_words(o, False), start + what + ")" + _out_words(o, True),
                            h, h_kv, *w, tuple(b), o.w if o else None, o.b if o else None,
                            {"qkv": lin.name, "o": o.name if o else None},
                            (0 if lin.role == "qkv" else 1) + o_prior + (name != "qkv"),
                            lin.role == "qkv" and modern_o and (name == "qkv" or r != D)))
    return out


def _separate(lins, D, heads) -> list[Reading]:
    """A Linear each for q, k and v: the square ones by their names, else in every order of
    registration; with fewer key/value heads, by their names only."""
    square = [l for l in lins if l.w.shape == (D, D)]
    named = {r: [l for l in square if l.role == r] for r in "qkv"}
    if all(len(named[r]) == 1 for r in "qkv"):
        choices = [((named["q"][0], named["k"][0], named["v"][0]), 0)]
    else:  # names leave roles open: the registration order decides, then every order
        pool = sorted(square, key=lambda l: l.order)[:5]
        choices = [(trio, 1 + (i > 0)) for i, trio in enumerate(itertools.permutations(pool, 3))]
    kv = {r: [l for l in lins if l.role == r and l.w.size(1) == D and l.w.size(0) < D]
          for r in "kv"}
    choices += [((q, k, v), 0) for q, k, v in itertools.product(named["q"], kv["k"], kv["v"])
                if k.w.shape == v.w.shape]
    out = []
    for (q, k, v), prior in choices:
        r = k.w.size(0)
        for o, o_prior, modern_o in _outs(lins, D, {q.name, k.name, v.name}):
            for h in heads:
                d_k = D // h
                if r % d_k or h % (r // d_k):
                    continue
                kind = "Linears" if q.oriented and k.oriented and v.oriented else "weights"
                out.append(Reading(
                    f"separate {kind} {q.name}, {k.name}, {v.name} [{q.shape()}]"
                    + _out_words(o, True),
                    f"separate Linears {q.name} [{q.shape()}], {k.name}, {v.name} "
                    f"[{k.shape()}]" + _out_words(o, True), h, r // d_k, q.w, k.w, v.w,
                    (q.b, k.b, v.b), o.w if o else None, o.b if o else None,
                    {"q": q.name, "k": k.name, "v": v.name, "o": o.name if o else None},
                    prior + o_prior, modern_o and (q.role, k.role, v.role) == ("q", "k", "v")))
    return out


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _per_head(lins, D) -> list[Reading]:
    """Heads as modules: group the d -> d_k Linears by their parent module (and a d_k -> d_k
    projection of each head's own, if every head has one)."""
    groups: dict[str, dict] = {}
    for l in lins:
        if "." in l.name and (l.role in ("q", "k", "v") and l.w.size(1) == D > l.w.size(0)
                              or l.role == "o" and l.w.size(0) == l.w.size(1) < D):
            groups.setdefault(l.name.rsplit(".", 1)[0], {})[l.role] = l
    heads = [g for _, g in sorted(groups.items(), key=lambda kv: _natural(kv[0]))
             if {"q", "k", "v"} <= set(g)]
    if not heads or sum(g["q"].w.size(0) for g in heads) != D:
        return []
    h = len(heads)
    cat = {r: torch.cat([g[r].w for g in heads]) for r in "qkv"}
    bias = {r: (torch.cat([g[r].b for g in heads]) if all(g[r].b is not None for g in heads)
                else None) for r in "qkv"}
    names = {r: [g[r].name for g in heads] for r in "qkv"}
    parent = heads[0]["q"].name.rsplit(".", 2)[0]
    leaves = "/".join(heads[0][r].name.rsplit(".", 1)[1] for r in "qkv")
    outs = [(o, p, None) for o, p, _ in _outs(lins, D, set())]
    if all(g.get("o") is not None and g["o"].w.size(0) == g["q"].w.size(0) for g in heads):
        own = Lin(heads[0]["o"].name, torch.block_diag(*[g["o"].w for g in heads]),
                  torch.cat([g["o"].b for g in heads]) if all(g["o"].b is not None
                                                              for g in heads) else None,
                  "o", 0)
        outs.insert(0, (own, 0, f"{parent}.*.{own.name.rsplit('.', 1)[1]}"))
    out = []
    for o, o_prior, own in outs:
        words = (f"{h} head modules ({parent}.*) with {leaves} Linears [{heads[0]['q'].shape()}]"
                 + (f", each with its own projection {own} [{heads[0]['o'].shape()}]" if own
                    else f" + projection {o.name} [{o.shape()}]" if o else ", no projection"))
        out.append(Reading(words, words, h, h, cat["q"], cat["k"], cat["v"],
                           (bias["q"], bias["k"], bias["v"]), o.w if o else None,
                           o.b if o else None, {**names, "o": None if own or not o else o.name},
                           o_prior, False, own))
    return out


def qk_norm(info: dict, D: int) -> Optional[dict]:
    """The norms of q and k (modules whose names say q and k, e.g. q_norm / k_norm), or None."""
    by_role = {}
    for entry in info.get("norms", []):
        role = role_of(entry["name"])
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


def describe_linears(info: dict) -> str:
    """What the layer holds, for a report that could not map it."""
    shapes = {n: tuple(p.shape) for n, p in info["params"].items() if p.dim() == 2}
    return ", ".join(f"{n} {list(s)}" for n, s in list(shapes.items())[:8]) or "no weight matrices"
