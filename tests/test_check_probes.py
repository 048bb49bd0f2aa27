"""The attention checker's probes past the checklist (check_attention/probes.py): each
layer in tests/attention_layers/ that makes one of the mistakes the 8-position forward pass
cannot see (a wrong backward, a chunked loop wrong after 64 queries, batch mixing, dropout left
on in eval mode, a -1e4 mask, in-place writes into the input) must be named as that mistake,
and only there; the correct layers pass every probe (tests/test_check_attention.py checks them
item by item).

Several checks share one test and one sandbox host: each check forks a child (2 to 4 s here).
"""
from __future__ import annotations

import pytest

from check_helpers import PROBES, failing, run, sandbox, text  # noqa: F401 (a fixture)



@pytest.mark.slow
def test_a_wrong_backward_is_named_while_the_forward_passes(sandbox):
    # dS = P * dP: dq and dk (and so dx, W_Q's and W_K's gradients) are wrong, dv is right
    for target, wrong, right in (
            ("wrong_backward.py:WrongBackward", ("dx", "q_proj.weight.grad", "k_proj.weight.grad"),
             ("v_proj.weight.grad", "output_proj.weight.grad")),
            ("wrong_backward.py:wrong_backward", ("dq", "dk"), ("dv",))):
        report = run(sandbox, target)
        assert failing(report) == {"backward"}, text(report)
        detail = report.items["backward"].detail
        assert detail.startswith("backward is wrong: ") and "differs from autograd" in detail
        named_wrong, named_right = detail.split("; right: ")
        assert all(w in named_wrong for w in wrong), detail
        assert named_right.startswith(", ".join(right) + ";"), detail
        assert report.items["equation"].status == "PASS"
    # the same custom autograd.Function with the softmax's full Jacobian passes
    for target in ("wrong_backward.py:RightBackward", "wrong_backward.py:right_backward"):
        report = run(sandbox, target)
        assert report.exit_code == 0, text(report)


@pytest.mark.slow
def test_a_layer_right_only_for_its_first_64_queries_is_named(sandbox):
    report = run(sandbox, "chunked_64.py:Chunked64")
    assert failing(report) == {"lengths"}, text(report)
    detail = report.items["lengths"].detail
    assert detail.startswith("wrong past position 64 at length 65"), detail
    assert "right only for the first 64 queries" in detail and "lengths 1, 7 are right" in detail


@pytest.mark.slow
def test_batch_mixing_dropout_in_eval_and_in_place_writes_are_named(sandbox):
    mixing = run(sandbox, "batch_mixing.py:PackedBatch")  # also leaks: its mask spans samples
    assert "batch" in failing(mixing) and "(batch mixing)" in mixing.items["batch"].detail
    dropout = run(sandbox, "dropout_in_eval.py:DropoutInEval")
    assert "deterministic" in failing(dropout)
    assert dropout.items["deterministic"].detail.startswith("dropout left on in eval mode")
    assert dropout.items["batch"].status == "PASS"  # seeded alike, each sample on its own
    for target, name in (("inplace_input.py:scales_q_in_place", "q"),
                         ("inplace_input.py:ResidualInPlace", "x")):
        report = run(sandbox, target)
        assert "input_kept" in failing(report), text(report)
        assert f"writes into its input {name} in place" in report.items["input_kept"].detail
    assert failing(run(sandbox, "inplace_input.py:scales_q_in_place")) == {"input_kept"}


@pytest.mark.slow
def test_a_finite_mask_value_leaks_at_large_scores(sandbox):
    report = run(sandbox, "finite_mask.py:MinusTenThousand")
    assert failing(report) == {"large_scores"}, text(report)  # at ordinary scales it is right
    detail = report.items["large_scores"].detail
    assert "the mask value is finite (like -1e4)" in detail
    assert "none with scores up to 1e+04" in detail  # named by the scale where it starts
    # -1e9 and finfo.min stay hidden at every scale probed (scores up to 1e6)
    for target in ("fused.py:FiniteMask", "separate.py:FinfoMinMask"):
        assert run(sandbox, target).items["large_scores"].status == "PASS"


@pytest.mark.slow
def test_probes_on_functions_and_other_dtypes(sandbox):
    keep = run(sandbox, "functions.py:keep_mask")
    assert all(keep.items[k].status == "PASS" for k in PROBES + ("unequal",)), text(keep)
    assert "bottom-right" in keep.items["unequal"].detail
    # a function that builds its own square mask cannot be given n_q != n_k: not its fault
    own = run(sandbox, "functions.py:builds_its_own_mask")
    assert own.items["unequal"].status == "N/A" and own.exit_code == 0, text(own)
    for dtype in ("bfloat16", "float64"):
        report = run(sandbox, "separate.py:MultiHeadSelfAttention", dtype=dtype)
        assert report.exit_code == 0, text(report)
        assert failing(run(sandbox, "wrong_backward.py:WrongBackward", dtype=dtype)) \
            == {"backward"}
    half = run(sandbox, "separate.py:MultiHeadSelfAttention", dtype="float16")
    assert half.items["large_scores"].status == "N/A" and half.exit_code == 0, text(half)


@pytest.mark.slow
def test_the_layers_context_bounds_the_lengths(sandbox):
    lecture = run(sandbox, "per_head.py:MultiHeadAttention")  # a tril buffer of 32 positions
    assert lecture.items["lengths"].detail == "lengths 1, 7, 32 (the layer's context is 32)"
    nano = run(sandbox, "fused.py:CausalSelfAttention")  # built with block_size = 257
    assert nano.items["lengths"].detail == "lengths 1, 7, 65, 129, 257"
