"""The checker names the cause, not a symptom, and what it costs: the third study's mistakes (a
head split without the transpose, a softmax over the queries, a sliding window off by one) by
the switch that reproduces each; the cause in `report.diagnosis` and so in a grading table's
diagnosis column; torch's bare view error after `split` turned into the fix; a leak that only
lengths past 64 show named as a causal leak; tiled grouped-query heads judged correct with a
note; and for each mistake named, its measured cost read from the costs file
(docs/pitfall_costs.json, written by scripts/summarize_ablations.py; here a fixture in the same
format), or nothing about cost where there is none.

The mistakes learners make in layouts other than ours (issue 62), each in a layer written in
that style (tests/attention_layers/styles.py and the others): named, with the fix, in the
diagnosis line a grading table shows.

The checks share one sandbox host (a fork per check, under a second each here).
"""
from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO_ROOT
from check_helpers import failing, run, sandbox, text  # noqa: F401 (a fixture)
from check_attention import costs
from check_attention.checks import CheckError
from check_attention.grading.grade import Graded
from check_attention.target import view_hint as _view_hint

FIXTURE = REPO_ROOT / "tests" / "fixtures" / "pitfall_costs.json"


@pytest.fixture
def measured(monkeypatch):
    """The checker reads the fixture as its costs file."""
    monkeypatch.setattr(costs, "COSTS_FILE", FIXTURE)


def cost_lines(report) -> list[str]:
    return [d for d in report.diagnosis if d.startswith("measured cost of ")]


@pytest.mark.parametrize("target, switch, words, quoted", [
    ("fused.py:MixedHeads", "split_heads_no_transpose",
     "heads are split by reshaping to (B, 4, T, 16), which mixes positions and heads",
     "causal validation loss +0.4123 nats per character, SE 0.0100 (41 SE), 4 paired seeds (the "
     "bookkeeping study, regime serve: 2 layers"),
    ("fused.py:SoftmaxOverQueries", "softmax_over_queries",
     "softmax runs over the queries (dim=-2) instead of the keys", "+1.2345 nats per character"),
    ("functions.py:softmax_over_queries", "softmax_over_queries",
     "softmax runs over the queries (dim=-2) instead of the keys", "+1.2345 nats per character"),
    ("separate.py:WindowOffByOne", "window_off_by_one", "the sliding window holds 5 keys, not 4",
     "-0.0150 nats per character, SE 0.0020 (8 SE)"),
    ("separate.py:ScaleDModel", "scale_d_model", "", "+0.0421 nats per character"),  # an old one
])
def test_each_mistake_is_named_by_its_switch_with_its_measured_cost(sandbox, measured, target,
                                                                    switch, words, quoted):
    report = run(sandbox, target)
    assert report.mistakes == [switch], text(report)
    assert words in report.items["equation"].detail, text(report)
    # the cause is in the diagnosis, words and all, so the grading table's column says it
    row = Graded(target.split(":")[0], target.split(":")[1], report).diagnosis
    assert f"attention={switch} ({words}" in row, row
    [line] = cost_lines(report)
    assert line.startswith(f"measured cost of attention={switch}: "), line
    assert quoted in line, line
    regime = {"scale_d_model": "heads", "window_off_by_one": "window"}.get(switch, "serve")
    assert f"python train.py +arm={regime}-{switch}" in line
    if switch in ("split_heads_no_transpose", "softmax_over_queries"):
        assert "causal" in failing(report)  # both leak the future


def test_without_a_costs_file_nothing_is_said_about_cost(sandbox, monkeypatch, tmp_path):
    monkeypatch.setattr(costs, "COSTS_FILE", tmp_path / "pitfall_costs.json")  # not there
    report = run(sandbox, "fused.py:MixedHeads")
    assert report.mistakes == ["split_heads_no_transpose"] and not cost_lines(report)
    assert not any("cost" in d for d in report.diagnosis), report.diagnosis


def test_a_layer_with_a_sliding_window_passes_with_a_note_naming_it(sandbox, measured):
    """A window is a design, not the sheet's mistake: judged with it, and said (docs)."""
    note = ("a sliding window of {w} keys: query i sees keys i - {v} .. i, not all of 0 .. i as "
            "the sheet's mask has it; judged against our layer with the same window")
    for target, w in (("separate.py:SlidingWindow", 4), ("styles.py:MistralWindow", 6)):
        report = run(sandbox, target)  # Mistral's: grouped heads and rotary positions too
        assert report.exit_code == 0, text(report)
        assert report.header["layout"].endswith(f"; a sliding window of {w} keys")
        assert report.diagnosis == [note.format(w=w, v=w - 1)]


