"""Probes past the checklist's forward pass on 8 positions, where the bugs people ship sit:
gradients, lengths past one tile, scores large enough to expose a finite mask value, batch
independence, determinism in eval mode, the input left unmodified, and (for a function that
takes q and k separately) unequal query and key lengths.

Each probe is judged against a float64 reference of the variant that reproduced the layer's
forward pass (so a layer already named for a mistake is not named again here), or, where none
did, by what the outputs alone can tell. Gradients follow flash-attention's tests: the layer's
error must stay within twice the error of the same reference computed in the layer's dtype,
plus a small floor. The probes are a list (`run`): each has its inputs, and its judgement reads
its own outputs; one batch of seeded calls in the sandbox serves them all.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from model.attention import causal_pattern
from check_attention import layouts
from check_attention.compare import LEAK, rel_err, same, worst
from check_attention.options import MAX_PROBE_BYTES
from check_attention.variants import layer_output

LENGTHS = (1, 7, 65, 129, 257)           # past the 16 / 32 / 64 / 128-wide tiles of kernels
LONGEST = max(LENGTHS)                   # what a layer taking a block_size is built with
SCORE_TARGETS = (1e2, 1e3, 1e4, 1e5, 1e6)  # largest |score| of the large-input probes
BLIND_SCALES = (10.0, 30.0, 100.0, 300.0, 1000.0)  # x's scale when the scores cannot be read
UNEQUAL = ((1, 9), (5, 12))              # (n_q, n_k): one decoded token, a chunk after a cache
# The gradient tolerance's floor, added to twice the reference's own error in the dtype.
GRAD_FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 3e-4,
              torch.bfloat16: 2e-3}


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
    per = worst(y, ref, axis) if ref.numel() else torch.zeros(0)
    bad = (per > tol).nonzero()
    return (int(bad[0]) if len(bad) else -1), per.max().item() if per.numel() else 0.0


def _lengths_words(results: list, tol: float, cap_words: str) -> tuple[str, str]:
    """results: (n, error or None, first bad position, worst). -> (status, detail)."""
    ok = [n for n, e, p, _ in results if e is None and p < 0]
    for n, error, p, most in results:
        if error is not None:
            return "FAIL", f"raises at length {n}: {error}" + (
                f" (lengths {', '.join(map(str, ok))} are right)" if ok else "")
        if p >= 0:
            tile = (f": right only for the first {p} queries, as a chunked or tiled loop that "
                    f"mishandles the chunks after the first" if p >= 16 and p % 16 == 0 else "")
            return "FAIL", (f"wrong past position {p} at length {n}: from position {p} on the "
                            f"output differs by up to {most:.2g} relative (positions 0 to "
                            f"{p - 1} match){tile}" if p > 0 else
                            f"wrong at length {n}: the output differs by up to {most:.2g} "
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
    for j, y in zip(moved, outs):
        if y is None or y.shape != base.shape:
            continue
        per = worst(y[:, :j], base[:, :j], 1, scale=base)  # [j]: each earlier position
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
        if got is None or isinstance(got, str):
            (none if got is None else frozen).append(name)
        elif not rel_err(got, ref) <= 2 * rel_err(low, ref) + floor:
            wrong.append((name, rel_err(got, ref), 2 * rel_err(low, ref) + floor))
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
    return ("FAIL", f"the call writes into its input {', '.join(moved)} in place (x += ..., "
                    f"x.mul_(...), masked_fill_): the caller's tensor is changed") if moved else \
        ("PASS", "compared bit for bit after each call")


# ----------------------------------------------------------------------------- the reference


@dataclass
class Reference:
    """What reproduced the forward pass (a diagnosis.Match), as the probes use it."""

    h: int                   # query heads
    pattern: str             # the matched variant's mask pattern
    output: Callable         # (*input) -> y, float64: x [B, T, D], or q, k, v [..., n, d_k]
    max_score: Optional[Callable]  # x -> the largest |score| (after scaling) over visible pairs
    grads: Callable          # (input, grad_output, dtype) -> {name: [in float64, in dtype]}
    attend: Optional[Callable] = None  # a function's: (q, k, v, visible [n_q, n_k]) -> y


def reference(f, t) -> Optional[Reference]:
    """The probes' Reference from what reproduced the target (t: target.Target), or None."""
    if f is None:
        return None
    v, r = f.variant, f.reading

    def grads(inp: tuple, g: torch.Tensor, dtype) -> dict:
        """{name: [ref64, ref in dtype]} for the inputs and every parameter the reading reads,
        by autograd on the equation: for a layer, through the same reading of float64 leaves
        of its weights."""
        refs = {}
        for low in (False, True):
            leaves = {n: a.clone().requires_grad_() for n, a in zip(t.inputs, inp)}
            if r is None:
                y = v.equation(*[a.to(dtype) if low else a for a in leaves.values()], t.d_k,
                               t.h)
            else:
                params = {n: p.double().clone().requires_grad_()
                          for n, p in t.info["params"].items()}
                same = layouts.readings(dict(t.info, params=params), t.captures[0], t.D,
                                        t.heads)[next(i for i, x in enumerate(t.readings)
                                                      if x is r)]
                y = layer_output(same, f.rotary, v, f.switches, leaves["x"],
                                 dtype if low else torch.float64, grad=True)
                leaves.update(params)
            for n, gr in zip(leaves, torch.autograd.grad(y, list(leaves.values()), g.to(y.dtype),
                                                         allow_unused=True)):
                if gr is not None:
                    refs.setdefault(n, [None, None])[int(low)] = gr.detach().double()
        return refs
    if r is None:  # a function: our equation on q, k, v
        return Reference(t.h, v.pattern, lambda q, k, v_: v.equation(q, k, v_, t.d_k, t.h),
                         None, grads, lambda q, k, v_, seen: v.equation(q, k, v_, t.d_k, t.h,
                                                                         seen))

    def max_score(x):  # on q and k as the scores see them: after QK-norm and rotary positions
        seen = {}
        layer_output(r, f.rotary, v, f.switches, x, seen=seen)
        k = seen["k"].repeat_interleave(r.h // r.h_kv, dim=1)
        s = (seen["q"] @ k.transpose(-2, -1)) * v.scale(t.D // r.h, r.h)
        return s.masked_fill(~causal_pattern(x.size(1), x.size(1)), 0).abs().max().item()
    return Reference(r.h, v.pattern, lambda x: layer_output(r, f.rotary, v, f.switches, x),
                     max_score, grads)


# ----------------------------------------------------------------------------- the probes


def run(t, report, found) -> None:
    """The probes, after the checklist, for a module or a function (t: target.Target); found:
    what reproduced its forward pass (diagnosis.Match; None: nothing did). Each probe is a named
    list of inputs: the same input three times (seeds 0, 0, 1), sample 0 changed, the last
    position changed at each large scale, prefixes of one long input, and (as the kind has
    them) the long input with one position changed at a time or unequal query and key
    lengths; one batch of seeded calls holds them all, and each judgement reads its own."""
    ref = reference(found, t)
    B, T = max(t.opts.batch, 2), t.T
    rand = t.randn(1)
    cap = t.context()
    lengths = _lengths(cap, max(t.probe_heads(ref), 1), t.D, B)
    x = t.draw(rand, B, T)  # each [*lead, T, width]
    other = tuple(a.clone() for a in x)
    for a in other if t.lead(B) else ():
        a[0] = rand(*a.shape[1:])  # sample 0 changed
    sigmas = t.sigmas(ref, x, SCORE_TARGETS, BLIND_SCALES)
    large = []
    for s in sigmas:
        base = tuple(a * s for a in x)
        large.append([base, t.changed(base, -1, rand, s, t.large_moves)])
    longest = t.draw(rand, B, max(lengths, default=1))
    shifts = _moved_positions(longest[0].size(-2), T) if t.long_leaks else []
    probes = {"same": [x, x, x], "other": [other],
              "large": [inp for pair in large for inp in pair],
              "lengths": [tuple(a[..., :n, :].contiguous() for a in longest) for n in lengths],
              "leaks": [t.changed(longest, j, rand, 4.0) for j in shifts],  # no earlier output
              "unequal": [(rand(*t.lead(B), nq, t.d_k), rand(*t.lead(B), nk, t.d_k),   # moves
                           rand(*t.lead(B), nk, t.d_k)) for nq, nk in UNEQUAL]
              if "unequal" in t.probe_items else []}
    inputs = [inp for batch in probes.values() for inp in batch]
    got = t.forward(inputs, [0, 0, 1] + [0] * (len(inputs) - 3))
    outs, at = {}, 0
    for name, batch in probes.items():  # each probe's own outputs and errors
        outs[name] = got["ys"][at:at + len(batch)], got["errors"][at:at + len(batch)]
        at += len(batch)
    report.set("deterministic", *_determinism(*outs["same"], t.info.get("dropouts", 0)))
    report.set("input_kept", *_kept(got["changed"]))
    y = outs["same"][0][0]
    y = y.double() if y is not None else None
    (moved,), (error,) = outs["other"]
    moved_by = rel_err(moved[1:], y[1:]) if y is not None and moved is not None and \
        moved.shape == y.shape else None
    report.set("batch", *(("N/A", "it takes one sequence, q, k, v [n, d], no batch")
                          if not t.lead(B) else
                          ("SKIP", f"not judged: {error or 'the output changes shape'}")
                          if moved_by is None else
                          ("FAIL", f"changing sample 0 moves the other samples' outputs by up "
                                   f"to {moved_by:.2g} (relative): samples attend to each other "
                                   f"(batch mixing)") if moved_by > LEAK else
                          ("PASS", "changing sample 0 leaves the other samples' outputs bit for "
                                   "bit")))
    if y is None or list(y.shape) != t.out_shape(B, T):
        for item in t.probe_items:
            report.set(item, "SKIP", f"not judged: the output's shape is not {t.shape_words}")
        return
    _large_scores(t, report, ref, x, sigmas, outs["large"][0], y)
    if ref is None and not t.blind:
        for item in ("lengths", "backward", "unequal"):
            report.set(item, "SKIP", "not judged: no variant of ours reproduces the forward pass")
        return
    _judge_lengths(t, report, ref, cap, lengths, probes["lengths"], outs, shifts)
    if probes["unequal"]:
        report.set("unequal", *_unequal(t, ref, *outs["unequal"], probes["unequal"]))
    _backward(t, report, ref, x, y, rand, B, T)


def _large_scores(t, report, ref, x, sigmas, outs, y) -> None:
    """The last position changed at each large scale: earlier outputs must not move."""
    if report.items.get("causal") and report.items["causal"].status == "FAIL":
        report.set("large_scores", "SKIP", "not judged: the future already leaks at ordinary "
                                           "scales (see Causality)")
    elif t.dtype == torch.float16:
        report.set("large_scores", "N/A", "float16 scores cannot exceed 65,504, where -1e4 is "
                                          "the usual mask value")
    else:
        levels = []
        for target, s, a, b in zip(SCORE_TARGETS, sigmas, outs[::2], outs[1::2]):
            ok = a is not None and b is not None
            leak = worst(b, a, t.axis)[:-1].max().item() if ok and a.size(t.axis) > 1 else 0.0
            levels.append((t.scale_words(ref if ok else None, x, target, s),
                           leak if leak > LEAK else None, 0 if a is None or a.shape != y.shape
                           else int((~torch.isfinite(a) & torch.isfinite(y)).sum())))
        report.set("large_scores", *_large_words(levels, t.large_words))


def _judge_lengths(t, report, ref, cap, lengths, longs, outs, moved) -> None:
    """Lengths past one tile against the reference (without one, each shorter output must be
    the start of the longest), and causality at the longest length."""
    results = []
    length_outs, length_errors = outs["lengths"]
    for n, inp, out, error in zip(lengths, longs, length_outs, length_errors):
        if error is not None or out is None:
            results.append((n, error or "no output", -1, 0.0))
        elif ref is not None:
            right = ref.output(*inp)
            skip = ref.pattern == "mask_no_diagonal"
            if skip:
                out, right = out[..., 1:, :], right[..., 1:, :]
            p, most = _first_bad(out, right, t.tol, t.axis) if out.shape == right.shape else \
                (0, math.inf)
            results.append((n, None, p + (p >= 0 and skip), most))
        else:
            results.append((n, None, -1, 0.0))
    cap_words = f" (the layer's context is {cap})" if cap and cap < LONGEST else ""
    blind_ok = all(report.items[k].status == "PASS" for k in ("causal", "deterministic")
                   if k in report.items)
    if ref is None and not blind_ok:
        report.set("lengths", "SKIP", "not judged: no reference reproduces the layer, and its "
                                      "outputs are not causal or not repeatable")
    elif ref is None:  # no reference: each shorter output must be the start of the longest
        okay = [(n, o.double()) for n, o, e in zip(lengths, length_outs, length_errors)
                if e is None and o is not None]
        results = [r for r in results if r[1] is not None] + [
            (n, None, *_first_bad(o, okay[-1][1][:, :n], t.tol, 1)) for n, o in okay[:-1]] + [
            (n, None, -1, 0.0) for n, _ in okay[-1:]]
        results.sort(key=lambda r: r[0])
        cap_words += "; no reference reproduces the layer, so judged by consistency: each " \
                     "shorter output is the start of the longest"
    long_leak = _long_leak(length_outs[-1] if lengths else None, outs["leaks"][0], moved, t.T)
    if long_leak and report.items.get("causal") and report.items["causal"].status == "PASS":
        report.set("causal", "FAIL", long_leak)
        report.diagnosis.append(f"a causal leak that only long sequences show: {long_leak}")
    if "lengths" not in report.items:
        status, detail = _lengths_words(results, t.tol, cap_words)
        report.set("lengths", status, detail + ("; the future leaks (see Causality)"
                                                if long_leak and status == "FAIL" else ""))


def _backward(t, report, ref, x, y, rand, B: int, T: int) -> None:
    """The gradients against autograd on the reference, float64 and in the layer's dtype."""
    if ref is None:
        report.set("backward", "SKIP", "not judged: no reference reproduces the forward pass")
        return
    if y.isnan().any():
        report.set("backward", "SKIP", "not judged: the output has NaN (a query that sees no "
                                       "key), which reaches every gradient")
        return
    g = rand(*t.out_shape(B, T))
    back = t.forward([x], [0], grad_outputs=[g])
    if back["errors"][0] is not None:
        report.set("backward", "FAIL", f"backward raises: {back['errors'][0]}")
        return
    grads, pairs = back["grads"][0], []
    for n, (r64, rlow) in (ref.grads(x, g, t.dtype) or {}).items():
        # an input's gradient is reported under its name, a parameter's as param:NAME (none
        # for one that does not require grad)
        name, mine = ("d" + n, grads.get(n)) if n in t.inputs else \
            (n + ".grad", grads.get("param:" + n, "frozen"))
        mine = mine.double() if isinstance(mine, torch.Tensor) else mine
        pairs.append((name, mine, r64, rlow, GRAD_FLOOR.get(t.dtype, 2e-3)))
    report.set("backward", *_grad_words(pairs))


def _unequal(t, ref: Reference, outs, errors, inputs) -> tuple[str, str]:
    """n_q != n_k with a bottom-right aligned mask (query i sees keys 0 .. n_k - n_q + i)."""
    if ref.pattern != "causal":
        return "SKIP", "not judged: the matched variant's mask is not the causal one"
    for (nq, nk), (q, k, v), out, error in zip(UNEQUAL, inputs, outs, errors):
        if error is not None or out is None:
            if not t.info["takes_mask"]:
                return "N/A", (f"it takes no mask and builds a square one itself (n_q = {nq}, "
                               f"n_k = {nk} raises: {error})")
            return "FAIL", f"n_q = {nq}, n_k = {nk} with a [{nq}, {nk}] mask raises: {error}"
        right = ref.attend(q, k, v, causal_pattern(nq, nk))
        if out.shape != right.shape:
            return "FAIL", f"n_q = {nq}, n_k = {nk} gives {list(out.shape)}, not " \
                           f"{list(right.shape)}"
        if rel_err(out, right) <= t.tol:
            continue
        top_left = ref.attend(q, k, v, torch.ones(nq, nk, dtype=torch.bool).tril())
        if rel_err(out, top_left) <= t.tol:
            return "FAIL", (f"n_q = {nq}, n_k = {nk}: the mask is aligned top-left (query i "
                            f"sees keys 0..i, torch's is_causal convention), not bottom-right: "
                            f"with a KV cache the new queries miss the latest keys")
        return "FAIL", (f"n_q = {nq}, n_k = {nk}: differs from the equation under the given "
                        f"[{nq}, {nk}] mask by {rel_err(out, right):.2g} relative")
    return "PASS", ", ".join(f"n_q = {nq}, n_k = {nk}" for nq, nk in UNEQUAL) + \
        " (bottom-right aligned mask)"
