"""A learner's layer in our GPT (train.py your_layer=FILE.py:NAME, check_attention/your_layer.py):
it trains, resumes and samples like any run; its causal loss comes from each position's prefix
alone; and the run's copy of its file is code, imported only when the user says so."""
from __future__ import annotations

import contextlib
import hashlib
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from forkserver import ForkServer
from helpers import GENERATE, REPO_ROOT, TRAIN, corpus_args, ok, one_error_line, write_corpus
from model.config import AttentionConfig, ModelConfig
from model.gpt import GPT
from safeio.cli import UserError
from training.evaluate import prefix_losses

SOLUTION = REPO_ROOT / "lessons" / "solutions" / "02_heads.py"
COPY = "layer/02_heads.py"
# A layer file that says when it runs: a refused run must never import it.
HOSTILE = '''import pathlib
pathlib.Path({marker!r}).write_text("imported")
from model.attention import causal_pattern, scaled_dot_product_attention
import torch.nn as nn
class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.proj = nn.Linear(d_model, d_model)
    def forward(self, x):
        return self.proj(x)
'''


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One tiny run of lesson 02's solution in the leak regime (20 steps), to read and to open."""
    root = tmp_path_factory.mktemp("your_layer")
    server = ForkServer(tmp_path_factory.mktemp("your_layer_output"))
    common = ["+arm=leak-yours", *corpus_args(write_corpus(root), root / "cache"),
              "train.threads=1", "train.dtype=float32", "train.eval_interval=10",
              "train.sample_tokens=20", "train.progress=false"]
    run = root / "run"
    trained = ok(server.run(TRAIN, [*common, f"your_layer={SOLUTION}:MultiHeadAttention",
                                    "train.max_steps=20",
                                    f"hydra.run.dir={run}"], cwd=root))
    yield SimpleNamespace(root=root, server=server, common=common, run=run, trained=trained)
    server.close()