def test_a_cause_found_step_by_step_is_in_the_diagnosis(sandbox):
    # no variant of ours has a mask value of -5: the fitted value is the cause, not a symptom
    report = run(sandbox, "fused.py:SmallMask")
    assert report.diagnosis and "the mask value is -5" in report.diagnosis[0], text(report)
    assert "the mask value is -5" in Graded("fused.py", "SmallMask", report).diagnosis


def test_a_view_that_puts_the_heads_first_gets_the_fix(sandbox, measured):
    with pytest.raises(CheckError) as error:
        run(sandbox, "fused.py:ViewHeads")
    words = str(error.value)
    assert "RuntimeError: view size is not compatible" in words  # torch's own, then the fix
    assert "hint: line 36 puts the heads before the positions " \
           "(`return t.view(B, self.n_head, T, C // self.n_head)`)" in words, words
    assert "instead of .view(B, T, 4, 16).transpose(1, 2)" in words
    assert "attention=split_heads_no_transpose" in words and "+0.4123" in words


def test_the_view_hint_is_given_only_for_a_line_that_puts_the_heads_first(tmp_path):
    file = tmp_path / "layer.py"
    file.write_text("y = y.transpose(1, 2).view(B, T, C)\nq = q.view(B, self.n_head, T, d)\n")
    error = ("RuntimeError: view size is not compatible with input tensor's size and stride "
             "(...). Use .reshape(...) instead. (layer.py, line {})")
    assert _view_hint(error.format(1), str(file), 64, 4) == ""  # .contiguous() is that fix
    assert _view_hint(error.format(2), str(file), 64, 4).startswith("; hint: line 2 puts the "
                                                                    "heads before the positions")
    assert _view_hint("RuntimeError: shape mismatch (layer.py, line 2)", str(file), 64, 4) == ""


def test_a_leak_only_long_sequences_show_is_a_causal_leak(sandbox):
    report = run(sandbox, "chunked_64.py:Chunked64Leak")
    assert failing(report) == {"causal", "lengths"}, text(report)
    causal = report.items["causal"].detail
    assert causal.startswith("at length 257, changing position 80 changes the output at "
                             "position 64 by up to "), causal
    assert "query 64 sees a future key, past the 8 positions of the check above" in causal
    assert report.items["lengths"].detail.endswith("; the future leaks (see Causality)")
    assert any(d.startswith("a causal leak that only long sequences show: at length 257")
               for d in report.diagnosis), report.diagnosis
    # hiding keys after 64 positions is wrong, but no leak
    assert failing(run(sandbox, "chunked_64.py:Chunked64")) == {"lengths"}


def test_tiled_grouped_heads_are_correct_unless_the_weights_were_trained_for_llama(sandbox,
                                                                                  measured):
    report = run(sandbox, "llama_rope_gqa.py:TiledGroups")
    assert report.exit_code == 0, text(report)
    [note] = [d for d in report.diagnosis if d.startswith("the key/value heads are tiled")]
    assert "its weights are not interchangeable with Llama's" in note
    assert "measured cost of attention=gqa_repeat_mismatch: causal validation loss +0.0012 " \
           "nats per character, SE 0.0031, 95% interval [-0.0087, +0.0111], 4 paired seeds: no " \
           "loss of the study can tell it from the correct layer" in note, note
    llama = run(sandbox, "llama_rope_gqa.py:TiledGroups", llama_weights=True)
    assert failing(llama) == {"equation"} and llama.mistakes == ["gqa_repeat_mismatch"]
    assert any("attention=gqa_repeat_mismatch " in d for d in llama.diagnosis)


# ----------------------------------------------------------------------------- the costs file


def test_the_costs_file_is_read_as_the_study_writes_it(tmp_path):
    """An entry made by scripts/summarize_ablations.py's own functions reads as the fixture's
    do: the fixture's format is the writer's."""
    sys.path.insert(0, str(REPO_ROOT))
    from scripts.summarize_ablations import Effect, cost, merge_costs
    entry = {"study": "bookkeeping", "regime": "serve", "setting": "2 layers",
             "shows_in": "causal", "causal": cost(Effect(0.5, 0.01, 0.48, 0.52, 4, True))}
    written = merge_costs(tmp_path / "none.json", {"study": "bookkeeping", "sweep": "runs/x",
                                                   "costs": {"softmax_over_queries": [entry]}})
    fixture = json.loads(FIXTURE.read_text())
    assert set(written) == set(fixture)
    mine = fixture["costs"]["softmax_over_queries"][0]
    assert set(mine) == set(entry) and set(mine["causal"]) == set(entry["causal"])
    path = tmp_path / "pitfall_costs.json"
    path.write_text(json.dumps(written))
    assert "+0.5000 nats per token, SE 0.0100 (50 SE), 4 paired seeds" in \
        costs.words("softmax_over_queries", costs.load(path))
    # a file that is not a costs file, or is broken, says nothing rather than stopping a check
    for junk in ("[1, 2]", "{not json", '{"costs": [1]}'):
        path.write_text(junk)
        assert costs.load(path) == {}


