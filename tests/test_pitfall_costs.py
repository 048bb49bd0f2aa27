"""The costs file (scripts/summarize_ablations.py, costs=): each pitfall's measured effect as the
study's tables give it, merged study by study, so that the attention checker quotes the figures
the studies measured, never a copy made by hand."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from safeio.cli import UserError
from scripts.summarize_ablations import Effect, cost, effect, merge_costs, shows_in, study_name


def arm(*finals: float, key: str = "causal") -> dict:
    """{seed: series} whose final `key` loss of seed 10 + i is finals[i]."""
    return {10 + i: {key: (np.array([50, 100]), np.array([9.0, value]))}
            for i, value in enumerate(finals)}


def test_an_effect_is_paired_by_seed_with_its_t_interval():
    e = effect(arm(2.5, 2.7, 2.6), arm(2.4, 2.5, 2.5))  # differences 0.1, 0.2, 0.1
    d = np.array([0.1, 0.2, 0.1])
    se = d.std(ddof=1) / math.sqrt(3)
    assert e.paired and e.n == 3
    assert e.mean == pytest.approx(d.mean()) and e.se == pytest.approx(se)
    assert (e.low, e.high) == pytest.approx((d.mean() - 4.303 * se, d.mean() + 4.303 * se))


def test_a_cost_of_measured_effects_is_json():
    """From the losses' numpy values: a pair identical to the bit, and a measured one."""
    same = cost(effect(arm(2.5, 2.6, 2.7), arm(2.5, 2.6, 2.7)))
    measured = cost(effect(arm(2.5, 2.7, 2.6), arm(2.4, 2.5, 2.5)))
    assert json.loads(json.dumps([same, measured])) == [same, measured]
    assert same["identical"] is True and measured["identical"] is False


def test_a_cost_says_which_loss_shows_the_pitfall():
    seen = cost(Effect(0.5, 0.05, 0.4, 0.6, 4, True))
    unseen = cost(Effect(0.01, 0.02, -0.03, 0.05, 4, True))
    same = cost(Effect(0.0, 0.0, 0.0, 0.0, 4, True))
    assert same["identical"] and not seen["identical"]
    assert shows_in({"causal": same, "cached": seen}) == "cached"
    assert shows_in({"causal": unseen}) is None
    # both intervals leave 0: the one with more standard errors
    assert shows_in({"causal": cost(Effect(1.0, 0.5, 0.1, 1.9, 4, True)), "cached": seen}) == \
        "cached"
    assert cost(Effect(0.3, math.nan, math.nan, math.nan, 1, False))["se"] is None


def entry(study: str, effect_: float) -> dict:
    return {"study": study, "regime": "r", "setting": "s", "shows_in": "causal",
            "causal": cost(Effect(effect_, 0.01, effect_ - 0.02, effect_ + 0.02, 4, True))}


def test_a_study_replaces_its_own_entries_and_keeps_the_others(tmp_path):
    path = tmp_path / "pitfall_costs.json"
    first = merge_costs(path, {"study": "ablations", "sweep": "runs/ablations/a",
                               "costs": {"mask_zero": [entry("ablations", 5.0)]}})
    path.write_text(json.dumps(first))
    second = merge_costs(path, {"study": "bookkeeping", "sweep": "runs/bookkeeping/b",
                                "costs": {"mask_zero": [entry("bookkeeping", 1.0)],
                                          "softmax_over_queries": [entry("bookkeeping", 2.0)]}})
    path.write_text(json.dumps(second))
    again = merge_costs(path, {"study": "ablations", "sweep": "runs/ablations/c",
                               "costs": {"no_scale": [entry("ablations", 0.2)]}})
    assert again["studies"] == {"ablations": "runs/ablations/c", "bookkeeping": "runs/bookkeeping/b"}
    assert sorted(again["costs"]) == ["mask_zero", "no_scale", "softmax_over_queries"]
    assert [e["study"] for e in again["costs"]["mask_zero"]] == ["bookkeeping"]  # old one gone
    assert again["costs"]["no_scale"][0]["causal"]["effect"] == 0.2
    assert "never edited by hand" in again["about"]


