"""The cheat sheet's checklist, run on someone's attention: probes, comparisons, verdict.

Black-box checks need nothing but the layer's outputs on seeded random inputs: causality (change
one position, see which earlier outputs move), the output's shape for several head counts, and
whether identical tokens give identical outputs at every position (they do exactly when each row
of attention weights sums to 1). White-box checks map the layer's weights onto our reference
(layouts.py) and find which of our variants (variants.py) reproduces its output (diagnosis.py);
when none does, the layer's own intermediate results (the inputs and outputs of its Linears)
locate the first step that differs. Every comparison (compare.py) is in float64 against the
layer's output, with a tolerance set by the layer's dtype.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
import re
import threading
from pathlib import Path
from typing import Optional

import torch

from model.attention import causal_pattern
from model.config import MaskMode
from check_attention import costs, layouts, modern
from check_attention import probes as deeper
from check_attention.compare import (INPUT_SCALES, PROBES, QKV_SCALES, TOLERANCE, Leaks,
                                             golden, leak_matrix, rel_err, same)
from check_attention.diagnosis import (closest_words, first_difference, match, report_match,
                                       unlisted)
from check_attention.options import MASKS, Options
from check_attention.report import Report
from check_attention.sandbox.runner import D_MODEL, N_HEAD
from check_attention.sandbox.host import CheckError, Sandbox, SandboxError, ask, project_snapshot
from check_attention.variants import (all_variants, attend_heads, divisor_words,
                                              mistake_words, num, split_words, switch_of,
                                              variant_attend_kwargs)

# What a layer may call its sliding window (keys, its own included), read from its attributes.
WINDOW = {"window", "window_size", "sliding_window", "attention_window", "attn_window"}


def _rebuild(child, n_head: int, x) -> dict:
    """{'shape': [...]} of the layer built with n_head heads, or {'error': why it could not be}."""
    try:
        return child.ask("rebuild", n_head=n_head, x=x)
    except SandboxError as exc:
        raise CheckError(str(exc)) from None


def head_choices(D: int, h: int) -> list[int]:
    return sorted({c for c in (1, 2, h, 2 * h, 8) if c <= D and D % c == 0})


# ----------------------------------------------------------------------------- entry point


_one_at_a_time = threading.Lock()


@contextlib.contextmanager
def _callers_state_kept():
    """One check at a time in a process, and the process's torch and Python random states and
    torch's thread count as they were before it: the references are computed here, in the
    caller's process (a course's test, say), with torch's process-wide state, and a sandbox
    host serves one child at a time."""
    with _one_at_a_time, torch.random.fork_rng(devices=[]):
        state, threads = random.getstate(), torch.get_num_threads()
        torch.set_num_threads(1)  # tiny tensors: more threads only wait on each other
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            random.setstate(state)


def check(file: str, name: str, opts: Options, sandbox: Optional[Sandbox] = None,
          fingerprint: Optional[str] = None) -> Report:
    """Run the checklist on FILE:NAME. Raises CheckError when the file or object is unusable.
    fingerprint: the object check() was given (runner.fingerprint), which NAME must still be."""
    with _callers_state_kept():
        return _check(file, name, opts, sandbox, fingerprint)


def _check(file: str, name: str, opts: Options, sandbox: Optional[Sandbox],
           fingerprint: Optional[str]) -> Report:
    own = sandbox is None
    if own:
        sandbox = Sandbox(gpu=opts.device != "cpu")
    try:
        if opts.device != "cpu" and not sandbox.gpu:
            raise CheckError(f"device={opts.device} needs a sandbox started with gpu=True")
        try:
            confinement = sandbox.confinement
        except SandboxError as exc:
            raise CheckError(str(exc)) from None
        before = None if sandbox.writes_confined else project_snapshot(sandbox.project_root)
        with sandbox.child(opts.timeout) as child:
            info = ask(child, "load", file=os.path.abspath(file), name=name, d_model=opts.d_model,
                       n_head=opts.n_head, block_size=max(opts.seq_len, deeper.LONGEST),
                       dtype=opts.dtype, device=opts.device, seed=opts.seed,
                       fingerprint=fingerprint)
            info["file"] = os.path.abspath(file)
            report = Report(f"{file}:{name}")
            if info["kind"] == "function":
                _check_function(child, info, opts, report)
            else:
                _check_module(child, info, opts, report)
            _quote_costs(report, costs.load())
        if before is not None:
            after = project_snapshot(sandbox.project_root)
            changed = sorted(set(before.items()) ^ set(after.items()))
            if changed:
                raise CheckError(f"the file's code changed the project ({changed[0][0]}); "
                                 f"its results are not trusted")
        report.header["sandbox"] = "a child process; " + confinement + (
            "" if before is None else "; no Landlock here: the project's files were checked "
                                      "unchanged after")
        return report
    finally:
        if own:
            sandbox.close()


# ----------------------------------------------------------------------------- a module


def _infer(info: dict, names: set) -> Optional[int]:
    for key, value in info["attrs"].items():
        if key in names and isinstance(value, int) and value > 0:
            return value
    return None


def _check_module(child, info: dict, opts: Options, report: Report) -> None:
    consumed = set(info["consumed"])
    dtype = getattr(torch, info["dtype"])
    tol = TOLERANCE.get(dtype, 5e-2)
    D = opts.d_model if "d_model" in consumed else (_infer(info, D_MODEL) or _width(info, opts))
    h = opts.n_head if "n_head" in consumed else _infer(info, N_HEAD)
    B, T = opts.batch, opts.seq_len
    gen = torch.Generator().manual_seed(opts.seed)

    def rand(*shape, scale=1.0):  # seeded, and rounded to the layer's dtype once
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()

    xs = [rand(B, T, D, scale=s) for s in INPUT_SCALES]
    main = ask(child, "forward", xs=xs + [xs[0]], seeds=[0, 0, 0, 1], capture=[True] * 3 + [False])
    if main["errors"][0]:
        raise CheckError(f"{info['how']} failed on x [{B}, {T}, {D}]: {main['errors'][0]}"
                         + _view_hint(main["errors"][0], info["file"], D, h or opts.n_head))
    ys = [y.double() if y is not None else None for y in main["ys"]]
    captures = main["captures"]
    report.header["layer"] = (f"{info['how']}, {info['dtype']} on {info['device']}, eval mode"
                              + ("" if "d_model" in consumed else
                                 f"; d_model = {D} read from the layer"))
    report.header["probes"] = (f"x [{B}, {T}, {D}] ~ N(0, 1) times "
                               f"{', '.join(f'{s:g}' for s in INPUT_SCALES)}, seed {opts.seed}; "
                               f"tolerance {tol:.0e} relative ({info['dtype']})")

    # -- black box: shape, determinism, causality, rows summing to 1
    y0 = ys[0]
    shape_ok = list(y0.shape) == [B, T, D]
    if not shape_ok:
        report.set("shape", "FAIL", f"x [{B}, {T}, {D}] gives {list(y0.shape)}, "
                   f"not [{B}, {T}, {D}]")
    elif "n_head" in consumed:
        shapes, broken = {}, []
        for hh in head_choices(D, opts.n_head):
            got = _rebuild(child, hh, xs[0]) if hh != opts.n_head else {"shape": list(y0.shape)}
            shapes[hh] = got.get("shape")
            if "error" in got:
                broken.append(f"n_head={hh}: {got['error']}")
        bad = {hh: s for hh, s in shapes.items() if s is not None and s != [B, T, D]}
        if bad:
            report.set("shape", "FAIL", "; ".join(f"n_head={hh} gives {s}"
                                                  for hh, s in bad.items()) + f", not [{B}, {T}, {D}]")
        elif len([s for s in shapes.values() if s]) < 2:
            report.set("shape", "SKIP", f"could not build it with another head count "
                       f"({broken[0]}" + (f"; {len(broken) - 1} more" if len(broken) > 1 else "")
                       + ")")
        else:
            report.set("shape", "PASS", f"[{B}, {T}, {D}] for n_head = "
                       + ", ".join(str(hh) for hh, s in shapes.items() if s))
    else:
        report.set("shape", "SKIP", f"[{B}, {T}, {D}] here, but the layer was not built with "
                   f"n_head, so other head counts could not be tried")

    nan_positions = [t for t in range(y0.size(1)) if y0[:, t].isnan().any()] \
        if y0.dim() >= 2 else []
    if nan_positions:
        report.diagnosis.append(f"the output is NaN at position{'s' * (len(nan_positions) > 1)} "
                                f"{', '.join(map(str, nan_positions))} (a query that sees no key "
                                f"at all takes the softmax of only -inf)")
    if ys[3] is not None and not same(ys[3], y0):
        report.diagnosis.append("the output changes from one call to the next in eval mode "
                                "(dropout that ignores self.training?): comparisons are unreliable")
    swaps = []
    for j in range(T):
        x = xs[0].clone()
        x[:, j] = rand(B, D, scale=4.0)
        swaps.append(x)
    token = rand(B, 1, D).expand(B, T, D).contiguous()
    probe = ask(child, "forward", xs=swaps + [token], seeds=[0] * (T + 1),
                capture=[False] * (T + 1))
    leaks = None
    if y0.dim() >= 2 and y0.size(1) == T and all(y is not None for y in probe["ys"][:T]):
        leaks = leak_matrix(y0, probe["ys"][:T], axis=1)
        if leaks.pairs():
            report.set("causal", "FAIL", leaks.words())
        else:
            report.set("causal", "PASS", f"each of the {T} positions changed in turn; no earlier "
                       f"output moved")
    else:
        report.set("causal", "SKIP", "the output is not [batch, positions, ...]")
    yt = probe["ys"][T]
    rows_sum_to_one = yt is not None and yt.dim() >= 2 and yt.size(1) == T and \
        rel_err(yt, yt[:, :1].expand_as(yt)) <= tol

    # -- white box: map the weights, find the variant
    heads = [h] if h else [c for c in range(1, D + 1) if D % c == 0]
    maps = layouts.mappings(info, captures[0], D, heads) if shape_ok else []
    why = "no layout fits"
    if maps:
        if not h and not any(m.layout == "per_head" for m in maps):
            report.header["heads"] = f"n_head not known: tried {', '.join(map(str, heads))}"
        found = match(maps, xs, ys[:3], tol, window=_infer(info, WINDOW))
        if found:
            report_match(report, found, D, tol, info, captures[0])
            return deeper.check_module(child, info, opts, report, found, D, captures[0])
        why = "no variant of ours reproduces it"
    # rotary positions, grouped key/value heads, QK-norm (modern.py)
    modern_found = modern.judge(report, info, captures[0], xs, ys[:3], tol, D, h,
                                classic=bool(maps), llama_weights=opts.llama_weights) \
        if shape_ok else None
    if modern_found is not None:
        if not modern_found:
            _black_box_items(report, leaks, rows_sum_to_one, shape_ok,
                             "no variant of ours reproduces it")
        return deeper.check_module(child, info, opts, report, modern_found or None, D,
                                   captures[0])
    if maps:
        difference = first_difference(maps, captures[:3], xs, ys[:3], tol, D)
        if difference:
            m, words, verdicts, switches = difference
            report.header["layout"] = f"{m.words}; {m.h} heads, d_k = {D // m.h}"
            for item, (ok, detail) in verdicts.items():
                report.set(item, "PASS" if ok else "FAIL", detail)
            report.set("equation", "FAIL", f"first difference: {words}")
            report.diagnosis.append(f"following the layer's own q, k, v step by step, the "
                                    f"first that differs from ours: {words}")
            report.named(*switches)
        else:
            report.header["layout"] = f"{maps[0].words}? (no variant of ours reproduces it)"
            if maps[0].prior == 0:  # the names agree with this reading: the layer differs
                report.set("equation", "FAIL", f"no variant of ours reproduces it under the "
                           f"layout its names give, and its steps could not be followed")
    else:
        report.header["layout"] = f"none recognised ({layouts.describe_linears(info)})"
    _black_box_items(report, leaks, rows_sum_to_one, shape_ok, why)
    deeper.check_module(child, info, opts, report, None, D, captures[0])


def _quote_costs(report: Report, table: dict) -> None:
    """A diagnosis line for each mistake the report names whose switch the studies measured
    (costs.py; nothing when docs/pitfall_costs.json is not there)."""
    for switch in report.mistakes:
        words = costs.words(switch, table)
        if words:
            report.diagnosis.append(words)


# `.view(B, n_head, T, d_k)`: heads before positions, the view's second argument a head count
HEADS_FIRST = re.compile(r"\.view\(\s*[^,()]+,\s*[\w.]*(?:head|\bh\b)[\w.]*\s*,")


def _view_hint(error: str, file: str, D: int, h: int) -> str:
    """The fix, when the layer's forward raised torch's view error on a line that splits the
    heads before the positions (nanoGPT's line without its transpose): after `.split` of the
    fused projection q is a strided slice that .view cannot cut that way, and where it can (a
    contiguous q, or .reshape) the result mixes positions and heads."""
    where = re.search(r"\(([^()]+\.py), line (\d+)\)$", error)
    if "view size is not compatible" not in error or not where:
        return ""
    try:
        lines = Path(file).read_text(encoding="utf-8", errors="replace").splitlines()
        line = lines[int(where.group(2)) - 1]
    except (OSError, IndexError, ValueError):
        return ""
    if not HEADS_FIRST.search(line):
        return ""
    d_k = D // h if h and D % h == 0 else "d_k"
    hint = (f"; hint: line {where.group(2)} puts the heads before the positions "
            f"(`{line.strip()[:120]}`): a slice of the fused projection (after .split) cannot "
            f"be viewed that way, and where .view or .reshape runs, {split_words(h, d_k)} "
            f"(the mistake attention=split_heads_no_transpose reproduces)")
    cost = costs.words("split_heads_no_transpose", costs.load())
    return hint + (f"; {cost}" if cost else "")


def _width(info: dict, opts: Options) -> int:
    """The width the layer's projections read: the most common input size of its Linears."""
    sizes = [p.size(1) for n, p in info["params"].items() if p.dim() == 2 and n.endswith("weight")]
    return max(set(sizes), key=sizes.count) if sizes else opts.d_model


def _black_box_items(report: Report, leaks: Optional[Leaks], rows_sum_to_one: bool,
                     shape_ok: bool, why: str) -> None:
    """Judge, from the outputs alone, the items nothing else judged; say which could not be."""
    skip = ("SKIP", f"not judged: {why}")
    verdicts = {"scale": skip, "w_o": skip, "before_softmax": skip, "mask_value": skip,
                "equation": skip if shape_ok else ("FAIL", "the output's shape is not the input's")}
    leak_pairs = leaks.pairs() if leaks is not None else None
    if leak_pairs == [] and rows_sum_to_one:
        verdicts["before_softmax"] = ("PASS", "from the outputs alone: identical tokens give "
                                      "identical outputs at every position, so each row of "
                                      "weights sums to 1")
        verdicts["mask_value"] = ("PASS", "from the outputs alone: the future gets no weight")
    elif leak_pairs and not rows_sum_to_one:
        verdicts["before_softmax"] = ("FAIL", "from the outputs alone: identical tokens give "
                                      "different outputs by position (rows of weights do not sum "
                                      "to 1, as when future weights are zeroed after softmax), "
                                      "and the future leaks")
    elif leak_pairs and len(leak_pairs) == len(leaks.worst) * (len(leaks.worst) - 1) // 2:
        verdicts["mask_value"] = ("FAIL", "from the outputs alone: every future position changes "
                                  "every earlier output, as with a mask value of 0 (or no mask)")
    for item, (status, detail) in verdicts.items():
        if item not in report.items:
            report.set(item, status, detail)


# ----------------------------------------------------------------------------- a function


def _check_function(child, info: dict, opts: Options, report: Report) -> None:
    h, D, B, T = opts.n_head, opts.d_model, opts.batch, opts.seq_len
    if D % h:
        raise CheckError(f"d_model ({D}) must be divisible by n_head ({h})")
    d_k = D // h
    dtype = getattr(torch, opts.dtype or "float32")
    tol = TOLERANCE.get(dtype, 5e-2)
    gen = torch.Generator().manual_seed(opts.seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).double()

    keep = causal_pattern(T, T)
    masks = {"keep": keep, "drop": ~keep,
             "add": torch.zeros(T, T, dtype=torch.float64).masked_fill(~keep, float("-inf"))}
    if not info["takes_mask"]:
        conventions = ["keep"]  # f(q, k, v) must mask the future itself
    else:
        conventions = list(MASKS) if opts.mask == "auto" else [opts.mask]
    # [B, h, n, d_k] first; a function that takes none of those, on the sheet's own 2-D shapes:
    # Q [n, d_k], K [n, d_k], V [n, d_v]
    first_error = None
    for lead in ((B, h), ()):
        probes = [tuple(rand(*lead, T, d_k, scale=s) for _ in range(3)) for s in QKV_SCALES]
        calls = [(*p, masks[c]) for c in conventions for p in probes]
        answer = ask(child, "call", calls=calls)
        outs = {c: answer["outs"][i * 3:(i + 1) * 3] for i, c in enumerate(conventions)}
        errors = {c: next((e for e in answer["errors"][i * 3:(i + 1) * 3] if e), None)
                  for i, c in enumerate(conventions)}
        usable = [c for c in conventions if errors[c] is None]
        if usable:
            break
        first_error = first_error or errors[conventions[0]]
    else:
        raise CheckError(f"calling {info['how']} on q, k, v [{B}, {h}, {T}, {d_k}] (and on "
                         f"[{T}, {d_k}]) with a [{T}, {T}] mask failed: {first_error}")
    dims = ", ".join(map(str, (*lead, T, d_k)))
    report.kind = "function"
    report.header["layer"] = f"the function {info['how']}, {str(dtype).replace('torch.', '')}" \
        + ("" if lead else "; it takes the sheet's 2-D shapes, Q [n, d_k], K, V [n, d], not "
                           "[batch, heads, n, d_k]")
    report.header["probes"] = (f"q, k, v [{dims}] ~ N(0, 1) times "
                               f"{', '.join(f'{s:g}' for s in QKV_SCALES)}, seed {opts.seed}; "
                               f"tolerance {tol:.0e} relative")
    expected = [*lead, T, d_k]
    q, k, v = (torch.stack([p[i] for p in probes]) for i in range(3))
    variants = [var for var in all_variants() if var.attn.out_proj
                and not var.attn.split_heads_no_transpose]  # its heads come split
    results = {}
    for c in usable:
        y = torch.stack([o.double() for o in outs[c]]) if all(
            list(o.shape) == expected for o in outs[c]) else None
        best = None
        for var in variants if y is not None else []:
            ref = attend_heads(q, k, v, var.pattern, **variant_attend_kwargs(var, d_k, h))
            err = rel_err(y, ref, skip_first=var.pattern == "mask_no_diagonal",
                          probes=PROBES)
            key = (err > tol, len(var.mistakes), err)
            if best is None or key < best[0]:
                best = (key, var, err)
        results[c] = (y, best)
    matched = [c for c in usable if results[c][1] and results[c][1][2] <= tol]
    chosen = min(matched or usable, key=lambda c: (results[c][1][0] if results[c][1] else
                                                   (True, 9, math.inf)))
    y, best = results[chosen]
    if not info["takes_mask"]:
        report.header["mask"] = "none given: the function takes q, k, v only, so it must mask " \
                                "the future itself"
    elif opts.mask == "auto":
        if len({tuple(torch.cat([o.double().flatten() for o in outs[c]]).tolist())
                for c in usable}) == 1 and len(usable) > 1:
            report.header["mask"] = "the output is the same whatever mask it is given"
        else:
            report.header["mask"] = f"{MASKS[chosen]} (found by trying all three conventions)"
    else:
        report.header["mask"] = f"{MASKS[chosen]} (mask={chosen})"

    # shape for several head counts, with d_v != d_k
    shapes, wrong = [], []
    d_v = next(d for d in (d_k // 2, d_k + 1, d_k + 3) if d > 0 and d not in (d_k, T))
    for hh in head_choices(D, h) if lead else [None]:
        lead_h = (B, hh) if lead else ()
        call = (rand(*lead_h, T, d_k), rand(*lead_h, T, d_k), rand(*lead_h, T, d_v),
                masks[chosen])
        got = ask(child, "call", calls=[call])
        out = got["outs"][0]
        shapes.append(hh)
        if out is None or list(out.shape) != [*lead_h, T, d_v]:
            wrong.append((f"{hh} heads, d_v = {d_v}: " if lead else f"d_v = {d_v}: ")
                         + (got["errors"][0] if out is None else f"{list(out.shape)}"))
    if wrong:
        report.set("shape", "FAIL", (f"{wrong[0]}, not [{B}, heads, {T}, {d_v}]" if lead else
                                     f"{wrong[0]}, not [{T}, {d_v}]")
                   + (f" (and {len(wrong) - 1} more head counts)" if len(wrong) > 1 else ""))
    elif lead:
        report.set("shape", "PASS", f"[{B}, heads, {T}, d_v] for {', '.join(map(str, shapes))} "
                   f"heads and d_v != d_k")
    else:
        report.set("shape", "PASS", f"[{T}, d_v] for Q [{T}, {d_k}], V [{T}, {d_v}]: d_v != d_k")
    # causality: change query, key and value j (a later query can leak too: a softmax over the
    # queries); the outputs of the queries before j must not move
    base_q, base_k, base_v = probes[1]
    calls = []
    for j in range(T):
        qq, kk, vv = base_q.clone(), base_k.clone(), base_v.clone()
        for t in (qq, kk, vv):
            t[..., j, :] = rand(*lead, d_k, scale=2.0)
        calls.append((qq, kk, vv, masks[chosen]))
    got = ask(child, "call", calls=calls + [probes[1] + (masks[chosen],)])
    if all(o is not None and o.dim() >= 2 and o.size(-2) == T for o in got["outs"]):
        leaks = leak_matrix(got["outs"][T], got["outs"][:T], axis=-2)
        report.set("causal", "FAIL" if leaks.pairs() else "PASS", leaks.words() or
                   f"each of the {T} queries, keys and values changed in turn; no earlier "
                   f"output moved")
    else:
        report.set("causal", "SKIP", "the output is not [..., positions, d_v]")

    report.set("w_o", "N/A", "a scaled dot-product function has no W_O; check the layer that "
                             "calls it")
    if best is not None and best[2] <= tol:
        var, err = best[1], best[2]
        words = mistake_words(var, d_k, h)
        fails = {i: w for i, w in words if i}
        passes = {"scale": f"divided by sqrt(d_k) = {num(math.sqrt(d_k))}, d_k = q.size(-1)",
                  "before_softmax": "each row of weights sums to 1 over the visible keys"
                  if not var.attn.softmax_over_queries else
                  "the mask is added to the scores before the softmax",
                  "mask_value": "future keys get weight 0"}
        for item in ("scale", "before_softmax", "mask_value"):
            report.set(item, "FAIL" if item in fails else "PASS", fails.get(item, passes[item]))
        if not var.mistakes:
            report.set("equation", "PASS", f"our scaled_dot_product_attention: max relative "
                                           f"difference {err:.1e}")
        else:
            report.set("equation", "FAIL", "; ".join(w for _, w in words))
            report.diagnosis.append(f"our scaled_dot_product_attention reproduces it as "
                                    f"attention={var.name} ({unlisted(words)}max relative "
                                    f"difference {err:.1e})")
            report.named(*filter(None, map(switch_of, var.mistakes)))
    else:
        _function_fits(report, y, q, k, v, h, d_k, tol, best)
    if chosen == "add" and report.items["mask_value"].status == "PASS":
        report.set("mask_value", "N/A", "an additive mask's value is the caller's choice; this "
                                        "check passed -inf")
    deeper.check_function(child, info, opts, report, chosen, best, batched=bool(lead))


def _function_fits(report, y, q, k, v, h, d_k, tol, best) -> None:
    if y is None:
        for item in ("scale", "before_softmax", "mask_value"):
            report.set(item, "SKIP", "not judged: the output's shape is wrong")
        report.set("equation", "FAIL", "the output's shape is not [..., n, d_v]")
        return
    causal = dict(mask_mode=MaskMode.add, mask_value=float("-inf"))
    log_s, e = golden(lambda ls: rel_err(y, attend_heads(q, k, v, "causal", scale=math.exp(ls),
                                                         **causal), probes=PROBES),
                      math.log(1e-3), math.log(10))
    if e <= tol:
        words = divisor_words(math.exp(log_s), d_k, h, tol)
        report.set("scale", "FAIL", words)
        report.set("before_softmax", "PASS", "each row of weights sums to 1 over the visible keys")
        report.set("mask_value", "PASS", "future keys get weight 0")
        report.set("equation", "FAIL", words)
        report.diagnosis.append(f"no variant of ours reproduces it; a fitted divisor does: {words}")
        return
    for mode in (MaskMode.add, MaskMode.fill):
        value, e = golden(lambda m, mode=mode: rel_err(y, attend_heads(
            q, k, v, "causal", scale=1 / math.sqrt(d_k), mask_mode=mode, mask_value=m),
            probes=PROBES), -60, 0)
        if e <= tol:
            words = (f"the mask value is {value:.3g}: too small to hide the future "
                     f"(exp({value:.3g}) = {math.exp(value):.2g} of a visible key's weight)")
            report.set("scale", "PASS", f"divided by sqrt(d_k) = {num(math.sqrt(d_k))}")
            report.set("before_softmax", "PASS", "")
            report.set("mask_value", "FAIL", words)
            report.set("equation", "FAIL", words)
            report.diagnosis.append(f"no variant of ours reproduces it; a fitted mask value "
                                    f"does: {words}")
            return
    for item in ("scale", "before_softmax", "mask_value"):
        report.set(item, "SKIP", "not judged: no variant of ours reproduces it")
    closest = f" ({closest_words(best[1], best[2])})" if best else ""
    report.set("equation", "FAIL", f"no variant of ours reproduces its output{closest}")
