"""The attention checker (check_attention): run on layers written in each common layout,
correct and with each classic mistake (tests/attention_layers/), it must give the right verdict
and name the right item in plain words; it must refuse what it cannot use with one `error:`
line; and nothing the checked file does may reach the project or the checker's references.

Most cases call the checker in-process with one shared sandbox host (a fork per case, well
under a second each); the command line itself is run as a user runs it in the `slow` tests.
"""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO_ROOT, SCRIPT_ENV, one_error_line
from check_helpers import ITEMS, failing, run, sandbox  # noqa: F401 (a fixture)
from check_attention.checks import CheckError, check
from check_attention.options import Options
from check_attention.sandbox.host import Sandbox



# (class in each module-layout file, the items that must fail, words the first one must say)
MISTAKES = [
    ("NoScale", {"scale"}, "not divided at all; they should be divided by sqrt(d_k) = 4.0"),
    ("ScaleDModel", {"scale"}, "divided by sqrt(d_model) = 8.0, not sqrt(d_k) = 4.0"),
    ("NoOutProj", {"w_o"}, "defined but never applied"),
    ("MaskZero", {"mask_value", "causal"}, "adds 0 to the future scores"),
    ("MaskFillZero", {"mask_value", "causal"}, "set to 0 instead of -inf"),
    ("MaskAfterSoftmax", {"before_softmax", "causal"}, "zeroed afterwards"),
    ("MaskNoDiagonal", set(), "diagonal excluded"),
    ("MaskOneFuture", {"causal"}, "off by one"),
]
CORRECT = {"fused.py": "CausalSelfAttention", "separate.py": "MultiHeadSelfAttention",
           "per_head.py": "MultiHeadAttention"}
MODULE_CASES = [(f"{file}:{cls}", fails | {"equation"}, words)
                for file in CORRECT for cls, fails, words in MISTAKES]


@pytest.mark.parametrize("target", [f"{f}:{c}" for f, c in CORRECT.items()]
                         + ["fused.py:FiniteMask", "separate.py:FinfoMinMask", "odd.py:Torch",
                            "odd.py:BareParameters"])
def test_correct_layers_pass_every_item(sandbox, target):
    report = run(sandbox, target)
    assert report.exit_code == 0, "\n".join(report.lines())
    assert [report.items[k].status for k in ITEMS] == ["PASS"] * 7
    assert all(item.status == "PASS" for item in report.items.values()), "\n".join(report.lines())
    assert report.verdict == f"PASS (all {len(report.items)} checks pass)"
    assert "our CausalSelfAttention with the layer's weights" in report.items["equation"].detail


@pytest.mark.parametrize("target, fails, words", MODULE_CASES)
def test_each_mistake_in_each_layout_is_named(sandbox, target, fails, words):
    report = run(sandbox, target)
    assert report.exit_code == 1
    assert failing(report) == fails, "\n".join(report.lines())
    first = next(k for k in ITEMS if k in fails - {"causal"})
    assert words in report.items[first].detail, "\n".join(report.lines())
    judged = sum(item.status != "N/A" for item in report.items.values())
    assert report.verdict.startswith(f"FAIL ({len(fails)} of {judged} ")
    variant = {"NoScale": "no_scale", "ScaleDModel": "scale_d_model", "NoOutProj": "no_out_proj",
               "MaskZero": "mask_zero", "MaskFillZero": "mask_fill_zero",
               "MaskAfterSoftmax": "mask_after_softmax", "MaskNoDiagonal": "mask_no_diagonal",
               "MaskOneFuture": "mask_one_future"}[target.split(":")[1]]
    assert any(f"attention={variant} " in d for d in report.diagnosis), report.diagnosis


@pytest.mark.slow
def test_the_layout_is_recognised(sandbox):
    layout = {t: run(sandbox, t).header["layout"] for t in (
        "fused.py:NoScale", "separate.py:NoScale", "per_head.py:NoScale")}
    assert "fused q/k/v Linear c_attn [64 -> 192]" in layout["fused.py:NoScale"]
    assert "+ output Linear c_proj" in layout["fused.py:NoScale"]
    assert "separate Linears q_proj, k_proj, v_proj" in layout["separate.py:NoScale"]
    assert "+ output output_proj" in layout["separate.py:NoScale"]
    assert "4 head modules (heads.*) with query/key/value" in layout["per_head.py:NoScale"]


