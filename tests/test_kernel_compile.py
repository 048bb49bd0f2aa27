"""The fused attention kernels compiled for real GPUs, on this machine, with no GPU.

`python -m tools.kernel_report` compiles every kernel x dtype x head size with the tiles the
launch would use, for sm_80 (compute capability 8.x) and sm_90 (H100 / H200), and reads what
ptxas and Triton report. These tests hold the tile tables to the rules a GPU would enforce or
punish: shared memory under the per-block limit (a launch over it fails), no spills to local
memory (slow), tensor-core instructions for fp16 / bf16 / tf32. Two negative controls show
that the checks catch the tiles the kernel shipped with before they were fixed.

The interpreter tests (tests/test_fused_attention.py) say the kernels compute the right thing;
these say they would launch and run well. Both without a GPU. One subprocess compiles
everything (Triton must not be in interpreter mode there), about 3 minutes of CPU time over up
to 4 cores.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from helpers import REPO_ROOT  # noqa: E402
from tools.kernel_report import (DTYPE_NAMES, KERNELS, TARGETS, Row,  # noqa: E402
                                   TENSOR_CORE_DTYPES)

pytestmark = pytest.mark.slow
HEAD_DIMS = (16, 32, 64, 128)
JOBS = min(4, os.cpu_count() or 1)
TIMEOUT_S = 1200  # a hang, not a budget: the whole table takes about 3 min of CPU time


def kernel_report(*args: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-m", "tools.kernel_report", "json=true",
                           f"jobs={JOBS}", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return kernel_report()


def test_every_variant_compiles_for_every_target(rows):
    got = {(r["kernel"], r["dtype"], r["head_dim"], r["target"]) for r in rows}
    assert got == set(itertools.product(KERNELS, DTYPE_NAMES, HEAD_DIMS, TARGETS))
    assert not [r for r in rows if r["error"]]


def test_the_limits_are_the_gpus():
    # max dynamic shared memory per block (opt-in): 99 KB on compute capability 8.6 / 8.9, the
    # smallest of the 8.x family whose tiles the sm_80 build stands for (A100 has 163 KB,
    # 166,912 B); 227 KB on 9.0
    assert TARGETS["sm_80"].smem_limit == 101_376 < 166_912
    assert TARGETS["sm_90"].smem_limit == 232_448


def test_shared_memory_fits_each_target(rows):
    over = [(r["kernel"], r["dtype"], r["head_dim"], r["target"], r["shared"]) for r in rows
            if r["shared"] > TARGETS[r["target"]].smem_limit]
    assert not over, over


def test_nothing_spills(rows):
    spilled = [(r["kernel"], r["dtype"], r["head_dim"], r["target"], r["tiles"],
                r["spill_stores"], r["spill_loads"]) for r in rows
               if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled


def test_matmuls_run_on_the_tensor_cores(rows):
    """mma.sync on 8.x; on Hopper the 16-bit kernels use its warpgroup MMA (wgmma)."""
    for r in rows:
        if r["kernel"] == "delta" or r["dtype"] not in TENSOR_CORE_DTYPES:
            continue
        what = (r["kernel"], r["dtype"], r["head_dim"], r["target"], r["tiles"])
        assert r["tensor_cores"] in ("mma", "wgmma"), what
        if r["target"] == "sm_90" and r["dtype"] != "tf32":
            assert r["tensor_cores"] == "wgmma", what


def test_one_compiled_variant_serves_every_kv_group(rows):
    """kv_group stays a runtime integer (Triton would make 1 a constant): the kernels checked
    here are the ones grouped-query attention launches too."""
    assert {r["kv_group"] for r in rows if r["kernel"] != "delta"} == {"i32"}


def test_the_rules_catch_the_tiles_the_kernel_used_to_ship():
    """Negative controls: the issue's findings, reproduced with the old tiles. dK/dV at d = 64
    with 4 warps spilled on sm_90; a 128 x 128 forward tile at d = 128 needs more shared memory
    than an RTX 4090 (8.9) has."""
    spilled, = kernel_report("kernels=dkdv", "dtypes=bf16", "head_dims=64", "targets=sm_90",
                             "tiles=32x128/4w3s")
    assert any("spills" in p for p in Row(**spilled).problems()), spilled
    big, = kernel_report("kernels=fwd", "dtypes=fp16", "head_dims=128", "targets=sm_80",
                         "tiles=128x128/8w3s")
    assert any("shared memory" in p for p in Row(**big).problems()), big


def test_row_problems_name_each_broken_rule():
    fine = Row("fwd", "bf16", 64, "sm_90", smem_limit=1000, shared=1000, tensor_cores="wgmma",
               kv_group="i32")
    assert fine.problems() == []
    broken = Row("fwd", "bf16", 64, "sm_90", smem_limit=1000, shared=1001, spill_stores=4,
                 kv_group="constexpr")
    assert len(broken.problems()) == 4
    assert Row("dq", "fp32", 64, "sm_80", error="boom").problems() == ["does not compile: boom"]
