"""The checker names the cause, not a symptom, and what it costs: the third study's mistakes (a
head split without the transpose, a softmax over the queries, a sliding window off by one) by
the switch that reproduces each; the cause in `report.diagnosis` and so in a grading table's
diagnosis column; torch's bare view error after `split` turned into the fix; a leak that only
lengths past 64 show named as a causal leak; tiled grouped-query heads judged correct with a
note; and for each mistake named, its measured cost read from the costs file
(docs/pitfall_costs.json, written by scripts/summarize_ablations.py; here a fixture in the same
format), or nothing about cost where there is none.

The checks share one sandbox host (a fork per check, under a second each here).
"""
from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO_ROOT
from check_helpers import failing, run, sandbox, text  # noqa: F401 (a fixture)
from check_attention import costs
from check_attention.checks import CheckError, _view_hint
from check_attention.grade import Row

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
     "causal validation loss +0.4123 nats per token, SE 0.0100 (41 SE), 4 paired seeds (the "
     "bookkeeping study, regime serve: 2 layers"),
    ("fused.py:SoftmaxOverQueries", "softmax_over_queries",
     "softmax runs over the queries (dim=-2) instead of the keys", "+1.2345 nats per token"),
    ("functions.py:softmax_over_queries", "softmax_over_queries",
     "softmax runs over the queries (dim=-2) instead of the keys", "+1.2345 nats per token"),
    ("separate.py:WindowOffByOne", "window_off_by_one", "the sliding window holds 5 keys, not 4",
     "-0.0150 nats per token, SE 0.0020 (8 SE)"),
    ("separate.py:ScaleDModel", "scale_d_model", "", "+0.0421 nats per token"),  # an old one
])
def test_each_mistake_is_named_by_its_switch_with_its_measured_cost(sandbox, measured, target,
                                                                    switch, words, quoted):
    report = run(sandbox, target)
    assert report.mistakes == [switch], text(report)
    assert words in report.items["equation"].detail, text(report)
    # the cause is in the diagnosis, words and all, so the grading table's column says it
    row = Row(target.split(":")[0], target.split(":")[1], report, 0.0).diagnosis
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


def test_a_layer_with_a_sliding_window_is_judged_with_it(sandbox, measured):
    report = run(sandbox, "separate.py:SlidingWindow")
    assert report.exit_code == 0, text(report)
    assert report.header["layout"].endswith("; a sliding window of 4 keys")
    assert report.diagnosis == []


def test_a_cause_found_step_by_step_is_in_the_diagnosis(sandbox):
    # no variant of ours has a mask value of -5: the fitted value is the cause, not a symptom
    report = run(sandbox, "fused.py:SmallMask")
    assert report.diagnosis and "the mask value is -5" in report.diagnosis[0], text(report)
    assert "the mask value is -5" in Row("fused.py", "SmallMask", report, 0.0).diagnosis


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
           "nats per token, SE 0.0031, 95% interval [-0.0087, +0.0111], 4 paired seeds: no " \
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
