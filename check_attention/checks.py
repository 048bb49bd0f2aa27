"""The cheat sheet's checklist, run on someone's attention: probes, comparisons, verdict.

Black-box checks need only the layer's outputs on seeded random inputs (causality, the shape,
identical tokens at every position); white-box ones read its weights (layouts.py) and find which
of our variants reproduces it (diagnosis.py), which decides the sheet's items (checklist.py).
"""
from __future__ import annotations

import contextlib
import os
import random
import threading
from typing import Optional

import torch

from check_attention import costs, layouts
from check_attention import probes as deeper
from check_attention.compare import PROBES, Leaks, leak_matrix, rel_err
from check_attention.diagnosis import Match, closest_words, match, no_match, report_found
from check_attention.layouts import Rotary
from check_attention.options import Options
from check_attention.report import Report
from check_attention.sandbox.host import CheckError, Sandbox, SandboxError, ask, project_snapshot
from check_attention.target import Target
from check_attention.variants import all_variants, fit

# ----------------------------------------------------------------------------- entry point


_one_at_a_time = threading.Lock()
OUT_OF_MEMORY = ("can't allocate memory", "MemoryError", "Cannot allocate memory")


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
    own = Sandbox(gpu=opts.device != "cpu") if sandbox is None else contextlib.nullcontext()
    with _callers_state_kept(), own as made:  # without one: a host of its own, closed after
        sandbox = made or sandbox
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
            _checklist(Target(child, info, opts), report)
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


def sandbox_for(opts: Options, reads: tuple = ()) -> Sandbox:
    """A sandbox host for opts' device, its children held to opts.memory GiB (and `reads`)."""
    memory = None if opts.memory is None else int(opts.memory * 2**30)
    return Sandbox(gpu=opts.device != "cpu", memory=memory, reads=reads)


def check_file(file: str, name: str, opts: Options, sandbox,
               fingerprint: Optional[str] = None) -> Report:
    """The report on FILE:NAME, every text in it inert (inert.py); a file or object the checker
    cannot use is a report whose `error` says why (the command prints it as its one `error:`
    line). fingerprint: what the object given to check() is made of (runner.fingerprint); the
    file's NAME must still be that object when the sandbox imports it."""
    try:
        return check(file, name, opts, sandbox=sandbox, fingerprint=fingerprint).made_inert()
    except CheckError as exc:
        words = " ".join(str(exc).split())
        if opts.memory is not None and opts.device == "cpu" and any(
                w in words for w in OUT_OF_MEMORY):
            words += f" (the layer's process may use {opts.memory:g} GiB: memory=)"
        return Report(f"{file}:{name}", error=words).made_inert()


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
    outs = t.forward(swaps + token + ([base] if y0 is None else []))["ys"]
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
                  shape_ok: bool) -> Optional[Match]:
    """Read the module's weights in every layout and find the variant of ours that reproduces
    it (diagnosis.match); where none does, say what its own Linears show and judge the rest from
    the outputs alone. Returns what reproduced it, for the probes, or None (nothing, or a fit)."""
    D, h, tol, info, captures = t.D, t.h, t.tol, t.info, t.captures
    heads = [h] if h else [c for c in range(1, D + 1) if D % c == 0]
    rs = t.readings = layouts.readings(info, captures[0], D, heads) if shape_ok else []
    t.heads = heads
    classic = [r for r in rs if r.classic]
    if classic and not h and not any(isinstance(r.names.get("q"), list) for r in classic):
        report.header["heads"] = f"n_head not known: tried {', '.join(map(str, heads))}"
    found, near = match(rs, info, t.xs, t.ys[:3], tol, window=info["window"])
    if found:
        report_found(report, found, D // found.reading.h, found.reading.h, tol, info,
                     captures[0], t.opts.llama_weights)
        return None if found.fitted else found
    if near is not None:
        no_match(report, near, D, captures[:3], t.xs, t.ys[:3], tol)
    else:
        report.header["layout"] = f"none recognised ({layouts.describe_linears(info)})"
    _black_box_items(report, leaks, rows_sum_to_one, shape_ok,
                     "no variant of ours reproduces it" if rs else "no layout fits")
    return None


def _judge_function(t: Target, report: Report, *black_box) -> Optional[Match]:
    """Judge the scale, the mask and the equation from the variant of ours that reproduces the
    function best, or else from a fitted divisor or mask value (the black box's verdicts are not
    needed: our variants cover every function the checker can follow).
    Returns that variant's match, for the probes, or None."""
    d_k, h, tol, best = t.d_k, t.h, t.tol, t.best
    report.set("w_o", "N/A", "a scaled dot-product function has no W_O; check the layer that "
                             "calls it")
    found = Match(None, Rotary(None), best[1], err=best[2]) \
        if best is not None and best[2] <= tol else None
    fitted = None
    if found is None and t.y is not None:
        q, k, v = (torch.stack([p[i] for p in t.probes]) for i in range(3))
        correct = all_variants()[0]
        fitted = fit(lambda **kw: correct.equation(q, k, v, d_k, h, **kw), t.y, d_k, h, tol,
                     PROBES)
        fitted = fitted and Match(None, Rotary(None), correct, fitted=fitted)
    if found or fitted:
        report_found(report, found or fitted, d_k, h, tol, t.info)
    else:
        why = "no variant of ours reproduces it" if t.y is not None else \
            "the output's shape is wrong"
        for item in ("scale", "before_softmax", "mask_value"):
            report.set(item, "SKIP", f"not judged: {why}")
        report.set("equation", "FAIL", "the output's shape is not [..., n, d_v]" if t.y is None
                   else "no variant of ours reproduces its output"
                   + (f" ({closest_words(best[1], best[2])})" if best else ""))
    if t.convention == "add" and report.items["mask_value"].status == "PASS":
        report.set("mask_value", "N/A", "an additive mask's value is the caller's choice; this "
                                        "check passed -inf")
    return found


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
