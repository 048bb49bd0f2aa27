"""Probes past the checklist's forward pass on 8 positions, where the bugs people ship sit:
gradients, lengths past one tile, scores large enough to expose a finite mask value, batch
independence, determinism in eval mode, the input left unmodified, and (for a function that
takes q and k separately) unequal query and key lengths.

Each probe is judged against a float64 reference of the variant that reproduced the layer's
forward pass (so a layer already named for a mistake is not named again here), or, where none
did, by what the outputs alone can tell. Gradients follow flash-attention's tests: the layer's
error must stay within twice the error of the same reference computed in the layer's dtype,
plus a small floor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from model.attention import causal_pattern, scaled_dot_product_attention
from model.pitfalls import masked_softmax
from check_attention import layouts, modern
from check_attention.compare import LEAK, TOLERANCE, rel_err, same
from check_attention.options import MAX_PROBE_BYTES
from check_attention.sandbox.host import ask
from check_attention.variants import (SPLITS, Variant, module_output, pattern,
                                              variant_attend_kwargs)

LENGTHS = (1, 7, 65, 129, 257)           # past the 16 / 32 / 64 / 128-wide tiles of kernels
LONGEST = max(LENGTHS)                   # what a layer taking a block_size is built with
SCORE_TARGETS = (1e2, 1e3, 1e4, 1e5, 1e6)  # largest |score| of the large-input probes
BLIND_SCALES = (10.0, 30.0, 100.0, 300.0, 1000.0)  # x's scale when the scores cannot be read
UNEQUAL = ((1, 9), (5, 12))              # (n_q, n_k): one decoded token, a chunk after a cache
# The gradient tolerance's floor, added to twice the reference's own error in the dtype.
GRAD_FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-4,
              torch.bfloat16: 2e-3}


def _randn(gen, dtype):
    def rand(*shape, scale=1.0):  # seeded, and rounded to the layer's dtype once
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()
    return rand


def _lengths(cap: Optional[int], h: int, D: int, B: int) -> list[int]:
    """LENGTHS up to the layer's context (and the context itself) and within the memory bound
    the options hold the causality probes to: scores [B, h, n, n] and x [B, n, D], float64, in
    both processes."""
    def fits(n):
        return 32 * B * (h * n * n + n * D) <= MAX_PROBE_BYTES
    top = min(cap or LONGEST, LONGEST)
    out = [n for n in LENGTHS if n <= top and fits(n)]
    return out + ([top] if top not in out and top > 1 and fits(top) else [])


def _first_bad(y: torch.Tensor, ref: torch.Tensor, tol: float, axis: int) -> tuple[int, float]:
    """(first position along axis whose error exceeds tol, or -1; the worst error)."""
    if ref.numel() == 0:
        return -1, 0.0
    scale = max(ref.nan_to_num(0).abs().max().item(), 1e-30)
    d = (y.double() - ref).abs()
    d = d.masked_fill(torch.isnan(y) & torch.isnan(ref), 0).nan_to_num(math.inf)
    per = d.movedim(axis, 0).reshape(d.size(axis), -1).max(dim=1).values / scale
    bad = (per > tol).nonzero()
    return (int(bad[0]) if len(bad) else -1), per.max().item() if per.numel() else 0.0


def _lengths_words(results: list, tol: float, cap_words: str) -> tuple[str, str]:
    """results: (n, error or None, first bad position, worst). -> (status, detail)."""
    ok = [n for n, e, p, _ in results if e is None and p < 0]
    for n, error, p, worst in results:
        if error is not None:
            return "FAIL", f"raises at length {n}: {error}" + (
                f" (lengths {', '.join(map(str, ok))} are right)" if ok else "")
        if p >= 0:
            tile = (f": right only for the first {p} queries, as a chunked or tiled loop that "
                    f"mishandles the chunks after the first" if p >= 16 and p % 16 == 0 else "")
            return "FAIL", (f"wrong past position {p} at length {n}: from position {p} on the "
                            f"output differs by up to {worst:.2g} relative (positions 0 to "
                            f"{p - 1} match){tile}" if p > 0 else
                            f"wrong at length {n}: the output differs by up to {worst:.2g} "
                            f"relative from position 0 on (a mask that holds only at one "
                            f"length?)") + (f"; lengths {', '.join(map(str, ok))} are right"
                                            if ok else "")
    return "PASS", f"lengths {', '.join(str(n) for n, *_ in results)}{cap_words}"


def _moved_positions(n: int, seen: int) -> list[int]:
    """Positions of the longest probe to change one at a time for causality past the
    checklist's `seen` positions: every 16th (the narrowest tiles' edges) and the last."""
    return sorted({j for j in range(16, n, 16) if j >= seen} | ({n - 1} if n > seen else set()))


def _long_leak(base, outs: list, moved: list[int], seen: int) -> Optional[str]:
    """Words for the first position j of `moved` whose change moves an earlier output of the
    longest probe (base), or None: causality at lengths the checklist's probe never reaches."""
    if base is None or base.dim() < 2:
        return None
    scale = max(base.double().nan_to_num(0).abs().max().item(), 1e-30)
    for j, y in zip(moved, outs):
        if y is None or y.shape != base.shape:
            continue
        d = (y[:, :j].double() - base[:, :j].double()).abs()
        d = d.masked_fill(torch.isnan(y[:, :j]) & torch.isnan(base[:, :j]), 0).nan_to_num(math.inf)
        per = d.reshape(d.size(0), j, -1).amax(dim=(0, 2)) / scale  # [j]: each earlier position
        bad = (per > LEAK).nonzero()
        if len(bad):
            i = int(bad[0])
            return (f"at length {base.size(1)}, changing position {j} changes the output at "
                    f"position {i} by up to {per[i].item():.3g} (relative): query {i} sees a "
                    f"future key, past the {seen} positions of the check above")
    return None


