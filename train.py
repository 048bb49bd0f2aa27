"""Train a GPT on the default corpus (or any other) with Hydra configs.

    python train.py                                   # Shakespeare, char-level, ~10 min on 2 cores
    python train.py +experiment=smoke                 # a few seconds
    python train.py model.n_layer=6 tokenizer=bpe     # any value in conf/ can be overridden
    python train.py attention=no_scale                # one of the attention pitfalls
    python train.py resume=runs/<run dir>             # continue from the latest checkpoint
    python train.py -m +experiment=ablations          # the whole pitfall study (multirun)
"""
from __future__ import annotations

import math
import os
import random
import signal
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tqdm import tqdm

from data.batches import RandomWindows, fixed_windows
from data.prepare import PreparedCorpus, prepare_corpus
from data.shakespeare import CorpusError
from model.attention import causal_variant
from model.gpt import GPT
from training.checkpoint import (CheckpointError, latest_checkpoint, load_state, load_weights,
                                 save_best, save_checkpoint)
from training.config import Config, register_configs, validate
from training.device import autocast, pick_device, pick_dtype
from training.evaluate import (attention_diagnostics, bits_per_char, full_split_loss, mean_loss,
                               qk_grad_norms)
from training.optim import lr_at, make_optimizer
from training.tb import open_writer, write_hparams

register_configs()


class UserError(RuntimeError):
    """A mistake in what the user asked for: reported as one line, without a traceback."""


class TrainingDiverged(UserError):
    pass


# ----------------------------------------------------------------------------- setup


def resolve_run(cfg: DictConfig) -> tuple[Config, Path, bool]:
    """The typed config and the run directory; for `resume=DIR`, the saved config of DIR with
    this command's other overrides on top (e.g. a larger train.max_steps)."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise UserError(f"cannot resume: {saved} does not exist (is {run_dir} a run directory?)")
        overrides = [o for o in HydraConfig.get().overrides.task
                     if not o.lstrip("+~").startswith(("resume=", "hydra."))]
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(saved),
                                 OmegaConf.from_dotlist([o.lstrip("+") for o in overrides]))
        merged.resume = str(run_dir)
        cfg = merged
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if latest_checkpoint(run_dir) is not None:
            raise UserError(f"{run_dir} already holds a checkpoint; resume it with resume={run_dir} "
                            "or choose another hydra.run.dir")
    conf: Config = OmegaConf.to_object(cfg)
    try:
        validate(conf)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return conf, run_dir, bool(cfg.resume)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": np.random.get_state()[1].tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", np.array(state["numpy"], dtype=np.uint32), 624, 0, 0.0))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopFlag:
    """SIGINT/SIGTERM ask the loop to finish the current step, save, and exit; a second SIGINT
    interrupts at once."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self._old = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name


def link_latest(run_dir: Path) -> None:
    """runs/latest -> this run, so `python generate.py` finds it without a path."""
    link = Path("runs") / "latest"
    try:
        link.parent.mkdir(exist_ok=True)
        tmp = link.with_name(".latest.tmp")
        if tmp.is_symlink():
            tmp.unlink()
        tmp.symlink_to(run_dir.resolve())
        os.replace(tmp, link)
    except OSError:
        pass  # a convenience only


# ----------------------------------------------------------------------------- training


def sample_text(model: GPT, corpus: PreparedCorpus, cfg: Config, step: int, amp) -> str:
    prompt = corpus.tokenizer.encode(cfg.train.sample_prompt).ids or [0]
    device = next(model.parameters()).device
    idx = torch.tensor([prompt], device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)  # global RNG untouched
    with amp:
        ids = [int(t) for t in model.generate(idx, cfg.train.sample_tokens,
                                              temperature=cfg.train.sample_temperature,
                                              generator=gen)]
    return corpus.tokenizer.decode(prompt + ids)