def test_a_file_that_is_not_a_costs_file_is_refused(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"costs": [1, 2]}))
    with pytest.raises(UserError, match="is not a costs file"):
        merge_costs(path, {"study": "x", "sweep": "y", "costs": {}})


def test_a_study_is_named_by_its_experiment_wherever_it_lies(tmp_path):
    moved = tmp_path / "shared" / "ablations_2026-12-06"
    moved.mkdir(parents=True)
    (moved / "sweep.json").write_text(  # the sweep's record, as guard/launch.py writes it
        '{"overrides": ["seed=3", "+experiment=ablations", "hydra.sweep.dir=/tmp/x"]}')
    assert study_name(moved) == "ablations"
    plain = tmp_path / "runs" / "decoding" / "2026-12-01_10-00-00"
    plain.mkdir(parents=True)
    assert study_name(plain) == "decoding"  # no record: runs/<study>/<date>


@pytest.mark.parametrize("tamper", [
    lambda e: e.update(setting=5), lambda e: e.update(shows_in=[]),
    lambda e: e["cached"].update(effect=1e308, se=1e-320), lambda e: e["cached"].update(se=-1)])
def test_a_tampered_costs_entry_is_left_out_as_a_missing_one(tmp_path, tamper):
    """Round six's C01-C03, C06: docs/pitfall_costs.json edited by hand (a number for a text, a
    list for a loss's name, a 309-digit effect, a deep nesting) ended every check that names the
    mistake in a traceback. An entry summarize_ablations would not write says nothing."""
    from check_attention import costs
    entry = {"study": "s", "regime": "r", "setting": "x", "shows_in": "cached",
             "causal": {"effect": 0.0, "se": 0.0}, "cached": {"effect": 0.05, "se": 0.005}}
    said = costs.words("no_scale", {"no_scale": [entry]})
    assert "+0.0500 nats per token, SE 0.0050 (10 SE)" in said
    tamper(entry)
    assert costs.words("no_scale", {"no_scale": [entry]}) in (None, costs.words(
        "no_scale", {"no_scale": [dict(entry, shows_in="causal")]}))
    assert costs.words("no_scale", {"no_scale": 5}) is None
    deep = tmp_path / "costs.json"
    deep.write_text('{"costs": ' + "[" * 1_000_000 + "]" * 1_000_000 + "}")
    assert costs.load(deep) == {}


def test_the_summary_rewrites_only_its_study_s_blocks_of_the_docs(tmp_path, monkeypatch):
    """docs=true: the tables in README.md and docs/ablations.md are the summary's, between
    `<!-- <study> <block>: ... -->` and `<!-- end -->`; the text around them and another study's
    blocks stay, and a second summary replaces the first (nothing typed by hand accumulates)."""
    import scripts.summarize_ablations as summary
    (tmp_path / "docs").mkdir()
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "ablations.md"
    readme.write_text("intro\n<!-- ablations short: written by the summary -->\nold\n"
                      "<!-- end -->\nbetween\n<!-- decoding short: x -->\nkept\n<!-- end -->\n")
    page.write_text("<!-- ablations table: written by the summary -->\n<!-- end -->\nafter\n")
    monkeypatch.setattr(summary, "REPO", tmp_path)
    for table in ("first", "second"):
        written = summary.write_blocks("ablations", {"table": f"T {table}", "short": f"S {table}"})
        assert written == [readme, page]
    assert readme.read_text() == ("intro\n<!-- ablations short: written by the summary -->\n"
                                  "S second\n<!-- end -->\nbetween\n<!-- decoding short: x -->\n"
                                  "kept\n<!-- end -->\n")
    assert page.read_text() == ("<!-- ablations table: written by the summary -->\nT second\n"
                                "<!-- end -->\nafter\n")