def _grad_words(pairs: list) -> tuple[str, str]:
    """pairs: (name, layer grad or None or 'frozen', ref64, ref_low, floor) -> (status, detail)."""
    wrong, none, frozen = [], [], []
    for name, got, ref, low, floor in pairs:
        if isinstance(got, str):
            frozen.append(name)
            continue
        if got is None:
            none.append(name)
            continue
        own = rel_err(low, ref)
        bound = 2 * own + floor
        err = rel_err(got, ref)
        if not err <= bound:
            wrong.append((name, err, bound))
    if none:
        return "FAIL", (f"no gradient reaches {', '.join(none)}: the output does not depend on "
                        f"{'it' if len(none) == 1 else 'them'} through autograd (computed under "
                        f"no_grad, detached, or a custom backward returning None)")
    if wrong:
        name, err, bound = max(wrong, key=lambda w: w[1] / w[2])
        rest = [n for n, *_ in pairs if n not in {w[0] for w in wrong} and n not in frozen]
        return "FAIL", (f"backward is wrong: {name} differs from autograd on the equation in "
                        f"float64 by {err:.2g} relative (tolerance {bound:.1e}: twice the same "
                        f"reference's error in the layer's dtype, plus a floor)"
                        + (f"; also wrong: {', '.join(w[0] for w in wrong if w[0] != name)}"
                           if len(wrong) > 1 else "")
                        + (f"; right: {', '.join(rest)}" if rest else "")
                        + "; the forward pass is right, so the backward (a custom "
                          "autograd.Function?) is not its derivative")
    names = ", ".join(n for n, g, *_ in pairs if not isinstance(g, str))
    return "PASS", (f"{names} within twice the float64 reference's own error in the layer's "
                    f"dtype, plus {pairs[0][4]:.0e}"
                    + (f"; {', '.join(frozen)} frozen (requires_grad=False)" if frozen else ""))


def _large_words(levels: list, what: str) -> tuple[str, str]:
    """levels: (words for the scale, leak or None, new non-finite count). First failure wins."""
    clean = []
    for scale_words, leak, nonfinite in levels:
        if nonfinite:
            return "FAIL", (f"at {scale_words} the output has {nonfinite} NaN or inf values it "
                            f"does not have at ordinary scales: the softmax overflows (exp of "
                            f"the scores without subtracting each row's maximum?)")
        if leak is not None:
            below = f"; none with {clean[-1]}" if clean else ""
            return "FAIL", (f"at {scale_words}, changing the last {what} moves earlier outputs "
                            f"by up to {leak:.2g} (relative){below}: the mask value is finite "
                            f"(like -1e4) and hides the future only while the scores stay "
                            f"below it")
        clean.append(scale_words)
    return "PASS", f"no leak and no overflow at {clean[-1]}" if clean else ""


