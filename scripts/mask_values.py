"""Finite mask values: what 0, -1e-9, -1e4, finfo.min and -inf do in float32, bfloat16 and
float16, in training and on a row that sees no key.

    python -m scripts.mask_values                      # both tables on the CPU (minutes)
    python -m scripts.mask_values steps=0              # the fully masked row alone (seconds)
    python -m scripts.mask_values device=cuda          # on a GPU: its SDPA backends and our kernel too

Two measurements (docs/ablations.md, the third study):

1. Training. The leak regime's model (conf/regime/leak.yaml) trained `steps` steps with
   attention.mask_value = value at every future key, in the scores' dtype, under autocast in
   each dtype: the last training loss, the validation loss under its own mask and the causal
   one, and the steps whose loss or gradient was not finite (skipped, as on_nonfinite=skip).
2. A fully masked row (a left-padded query before its row's first real token), computed with
   each value in each dtype by every path: our equation adding M, a masked_fill, torch's SDPA
   with a float mask, and, value-free, SDPA with a boolean mask and our fast path; on CUDA also
   SDPA's backends one by one and our Triton kernel. Reported: NaN, or the finite row.

The correct layer never meets 2.: a pad query sees its own key (model/attention.py's
visible_keys). float16 on a CPU: torch 2.13 runs float16 autocast there (emulated, about 9x
slower than float32 on an AVX2 CPU), softmax included in float16; a GPU runs the same rows with
its own kernels (tools/gpu_checks.sh).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from safeio.cli import UserError, parse_key_values, run_cli

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
VALUES = ("0", "-1e-9", "-1e4", "finfo.min", "-inf")
USAGE = ("usage: python -m scripts.mask_values [steps=N] [dtypes=fp32,bf16,fp16] [device=cpu] "
         "[seed=N] [sdist_path=FILE]")


@dataclass
class MaskArgs:
    steps: int = 200                # training steps per run (0: the fully masked row alone)
    dtypes: list[str] = field(default_factory=lambda: list(DTYPES))  # among fp32, bf16, fp16
    device: str = "cpu"             # cpu | cuda | cuda:N (auto: cuda if there is one)
    seed: int = 10                  # the leak regime's first study seed
    eval_batches: int = 10          # validation batches scored at the end
    sdist_path: Optional[str] = None  # the corpus as a file, without a network (data.sdist_path)


def mask_value(name: str, dtype: torch.dtype) -> float:
    """The value as code writes it for scores of `dtype` (finfo.min: that dtype's)."""
    return torch.finfo(dtype).min if name == "finfo.min" else float(name)


def autocast(device: torch.device, dtype: torch.dtype):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not torch.float32)


# ----------------------------------------------------------------------------- 1. training


def train_one(value: float, dtype: torch.dtype, args: MaskArgs, device: torch.device,
              corpus) -> dict:
    """The leak regime's model trained with M = value, under autocast(dtype)."""
    from data.batches import RandomWindows, fixed_windows
    from guard.compose import compose
    from model.gpt import GPT
    from training.evaluate import mean_loss
    from training.optim import lr_at

    cfg = compose(["+arm=leak-correct", f"seed={args.seed}"])
    attn = cfg.attention.__class__(name="finite_mask", mask_value=value)
    m, o, batch = cfg.model, cfg.optim, cfg.train.batch_size
    torch.manual_seed(args.seed)
    model = GPT(m, corpus.vocab_size, attn).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, weight_decay=o.weight_decay,
                            betas=(o.beta1, o.beta2))
    sampler = RandomWindows(corpus.train, m.block_size, batch, args.seed)
    amp, nan_steps, last = autocast(device, dtype), [], math.nan
    for step in range(1, args.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, o, args.steps)
        x, y = (t.to(device) for t in sampler.next_batch())
        with amp:
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        if not (torch.isfinite(loss) and torch.isfinite(norm)):
            nan_steps.append(step)  # skipped, as train.on_nonfinite=skip does
            continue
        opt.step()
        last = loss.item()
    val = fixed_windows(corpus.validation, m.block_size, args.eval_batches, batch, seed=123)
    own = mean_loss(model, val, amp)
    with model.attention_variant(attn.causal_variant()):
        causal = mean_loss(model, val, torch.autocast(device.type, enabled=False))
    return {"train": last, "val": own, "causal": causal, "nan_steps": nan_steps}


