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
import threading
from typing import Optional

import torch

from model.config import MaskMode
from check_attention import costs, layouts, modern
from check_attention import probes as deeper
from check_attention.compare import PROBES, Leaks, golden, leak_matrix, rel_err
from check_attention.diagnosis import (closest_words, first_difference, match,
                                       report_equation, report_match)
from check_attention.options import Options
from check_attention.report import Report
from check_attention.sandbox.host import CheckError, Sandbox, SandboxError, ask, project_snapshot
from check_attention.target import FunctionTarget, ModuleTarget, Target, infer
from check_attention.target import view_hint as _view_hint  # noqa: F401 (its tests' name)
from check_attention.variants import attend_heads, divisor_words, mistake_words, num

# What a layer may call its sliding window (keys, its own included), read from its attributes.
WINDOW = {"window", "window_size", "sliding_window", "attention_window", "attn_window"}

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
            _checklist((FunctionTarget if info["kind"] == "function" else ModuleTarget)(
                child, info, opts), report)
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


# ----------------------------------------------------------------------------- the checklist


def _checklist(t: Target, report: Report) -> None:
    """The checklist, the same for a module and a function: call it on seeded inputs, check the
    output's shape, then causality, then find which of our variants reproduces it (a module's
    weights are mapped onto ours first), then the deeper probes (probes.py)."""
    rand = t.randn()
    t.first_call(rand, report)
    shape_ok = t.check_shape(rand, report)
    leaks, rows_sum_to_one = _causality(t, rand, report)
    judge = _judge_module if t.kind == "module" else _judge_function
    deeper.run(t, report, judge(t, report, leaks, rows_sum_to_one, shape_ok))


def _causality(t: Target, rand, report: Report) -> tuple:
    """Change each position j of the first call's input in turn (a query, key and value at once
    for a function: a later query can leak too, through a softmax over the queries); no output
    before j may move. A module's output for that input is known from its first call, a
    function's is asked again. A module also gets one token repeated at every position: its
    outputs are identical at every position exactly when each row of weights sums to 1, which
    judges the mask from the outputs alone where no variant reproduces the layer.
    Returns (the leaks or None, whether the rows sum to 1)."""
    B, T, base, y0 = t.opts.batch, t.T, t.base, t.base_out
    swaps = [t.changed(base, j, rand, t.causal_scale) for j in range(T)]
    # the token: x [B, 1, D] repeated to [B, T, D]
    token = [tuple(a.expand(*a.shape[:-2], T, a.size(-1)).contiguous()
                   for a in t.draw(rand, B, 1))] if t.rows_probe else []
    outs = t.call(swaps + token + ([base] if y0 is None else []))
    y0 = outs[-1] if y0 is None else y0
    leaks = None
    if all(o is not None and o.dim() >= 2 and o.size(t.axis) == T for o in outs[:T] + [y0]):
        leaks = leak_matrix(y0, outs[:T], axis=t.axis)
        report.set("causal", "FAIL" if leaks.pairs() else "PASS", leaks.words() or
                   f"each of the {T} {t.changed_words} changed in turn; no earlier output moved")
    else:
        report.set("causal", "SKIP", f"the output is not {t.positions_words}")
    yt = outs[T] if token else None
    rows_sum_to_one = yt is not None and yt.dim() >= 2 and yt.size(t.axis) == T and \
        rel_err(yt, yt.narrow(t.axis, 0, 1).expand_as(yt)) <= t.tol
    return leaks, rows_sum_to_one


def _judge_module(t: Target, report: Report, leaks: Optional[Leaks], rows_sum_to_one: bool,
                  shape_ok: bool) -> Optional[deeper.Reference]:
    """Map the module's weights onto ours and find the variant that reproduces it (the classic
    layouts, then modern.py's rotary, grouped and QK-norm readings); where none does, follow
    its own q, k, v to the first step that differs, and judge the rest from the outputs alone.
    Returns the probes' Reference for what reproduced it, or None."""
    D, h, tol, info, xs, ys, captures = t.D, t.h, t.tol, t.info, t.xs, t.ys, t.captures
    heads = [h] if h else [c for c in range(1, D + 1) if D % c == 0]
    maps = layouts.mappings(info, captures[0], D, heads) if shape_ok else []
    why = "no layout fits"
    if maps:
        if not h and not any(m.layout == "per_head" for m in maps):
            report.header["heads"] = f"n_head not known: tried {', '.join(map(str, heads))}"
        found = match(maps, xs, ys[:3], tol, window=infer(info, WINDOW))
        if found:
            report_match(report, found, D, tol, info, captures[0])
            return deeper.reference(found, info, captures[0], D)
        why = "no variant of ours reproduces it"
    # rotary positions, grouped key/value heads, QK-norm (modern.py)
    modern_found = modern.judge(report, info, captures[0], xs, ys[:3], tol, D, h,
                                classic=bool(maps), llama_weights=t.opts.llama_weights) \
        if shape_ok else None
    if modern_found is not None:
        if not modern_found:
            _black_box_items(report, leaks, rows_sum_to_one, shape_ok,
                             "no variant of ours reproduces it")
        return deeper.reference(modern_found or None, info, captures[0], D)
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
    return None


def _judge_function(t: Target, report: Report, *black_box) -> Optional[deeper.Reference]:
    """Judge the scale, the mask and the equation from the variant of ours that reproduces the
    function best, or else from a fitted divisor or mask value (the black box's verdicts are not
    needed: our variants cover every function the checker can follow).
    Returns the probes' Reference for that variant, or None."""
    d_k, h, tol, best = t.d_k, t.h, t.tol, t.best
    report.set("w_o", "N/A", "a scaled dot-product function has no W_O; check the layer that "
                             "calls it")
    var = best[1] if best is not None and best[2] <= tol else None
    if var is not None:
        err = best[2]
        words = mistake_words(var, d_k, h)
        fails = {i: w for i, w in words if i}
        passes = {"scale": f"divided by sqrt(d_k) = {num(math.sqrt(d_k))}, d_k = q.size(-1)",
                  "before_softmax": "each row of weights sums to 1 over the visible keys"
                  if not var.attn.softmax_over_queries else
                  "the mask is added to the scores before the softmax",
                  "mask_value": "future keys get weight 0"}
        for item in ("scale", "before_softmax", "mask_value"):
            report.set(item, "FAIL" if item in fails else "PASS", fails.get(item, passes[item]))
        report_equation(report, var, words, "our scaled_dot_product_attention", "it",
                        f"max relative difference {err:.1e}", f"max relative difference {err:.1e}")
    else:
        q, k, v = (torch.stack([p[i] for p in t.probes]) for i in range(3))
        _function_fits(report, t.y, q, k, v, h, d_k, tol, best)
    if t.convention == "add" and report.items["mask_value"].status == "PASS":
        report.set("mask_value", "N/A", "an additive mask's value is the caller's choice; this "
                                        "check passed -inf")
    return var and deeper.function_reference(var, d_k, h)


def _quote_costs(report: Report, table: dict) -> None:
    """A diagnosis line for each mistake the report names whose switch the studies measured
    (costs.py; nothing when docs/pitfall_costs.json is not there)."""
    for switch in report.mistakes:
        words = costs.words(switch, table)
        if words:
            report.diagnosis.append(words)


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