def _leak(base: torch.Tensor, moved: torch.Tensor, axis: int) -> Optional[float]:
    """How far positions before the last moved (relative), or None under LEAK."""
    a, b = base.narrow(axis, 0, base.size(axis) - 1), moved.narrow(axis, 0, base.size(axis) - 1)
    scale = max(base.double().nan_to_num(0).abs().max().item(), 1e-30)
    d = (a.double() - b.double()).abs().masked_fill(torch.isnan(a) & torch.isnan(b), 0)
    worst = d.nan_to_num(math.inf).max().item() / scale if d.numel() else 0.0
    return worst if worst > LEAK else None


def _new_nonfinite(y: torch.Tensor, y1: torch.Tensor) -> int:
    if y.shape != y1.shape:
        return 0
    return int((~torch.isfinite(y) & torch.isfinite(y1)).sum())


def _determinism(outs: list, errors: list, dropouts: int) -> tuple[str, str]:
    """outs: the same input with seeds 0, 0, 1."""
    if any(e for e in errors[:3]):
        return "SKIP", f"not judged: {next(e for e in errors[:3] if e)}"
    a, b, c = outs[:3]
    if not same(a, b):
        return "FAIL", (f"two identical calls with the same seed give outputs differing by "
                        f"{rel_err(b, a):.2g} (relative): the layer keeps state between calls, "
                        f"or a kernel is nondeterministic")
    if not same(a, c):
        return "FAIL", (f"dropout left on in eval mode: the output follows torch's random seed "
                        f"(seeds 0 and 1 differ by {rel_err(c, a):.2g} relative; two calls with "
                        f"seed 0 agree)" + (f"; its {dropouts} nn.Dropout modules are off in eval "
                                            f"mode, so it is a functional dropout that ignores "
                                            f"self.training" if dropouts else ""))
    return "PASS", "two calls with seed 0 and one with seed 1 give identical outputs"


def _kept(changed: list) -> tuple[str, str]:
    moved = sorted({n for c in changed for n in c})
    if moved:
        return "FAIL", (f"the call writes into its input {', '.join(moved)} in place (x += ..., "
                        f"x.mul_(...), masked_fill_): the caller's tensor is changed")
    return "PASS", "compared bit for bit after each call"


# ----------------------------------------------------------------------------- a module


