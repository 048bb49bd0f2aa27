"""Every shipped config composes, validates, and is what its name says.

The dataclasses hold every default and each YAML file only what differs, so a typo in a YAML
file (a misspelt key, a value of the wrong type) fails here, not halfway through a sweep.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import asdict, fields

import pytest

from guard.preflight import compose
from helpers import VARIANT_NEEDS
from training.config import CONF_DIR, Config

GROUPS = ("model", "attention", "data", "tokenizer", "optim", "train")
PACKAGES = ("arm", "regime", "experiment", "arch")  # added with +name=option


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def needs(group: str, option: str) -> list[str]:
    """The overrides an attention pitfall needs to do anything (none for other options)."""
    return VARIANT_NEEDS.get(option, []) if group == "attention" else []


def without_names(cfg: Config) -> dict:
    """A config as a dict, without the names that only label it."""
    flat = asdict(cfg)
    flat.pop("run_name")
    flat["attention"].pop("name")
    return flat


# The default model's switches, from round 2 of docs/budget.md (conf/model/small.yaml). The
# dataclass keeps GPT-2's values, so that a ModelConfig() built in code is GPT-2's architecture.
DEFAULT_SWITCHES = {"positions": "rope", "mlp": "relu2", "n_kv_head": 2, "attn_gate": True}
# The default optimizer's AdamW betas, from round 6 (conf/optim/muon.yaml); the dataclass keeps
# AdamW's usual ones, which `optim=adamw` trains with.
DEFAULT_BETAS = {"beta1": 0.8, "beta2": 0.999}


def test_the_default_config_is_the_dataclass_defaults():
    """One source of defaults: `python train.py` runs what the dataclasses say, but for the
    switches the default model and optimizer groups set (and those files set nothing else)."""
    expected = asdict(Config()) | {"run_name": "correct_seed1337"}
    expected["model"] |= DEFAULT_SWITCHES
    expected["optim"] |= DEFAULT_BETAS
    assert asdict(compose()) == expected
    assert asdict(compose(["+arch=gpt2"]))["model"] == asdict(Config())["model"]


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_validates(group, option):
    compose([f"{group}={option}", *needs(group, option)])


@pytest.mark.parametrize("package,option", [(p, o) for p in PACKAGES for o in options(p)])
def test_every_added_config_composes_and_validates(package, option):
    compose([f"+{package}={option}"])


@pytest.mark.parametrize("variant", options("attention"))
def test_each_attention_file_is_named_for_its_variant_and_only_the_pitfalls_leave_the_default(
        variant):
    attention = compose([f"attention={variant}", *needs("attention", variant)]).attention
    assert attention.name == variant
    differs = [f.name for f in fields(attention)
               if getattr(attention, f.name) != getattr(Config().attention, f.name)]
    assert (differs == []) == (variant == "correct"), differs


@pytest.mark.parametrize("arm", options("arm"))
def test_each_arm_is_its_regime_with_its_variant(arm):
    """conf/arm/<regime>-<variant>.yaml: the regime's settings with that attention variant,
    nothing else, and a run name that says both."""
    regime, variant = arm.split("-", 1)
    assert regime in options("regime") and variant in options("attention")
    cfg = compose([f"+arm={arm}", "seed=7"])
    expected = compose([f"+regime={regime}", f"attention={variant}", "seed=7"])
    assert without_names(cfg) == without_names(expected)
    assert cfg.attention.name == variant
    assert cfg.run_name == f"{arm}_seed7"


# The studies and their regimes: the first (the classic pitfalls), the second (rotary positions,
# grouped heads and the KV cache).
STUDIES = {"ablations": ("leak", "scale", "heads"), "decoding": ("decode",)}


@pytest.mark.parametrize("study", list(STUDIES))
def test_each_study_sweeps_every_arm_of_its_regimes(study):
    text = (CONF_DIR / "experiment" / f"{study}.yaml").read_text()
    for arm in options("arm"):
        if arm.split("-", 1)[0] in STUDIES[study]:
            assert arm in text, f"+experiment={study} does not run {arm}"
    assert {r for rs in STUDIES.values() for r in rs} == set(options("regime"))


# The budget sweep's arms (docs/budget.md): one line each on top of its round's file,
# `python train.py -m +experiment=budget_rN run_name=ARM key=value ...`.
BUDGET_LINE = re.compile(r"^python train\.py -m \+experiment=(budget_r\d) run_name=(\S+)(.*)$", re.M)


def budget_arms() -> dict[str, list[str]]:
    text = (CONF_DIR.parent / "docs" / "budget.md").read_text()
    arms = {}
    for round_, arm, rest in BUDGET_LINE.findall(text):
        assert arm not in arms, f"docs/budget.md gives {arm} twice"
        arms[arm] = [f"+experiment={round_}", f"run_name={arm}", *shlex.split(rest)]
    return arms


def test_docs_budget_md_gives_every_arm_of_the_seven_rounds():
    rounds = [overrides[0] for overrides in budget_arms().values()]
    assert [rounds.count(f"+experiment=budget_r{n}") for n in range(1, 8)] == [8, 8, 23, 14, 26, 11,
                                                                              2]


@pytest.mark.parametrize("arm", list(budget_arms()))
def test_each_budget_arm_is_named_for_itself(arm):
    assert compose(budget_arms()[arm]).run_name == arm


@pytest.mark.parametrize("arm", [a for a, overrides in budget_arms().items()
                                 if overrides[0] in ("+experiment=budget_r1",
                                                     "+experiment=budget_r2")])
def test_the_first_budget_rounds_keep_the_schedule_they_were_measured_with(arm):
    """Rounds 1 and 2 of docs/budget.md ran with a cosine decay to 2e-4 (r2_08: 3e-4) and weight
    decay 0.1, the defaults of the time; their files pin them, so the default may move on."""
    cfg = compose(budget_arms()[arm])
    assert (cfg.optim.schedule.value, cfg.optim.weight_decay) == ("cosine", 0.1)
    assert cfg.optim.min_lr == (3e-4 if arm == "r2_08_lr6e-3" else 2e-4)


def test_the_default_is_round_3_s_last_arm_with_the_later_rounds_kept_switches():
    """`python train.py` trains r3_23_steps2800, the winner of round 3, reading its data in
    epochs with a per-head output gate (round 4's kept switches; round 5 kept none) and AdamW's
    betas 0.8 and 0.999 beside Muon (round 6's), for 3,400 steps (round 7's); the budget
    experiment only evaluates more often, hides the progress bar, and trains its steps on any
    machine, where the default's time budget may fix fewer."""
    arm = asdict(compose(budget_arms()["r3_23_steps2800"] + [
        "data.order=epochs", "model.attn_gate=true", "optim.beta1=0.8", "optim.beta2=0.999",
        "train.max_steps=3400"]))
    default = asdict(compose())
    for flat in (arm, default):
        flat.pop("run_name")
        flat["train"].pop("eval_interval")
        flat["train"].pop("progress")
        flat["train"].pop("budget_minutes")
    assert arm == default


@pytest.mark.slow  # 6 s on 2 cores: every option of every group
def test_no_yaml_file_restates_a_default():
    """Each group option holds only what differs from the dataclass defaults (a restated
    default would be a second source of truth that can drift)."""
    base = asdict(Config())
    for group in GROUPS:
        for option in options(group):
            text = (CONF_DIR / group / f"{option}.yaml").read_text()
            composed = asdict(compose([f"{group}={option}", *needs(group, option)]))[group]
            for line in text.splitlines():
                key = line.split(":", 1)[0].strip()
                if line.startswith((" ", "#", "-")) or ":" not in line or key == "defaults":
                    continue
                assert composed[key] != base[group][key], \
                    f"conf/{group}/{option}.yaml restates the default {key}: {composed[key]!r}"


# What the pitfall study (README, docs/ablations.md) was measured with, besides what each regime
# file sets itself: GPT-2's architecture and these optimizer values. Changing a default must not
# move the study's figures, so the regimes pin them; this test says if one slips.
STUDY_OPTIM = dict(name="adamw", lr=3e-3, schedule="constant", warmup_steps=20, weight_decay=0.1,
                   beta1=0.9, beta2=0.99, eps=1e-8, grad_clip=1.0)


# The second study's architecture (conf/regime/decode.yaml): Llama's switches at GPT-2's init.
DECODE_ARCH = dict(positions="rope", rope_theta=10000.0, norm="rmsnorm", norm_eps=1e-5,
                   mlp="swiglu", mlp_hidden=None, n_kv_head=2, qk_norm=False,
                   tie_embeddings=True, zero_init_residual=False, bias=False, mlp_ratio=4,
                   init_std=0.02, dropout=0.0, attn_dropout=None, activation=None,
                   value_residual=False, unet_skips=False, attn_gate=False, xsa=False, mtp=0.0,
                   bigram_buckets=0, smear=False)


@pytest.mark.parametrize("regime", options("regime"))
def test_the_pitfall_regimes_keep_the_architecture_they_were_measured_with(regime):
    cfg = compose([f"+regime={regime}"])
    gpt2 = compose(["+arch=gpt2"]).model
    arch = [f.name for f in fields(gpt2) if f.name not in ("n_layer", "n_head", "n_embd",
                                                           "block_size")]
    if regime in STUDIES["decoding"]:
        model = asdict(cfg.model)
        assert {k: getattr(model[k], "value", model[k]) for k in arch} == DECODE_ARCH
    else:
        assert {k: getattr(cfg.model, k) for k in arch} == {k: getattr(gpt2, k) for k in arch}
    optim = asdict(cfg.optim)
    assert {k: getattr(optim[k], "value", optim[k]) for k in STUDY_OPTIM} == STUDY_OPTIM
    assert cfg.tokenizer.kind.value == "char" and cfg.attention.query_block is None


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
@pytest.mark.slow
def test_train_py_composes_each_run_once(sweep, tmp_path, monkeypatch):
    """A run's config is composed once (a sweep: once per arm, and once without the swept values
    for hydra.sweep.*), every arm before the first trains, and what is trained is that config."""
    import guard.preflight as preflight
    from safeio.run_lock import release_locks
    from helpers import corpus_args, write_corpus

    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["overrides"])
        return compose_with_hydra(*args, **kwargs)

    compose_with_hydra = preflight.hydra_compose
    monkeypatch.setattr(preflight, "hydra_compose", counting)
    monkeypatch.setattr(preflight.Launch, "_begin", lambda self, job: None)  # no log, no record
    argv = ["+experiment=smoke", *corpus_args(write_corpus(tmp_path), tmp_path / "cache"),
            *(["-m", "seed=1,2", f"hydra.sweep.dir={tmp_path / 's'}"] if sweep
              else [f"hydra.run.dir={tmp_path / 'run'}"])]
    try:
        jobs = preflight.Launch(argv).jobs()
        first = next(jobs)
        assert len(calls) == (3 if sweep else 1), calls
        assert first.settled.cfg.seed == (1 if sweep else 1337)
        assert first.settled.run_dir.parent == (tmp_path / "s" if sweep else tmp_path)
        jobs.close()
    finally:
        release_locks()