def copy_run(env, tmp_path: Path) -> Path:
    shutil.copytree(env.run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def test_the_run_keeps_the_file_it_trained_and_scores_it_from_each_prefix(env):
    code = SOLUTION.read_bytes()
    assert (env.run / COPY).read_bytes() == code
    config = (env.run / "config.yaml").read_text()
    assert f"your_layer: {COPY}:MultiHeadAttention" in config
    assert f"your_layer_sha256: {hashlib.sha256(code).hexdigest()}" in config
    with safe_open(str(next((env.run / "checkpoints").glob("step_*")) / "model.safetensors"),
                   "pt") as f:
        assert "blocks.1.attn.layer.W_O.weight" in f.keys()  # the learner's weights, trained
    # a causal layer: its loss from each prefix alone is its own, to rounding
    lines = env.trained.stderr.splitlines()
    own = next(line for line in lines if line.strip().startswith("val loss")).split()[-1]
    causal = next(line for line in lines if "causal val loss" in line).split()[-1]
    assert own == causal
    assert "generate.py run=" in env.trained.stderr and "trust_layer=true use_cache=false" in \
        env.trained.stderr


def test_the_run_resumes_and_samples_with_the_users_consent(env, tmp_path):
    run = copy_run(env, tmp_path)
    ok(env.server.run(TRAIN, [f"resume={run}", "train.max_steps=30", "trust_layer=true"],
                      cwd=tmp_path))
    assert (run / "checkpoints" / "step_00000030").is_dir()
    sample = ok(env.server.run(GENERATE, [f"run={run}", "trust_layer=true", "use_cache=false",
                                          "max_new_tokens=20", "prompt=ROMEO:"], cwd=tmp_path))
    assert sample.stdout.startswith("ROMEO:") and len(sample.stdout) > len("ROMEO:")
    # the KV cache, which a layer seeing x alone has not: one line that says what to set
    cached = env.server.run(GENERATE, [f"run={run}", "trust_layer=true"], cwd=tmp_path)
    assert "use_cache=false" in one_error_line(cached) and cached.stdout == ""  # (nothing echoed)


# ----------------------------------------------------------------------------- code in a run


def refused(env, tmp_path: Path, run: Path, marker: Path, *args: str) -> list[str]:
    """The one error line of each command that opens run; none of them imported the layer."""
    lines = [one_error_line(env.server.run(TRAIN, [f"resume={run}", "train.max_steps=30",
                                                   *args], cwd=tmp_path)),
             one_error_line(env.server.run(GENERATE, [f"run={run}", "use_cache=false", *args],
                                           cwd=tmp_path))]
    from bench.score import score_run
    with pytest.raises(UserError) as caught:
        score_run(run, trust_layer="trust_layer=true" in args)
    assert not marker.exists(), "the run's layer was imported"
    return lines + [str(caught.value)]


def test_without_the_option_a_runs_copy_is_refused_by_name(env, tmp_path):
    run, marker = copy_run(env, tmp_path), tmp_path / "ran"
    (run / COPY).write_text(HOSTILE.format(marker=str(marker)))  # what a stranger's run may hold
    digest = hashlib.sha256((run / COPY).read_bytes()).hexdigest()
    config = run / "config.yaml"
    config.write_text(config.read_text().replace(
        hashlib.sha256(SOLUTION.read_bytes()).hexdigest(), digest).replace(
        "trust_layer: false", "trust_layer: true"))
    for line in refused(env, tmp_path, run, marker):  # (config.yaml's trust_layer: not the user)
        assert str(run / COPY) in line and "trust_layer=true" in line, line


@pytest.mark.parametrize("case", ["another file", "outside the run", "hash", "link"])
def test_a_tampered_run_is_refused_even_with_the_option(env, tmp_path, case):
    run, marker = copy_run(env, tmp_path), tmp_path / "ran"
    hostile = tmp_path / "hostile.py"
    hostile.write_text(HOSTILE.format(marker=str(marker)))
    config = run / "config.yaml"
    if case == "another file":  # config.yaml edited to name a file outside the run
        config.write_text(config.read_text().replace(f"your_layer: {COPY}",
                                                     f"your_layer: {hostile}"))
    elif case == "outside the run":
        config.write_text(config.read_text().replace(f"your_layer: {COPY}",
                                                     f"your_layer: layer/../../{hostile.name}"))
    elif case == "hash":  # the copy changed since the run trained with it
        (run / COPY).write_text(HOSTILE.format(marker=str(marker)))
    else:  # the copy a link to a file elsewhere
        (run / COPY).unlink()
        (run / COPY).symlink_to(hostile)
    expected = {"another file": "a run imports no code from outside its directory",
                "outside the run": "a run imports no code from outside its directory",
                "hash": "it is not the file the run trained with",
                "link": "no symbolic link"}[case]
    for line in refused(env, tmp_path, run, marker, "trust_layer=true"):
        assert expected in line or "symbolic link" in line, line  # (resume refuses any link)


def test_scripts_that_cannot_run_a_learners_layer_say_which_can(env, tmp_path):
    from scripts.export_hf import export

    with pytest.raises(UserError, match="generate.py and bench.score do, given trust_layer=true"):
        export(env.run, tmp_path / "out")


# ----------------------------------------------------------------------------- refused at once


def test_a_class_the_checker_cannot_bind_is_one_line_naming_the_spellings(env, tmp_path):
    layer = tmp_path / "odd.py"
    layer.write_text("import torch.nn as nn\nclass Odd(nn.Module):\n"
                     "    def __init__(self, d_model, heads_count, extra):\n"
                     "        super().__init__()\n")
    line = one_error_line(env.server.run(TRAIN, [*env.common, f"your_layer={layer}:Odd",
                                                 f"hydra.run.dir={tmp_path / 'run'}"],
                                         cwd=tmp_path))
    assert "'heads_count'" in line and "d_model / n_embd / embed_dim" in line, line
    assert "n_head / num_heads" in line and not (tmp_path / "run").exists()  # nothing left
    layer.write_text("import torch.nn as nn\nclass Odd(nn.Module):\n"
                     "    def __init__(self, d_model, n_head):\n"
                     "        super().__init__()\n"
                     "    def forward(self, x):\n        return x[..., :1]\n")
    line = one_error_line(env.server.run(TRAIN, [*env.common, f"your_layer={layer}:Odd",
                                                 f"hydra.run.dir={tmp_path / 'run'}"],
                                         cwd=tmp_path))
    assert "returned [32, 32, 1] for x of shape [32, 32, 64]" in line, line


def test_what_a_layer_seeing_x_alone_cannot_run_is_named_at_once(env, tmp_path):
    line = one_error_line(env.server.run(TRAIN, [f"your_layer={SOLUTION}:MultiHeadAttention"],
                                         cwd=tmp_path))
    for fix in ("+arch=gpt2", "train.cached_eval_batches=0", "train.attention_maps=false"):
        assert fix in line, line
    line = one_error_line(env.server.run(TRAIN, [*env.common, f"your_layer={tmp_path / 'no.py'}:A"],
                                         cwd=tmp_path))
    assert "no.py does not exist" in line, line


# ----------------------------------------------------------------------------- the causal loss


def tiny(attention: AttentionConfig = AttentionConfig()) -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=8), 11, attention).eval()