@pytest.mark.slow
@pytest.mark.parametrize("target, fails, words", [
    # no variant of ours has these: a divisor or a mask value is fitted
    ("fused.py:ScaleDkNoSqrt", {"scale"}, "divided by d_k = 16, not sqrt(d_k) = 4.0"),
    ("fused.py:SmallMask", {"mask_value", "causal"}, "the mask value is -5"),
    ("fused.py:MixedHeads", {"causal"}, "which mixes positions and heads"),
    # bare nn.Parameters used as x @ W
    ("odd.py:BareParametersScaleDModel", {"scale"}, "sqrt(d_model) = 8.0"),
    # two mistakes at once are both named
    ("fused.py:NoScaleNoOutProj", {"scale", "w_o"}, "not divided at all"),
])
def test_fitted_and_combined_mistakes(sandbox, target, fails, words):
    report = run(sandbox, target)
    assert failing(report) == fails | {"equation"}, "\n".join(report.lines())
    assert words in report.items["equation"].detail


@pytest.mark.slow
def test_a_layout_it_cannot_follow_still_gets_the_black_box_checks(sandbox):
    report = run(sandbox, "odd.py:ALiBi")  # position biases: causal, right shape, not the equation
    assert report.items["causal"].status == "PASS"
    assert report.items["shape"].status == "PASS"
    assert report.items["scale"].status == "SKIP"
    assert "from the outputs alone" in report.items["mask_value"].detail
    assert report.items["equation"].status == "FAIL"
    assert "the closest correct reading, with no rotary positions, differs by" in \
        report.items["equation"].detail

    report = run(sandbox, "odd.py:HeadsOut")  # returns [B, h, T, d_k], no W_O at all
    assert report.items["shape"].status == "FAIL"
    assert "[2, 4, 8, 16], not [2, 8, 64]" in report.items["shape"].detail
    assert report.items["scale"].status == "SKIP" and report.exit_code == 1


def test_a_factory_is_checked_but_says_what_it_cannot_judge(sandbox):
    report = run(sandbox, "odd.py:ours")  # our own layer, d_model 48 and 6 heads, from a factory
    assert "d_model = 48 read from the layer" in report.header["layer"]
    assert report.items["equation"].status == "PASS"
    assert report.items["shape"].status == "SKIP"  # one head count only
    assert report.exit_code == 1 and report.verdict.startswith("NOT VERIFIED")


def test_a_layer_built_with_one_head_count_only(sandbox):
    report = run(sandbox, "odd.py:FourHeadsOnly")
    assert report.items["equation"].status == "PASS"
    assert report.items["shape"].status == "SKIP"
    assert "n_head=1: building FourHeadsOnly(d_model=64, n_head=1) failed: ValueError: this " \
           "layer has 4 heads (odd.py, line" in report.items["shape"].detail


def test_dropout_that_ignores_eval_is_reported(sandbox):
    report = run(sandbox, "odd.py:RandomInEval")
    assert any("changes from one call to the next in eval mode" in d for d in report.diagnosis)
    assert report.exit_code == 1


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float64"])
def test_tolerance_follows_the_dtype(sandbox, dtype):
    assert run(sandbox, "separate.py:MultiHeadSelfAttention", dtype=dtype).exit_code == 0
    for target, item in (("separate.py:ScaleDModel", "scale"), ("per_head.py:MaskZero",
                                                                 "mask_value")):
        report = run(sandbox, target, dtype=dtype)
        assert item in failing(report), "\n".join(report.lines())


# ----------------------------------------------------------------------------- functions


@pytest.mark.parametrize("name, convention", [
    ("keep_mask", "True = may attend"), ("drop_mask", "True = masked out"),
    ("additive_mask", "additive")])
def test_a_functions_mask_convention_is_found(sandbox, name, convention):
    report = run(sandbox, f"functions.py:{name}")
    assert report.exit_code == 0, "\n".join(report.lines())
    assert convention in report.header["mask"] and "found by trying" in report.header["mask"]
    assert report.items["w_o"].status == "N/A"


@pytest.mark.parametrize("name, fails, words", [
    ("no_scale", {"scale"}, "not divided at all"),
    ("sqrt_d_model", {"scale"}, "sqrt(d_model) = 8.0, not sqrt(d_k) = 4.0"),
    ("fill_zero", {"mask_value", "causal"}, "set to 0 instead of -inf"),
    ("after_softmax", {"before_softmax", "causal"}, "zeroed afterwards"),
    ("transposed_output", {"shape"}, "[2, 1, 17, 8], not [2, heads, 8, 17]"),
    ("forgets_the_mask", {"mask_value", "causal"}, "does not hide them"),  # f(q, k, v)
])
def test_a_functions_mistake_is_named(sandbox, name, fails, words):
    report = run(sandbox, f"functions.py:{name}")
    assert failing(report) == fails | {"equation"}, "\n".join(report.lines())
    first = next(k for k in ITEMS if k in fails)
    assert words in report.items[first].detail


def test_a_function_without_a_mask_parameter_masks_itself(sandbox):
    report = run(sandbox, "functions.py:builds_its_own_mask")
    assert report.exit_code == 0
    assert "takes q, k, v only" in report.header["mask"]