def _equation(w, h: int, variant: Variant, x: torch.Tensor) -> torch.Tensor:
    """Our equation as `variant` computes it, differentiable and in x's dtype: x [B, T, D]."""
    dt = x.dtype
    cut, _ = SPLITS["mixed" if variant.attn.split_heads_no_transpose else "heads"]
    _, join = SPLITS["heads"]
    q, k, v = (cut(F.linear(x, wt.to(dt), None if b is None else b.to(dt)), h)
               for wt, b in ((w.wq, w.bq), (w.wk, w.bk), (w.wv, w.bv)))
    kw = variant_attend_kwargs(variant, w.wq.size(1) // h, h)
    y, _ = scaled_dot_product_attention(q, k, v, variant.visible(x.size(1)),
                                        scale=kw["scale"], masked_softmax=masked_softmax(
                                            kw["mask_mode"], kw["mask_value"], kw["dim"]))
    y = join(y)
    if w.wo is not None:
        y = F.linear(y, w.wo.to(dt), None if w.bo is None else w.bo.to(dt))
    return y


@dataclass
class Reference:
    """The reading of a module's weights that reproduced its forward pass, as the probes use it,
    whichever found it: the classic layouts (a diagnosis.Match) or modern.py (a modern.Found:
    rotary positions, grouped key/value heads, QK-norm)."""

    h: int                   # query heads
    pattern: str             # the matched variant's mask pattern
    output: Callable         # x [B, T, D] -> y, float64
    max_score: Callable      # x -> the largest |score| (after scaling) over visible pairs
    rebuild: Callable        # {name: float64 leaf} -> (x, dtype) -> y, differentiable in the
    #                          leaves; None when the same reading cannot be made of them


def reference(found, info: dict, captures: dict, D: int) -> Optional[Reference]:
    """A Reference from a diagnosis.Match or a modern.Found (None: none reproduced the layer)."""
    if found is None:
        return None
    if isinstance(found, modern.Found):
        return _modern(found, info, captures, D)
    m, v = found.mapping, found.variant

    def rebuild(leaves):
        maps = layouts.mappings(dict(info, params=leaves), captures, D, [m.h])
        same = next((n for n in maps if n.words == m.words
                     and _same_weights(n.weights, m.weights)), None)
        return same and (lambda x, dtype: _equation(same.weights, m.h, v, x.to(dtype)))
    return Reference(m.h, v.pattern, lambda x: module_output(m.weights, m.h, v, x),
                     lambda x: _max_score(m.weights, m.h, v, x), rebuild)


def _modern(f, info: dict, captures: dict, D: int) -> Reference:
    r, h = f.reading, f.reading.h

    def output(x, reading=r, dtype=torch.float64, grad=False, seen=None):
        return modern.output(reading, f.rotary, f.variant, f.pitfalls, x, dtype, grad, seen)

    def rebuild(leaves):
        same = next((n for n in modern.readings(dict(info, params=leaves), captures, D, h)
                     if n.words == r.words and n.h_kv == r.h_kv
                     and torch.equal(n.wq.detach(), r.wq.double())), None)
        return same and (lambda x, dtype: output(x, same, dtype, grad=True))

    def max_score(x):  # on q and k as the scores see them: after QK-norm and rotary positions
        seen = {}
        output(x, seen=seen)
        k = seen["k"].repeat_interleave(h // r.h_kv, dim=1)
        s = (seen["q"] @ k.transpose(-2, -1)) * f.variant.scale(D // h, h)
        return s.masked_fill(~causal_pattern(x.size(1), x.size(1)), 0).abs().max().item()
    return Reference(h, f.variant.pattern, output, max_score, rebuild)


def _module_grads(info: dict, ref: Reference, x: torch.Tensor, g: torch.Tensor, dtype
                  ) -> Optional[dict]:
    """{name: (ref64, ref in dtype)} for dx and every parameter the reference reads, by autograd
    through the same reading of the layer's weights on float64 leaves; None when that reading
    cannot be rebuilt."""
    refs = {}
    for low in (False, True):
        leaves = {n: p.double().clone().requires_grad_() for n, p in info["params"].items()}
        equation = ref.rebuild(leaves)
        if equation is None:
            return None
        xl = x.clone().requires_grad_()
        y = equation(xl, dtype if low else torch.float64)
        names = ["x"] + list(leaves)
        tensors = [xl] + list(leaves.values())
        grads = torch.autograd.grad(y, tensors, grad_outputs=g.to(y.dtype), allow_unused=True)
        for n, gr in zip(names, grads):
            if gr is not None:
                refs.setdefault(n, [None, None])[int(low)] = gr.detach().double()
    return refs


def _same_weights(a, b) -> bool:
    """The same reading: equal in every field (a bare Parameter's two orientations share their
    words)."""
    fields = ("wq", "wk", "wv", "bq", "bk", "bv", "wo", "bo")
    return all((getattr(a, f) is None) == (getattr(b, f) is None) and (
        getattr(a, f) is None or torch.equal(getattr(a, f).detach(), getattr(b, f).double()))
        for f in fields)


def check_module(child, info: dict, opts, report, found, D: int, captures: dict) -> None:
    """The probes for an nn.Module, after the checklist; `found`: the diagnosis's Match or
    modern.py's Found (or None)."""
    ref = reference(found, info, captures, D)
    dtype = getattr(torch, info["dtype"])
    tol = TOLERANCE.get(dtype, 5e-2)
    B, T = max(opts.batch, 2), opts.seq_len
    rand = _randn(torch.Generator().manual_seed(opts.seed + 1), dtype)
    h = ref.h if ref else (opts.n_head if "n_head" in info["consumed"] else 1)
    cap = min(ask(child, "context")["sizes"] or [None], key=lambda s: s or math.inf)
    lengths = _lengths(cap, max(h, 1), D, B)
    x = rand(B, T, D)
    other = x.clone()
    other[0] = rand(T, D)
    if ref is not None:
        s1 = ref.max_score(x)
        sigmas = [math.sqrt(t / s1) for t in SCORE_TARGETS] if s1 > 0 else list(BLIND_SCALES)
    else:
        sigmas = list(BLIND_SCALES)
    large = []
    for s in sigmas:
        base = x * s
        moved = base.clone()
        moved[:, -1] = rand(B, D, scale=s)
        large += [base.to(dtype).double(), moved.to(dtype).double()]
    longest = rand(B, max(lengths, default=1), D)
    longs = [longest[:, :n].contiguous() for n in lengths]  # prefixes of one sequence
    moved = _moved_positions(longest.size(1), T)
    leaks = []
    for j in moved:  # the longest with position j changed: no output before j may move
        xj = longest.clone()
        xj[:, j] = rand(B, D, scale=4.0)
        leaks.append(xj)
    inputs = [x, x, x, other] + large + longs + leaks
    seeds = [0, 0, 1] + [0] * (len(inputs) - 3)
    got = ask(child, "probe", inputs=inputs, seeds=seeds, grad_outputs=[None] * len(inputs))
    outs, errors = got["outs"], got["errors"]
    report.set("deterministic", *_determinism(outs, errors, info.get("dropouts", 0)))
    report.set("input_kept", *_kept(got["changed"]))
    y = outs[0].double() if outs[0] is not None else None
    shaped = y is not None and list(y.shape) == [B, T, D]
    if outs[3] is None or y is None or outs[3].shape != y.shape:
        report.set("batch", "SKIP", f"not judged: {errors[3] or 'the output changes shape'}")
    else:
        moved_by = rel_err(outs[3][1:], y[1:]) if B > 1 else 0.0
        report.set("batch", "FAIL" if moved_by > LEAK else "PASS",
                   f"changing sample 0 moves the other samples' outputs by up to {moved_by:.2g} "
                   f"(relative): samples attend to each other (batch mixing)" if moved_by > LEAK
                   else "changing sample 0 leaves the other samples' outputs bit for bit")
    if not shaped:
        for item in ("lengths", "large_scores", "backward"):
            report.set(item, "SKIP", "not judged: the output's shape is not the input's")
        return
    # large scores: the last position changed at each scale; earlier outputs must not move
    if report.items.get("causal") and report.items["causal"].status == "FAIL":
        report.set("large_scores", "N/A", "the future already leaks at ordinary scales (see "
                                          "Causality)")
    elif dtype == torch.float16:
        report.set("large_scores", "N/A", "float16 scores cannot exceed 65,504, where -1e4 is "
                                          "the usual mask value")
    else:
        levels = []
        for i, s in enumerate(sigmas):
            a, b = outs[4 + 2 * i], outs[5 + 2 * i]
            if a is None or b is None:
                levels.append((f"x times {s:.3g}", None, 0))
                continue
            words = (f"scores up to {ref.max_score(x * s):.0e} (x times {s:.3g})"
                     if ref is not None else f"x times {s:.3g}")
            levels.append((words, _leak(a.double(), b.double(), 1), _new_nonfinite(a, y)))
        report.set("large_scores", *_large_words(levels, "position"))
    # lengths past one tile
    at = 4 + len(large)  # where the lengths' outputs start, then the moved positions'
    results = []
    for n, xl, out, error in zip(lengths, longs, outs[at:], errors[at:]):
        if error is not None or out is None:
            results.append((n, error or "no output", -1, 0.0))
        elif ref is not None:
            right = ref.output(xl)
            if ref.pattern == "mask_no_diagonal":
                out, right = out[:, 1:], right[:, 1:]
            p, worst = _first_bad(out, right, tol, 1) if out.shape == right.shape else \
                (0, math.inf)
            results.append((n, None, p + (p >= 0 and ref.pattern == "mask_no_diagonal"), worst))
        else:
            results.append((n, None, -1, 0.0))
    cap_words = f" (the layer's context is {cap})" if cap and cap < LONGEST else ""
    blind_ok = all(report.items[k].status == "PASS" for k in ("causal", "deterministic")
                   if k in report.items)
    if ref is None and not blind_ok:
        report.set("lengths", "SKIP", "not judged: no reference reproduces the layer, and its "
                                      "outputs are not causal or not repeatable")
    elif ref is None:  # no reference: each shorter output must be the start of the longest
        okay = [(n, o.double()) for n, o, e in zip(lengths, outs[at:], errors[at:])
                if e is None and o is not None]
        results = [r for r in results if r[1] is not None] + [
            (n, None, *_first_bad(o, okay[-1][1][:, :n], tol, 1)) for n, o in okay[:-1]] + [
            (n, None, -1, 0.0) for n, _ in okay[-1:]]
        results.sort(key=lambda r: r[0])
        cap_words += "; no reference reproduces the layer, so judged by consistency: each " \
                     "shorter output is the start of the longest"
    long_leak = _long_leak(outs[at + len(lengths) - 1] if lengths else None,
                           outs[at + len(lengths):], moved, T)
    if long_leak and report.items.get("causal") and report.items["causal"].status == "PASS":
        report.set("causal", "FAIL", long_leak)
        report.diagnosis.append(f"a causal leak that only long sequences show: {long_leak}")
    if "lengths" not in report.items:
        status, detail = _lengths_words(results, tol, cap_words)
        report.set("lengths", status, detail + ("; the future leaks (see Causality)"
                                                if long_leak and status == "FAIL" else ""))
    # backward
    if ref is None:
        report.set("backward", "SKIP", "not judged: no reference reproduces the forward pass")
        return
    if y.isnan().any():
        report.set("backward", "SKIP", "not judged: the output has NaN (a query that sees no "
                                       "key), which reaches every gradient")
        return
    g = rand(B, T, D)
    refs = _module_grads(info, ref, x, g, dtype) or {}
    back = ask(child, "probe", inputs=[x], seeds=[0], grad_outputs=[g])
    if back["errors"][0] is not None:
        report.set("backward", "FAIL", f"backward raises: {back['errors'][0]}")
        return
    grads = back["grads"][0]
    pairs = []
    for n, (r64, rlow) in refs.items():
        key = n if n == "x" else "param:" + n
        mine = grads.get(key) if key in grads else ("frozen" if n != "x" else None)
        mine = mine.double() if isinstance(mine, torch.Tensor) else mine
        pairs.append(("dx" if n == "x" else n + ".grad", mine, r64, rlow,
                      GRAD_FLOOR.get(dtype, 2e-3)))
    report.set("backward", *_grad_words(pairs))


def _max_score(w, h: int, variant: Variant, x: torch.Tensor) -> float:
    """The largest |score| (after scaling) over visible pairs, from the reference's weights."""
    cut, _ = SPLITS["mixed" if variant.attn.split_heads_no_transpose else "heads"]
    q = cut(F.linear(x.double(), w.wq, w.bq), h)
    k = cut(F.linear(x.double(), w.wk, w.bk), h)
    s = (q @ k.transpose(-2, -1)) * variant.scale(w.wq.size(1) // h, h)
    return s.masked_fill(~causal_pattern(x.size(1), x.size(1)), 0).abs().max().item()


# ----------------------------------------------------------------------------- a function


def _sdpa(q, k, v, visible, var: Variant, d_k: int, h: int):
    kw = variant_attend_kwargs(var, d_k, h)
    y, _ = scaled_dot_product_attention(q, k, v, visible, scale=kw["scale"],
                                        masked_softmax=masked_softmax(kw["mask_mode"],
                                                                      kw["mask_value"], kw["dim"]))
    return y


def _as_mask(visible: torch.Tensor, convention: str) -> torch.Tensor:
    if convention == "keep":
        return visible
    if convention == "drop":
        return ~visible
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))


def check_function(child, info: dict, opts, report, convention: str, best,
                   batched: bool = True) -> None:
    """The probes for f(q, k, v, mask), after the checklist; best: (key, variant, err).
    batched: q, k, v [B, h, n, d_k]; else the sheet's [n, d_k] (one sequence, no batch)."""
    h, D = opts.n_head, opts.d_model
    d_k = D // h
    dtype = getattr(torch, opts.dtype or "float32")
    tol = TOLERANCE.get(dtype, 5e-2)
    B, T = max(opts.batch, 2), opts.seq_len
    lead = (B, h) if batched else ()
    rand = _randn(torch.Generator().manual_seed(opts.seed + 1), dtype)
    var = best[1] if best is not None and best[2] <= tol else None
    mask = _as_mask(causal_pattern(T, T), convention)
    qkv = tuple(rand(*lead, T, d_k) for _ in range(3))
    other = tuple(t.clone() for t in qkv)
    for t in other if batched else ():
        t[0] = rand(h, T, d_k)
    lengths = _lengths(None, h, D, B)
    q1, k1 = qkv[0], qkv[1]
    s1 = ((q1 @ k1.transpose(-2, -1)) / math.sqrt(d_k)).abs().max().item()
    sigmas = [math.sqrt(t / s1) for t in SCORE_TARGETS]
    large = []
    for s in sigmas:
        q, k, v = (t * s for t in qkv)
        k2, v2 = k.clone(), v.clone()
        k2[..., -1, :], v2[..., -1, :] = rand(*lead, d_k, scale=s), rand(*lead, d_k, scale=s)
        large += [(q, k, v, mask), (q, k2, v2, mask)]
    longest = [rand(*lead, max(lengths, default=1), d_k) for _ in range(3)]
    longs = [tuple(t[..., :n, :].contiguous() for t in longest) for n in lengths]
    unequal = [(rand(*lead, nq, d_k), rand(*lead, nk, d_k), rand(*lead, nk, d_k))
               for nq, nk in UNEQUAL]
    inputs = ([(*qkv, mask)] * 3 + [(*other, mask)] + large
              + [(*t, _as_mask(causal_pattern(n, n), convention)) for n, t in zip(lengths, longs)]
              + [(*t, _as_mask(causal_pattern(nq, nk), convention))
                 for (nq, nk), t in zip(UNEQUAL, unequal)])
    seeds = [0, 0, 1] + [0] * (len(inputs) - 3)
    got = ask(child, "probe", inputs=inputs, seeds=seeds, grad_outputs=[None] * len(inputs))
    outs, errors = got["outs"], got["errors"]
    report.set("deterministic", *_determinism(outs, errors, 0))
    report.set("input_kept", *_kept(got["changed"]))
    y = outs[0]
    if not batched:
        report.set("batch", "N/A", "it takes one sequence, q, k, v [n, d], no batch")
    elif y is None or outs[3] is None or outs[3].shape != y.shape:
        report.set("batch", "SKIP", f"not judged: {errors[3] or 'the output changes shape'}")
    else:
        moved_by = rel_err(outs[3][1:], y[1:])
        report.set("batch", "FAIL" if moved_by > LEAK else "PASS",
                   f"changing sample 0 moves the other samples' outputs by up to {moved_by:.2g} "
                   f"(relative): samples attend to each other (batch mixing)" if moved_by > LEAK
                   else "changing sample 0 leaves the other samples' outputs bit for bit")
    at = 4 + len(large)
    if y is None or list(y.shape) != [*lead, T, d_k]:
        for item in ("lengths", "large_scores", "backward", "unequal"):
            report.set(item, "SKIP", "not judged: the output's shape is not [..., n, d_v]")
        return
    if report.items.get("causal") and report.items["causal"].status == "FAIL":
        report.set("large_scores", "N/A", "the future already leaks at ordinary scales (see "
                                          "Causality)")
    elif dtype == torch.float16:
        report.set("large_scores", "N/A", "float16 scores cannot exceed 65,504, where -1e4 is "
                                          "the usual mask value")
    else:
        levels = []
        for i, s in enumerate(sigmas):
            a, b = outs[4 + 2 * i], outs[5 + 2 * i]
            words = f"scores up to {SCORE_TARGETS[i]:.0e} (q, k times {s:.3g})"
            levels.append((words, None if a is None or b is None else
                           _leak(a.double(), b.double(), -2),
                           0 if a is None else _new_nonfinite(a, y)))
        report.set("large_scores", *_large_words(levels, "key and value"))
    if var is None:
        for item in ("lengths", "backward", "unequal"):
            report.set(item, "SKIP", "not judged: no variant of ours reproduces the forward pass")
        return
    results = []
    for n, t, out, error in zip(lengths, longs, outs[at:], errors[at:]):
        if error is not None or out is None:
            results.append((n, error or "no output", -1, 0.0))
            continue
        ref = _sdpa(*t, pattern(var.pattern, n), var, d_k, h)
        skip = var.pattern == "mask_no_diagonal"
        a, r = (out[..., 1:, :], ref[..., 1:, :]) if skip else (out, ref)
        p, worst = _first_bad(a, r, tol, -2) if a.shape == r.shape else (0, math.inf)
        results.append((n, None, p + (p >= 0 and skip), worst))
    report.set("lengths", *_lengths_words(results, tol, ""))
    report.set("unequal", *_unequal(info, outs[at + len(lengths):], errors[at + len(lengths):],
                                    unequal, var, d_k, h, tol))
    # backward: dq, dk, dv against autograd on our equation
    if y.isnan().any():
        report.set("backward", "SKIP", "not judged: the output has NaN (a query that sees no "
                                       "key), which reaches every gradient")
        return
    g = rand(*lead, T, d_k)
    back = ask(child, "probe", inputs=[(*qkv, mask)], seeds=[0], grad_outputs=[g])
    if back["errors"][0] is not None:
        report.set("backward", "FAIL", f"backward raises: {back['errors'][0]}")
        return
    refs = {}
    for low in (False, True):
        leaves = [t.clone().requires_grad_() for t in qkv]
        ins = [t.to(dtype) for t in leaves] if low else leaves
        out = _sdpa(*ins, pattern(var.pattern, T), var, d_k, h)
        for n, gr in zip("qkv", torch.autograd.grad(out, leaves, grad_outputs=g.to(out.dtype))):
            refs.setdefault(n, [None, None])[int(low)] = gr.double()
    layer = back["grads"][0]
    report.set("backward", *_grad_words([
        ("d" + n, None if layer.get(n) is None else layer[n].double(), r64, rlow,
         GRAD_FLOOR.get(dtype, 2e-3)) for n, (r64, rlow) in refs.items()]))


def _unequal(info, outs, errors, inputs, var: Variant, d_k: int, h: int, tol: float):
    """n_q != n_k with a bottom-right aligned mask (query i sees keys 0 .. n_k - n_q + i)."""
    if var.pattern != "causal":
        return "SKIP", "not judged: the matched variant's mask is not the causal one"
    for (nq, nk), (q, k, v), out, error in zip(UNEQUAL, inputs, outs, errors):
        if error is not None or out is None:
            if not info["takes_mask"]:
                return "N/A", (f"it takes no mask and builds a square one itself (n_q = {nq}, "
                               f"n_k = {nk} raises: {error})")
            return "FAIL", f"n_q = {nq}, n_k = {nk} with a [{nq}, {nk}] mask raises: {error}"
        right = _sdpa(q, k, v, causal_pattern(nq, nk), var, d_k, h)
        if out.shape != right.shape:
            return "FAIL", f"n_q = {nq}, n_k = {nk} gives {list(out.shape)}, not " \
                           f"{list(right.shape)}"
        if rel_err(out, right) <= tol:
            continue
        top_left = _sdpa(q, k, v, torch.ones(nq, nk, dtype=torch.bool).tril(), var, d_k, h)
        if rel_err(out, top_left) <= tol:
            return "FAIL", (f"n_q = {nq}, n_k = {nk}: the mask is aligned top-left (query i "
                            f"sees keys 0..i, torch's is_causal convention), not bottom-right: "
                            f"with a KV cache the new queries miss the latest keys")
        return "FAIL", (f"n_q = {nq}, n_k = {nk}: differs from the equation under the given "
                        f"[{nq}, {nk}] mask by {rel_err(out, right):.2g} relative")
    return "PASS", ", ".join(f"n_q = {nq}, n_k = {nk}" for nq, nk in UNEQUAL) + \
        " (bottom-right aligned mask)"