def test_round_4_s_base_is_round_3_s_default_at_the_proxy_budget():
    """r4_base: the default as round 3 left it (windows drawn with replacement) at 800 steps."""
    base = compose(budget_arms()["r4_base"])
    r3 = compose(budget_arms()["r3_23_steps2800"])
    assert base.train.max_steps == 800 and base.data.order.value == "random"
    assert (base.model, base.optim) == (r3.model, r3.optim)
    assert compose(budget_arms()["r4_epochs"]).data.order.value == "epochs"


def test_round_5_s_base_is_round_4_s_default_at_the_proxy_budget():
    """r5_base: the default as round 4 left it (epochs, the gate) at 800 steps, and r5full_base
    the same at the full 2,800."""
    base = compose(budget_arms()["r5_base"])
    default = compose(["optim.beta1=0.9", "optim.beta2=0.99"])  # round 4's (round 6 moved them)
    assert base.train.max_steps == 800 and base.data.order.value == "epochs"
    assert (base.model, base.optim, base.data) == (default.model, default.optim, default.data)
    assert compose(budget_arms()["r5full_base"]).train.max_steps == 2800  # round 7 moved it


def test_round_6_s_winner_is_the_default_at_the_budget_experiment():
    """Round 6 ran on round 5's base (no switch was kept in between), and its kept arm,
    r6full_beta1_0.8_beta2, trains the default's model, optimizer and data (round 7 lengthened
    the run)."""
    base, r5 = asdict(compose(budget_arms()["r6_base"])), asdict(compose(budget_arms()["r5_base"]))
    base.pop("run_name"), r5.pop("run_name")
    assert base == r5
    winner, default = compose(budget_arms()["r6full_beta1_0.8_beta2"]), compose()
    assert (winner.model, winner.optim, winner.data) == (default.model, default.optim, default.data)
    assert winner.train.max_steps == 2800  # round 7 moved it


def test_round_7_s_base_is_round_6_s_winner_and_its_arm_the_default_s_steps():
    """r7full_base trains round 6's kept arm again; r7full_steps3400 trains what the default
    trains, for its 3,400 steps."""
    base = compose(budget_arms()["r7full_base"])
    r6 = compose(budget_arms()["r6full_beta1_0.8_beta2"])
    assert (base.model, base.optim, base.data, base.train) == (r6.model, r6.optim, r6.data,
                                                               r6.train)
    arm, default = compose(budget_arms()["r7full_steps3400"]), compose()
    assert (arm.model, arm.optim, arm.data) == (default.model, default.optim, default.data)
    assert arm.train.max_steps == default.train.max_steps == 3400