class ReadsAhead(torch.nn.Module):
    """A perfect leak: position t's logits single out token t + 1 of its window where the
    window has one (100 nats over the rest), and are uniform at the window's last position."""

    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        logits = 100.0 * F.one_hot(x[:, 1:], 11).float()  # [B, T - 1, 11]
        return torch.cat([logits, torch.zeros(x.size(0), 1, 11)], dim=1), None


def test_prefix_losses_are_the_own_for_a_causal_model_and_what_a_leak_cannot_read():
    torch.manual_seed(1)
    tokens = torch.randint(0, 11, (4, 3, 9))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # windows: y is x shifted by one
    own, causal = prefix_losses(tiny(), batches, contextlib.nullcontext())
    assert causal == pytest.approx(own, abs=1e-6)
    own, causal = prefix_losses(ReadsAhead(), batches, contextlib.nullcontext())
    assert own == pytest.approx(math.log(11) / 8)  # only the last position cannot read ahead
    assert causal == pytest.approx(math.log(11))  # from its prefix alone, none can


def test_every_position_is_cut_once_when_there_are_cuts_enough():
    """Four copies of one batch, two cuts each: the 8 positions once each, so the estimate is the
    mean of every position's loss from its prefix alone, computed here one by one."""
    model = tiny(AttentionConfig(name="mask_zero", mask_value=0.0))
    x, y = torch.randint(0, 11, (3, 8)), torch.randint(0, 11, (3, 8))
    _, causal = prefix_losses(model, [(x, y)] * 4, contextlib.nullcontext(), cuts=2)
    with torch.no_grad():
        every = torch.stack([F.cross_entropy(model(x[:, :t + 1])[0][:, -1], y[:, t])
                             for t in range(8)])
    assert causal == pytest.approx(every.mean().item(), abs=1e-5)


def test_a_learner_layer_leaks_by_measure_and_is_told_so():
    import train
    from test_overfitting import guarded_run

    run = guarded_run(AttentionConfig())
    run.cfg.your_layer, run.metrics = "layer/x.py:Mine", {"val_loss": 1.2, "causal_val_loss": 6.0}
    run.leaky = train.Run.leaky.fget(run)
    assert run.leaky and not train.Run.leaky.fget(SimpleNamespace(cfg=run.cfg, metrics={
        "val_loss": 1.2, "causal_val_loss": 1.2 + 1e-5}))  # (rounding is no leak)
    train.check_overfitting(run)
    [(_, message)] = run.writer.texts
    assert "the leak, not overfitting" in message and "your_layer=layer/x.py:Mine lets" in message