# ----------------------------------------------------------------------------- other layouts


def said(report) -> str:
    """The diagnosis line that names the mistake (the one a grading table shows first)."""
    return next(d for d in report.diagnosis if "attention=" in d or "fitted" in d)


def test_heads_split_without_the_transpose_with_rotary_positions(sandbox):
    report = run(sandbox, "cs336_adapters.py:run_multihead_self_attention_with_rope_no_transpose")
    assert failing(report) == {"causal", "equation"} and report.mistakes == [
        "split_heads_no_transpose"], text(report)
    assert "attention=split_heads_no_transpose (heads are split by reshaping to (B, 4, T, 16), " \
           "which mixes positions and heads, instead of .view(B, T, 4, 16).transpose(1, 2)" \
           in said(report), text(report)
    assert report.items["lengths"].status == "PASS"  # judged against the same mistake


def test_an_inverted_boolean_mask_is_named(sandbox):
    fix = "fill the scores where the mask hides a key (masked_fill(~visible, -inf)"
    for target, options in (("styles.py:InvertedMask", {}),  # its own triu buffer, read as tril
                            ("functions.py:keep_mask", {"mask": "drop"})):  # the caller's mask
        report = run(sandbox, target, **options)
        assert failing(report) == {"causal", "equation"}, text(report)
        assert "attention=mask_inverted (the boolean mask is read inverted" in said(report)
        assert fix in said(report)


def test_a_function_computing_k_q_transposed_is_named(sandbox):
    report = run(sandbox, "sheet_2d.py:attention_kq")
    assert "equation" in failing(report) and report.items["causal"].status == "PASS"
    assert "attention=scores_kq (the scores are K Q^T, not Q K^T" in said(report), text(report)
    assert "compute Q @ K.transpose(-2, -1)" in said(report)


def test_the_scale_after_the_softmax_is_named(sandbox):
    report = run(sandbox, "styles.py:ScaleAfterSoftmax")
    assert failing(report) == {"scale", "equation"}, text(report)
    assert "attention=scale_after_softmax (the weights are divided by sqrt(d_k) = 4.0 after " \
           "the softmax, not the scores before it" in said(report)
    assert "divide QK^T by sqrt(d_k) before the softmax" in said(report)


@pytest.mark.slow  # the fits under each rotary layout: over 3 s on 2 cores
def test_a_rotary_layer_dividing_by_head_dim_is_named(sandbox):
    report = run(sandbox, "styles.py:LlamaHeadDim")
    assert failing(report) == {"scale", "equation"}, text(report)
    assert said(report) == ("no variant of ours reproduces it; a fitted divisor does (our "
                            "CausalSelfAttention with the layer's weights, 2 key/value heads, "
                            "rotate-half rotary positions): scores are divided by d_k = 16, not "
                            "sqrt(d_k) = 4.0")


def test_heads_with_their_own_projections_are_never_mixed(sandbox):
    report = run(sandbox, "styles.py:OwnProjections")
    assert failing(report) == {"w_o", "equation"}, text(report)
    assert "attention=own_out_proj (each head has its own output projection (heads.*.proj " \
           "[16 -> 16]) and the heads are only concatenated: nothing mixes them; apply one " \
           "W_O [64 -> 64] to the concatenated heads" in said(report)


def test_interleaved_rotary_pairs_fail_on_llamas_weights_only(sandbox, measured):
    assert run(sandbox, "styles.py:MetaLlama").exit_code == 0  # its own weights: either pairing
    report = run(sandbox, "styles.py:MetaLlama", llama_weights=True)
    assert failing(report) == {"equation"} and report.mistakes == ["rotary_interleaved"]
    assert "attention=rotary_interleaved (the second study's switches" in said(report)
    assert "pair dimension j with j + d_k / 2 (rotate_half)" in said(report)


def test_litgpts_grouped_fused_projection_passes(sandbox):
    report = run(sandbox, "styles.py:LitGPTAttention")
    assert report.exit_code == 0, text(report)
    assert "fused q/k/v Linear attn [64 -> 128] (for each of its 2 groups: 2 query heads, then a " \
           "key and a value head) + output proj" in report.header["layout"]