def train(cfg: Config, run_dir: Path, resuming: bool) -> dict:
    t, m = cfg.train, cfg.model
    if t.threads:
        torch.set_num_threads(t.threads)
    device = pick_device(t.device)
    dtype = pick_dtype(t.dtype, device)
    amp = autocast(device, dtype)
    seed_everything(cfg.seed)

    corpus = prepare_corpus(cfg.data, cfg.tokenizer)
    if len(corpus.validation) < 2:
        raise UserError("the validation split is shorter than 2 tokens")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK):
        raise UserError(f"run directory {run_dir} is not writable")
    if not resuming:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        corpus.tokenizer.save(str(run_dir / "tokenizer.json"))

    model = GPT(m, corpus.vocab_size, cfg.attention).to(device)
    optimizer = make_optimizer(model, cfg.optim)
    sampler = RandomWindows(corpus.train, m.block_size, t.batch_size, cfg.seed, device)
    eval_batches = fixed_windows(corpus.validation, min(m.block_size, len(corpus.validation) - 1),
                                 t.eval_batches, t.batch_size, seed=cfg.seed + 1)
    step, tokens_seen, best_val, elapsed, loss_window = 0, 0, math.inf, 0.0, []

    if resuming:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise UserError(f"cannot resume: {run_dir} holds no checkpoint")
        load_weights(model, ckpt / "model.safetensors")
        state = load_state(ckpt / "state.pt")
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        step, tokens_seen, best_val = state["step"], state["tokens_seen"], state["best_val"]
        elapsed, loss_window = state["elapsed"], list(state["loss_window"])
        if step >= t.max_steps:
            print(f"{run_dir} already finished ({step} of train.max_steps={t.max_steps} steps); "
                  f"raise train.max_steps to train further.", file=sys.stderr)
            return {}
        print(f"resuming {run_dir} from step {step}", file=sys.stderr)

    step_model = torch.compile(model) if t.compile else model
    writer = open_writer(run_dir, purge_step=step if resuming else None)
    if not resuming:
        writer.add_text("config", "```\n" + OmegaConf.to_yaml(OmegaConf.structured(cfg)) + "\n```", 0)
    leaky = not cfg.attention.is_causal()
    print(f"model: {model.num_params() / 1e6:.2f}M parameters, vocab {corpus.vocab_size}, "
          f"{device.type} {str(dtype).replace('torch.', '')}, run dir {run_dir}", file=sys.stderr)

    def checkpoint_state() -> dict:
        return {"optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
                "rng": rng_state(), "step": step, "tokens_seen": tokens_seen,
                "best_val": best_val, "elapsed": elapsed, "loss_window": list(loss_window)}

    def evaluate_and_save(final: bool) -> dict:
        nonlocal best_val
        metrics = {"val_loss": mean_loss(model, eval_batches, amp)}
        writer.add_scalar("val/loss", metrics["val_loss"], step)
        if leaky:
            with model.attention_variant(causal_variant(cfg.attention)):
                metrics["causal_val_loss"] = mean_loss(model, eval_batches, amp)
            writer.add_scalar("val/causal_loss", metrics["causal_val_loss"], step)
        else:
            metrics["causal_val_loss"] = metrics["val_loss"]
        for i, d in enumerate(attention_diagnostics(model, eval_batches[0][0], amp)):
            writer.add_scalar(f"attn/max_weight/layer{i}", d["max_weight"], step)
            writer.add_scalar(f"attn/entropy/layer{i}", d["entropy"], step)
        if t.sample_tokens > 0:
            writer.add_text("sample", sample_text(model, corpus, cfg, step, amp), step)
        if metrics["causal_val_loss"] < best_val:
            best_val = metrics["causal_val_loss"]
            save_best(run_dir, model, step, best_val)
        save_checkpoint(run_dir, step, model, checkpoint_state(), t.keep_checkpoints)
        writer.flush()
        return metrics

    start_tokens, step_seconds = tokens_seen, 0.0  # this process's pure training throughput
    t_last, tok_last = time.perf_counter(), tokens_seen
    t_start = time.perf_counter() - elapsed
    stopped_by, metrics = None, {}
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    bar = tqdm(total=t.max_steps, initial=step, disable=not t.progress or None, dynamic_ncols=True,
               unit="step", file=sys.stderr)
    model.train()
    with StopFlag() as stop:
        while step < t.max_steps:
            t_step = time.perf_counter()
            lr = lr_at(step, cfg.optim, t.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = sampler.next_batch()
            with amp:
                _, loss = step_model(x, y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
            loss_value = loss.item()
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                raise TrainingDiverged(
                    f"non-finite {'loss' if not math.isfinite(loss_value) else 'gradient'} at step "
                    f"{step}; the last good checkpoint is kept in {run_dir / 'checkpoints'} "
                    f"(try a lower optim.lr)")
            log_now = (step + 1) % t.log_interval == 0
            qk = qk_grad_norms(model) if log_now else None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += x.numel()
            loss_window.append(loss_value)
            step_seconds += time.perf_counter() - t_step

            if log_now:
                now = time.perf_counter()
                tok_s = (tokens_seen - tok_last) / max(now - t_last, 1e-9)
                t_last, tok_last = now, tokens_seen
                train_loss = float(np.mean(loss_window))
                loss_window = []
                writer.add_scalar("train/loss", train_loss, step)
                writer.add_scalar("lr", lr, step)
                writer.add_scalar("grad_norm", grad_norm, step)
                writer.add_scalar("tokens_per_sec", tok_s, step)
                for i, g in enumerate(qk):
                    writer.add_scalar(f"attn/grad_norm_q/layer{i}", g["q"], step)
                    writer.add_scalar(f"attn/grad_norm_k/layer{i}", g["k"], step)
                metrics["train_loss"] = train_loss
                bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
                if bar.disable:
                    print(f"step {step}/{t.max_steps} loss {train_loss:.4f} {tok_s:,.0f} tok/s",
                          file=sys.stderr, flush=True)
            bar.update(1)

            elapsed = time.perf_counter() - t_start
            out_of_time = t.max_minutes is not None and elapsed >= 60 * t.max_minutes
            if step % t.eval_interval == 0 and step < t.max_steps and not out_of_time:
                metrics.update(evaluate_and_save(final=False))
                bar.write(f"step {step}: val loss {metrics['val_loss']:.4f}"
                          + (f", causal val loss {metrics['causal_val_loss']:.4f}" if leaky else ""))
                t_last = time.perf_counter()  # evaluation time is not training throughput
            if stop.signal or out_of_time:
                stopped_by = stop.signal or f"time budget of {t.max_minutes} min"
                break
        bar.close()
        metrics.update(evaluate_and_save(final=True))

    if stopped_by and stop.signal:
        print(f"stopped by {stopped_by} at step {step}; checkpoint saved. Continue with:\n"
              f"  python train.py resume={run_dir}", file=sys.stderr)
        writer.close()
        return metrics

    metrics["train_time_min"] = elapsed / 60
    metrics["tokens_per_sec"] = (tokens_seen - start_tokens) / max(step_seconds, 1e-9)
    metrics["steps"] = step
    if t.final_full_eval:
        full = full_split_loss(model, corpus.validation, m.block_size, t.batch_size, amp)
        metrics["val_loss_full"] = full
        metrics["val_bpc_full"] = bits_per_char(full, len(corpus.validation),
                                                corpus.n_chars["validation"])
        writer.add_scalar("val/loss_full", full, step)
        writer.add_scalar("val/bpc_full", metrics["val_bpc_full"], step)
        if leaky:
            with model.attention_variant(causal_variant(cfg.attention)):
                metrics["causal_val_loss_full"] = full_split_loss(
                    model, corpus.validation, m.block_size, t.batch_size, amp)
            writer.add_scalar("val/causal_loss_full", metrics["causal_val_loss_full"], step)
    metrics["val_bpc"] = bits_per_char(metrics["causal_val_loss"], len(corpus.validation),
                                       corpus.n_chars["validation"])
    write_hparams(writer, cfg, {k: v for k, v in metrics.items()
                                if k in ("val_loss", "causal_val_loss", "train_loss", "val_bpc",
                                         "val_loss_full", "causal_val_loss_full", "val_bpc_full")})
    writer.close()
    return metrics


def report(metrics: dict, run_dir: Path) -> None:
    if not metrics:
        return
    rows = [("steps", "steps", "{:.0f}"), ("train_time_min", "train time (min)", "{:.2f}"),
            ("train_loss", "train loss", "{:.4f}"), ("val_loss", "val loss (eval batches)", "{:.4f}"),
            ("causal_val_loss", "causal val loss", "{:.4f}"),
            ("val_loss_full", "val loss (whole split)", "{:.4f}"),
            ("val_bpc_full", "val bits/char (whole split)", "{:.4f}")]
    print(f"\nrun: {run_dir}")
    for key, label, fmt in rows:
        if key in metrics:
            print(f"  {label:<28} {fmt.format(metrics[key])}")
    print(f"sample: python generate.py run={run_dir} prompt='ROMEO:'")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    try:
        conf, run_dir, resuming = resolve_run(cfg)
        metrics = train(conf, run_dir, resuming)
    except (UserError, CorpusError, CheckpointError, OmegaConfBaseException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    report(metrics, run_dir)
    if HydraConfig.get().mode.name == "RUN":
        link_latest(run_dir)
    return metrics.get("causal_val_loss", math.nan)


if __name__ == "__main__":
    main()
