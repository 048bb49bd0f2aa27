"""The object under check, as the checklist (checks.py) and the probes (probes.py) see it: a
module called on x [batch, positions, d_model], or a scaled dot-product function called on
q, k, v [batch, heads, positions, d_k] (or the sheet's [positions, d_k]) and a mask, which the
sandbox's child wraps as a layer over (q, k, v, mask) (runner.FunctionLayer): one target kind,
asked the same way.

An input is a tuple of tensors, each [*lead, positions, width] (a module's is (x,), a
function's (q, k, v)), so that drawing a seeded input, changing one position or cutting a
prefix is the same code for both kinds. What differs is said here once per kind (KINDS): the
shape the output should have, which tensors a probe changes, and the words a report uses; and
how the first call and the shape check go.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Optional

import torch

from model.attention import causal_pattern
from check_attention import costs
from check_attention.compare import INPUT_SCALES, QKV_SCALES, TOLERANCE, same
from check_attention.diagnosis import match_function
from check_attention.options import MASKS, Options
from check_attention.sandbox.host import CheckError, SandboxError, ask
from check_attention.variants import split_words

KINDS = {  # what a report and the probes say and change, by kind
    "module": dict(inputs=("x",), axis=1, changed_words="positions",
                   positions_words="[batch, positions, ...]", shape_words="the input's",
                   large_moves=(0,), large_words="position", causal_scale=4.0, rows_probe=True,
                   long_leaks=True, blind=True,
                   probe_items=("lengths", "large_scores", "backward")),
    "function": dict(inputs=("q", "k", "v"), axis=-2, changed_words="queries, keys and values",
                     positions_words="[..., positions, d_v]", shape_words="[..., n, d_v]",
                     large_moves=(1, 2), large_words="key and value", causal_scale=2.0,
                     rows_probe=False, long_leaks=False, blind=False,
                     probe_items=("lengths", "large_scores", "backward", "unequal")),
}


def head_choices(D: int, h: int) -> list[int]:
    return sorted({c for c in (1, 2, h, 2 * h, 8) if c <= D and D % c == 0})


def as_mask(visible: torch.Tensor, convention: str) -> torch.Tensor:
    """visible [n_q, n_k] (True = may attend) as a mask in a function's convention."""
    if convention == "keep":
        return visible
    if convention == "drop":
        return ~visible
    return torch.zeros(visible.shape, dtype=torch.float64).masked_fill(~visible, float("-inf"))


