"""Comparing a layer's outputs with ours: relative differences judged per probe, tolerances by
dtype, the causality probe's leak matrix, and a one-dimensional fit for the diagnosis."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

# Relative difference (to the largest reference value) a layer computing our equation stays
# under, by the dtype it computes in: float64 reference vs the layer's own rounding.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}
INPUT_SCALES = (1.0, 2.0, 4.0)       # x = N(0, 1) * s: flatter and sharper softmax rows
QKV_SCALES = (0.5, 1.0, 2.0)         # q, k, v of a scaled dot-product function
PROBES = len(INPUT_SCALES)           # probes stacked on the batch dim in each comparison
LEAK = 1e-6                          # causality: a change this large (relative) is a leak


def worst(y: torch.Tensor, ref: torch.Tensor, axis: int = 0,
          scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[n]: the largest |y - ref| at each of the n positions along axis, relative to the largest
    |ref| (or |scale|), NaN where both are NaN counting as equal and any other NaN as inf."""
    y, ref = y.double(), ref.double()
    d = (y - ref).abs().masked_fill(torch.isnan(y) & torch.isnan(ref), 0).nan_to_num(math.inf)
    top = (ref if scale is None else scale.double()).nan_to_num(0).abs().max().item()
    return d.movedim(axis, 0).reshape(d.size(axis), -1).amax(dim=1) / max(top, 1e-30)


def rel_err(y: torch.Tensor, ref: torch.Tensor, skip_first: bool = False,
            probes: int = 1) -> float:
    """max |y - ref| / max |ref| (worst); inf on a shape mismatch. skip_first leaves out
    position 0 (dim -2). With probes > 1, y and ref hold that many probes stacked on dim 0 and
    each is judged against its own scale (a flat probe must not hide behind a saturated one's
    large values)."""
    if y.shape != ref.shape:
        return math.inf
    if probes > 1:
        return max(rel_err(a, b, skip_first) for a, b in zip(y.chunk(probes), ref.chunk(probes)))
    if skip_first:
        y, ref = y[..., 1:, :], ref[..., 1:, :]
    return worst(y.reshape(1, -1), ref.reshape(1, -1)).max().item() if y.numel() else 0.0


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and rel_err(a, b) == 0.0


def golden(f, lo: float, hi: float, steps: int = 40) -> tuple[float, float]:
    """Minimise f on [lo, hi]: a coarse grid, then golden-section search around its best."""
    grid = [lo + (hi - lo) * i / 24 for i in range(25)]
    vals = [f(g) for g in grid]
    i = min(range(len(grid)), key=vals.__getitem__)
    a, b = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    r = (math.sqrt(5) - 1) / 2
    c, d = b - r * (b - a), a + r * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - r * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + r * (b - a)
            fd = f(d)
    best = min([(vals[i], grid[i]), (fc, c), (fd, d)])
    return best[1], best[0]


@dataclass
class Leaks:
    """Which earlier outputs move when one position changes: worst[i][j] for j > i."""

    worst: list
    threshold: float

    def pairs(self) -> list[tuple[int, int, float]]:
        return [(i, j, v) for i, row in enumerate(self.worst) for j, v in enumerate(row)
                if j > i and v > self.threshold]

    def words(self) -> str:
        pairs = self.pairs()
        if not pairs:
            return ""
        i, j, v = max(pairs, key=lambda p: p[2])
        T = len(self.worst)
        if all(j == i + 1 for i, j, _ in pairs):
            pattern = "only the next position leaks (position i sees i + 1)"
        elif all(i == 0 for i, _, _ in pairs):
            pattern = "only position 0 sees the future"
        else:
            pattern = f"{len(pairs)} of {T * (T - 1) // 2} (earlier, later) pairs leak"
        return (f"changing position {j} changes the output at position {i} by up to {v:.3g} "
                f"(relative); {pattern}")


def leak_matrix(base: torch.Tensor, perturbed: list, axis: int) -> Leaks:
    """base [.., T, ..] outputs; perturbed[j]: outputs with position j changed. axis: time."""
    T = base.size(axis)
    worst_ = [[0.0] * T for _ in range(T)]
    for j, y in enumerate(perturbed):
        for i, v in enumerate(worst(y, base, axis)[:j].tolist()):
            worst_[i][j] = v
    return Leaks(worst_, LEAK)
