"""Every shipped config composes, validates, and is what its name says.

The dataclasses hold every default and each YAML file only what differs, so a typo in a YAML
file (a misspelt key, a value of the wrong type) fails here, not halfway through a sweep.
"""
from __future__ import annotations

from dataclasses import asdict, fields

import pytest

from guard.compose import compose
from helpers import VARIANT_NEEDS
from training.config import CONF_DIR, Config

GROUPS = ("model", "attention", "data", "tokenizer", "optim", "train")
PACKAGES = ("arm", "regime", "experiment", "arch")  # added with +name=option


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# What a learner's arm (conf/arm/<regime>-yours.yaml) trains: lesson 02's solution.
YOURS = "your_layer=lessons/solutions/02_heads.py:MultiHeadAttention"


def needs(group: str, option: str) -> list[str]:
    """The overrides an attention pitfall needs to do anything, and a learner's arm its layer
    (none for other options)."""
    if group == "arm" and option.endswith("-yours"):
        return [YOURS]
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
    compose([f"+{package}={option}", *needs(package, option)])


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
    yours = variant == "yours"  # a learner's layer: what it cannot run, off (docs/your_layer.md)
    assert regime in options("regime") and (yours or variant in options("attention"))
    cfg = compose([f"+arm={arm}", "seed=7", *needs("arm", arm)])
    # (a leak's arm in the third study's serve regime skips its served evaluation: no decoder
    # reads ahead)
    leaky_decoding = regime == "serve" and not cfg.attention.is_causal()
    expected = compose([f"+regime={regime}", "attention=correct" if yours else
                        f"attention={variant}", "seed=7",
                        *(["train.cached_eval_batches=0"] if leaky_decoding or yours else []),
                        *([YOURS, "train.attention_maps=false"] if yours else [])])
    assert without_names(cfg) == without_names(expected)
    assert cfg.attention.name == variant
    assert cfg.run_name == f"{arm}_seed7"


# The studies and their regimes: the first (the classic pitfalls), the second (rotary positions,
# grouped heads and the KV cache), the third (the head split, the softmax axis, padding, windows
# and cache reuse).
STUDIES = {"ablations": ("leak", "scale", "heads"), "decoding": ("decode",),
           "bookkeeping": ("serve", "window")}


@pytest.mark.parametrize("study", list(STUDIES))
def test_each_study_sweeps_every_arm_of_its_regimes(study):
    text = (CONF_DIR / "experiment" / f"{study}.yaml").read_text()
    for arm in options("arm"):
        if arm.split("-", 1)[0] in STUDIES[study] and not arm.endswith("-yours"):
            assert arm in text, f"+experiment={study} does not run {arm}"
    assert {r for rs in STUDIES.values() for r in rs} == set(options("regime"))


def test_the_budget_harness_trains_the_default_with_fixed_steps():
    """+experiment=budget is the harness of a next budget round (docs/budget.md): the default's
    model, optimizer and data, each arm's own fixed steps, no progress bar, curves every 250
    steps; the past rounds' pins live at the commits docs/budget.md names, not here."""
    harness, default = asdict(compose(["+experiment=budget"])), asdict(compose())
    assert (harness["train"]["budget_minutes"], harness["train"]["progress"],
            harness["train"]["eval_interval"]) == (None, False, 250)
    for flat in (harness, default):
        for key in ("budget_minutes", "progress", "eval_interval"):
            flat["train"].pop(key)
    assert harness == default


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
                   tie_embeddings=True, bias=False, mlp_ratio=4, init_std=0.02, dropout=0.0,
                   attn_dropout=None, attn_gate=False)


@pytest.mark.parametrize("regime", options("regime"))
def test_the_pitfall_regimes_keep_the_architecture_they_were_measured_with(regime):
    cfg = compose([f"+regime={regime}"])
    gpt2 = compose(["+arch=gpt2"]).model
    arch = [f.name for f in fields(gpt2) if f.name not in ("n_layer", "n_head", "n_embd",
                                                           "block_size")]
    if regime in STUDIES["decoding"] or regime == "window":  # (the window: Llama's, windowed)
        model = asdict(cfg.model)
        window = {"window": 8 if regime == "window" else None}
        assert {k: getattr(model[k], "value", model[k]) for k in arch} == DECODE_ARCH | window
    else:
        assert {k: getattr(cfg.model, k) for k in arch} == {k: getattr(gpt2, k) for k in arch}
    optim = asdict(cfg.optim)
    assert {k: getattr(optim[k], "value", optim[k]) for k in STUDY_OPTIM} == STUDY_OPTIM
    assert cfg.tokenizer.kind.value == "char" and cfg.attention.query_block is None


@pytest.mark.parametrize("sweep", [False, True], ids=["run", "sweep"])
@pytest.mark.slow
def test_train_py_composes_each_run_once(sweep, tmp_path, monkeypatch):
    """A run's config is composed once (a sweep: once per arm, and once without the swept values
    for hydra.sweep.*), every arm before the first trains, and what is trained is that config.
    (Hydra's launcher then composes each arm once more, where it trains it.)"""
    import guard.compose as compose_module
    from guard.launch import Launch
    from safeio.run_lock import release_locks
    from helpers import corpus_args, write_corpus

    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs["overrides"])
        return compose_with_hydra(*args, **kwargs)

    compose_with_hydra = compose_module.hydra_compose
    monkeypatch.setattr(compose_module, "hydra_compose", counting)
    argv = ["+experiment=smoke", *corpus_args(write_corpus(tmp_path), tmp_path / "cache"),
            *(["-m", "seed=1,2", f"hydra.sweep.dir={tmp_path / 's'}"] if sweep
              else [f"hydra.run.dir={tmp_path / 'run'}"])]
    try:
        first = Launch(argv).plan()[0]
        assert len(calls) == (3 if sweep else 1), calls
        assert first.checked.cfg.seed == (1 if sweep else 1337)
        assert first.checked.run_dir.parent == (tmp_path / "s" if sweep else tmp_path)
    finally:
        release_locks()