class Target:
    """What the checklist needs of the object: seeded inputs, calls in the sandbox, shapes and
    words. first_call keeps `base`, the input causality starts from, and `base_out`, its output
    if known; a module's also xs, ys and the captures, a function's probes, y and best."""

    def __init__(self, child, info: dict, opts: Options):
        self.child, self.info, self.opts, self.kind = child, info, opts, info["kind"]
        self.__dict__.update(KINDS[self.kind])
        self.function = self.kind == "function"
        self.T, self.batched, self.convention = opts.seq_len, True, "keep"
        if self.function:
            self.dtype = getattr(torch, opts.dtype or "float32")
            self.h, self.D = opts.n_head, opts.d_model
            if self.D % self.h:
                raise CheckError(f"d_model ({self.D}) must be divisible by n_head ({self.h})")
            self.d_k = self.D // self.h
            self.widths = (self.d_k,) * 3
        else:
            consumed = set(info["consumed"])
            self.dtype = getattr(torch, info["dtype"])
            self.D = opts.d_model if "d_model" in consumed else (
                info["d_model"] or _width(info, opts))
            self.h = opts.n_head if "n_head" in consumed else info["n_head"]
            self.widths = (self.D,)
        self.tol = TOLERANCE.get(self.dtype, 5e-2)

    def randn(self, offset: int = 0):
        """A seeded normal draw, rounded to the layer's dtype once (the checklist's inputs at
        offset 0, the probes' at 1), returned in float64."""
        gen = torch.Generator().manual_seed(self.opts.seed + offset)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen, dtype=torch.float64)
                    * scale).to(self.dtype).double()
        return rand

    def draw(self, rand, B: int, n: int) -> tuple:
        """A fresh input: each tensor [*lead, n, width]."""
        return tuple(rand(*self.lead(B), n, w) for w in self.widths)

    @staticmethod
    def changed(inp: tuple, j: int, rand, scale: float, which=None) -> tuple:
        """A copy of inp with position j redrawn (at scale) in the tensors `which` (all)."""
        out = tuple(t.clone() for t in inp)
        for t in out if which is None else [out[i] for i in which]:
            t[..., j, :] = rand(*t.shape[:-2], t.size(-1), scale=scale)  # [*lead, width]
        return out

    def lead(self, B: int) -> tuple:
        return (B, self.h) if self.function and self.batched else () if self.function else (B,)

    def wire(self, inp: tuple) -> tuple:
        """An input as the child's layer takes it: (x,), or (q, k, v, the causal mask [n_q, n_k]
        bottom-right aligned in the function's convention)."""
        if not self.function:
            return inp
        return (*inp, as_mask(causal_pattern(inp[0].size(-2), inp[1].size(-2)), self.convention))

    def out_shape(self, B: int, n: int) -> list:
        return [*self.lead(B), n, self.d_k if self.function else self.D]

    def forward(self, inputs: list, seeds=None, capture=None, grad_outputs=None) -> dict:
        """The child's answer to forward on each input under its seed (outputs None where it
        raised): with capture, its Linears' inputs and outputs; with grad_outputs, the
        gradients; else the inputs it changed in place."""
        n = len(inputs)
        return ask(self.child, "forward", xs=[self.wire(i) for i in inputs],
                   seeds=seeds or [0] * n, capture=capture or [False] * n,
                   grad_outputs=grad_outputs or [None] * n)

    def context(self) -> Optional[int]:
        """The shortest context length a layer registers (block_size, a [T, T] buffer)."""
        if self.function:
            return None
        return min(ask(self.child, "context")["sizes"] or [None], key=lambda s: s or math.inf)

    def probe_heads(self, ref) -> int:
        if self.function:
            return self.h
        return ref.h if ref else (self.opts.n_head if "n_head" in self.info["consumed"] else 1)

    def sigmas(self, ref, inp: tuple, targets, blind) -> list:
        """The inputs' scales that bring the largest score to each target: q and k's for a
        function, x's from the reference's scores for a layer (blind: the scores unread)."""
        if self.function:
            q, k = inp[0], inp[1]
            s1 = ((q @ k.transpose(-2, -1)) / math.sqrt(self.d_k)).abs().max().item()
        else:
            s1 = ref.max_score(inp[0]) if ref is not None else 0
        return [math.sqrt(t / s1) for t in targets] if s1 > 0 else list(blind)

    def scale_words(self, ref, inp: tuple, target: float, s: float) -> str:
        if self.function:
            return f"scores up to {target:.0e} (q, k times {s:.3g})"
        return (f"scores up to {ref.max_score(inp[0] * s):.0e} (x times {s:.3g})"
                if ref is not None else f"x times {s:.3g}")

    # ------------------------------------------------------------------------- the first call

    def first_call(self, rand, report) -> None:
        (self._first_function if self.function else self._first_module)(rand, report)

    def _first_module(self, rand, report) -> None:
        """Run forward on x [B, T, D] at each of INPUT_SCALES (capturing its Linears' inputs and
        outputs), and once more on the first under another seed. Keeps xs, ys (float64) and the
        captures; the causality probe starts from the first x and its output."""
        B, T, D, info = self.opts.batch, self.T, self.D, self.info
        xs = [rand(B, T, D, scale=s) for s in INPUT_SCALES]
        main = self.forward([(x,) for x in xs + [xs[0]]], [0, 0, 0, 1], [True] * 3 + [False])
        if main["errors"][0]:
            raise CheckError(f"{info['how']} failed on x [{B}, {T}, {D}]: {main['errors'][0]}"
                             + view_hint(main["errors"][0], info["file"], D,
                                         self.h or self.opts.n_head))
        ys = [y.double() if y is not None else None for y in main["ys"]]
        report.header["layer"] = (f"{info['how']}, {info['dtype']} on {info['device']}, eval mode"
                                  + ("" if "d_model" in info["consumed"] else
                                     f"; d_model = {D} read from the layer"))
        report.header["probes"] = (f"x [{B}, {T}, {D}] ~ N(0, 1) times "
                                   f"{', '.join(f'{s:g}' for s in INPUT_SCALES)}, seed "
                                   f"{self.opts.seed}; tolerance {self.tol:.0e} relative "
                                   f"({info['dtype']})")
        y0 = ys[0]
        nan_positions = [t for t in range(y0.size(1)) if y0[:, t].isnan().any()] \
            if y0.dim() >= 2 else []
        if nan_positions:
            report.diagnosis.append(f"the output is NaN at position"
                                    f"{'s' * (len(nan_positions) > 1)} "
                                    f"{', '.join(map(str, nan_positions))} (a query that sees no "
                                    f"key at all takes the softmax of only -inf)")
        if ys[3] is not None and not same(ys[3], y0):
            report.diagnosis.append("the output changes from one call to the next in eval mode "
                                    "(dropout that ignores self.training?): comparisons are "
                                    "unreliable")
        self.xs, self.ys, self.captures = xs, ys, main["captures"]
        self.base, self.base_out = (xs[0],), y0

    def _first_function(self, rand, report) -> None:
        """Call the function on q, k, v [B, h, n, d_k] (else on the sheet's 2-D Q [n, d_k],
        K [n, d_k], V [n, d_v]) at each scale, under each mask convention it may take, and keep
        the lead shape and the convention our variants reproduce best. Keeps probes (the inputs
        per scale), y (the outputs stacked, or None) and best ((key, variant, err) or None); the
        causality probe starts from the second scale's input."""
        B, T, h, d_k = self.opts.batch, self.T, self.h, self.d_k
        conventions = ["keep"] if not self.info["takes_mask"] else (  # f(q, k, v) masks itself
            list(MASKS) if self.opts.mask == "auto" else [self.opts.mask])
        first_error = None
        for lead in ((B, h), ()):
            self.batched = bool(lead)
            probes = [tuple(rand(*lead, T, d_k, scale=s) for _ in range(3)) for s in QKV_SCALES]
            outs = {}
            for self.convention in conventions:
                outs[self.convention] = self.forward(probes)
            usable = [c for c in conventions if not any(outs[c]["errors"])]
            if usable:
                break
            first_error = first_error or next(e for e in outs[conventions[0]]["errors"] if e)
        else:
            raise CheckError(f"calling {self.info['how']} on q, k, v [{B}, {h}, {T}, {d_k}] "
                             f"(and on [{T}, {d_k}]) with a [{T}, {T}] mask failed: "
                             f"{first_error}")
        outs = {c: outs[c]["ys"] for c in usable}
        dims = ", ".join(map(str, (*lead, T, d_k)))
        report.kind = "function"
        report.header["layer"] = (
            f"the function {self.info['how']}, {str(self.dtype).replace('torch.', '')}"
            + ("" if lead else "; it takes the sheet's 2-D shapes, Q [n, d_k], K, V [n, d], "
                               "not [batch, heads, n, d_k]"))
        report.header["probes"] = (f"q, k, v [{dims}] ~ N(0, 1) times "
                                   f"{', '.join(f'{s:g}' for s in QKV_SCALES)}, seed "
                                   f"{self.opts.seed}; tolerance {self.tol:.0e} relative")
        q, k, v = (torch.stack([p[i] for p in probes]) for i in range(3))
        results = {}
        for c in usable:
            y = torch.stack([o.double() for o in outs[c]]) if all(
                list(o.shape) == [*lead, T, d_k] for o in outs[c]) else None
            results[c] = y, match_function(q, k, v, y, d_k, h, self.tol)
        matched = [c for c in usable if results[c][1] and results[c][1][2] <= self.tol]
        self.convention = min(matched or usable, key=lambda c: (
            results[c][1][0] if results[c][1] else (True, 9, math.inf)))
        if not self.info["takes_mask"]:
            report.header["mask"] = "none given: the function takes q, k, v only, so it must " \
                                    "mask the future itself"
        elif self.opts.mask == "auto":
            if len({tuple(torch.cat([o.double().flatten() for o in outs[c]]).tolist())
                    for c in usable}) == 1 and len(usable) > 1:
                report.header["mask"] = "the output is the same whatever mask it is given"
            else:
                report.header["mask"] = (f"{MASKS[self.convention]} (found by trying all three "
                                         f"conventions)")
        else:
            report.header["mask"] = f"{MASKS[self.convention]} (mask={self.convention})"
        self.probes, (self.y, self.best) = probes, results[self.convention]
        self.base, self.base_out = probes[1], None

    # ------------------------------------------------------------------------- the shape

    def check_shape(self, rand, report) -> bool:
        return (self._shape_function if self.function else self._shape_module)(rand, report)

    def _shape_module(self, rand, report) -> bool:
        """The output [B, T, D], and again built with other head counts where it takes n_head.
        Returns whether the first output has the input's shape."""
        B, T, D, n_head, y0 = self.opts.batch, self.T, self.D, self.opts.n_head, self.base_out
        if list(y0.shape) != [B, T, D]:
            report.set("shape", "FAIL", f"x [{B}, {T}, {D}] gives {list(y0.shape)}, "
                       f"not [{B}, {T}, {D}]")
            return False
        if "n_head" not in self.info["consumed"]:
            report.set("shape", "SKIP", f"[{B}, {T}, {D}] here, but the layer was not built "
                       f"with n_head, so other head counts could not be tried")
            return True
        shapes, broken = {}, []
        for hh in head_choices(D, n_head):
            got = self._rebuild(hh, self.xs[0]) if hh != n_head else {"shape": list(y0.shape)}
            shapes[hh] = got.get("shape")
            if "error" in got:
                broken.append(f"n_head={hh}: {got['error']}")
        bad = {hh: s for hh, s in shapes.items() if s is not None and s != [B, T, D]}
        if bad:
            report.set("shape", "FAIL", "; ".join(f"n_head={hh} gives {s}" for hh, s in
                                                  bad.items()) + f", not [{B}, {T}, {D}]")
        elif len([s for s in shapes.values() if s]) < 2:
            report.set("shape", "SKIP", f"could not build it with another head count "
                       f"({broken[0]}" + (f"; {len(broken) - 1} more" if len(broken) > 1 else "")
                       + ")")
        else:
            report.set("shape", "PASS", f"[{B}, {T}, {D}] for n_head = "
                       + ", ".join(str(hh) for hh, s in shapes.items() if s))
        return True

    def _rebuild(self, n_head: int, x) -> dict:
        """{'shape': [...]} of the layer built with n_head heads, or {'error': why not}."""
        try:
            return self.child.ask("rebuild", n_head=n_head, x=(x,))
        except SandboxError as exc:
            raise CheckError(str(exc)) from None

    def _shape_function(self, rand, report) -> bool:
        """The output [..., n, d_v] for several head counts, with d_v != d_k."""
        B, T, d_k, lead = self.opts.batch, self.T, self.d_k, self.batched
        shapes, wrong = [], []
        d_v = next(d for d in (d_k // 2, d_k + 1, d_k + 3) if d > 0 and d not in (d_k, T))
        for hh in head_choices(self.D, self.h) if lead else [None]:
            lead_h = (B, hh) if lead else ()
            got = self.forward([(rand(*lead_h, T, d_k), rand(*lead_h, T, d_k),
                                 rand(*lead_h, T, d_v))])
            out = got["ys"][0]
            shapes.append(hh)
            if out is None or list(out.shape) != [*lead_h, T, d_v]:
                wrong.append((f"{hh} heads, d_v = {d_v}: " if lead else f"d_v = {d_v}: ")
                             + (got["errors"][0] if out is None else f"{list(out.shape)}"))
        if wrong:
            report.set("shape", "FAIL", (f"{wrong[0]}, not [{B}, heads, {T}, {d_v}]" if lead
                                         else f"{wrong[0]}, not [{T}, {d_v}]")
                       + (f" (and {len(wrong) - 1} more head counts)" if len(wrong) > 1 else ""))
        elif lead:
            report.set("shape", "PASS", f"[{B}, heads, {T}, d_v] for {', '.join(map(str, shapes))}"
                       f" heads and d_v != d_k")
        else:
            report.set("shape", "PASS", f"[{T}, d_v] for Q [{T}, {d_k}], V [{T}, {d_v}]: "
                       f"d_v != d_k")
        return not wrong


# `.view(B, n_head, T, d_k)`: heads before positions, the view's second argument a head count
HEADS_FIRST = re.compile(r"\.view\(\s*[^,()]+,\s*[\w.]*(?:head|\bh\b)[\w.]*\s*,")


def view_hint(error: str, file: str, D: int, h: int) -> str:
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