def steps_words(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{len(steps)} (first {steps[0]})"


# ----------------------------------------------------------------------------- 2. a masked row


def masked_row_outputs(device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Each path's output [1, 1, 3, 4] for 3 queries over 3 keys, query 0 seeing no key (a pad
    query), queries 1 and 2 the causal keys from key 1 on; {path name: output} per value."""
    from model.attention import scaled_dot_product_attention
    from model.fast_paths import shared_mask_attention
    from model.pitfalls import masked_softmax
    from model.config import MaskMode

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=g).to(device) for _ in range(3))
    visible = torch.tensor([[False, False, False], [False, True, False], [False, True, True]],
                           device=device)
    out = {}
    with autocast(device, dtype):
        for name in VALUES:
            value = mask_value(name, dtype)
            for mode in (MaskMode.add, MaskMode.fill):
                step = masked_softmax(mode, value)
                out[f"our equation, {mode.value} {name}"] = scaled_dot_product_attention(
                    q, k, v, visible, masked_softmax=step)[0]
            M = torch.zeros(3, 3, device=device, dtype=q.dtype if dtype is torch.float32
                            else dtype).masked_fill(~visible, value)
            out[f"torch SDPA, float mask {name}"] = F.scaled_dot_product_attention(
                q, k, v, attn_mask=M)
        out["torch SDPA, boolean mask"] = F.scaled_dot_product_attention(q, k, v,
                                                                           attn_mask=visible)
        out["our fast path (-inf in the matmul)"] = shared_mask_attention(q, k, v, visible,
                                                                          0.5)
        if device.type == "cuda":
            out.update(cuda_paths(q, k, v, visible, dtype))
    return out


def cuda_paths(q, k, v, visible, dtype) -> dict[str, torch.Tensor]:
    """SDPA's CUDA backends one by one (a backend that refuses the inputs is named so), and
    our Triton kernel's causal mask (no pad mask: the row it sees is its own, a control)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    q16, k16, v16 = (t.to(dtype if dtype is not torch.float32 else t.dtype) for t in (q, k, v))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                out[f"torch SDPA {backend.name}, boolean mask"] = F.scaled_dot_product_attention(
                    q16, k16, v16, attn_mask=visible)
        except RuntimeError as exc:
            out[f"torch SDPA {backend.name}, boolean mask"] = str(exc).splitlines()[0][:60]
    return out


def describe(output) -> str:
    """What query 0 (no key) got: NaN, or finite and what."""
    if isinstance(output, str):
        return f"refused ({output})"
    row = output[0, 0, 0].float()
    if torch.isnan(row).any():
        return "NaN"
    return "0 (zeros)" if (row == 0).all() else "finite (an average of masked values)"


# ----------------------------------------------------------------------------- the command


def main(argv: list[str]) -> int:
    def body() -> None:
        from guard.limits import parse_device

        args = parse_key_values(argv, MaskArgs, USAGE, about=__doc__.split("\n\n")[0])
        unknown = [d for d in args.dtypes if d not in DTYPES]
        if unknown or not args.dtypes:
            raise UserError(f"dtypes must be among {', '.join(DTYPES)}, got {args.dtypes}")
        if args.steps < 0 or not 1 <= args.eval_batches <= 1000:  # all held at once
            raise UserError(f"steps must be >= 0 and eval_batches from 1 to 1,000, got "
                            f"{args.steps} and {args.eval_batches:,}")
        device = parse_device(args.device)
        torch.set_num_threads(1)
        print(f"device {device}, torch {torch.__version__}, 1 thread")
        if args.steps:
            training_table(args, device)
        masked_row_table(args, device)
    return run_cli(body)


def training_table(args: MaskArgs, device: torch.device) -> None:
    from data.config import DataConfig, TokenizerConfig, TokenizerKind
    from data.prepare import prepare_corpus

    data = DataConfig() if args.sdist_path is None else DataConfig(sdist_path=args.sdist_path)
    corpus = prepare_corpus(data, TokenizerConfig(kind=TokenizerKind.char))
    print(f"\n1. training: the leak regime, seed {args.seed}, {args.steps} steps, mask value "
          f"added at the future keys in the scores' dtype\n")
    print("| mask value | dtype | value in that dtype | train loss | val loss (own mask) | "
          "causal val loss | steps with a NaN |")
    print("|---|---|---|---|---|---|---|")
    for name in VALUES:
        for key in args.dtypes:
            dtype = DTYPES[key]
            value = mask_value(name, dtype)
            r = train_one(value, dtype, args, device, corpus)
            print(f"| {name} | {key} | {torch.tensor(value, dtype=dtype).item():.4g} | "
                  f"{r['train']:.3f} | {r['val']:.3f} | {r['causal']:.3f} | "
                  f"{steps_words(r['nan_steps'])} |", flush=True)


def masked_row_table(args: MaskArgs, device: torch.device) -> None:
    print("\n2. a fully masked row (a left-padded query before its first real token)\n")
    outputs = {key: masked_row_outputs(device, DTYPES[key]) for key in args.dtypes}
    paths = list(next(iter(outputs.values())))
    print("| path | " + " | ".join(args.dtypes) + " |")
    print("|---|" + "---|" * len(args.dtypes))
    for path in paths:
        print(f"| {path} | " + " | ".join(describe(outputs[key][path]) for key in args.dtypes)
              + " |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