@pytest.mark.slow
def test_a_mask_convention_can_be_given(sandbox):
    assert run(sandbox, "functions.py:keep_mask", mask="keep").exit_code == 0
    wrong = run(sandbox, "functions.py:keep_mask", mask="drop")  # its visible keys get hidden
    assert {"causal", "equation"} <= failing(wrong)


# ----------------------------------------------------------------------------- what it refuses


@pytest.mark.parametrize("target, words", [
    ("odd.py:Nope", "odd.py has no 'Nope' (it defines"),
    ("odd.py:NOT_A_LAYER", "is an object of type int"),
    ("odd.py:NeedsVocab", "its parameter 'vocab_size' is none the checker knows"),
    ("odd.py:ReturnsDict", "forward returned a dict"),
    ("hostile.py:leaves", "ended its process"),
])
def test_unusable_objects_are_refused(sandbox, target, words):
    with pytest.raises(CheckError, match=re.escape(words)):
        run(sandbox, target)


def test_broken_files_are_refused_with_the_users_line(sandbox, tmp_path):
    (tmp_path / "syntax.py").write_text("import torch\ndef f(:\n")
    (tmp_path / "raises.py").write_text("import torch\n\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(CheckError, match=r"SyntaxError: .*\(syntax.py, line 2\)"):
        check(str(tmp_path / "syntax.py"), "f", Options(), sandbox=sandbox)
    with pytest.raises(CheckError, match=r"RuntimeError: no GPU here \(raises.py, line 3\)"):
        check(str(tmp_path / "raises.py"), "f", Options(), sandbox=sandbox)


@pytest.mark.parametrize("name, words", [
    ("ComplexOutput", "forward returned a complex tensor (complex64, strided); attention outputs "
                      "are dense real tensors"),
    ("SparseOutput", "forward returned a sparse tensor (float32, sparse_coo)"),
    ("QuantizedOutput", "forward returned a quantized tensor (qint32, strided)"),
    ("ForgedShortAnswer", "sent a malformed answer to 'forward': ys is not a list of 4"),
    ("ForgedSparseAnswer", "an output is a sparse tensor; the checker compares dense real"),
])
def test_outputs_it_cannot_compare_are_refused(sandbox, name, words):
    with pytest.raises(CheckError, match=re.escape(words)):
        run(sandbox, f"outputs.py:{name}")


@pytest.mark.slow  # a subprocess, measured over 2 s on 2 cores
def test_a_forged_exit_is_refused_and_the_next_check_is_not_confused(sandbox):
    with pytest.raises(CheckError, match="malformed answer"):
        run(sandbox, "outputs.py:ForgedExit")
    assert run(sandbox, "fused.py:CausalSelfAttention").exit_code == 0


@pytest.mark.slow  # a subprocess, measured over 2 s on 2 cores
def test_a_layer_that_hangs_is_stopped(sandbox):
    with pytest.raises(CheckError, match="took more than 2 s"):
        run(sandbox, "hostile.py:hangs", timeout=2.0)
    assert run(sandbox, "fused.py:NoScale").exit_code == 1  # and the host still serves


# ----------------------------------------------------------------------------- the sandbox


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kernel_has_landlock() -> bool:
    """Asked of the kernel directly, not through the code under test."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)) >= 1


def test_the_checked_file_cannot_write_into_the_project_or_fool_the_references(sandbox):
    """hostile.py tries to create planted.txt in the repository and to open model/attention.py
    for writing, and patches math.sqrt so that an in-process reference would skip the scaling
    too. Under Landlock both writes fail, and the verdict is still 'not divided at all'."""
    if not kernel_has_landlock():
        pytest.skip("no Landlock on this system: the fallback is tested below")
    assert "Landlock ABI" in sandbox.confinement and sandbox.writes_confined
    attention, planted = REPO_ROOT / "model" / "attention.py", REPO_ROOT / "planted.txt"
    before = (digest(attention), attention.stat().st_mtime_ns)
    try:
        report = run(sandbox, "hostile.py:Unscaled")
        assert not planted.exists()
    finally:
        planted.unlink(missing_ok=True)  # should the sandbox ever fail, leave no trace
    assert (digest(attention), attention.stat().st_mtime_ns) == before
    assert failing(report) == {"scale", "equation"}
    assert "not divided at all" in report.items["scale"].detail


@pytest.mark.slow
def test_without_landlock_a_write_into_the_project_is_caught(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "layer.py").write_text(
        "from pathlib import Path\nimport torch.nn as nn\n"
        "Path(__file__).with_name('planted.txt').write_text('x')\n"
        "class A(nn.Module):\n    def __init__(self, d_model, n_head):\n        super().__init__()\n"
        "        self.proj = nn.Linear(d_model, d_model)\n"
        "    def forward(self, x):\n        return self.proj(x)\n")
    with Sandbox(project_root=project, confine=False) as open_box:
        assert not open_box.writes_confined
        with pytest.raises(CheckError, match=r"changed the project \(planted.txt\)"):
            check(str(project / "layer.py"), "A", Options(), sandbox=open_box)


# ----------------------------------------------------------------------------- the command


def cli(*args, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_attention", *map(str, args)],
                          cwd=cwd, env=SCRIPT_ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, words", [
    (["tests/attention_layers/nope.py:X"], "no such file"),
    (["tests/attention_layers/fused.py"], "defines CausalSelfAttention, NoScale,"),
    (["docs/grading.md"], "the target must be FILE.py[:NAME]"),
    (["tests/attention_layers/fused.py:X", "heads=2"], "unknown key 'heads'"),
    (["tests/attention_layers/fused.py:X", "n_head=3"], "must be divisible by n_head (3)"),
    (["tests/attention_layers/fused.py:X", "mask=maybe"], "mask must be keep, drop, add or auto"),
    # issue 28: each number has a range that says its real bound, checked before any work
    (["tests/attention_layers/fused.py:X", "seq_len=4000"], "seq_len must be a whole number "
                                                             "from 2 to 512, got 4000"),
    (["tests/attention_layers/fused.py:X", "seq_len=512", "d_model=256"], "need about 4.0 GiB "
                                                                           "for the causality"),
    (["tests/attention_layers/fused.py:X", "timeout=inf"], "timeout must be a number of seconds "
                                                            "above 0 and at most 86,400, got inf"),
    (["tests/attention_layers/fused.py:X", "timeout=nan"], "got nan"),
    (["tests/attention_layers/fused.py:X", "seed=-1"], "seed must be a whole number from 0 to"),
    (["tests/attention_layers/fused.py:X", "batch=0"], "batch must be a whole number from 1 to"),
])
def test_bad_command_lines_get_one_error_line(args, words):
    result = cli(*args)
    assert result.returncode == 2
    assert words in one_error_line(result)


def test_a_path_with_an_equals_sign_is_the_file(tmp_path):
    """`python -m check_attention runs/lr=0.1/layer.py:Attn` names the file (issue 28):
    an argument ending in .py:NAME is the target, whatever its path holds."""
    from check_attention.__main__ import parse_args
    folder = tmp_path / "lr=0.1"
    folder.mkdir()
    (folder / "layer.py").write_text("")
    file, name, opts = parse_args([f"{folder}/layer.py:Attn", "seq_len=16"])
    assert (file, name, opts.seq_len) == (f"{folder}/layer.py", "Attn", 16)


@pytest.mark.slow
def test_help_lists_every_key():
    result = cli("--help")
    assert result.returncode == 0
    for key in Options.__dataclass_fields__:
        assert re.search(rf"^  {key}=\S+ +\w", result.stdout, re.M), key


@pytest.mark.slow
def test_exit_codes_from_the_command_line():
    ok = cli("tests/attention_layers/per_head.py:MultiHeadAttention")
    assert ok.returncode == 0 and ok.stdout.strip().endswith(" checks pass)")
    broken = cli("tests/attention_layers/functions.py:fill_zero")
    assert broken.returncode == 1 and "FAIL  The mask value is" in broken.stdout
    refused = cli("tests/attention_layers/odd.py:ReturnsDict")
    assert refused.returncode == 2 and "forward returned a dict" in one_error_line(refused)


def readme_example() -> tuple[str, list[str]]:
    """The check_attention command docs/check_attention.md shows (its "An example")
    and the output it shows."""
    section = (REPO_ROOT / "docs" / "check_attention.md").read_text().split("## An example", 1)[1]
    command = re.search(r"```bash\n(python -m check_attention [^\n]+)\n```", section)
    output = re.search(r"```text\n(.*?)```", section, re.S)
    return command.group(1), output.group(1).strip().splitlines()


@pytest.mark.slow
def test_the_readme_example_works_as_pasted():
    """Same lines as the README, but for what depends on the machine: the sandbox line (the
    kernel's Landlock) and the last digits of float32 differences."""
    command, expected = readme_example()
    argv = [sys.executable, *command.split()[1:]]  # `python` as the README's venv has it
    result = subprocess.run(argv, cwd=REPO_ROOT, env=SCRIPT_ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 1, result.stderr
    got = result.stdout.strip().splitlines()

    def stable(lines):
        return [re.sub(r"difference \S+,", "difference <n>,", line) for line in lines
                if not line.startswith("  sandbox:")]
    assert stable(got) == stable(expected)
