"""scripts/mask_values.py's second table: a query that sees no key at all (a left-padded query
before its first real token), on each path, for each mask value. What each row must be follows
from the equation: a finite value added to every score of the row cancels in the softmax (the
row attends as if unmasked); filled into every score, it leaves equal weights (the mean of the
values); -inf leaves 0 / 0 = NaN in our equation. The correct layer never computes such a row
(a pad query sees its own key: tests/test_batched_generation.py)."""
from __future__ import annotations

import math

import pytest
import torch

from scripts.mask_values import DTYPES, describe, mask_value, masked_row_outputs

FINITE = ("0", "-1e-9", "-1e4")


def inputs():
    """q, k, v as masked_row_outputs draws them: query 0 is the masked row."""
    g = torch.Generator().manual_seed(0)
    return [torch.randn(1, 1, 3, 4, generator=g) for _ in range(3)]


def test_a_fully_masked_row_on_each_path_in_float32():
    out = masked_row_outputs(torch.device("cpu"), torch.float32)
    q, k, v = inputs()
    unmasked = torch.softmax(q[0, 0, 0] @ k[0, 0].T / math.sqrt(4), -1) @ v[0, 0]  # [4]
    for name in FINITE:
        # (-1e4 + a score is rounded to float32's step there, 2**-10: weights to about 1e-4)
        atol = 1e-3 if name == "-1e4" else 1e-6
        for path in (f"our equation, add {name}", f"torch SDPA, float mask {name}"):
            torch.testing.assert_close(out[path][0, 0, 0], unmasked, atol=atol, rtol=0)
        torch.testing.assert_close(out[f"our equation, fill {name}"][0, 0, 0],
                                   v[0, 0].mean(0), atol=1e-5, rtol=0)
    for path in ("our equation, add -inf", "our equation, fill -inf",
                 "our fast path (-inf in the matmul)"):
        assert describe(out[path]) == "NaN", path
    # torch's CPU kernel returns zeros for a row with no visible key (CUDA's backends differ:
    # tools/gpu_checks.sh runs the same table there)
    assert describe(out["torch SDPA, boolean mask"]) == "0 (zeros)"
    for path, row in out.items():  # the rows that see keys are never NaN
        assert not torch.isnan(row[0, 0, 1:]).any(), path


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_finfo_min_is_the_dtype_s_own(dtype):
    assert mask_value("finfo.min", DTYPES[dtype]) == torch.finfo(DTYPES[dtype]).min
    assert mask_value("-1e4", DTYPES[dtype]) == -1e4
