"""Train a GPT on the default corpus (or any other) with Hydra configs.

    python train.py                                   # Shakespeare, char-level, ~10 min on 2 cores
    python train.py +experiment=smoke                 # a few seconds
    python train.py model.n_layer=6 tokenizer=bpe     # any value in conf/ can be overridden
    python train.py attention=no_scale                # one of the attention pitfalls
    python train.py resume=runs/<run dir>             # continue from the latest checkpoint
    python train.py -m +experiment=ablations          # the whole pitfall study (multirun)
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data.batches import RandomWindows, fixed_windows
from data.prepare import PreparedCorpus, prepare_corpus
from data.shakespeare import CorpusError
from data.tokenizer import load_tokenizer
from model.attention import causal_variant
from model.gpt import GPT
from training.checkpoint import (CHECKPOINTS, CheckpointError, atomic_write, holds_checkpoints,
                                 latest_checkpoint, load_state, load_weights, save_best,
                                 save_checkpoint)
from training.config import Config, NonFinite, register_configs, validate
from training.device import autocast, pick_dtype
from training.distributed import (NullWriter, World, all_sum, barrier, broadcast_from_main,
                                  init_world, shutdown)
from training.evaluate import (attention_diagnostics, bits_per_char, full_split_loss, mean_loss,
                               qk_grad_norms)
from training.optim import lr_at, make_optimizer
from training.errors import TrainingDiverged, UserError, first_line, one_line, root_cause
from training.signals import StopFlag
from training.state import rng_state, seed_everything, set_rng_state
from training.tb import open_writer, write_hparams

register_configs()


# ----------------------------------------------------------------------------- setup


def resolve_run(cfg: DictConfig) -> tuple[Config, Path, bool]:
    """The typed config and the run directory; for `resume=DIR`, the saved config of DIR with
    this command's other overrides on top (e.g. a larger train.max_steps)."""
    if cfg.resume:
        run_dir = Path(cfg.resume)
        saved = run_dir / "config.yaml"
        if not saved.is_file():
            raise UserError(f"cannot resume: {saved} does not exist (is {run_dir} a run directory?)")
        try:
            saved_cfg = OmegaConf.load(saved)
        except Exception as exc:  # YAML syntax, unreadable file
            raise UserError(f"cannot resume: {saved} is not a readable run config: "
                            f"{first_line(exc)}") from exc
        merged = OmegaConf.merge(OmegaConf.structured(Config), saved_cfg)
        # What this command overrode wins over the saved config, taken from the config Hydra has
        # composed (so values are parsed as usual): a key (train.max_steps=...) or a whole group
        # (data=...). Packages such as +experiment=... only select values and are not replayed.
        for override in HydraConfig.get().overrides.task:
            key = override.lstrip("+~").split("=", 1)[0]
            if key == "resume" or key.startswith("hydra.") or ("." not in key and key not in cfg):
                continue
            OmegaConf.update(merged, key, OmegaConf.select(cfg, key), merge=False)
        merged.resume = str(run_dir)
        cfg = merged
    else:
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if holds_checkpoints(run_dir):
            raise UserError(f"{run_dir} already holds a checkpoint; resume it with resume={run_dir} "
                            "or choose another hydra.run.dir")
    conf: Config = OmegaConf.to_object(cfg)
    try:
        validate(conf)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    return conf, run_dir, bool(cfg.resume)


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


def load_corpus(cfg: Config) -> PreparedCorpus:
    """prepare_corpus, with the errors of the libraries below it (undecodable text, a tokenizer
    that cannot be built) turned into CorpusError."""
    try:
        return prepare_corpus(cfg.data, cfg.tokenizer)
    except CorpusError:
        raise
    except (OSError, ValueError) as exc:  # includes UnicodeDecodeError
        raise CorpusError(f"cannot read or tokenize the corpus: {root_cause(exc)}") from exc
    except Exception as exc:
        if type(exc).__module__.split(".")[0] != "datasets":
            raise
        raise CorpusError(f"cannot read the corpus files: {root_cause(exc)}") from exc


def check_tokenizer(corpus: PreparedCorpus, saved: Path) -> None:
    """On resume, the tokenizer built from today's data must be the run's own."""
    try:
        run_tokenizer = load_tokenizer(saved)
    except Exception as exc:  # tokenizers raises plain Exception
        raise CheckpointError(f"cannot resume: cannot read {saved}: {first_line(exc)}") from exc
    if run_tokenizer.get_vocab() != corpus.tokenizer.get_vocab():
        raise UserError(
            f"cannot resume: the tokenizer built from the current data ({corpus.vocab_size} tokens) "
            f"differs from the run's {saved} ({run_tokenizer.get_vocab_size()} tokens); the corpus "
            f"(data.*) or the tokenizer config changed since the run started")


def restore(run_dir: Path, model, optimizer, sampler, corpus: PreparedCorpus) -> dict:
    """Load the latest checkpoint of run_dir into model, optimizer, sampler and the RNGs; return
    the loop counters saved with it."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        pointer = run_dir / CHECKPOINTS / "latest"
        if pointer.is_file():
            raise CheckpointError(f"cannot resume: {pointer} names {pointer.read_text().strip()!r}, "
                                  f"which is not in {pointer.parent}")
        raise UserError(f"cannot resume: {run_dir} holds no checkpoint")
    check_tokenizer(corpus, run_dir / "tokenizer.json")
    load_weights(model, ckpt / "model.safetensors")
    state = load_state(ckpt / "state.pt")
    try:
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"training state {ckpt / 'state.pt'} does not fit this model and "
                              f"run: {first_line(exc)}") from exc
    return {"step": state["step"], "tokens_seen": state["tokens_seen"], "best_val": state["best_val"],
            "elapsed": state.get("elapsed", 0.0), "loss_window": list(state.get("loss_window", [])),
            "skipped": state.get("skipped", 0)}


def train(cfg: Config, run_dir: Path, resuming: bool, world: World) -> dict:
    t, m = cfg.train, cfg.model
    if t.threads:
        torch.set_num_threads(t.threads)
    device = world.device
    dtype = pick_dtype(t.dtype, device)
    amp = autocast(device, dtype)
    seed_everything(cfg.seed)

    # Rank 0 builds the token cache first; the others then only read it.
    corpus = load_corpus(cfg) if world.is_main else None
    barrier(world)
    corpus = corpus or load_corpus(cfg)
    if len(corpus.validation) < 2:
        raise UserError("the validation split is shorter than 2 tokens")
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(run_dir, os.W_OK):
            raise UserError(f"run directory {run_dir} is not writable")
        if not resuming:
            atomic_write(run_dir / "tokenizer.json", corpus.tokenizer.to_str().encode())
            atomic_write(run_dir / "config.yaml",
                         OmegaConf.to_yaml(OmegaConf.structured(cfg)).encode())

    model = GPT(m, corpus.vocab_size, cfg.attention).to(device)
    optimizer = make_optimizer(model, cfg.optim)
    sampler = RandomWindows(corpus.train, m.block_size, t.batch_size, cfg.seed, device)
    eval_batches = fixed_windows(corpus.validation, min(m.block_size, len(corpus.validation) - 1),
                                 t.eval_batches, t.batch_size, seed=cfg.seed + 1)
    step, tokens_seen, best_val, elapsed, loss_window, skipped = 0, 0, math.inf, 0.0, [], 0
    if resuming:
        saved = restore(run_dir, model, optimizer, sampler, corpus)
        step, tokens_seen, best_val = saved["step"], saved["tokens_seen"], saved["best_val"]
        elapsed, loss_window, skipped = saved["elapsed"], saved["loss_window"], saved["skipped"]
        if step >= t.max_steps:
            if world.is_main:
                print(f"{run_dir} already finished ({step} of train.max_steps={t.max_steps} steps); "
                      f"raise train.max_steps to train further.", file=sys.stderr)
            return {}
        if world.is_main:
            print(f"resuming {run_dir} from step {step}", file=sys.stderr)

    # DDP averages gradients over ranks during backward; with accumulation, only the last
    # micro-step of an optimizer step synchronises (no_sync on the others).
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if world.distributed else model
    use_compile = t.compile if t.compile is not None else device.type == "cuda"
    step_model = torch.compile(ddp_model) if use_compile else ddp_model
    # On resume, purge from step + 1: what was logged at the checkpoint's own step is part of it
    # (kept), anything later came from the interrupted process and is logged again. A fresh run
    # purges from 0: the curves of an attempt killed before its first checkpoint do not show.
    writer = open_writer(run_dir, purge_step=step + 1 if resuming else 0) if world.is_main \
        else NullWriter()
    if not resuming:
        writer.add_text("config", "```\n" + OmegaConf.to_yaml(OmegaConf.structured(cfg)) + "\n```", 0)
    leaky = not cfg.attention.is_causal()
    tokens_per_step = t.batch_size * t.grad_accum * world.size * m.block_size
    if world.is_main:
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, vocab {corpus.vocab_size}, "
              f"{device.type} {str(dtype).replace('torch.', '')}, {world.size} process(es), "
              f"{tokens_per_step:,} tokens per step (batch {t.batch_size} x accumulation "
              f"{t.grad_accum} x processes {world.size} x block {m.block_size}), run dir {run_dir}",
              file=sys.stderr)

    def checkpoint_state() -> dict:
        return {"optimizer": optimizer.state_dict(), "sampler": sampler.state_dict(),
                "rng": rng_state(), "step": step, "tokens_seen": tokens_seen,
                "best_val": best_val, "elapsed": elapsed, "loss_window": list(loss_window),
                "skipped": skipped}

    saved_at = step if resuming else None  # step of the newest checkpoint on disk

    def save() -> None:
        nonlocal saved_at
        if world.is_main:
            writer.flush()  # everything logged up to this step is on disk before the checkpoint
            save_checkpoint(run_dir, step, model, checkpoint_state(), t.keep_checkpoints)
        saved_at = step

    def evaluate_and_save() -> dict:
        """Every rank evaluates its share of the batches; rank 0 logs, samples and saves."""
        nonlocal best_val
        metrics = {"val_loss": mean_loss(model, eval_batches, amp, world)}
        writer.add_scalar("val/loss", metrics["val_loss"], step)
        # per character, so runs with different tokenizers share one axis (the split's
        # tokens-per-character ratio converts the sampled batches' nats/token)
        writer.add_scalar("val/bpc", bits_per_char(metrics["val_loss"], len(corpus.validation),
                                                   corpus.n_chars["validation"]), step)
        if leaky:
            with model.attention_variant(causal_variant(cfg.attention)):
                metrics["causal_val_loss"] = mean_loss(model, eval_batches, amp, world)
            writer.add_scalar("val/causal_loss", metrics["causal_val_loss"], step)
        else:
            metrics["causal_val_loss"] = metrics["val_loss"]
        if world.is_main:
            for i, d in enumerate(attention_diagnostics(model, eval_batches[0][0], amp)):
                writer.add_scalar(f"attn/max_weight/layer{i}", d["max_weight"], step)
                writer.add_scalar(f"attn/entropy/layer{i}", d["entropy"], step)
            if t.sample_tokens > 0:
                writer.add_text("sample", sample_text(model, corpus, cfg, step, amp), step)
        if metrics["causal_val_loss"] < best_val:
            best_val = metrics["causal_val_loss"]
            if world.is_main:
                save_best(run_dir, model, step, best_val)
        save()
        return metrics

    start_tokens, step_seconds = tokens_seen, 0.0  # this process's pure training throughput
    t_last, tok_last = time.perf_counter(), tokens_seen
    t_start = time.perf_counter() - elapsed
    stopped_by, metrics = None, {}
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    bar = tqdm(total=t.max_steps, initial=step, dynamic_ncols=True, unit="step", file=sys.stderr,
               disable=True if not (t.progress and world.is_main) else None)
    model.train()
    with StopFlag() as stop:
        while step < t.max_steps:
            t_step = time.perf_counter()
            lr = lr_at(step, cfg.optim, t.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's may have its own scale
            loss_sum = 0.0
            micro_batches = sampler.next_step(t.grad_accum, world.rank, world.size)
            for i, (x, y) in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                sync = contextlib.nullcontext() if last or not world.distributed \
                    else ddp_model.no_sync()
                with sync:
                    with amp:
                        _, loss = step_model(x, y)
                    if t.inject_nan_at_step == step:
                        loss = loss * float("nan")
                    (loss / len(micro_batches)).backward()
                loss_sum += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
            loss_value = all_sum([loss_sum / len(micro_batches)], world)[0] / world.size
            finite = math.isfinite(loss_value) and math.isfinite(grad_norm)
            if not finite:
                what = "loss" if not math.isfinite(loss_value) else "gradient"
                if t.on_nonfinite is NonFinite.stop:
                    writer.close()
                    kept = (f"the last good checkpoint (step {saved_at}) is kept in "
                            f"{run_dir / CHECKPOINTS}" if saved_at is not None
                            else "no checkpoint had been saved yet")
                    raise TrainingDiverged(
                        f"non-finite {what} at step {step}; stopped without saving, {kept} "
                        f"(lower optim.lr, or set train.on_nonfinite=skip)")
                skipped += 1
                # logged at step + 1, like everything about this step: a checkpoint at `step`
                # precedes it, so a resumed run purges it rather than logging it twice
                writer.add_scalar("train/skipped_steps", skipped, step + 1)
                bar.write(f"step {step}: non-finite {what}, step skipped ({skipped} so far)")
            log_now = (step + 1) % t.log_interval == 0
            qk = qk_grad_norms(model) if log_now and finite and world.is_main else []
            if finite:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if finite:
                tokens_seen += tokens_per_step
                loss_window.append(loss_value)
            step_seconds += time.perf_counter() - t_step

            if log_now and loss_window:
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
            bar.update(1)

            elapsed = time.perf_counter() - t_start
            # every rank must take the same branch below: agree on the stop conditions
            stop_asked, out_of_time = (v > 0 for v in all_sum(
                [float(stop.signal is not None),
                 float(t.max_minutes is not None and elapsed >= 60 * t.max_minutes)], world))
            if step % t.eval_interval == 0 and step < t.max_steps and not out_of_time:
                metrics.update(evaluate_and_save())
                bar.write(f"step {step}: train loss {metrics.get('train_loss', math.nan):.4f}, "
                          f"val loss {metrics['val_loss']:.4f}"
                          + (f", causal val loss {metrics['causal_val_loss']:.4f}" if leaky else ""))
                t_last = time.perf_counter()  # evaluation time is not training throughput
            if (stop_asked or out_of_time) and step < t.max_steps:
                stopped_by = (stop.signal or "a signal to another process") if stop_asked \
                    else f"time budget of {t.max_minutes} min"
                break
        bar.close()
        signalled = stopped_by is not None and stop_asked
        if signalled:
            # Only a checkpoint, no evaluation: an extra evaluation would log an extra val/loss
            # point and could move `best`, and the resumed run must match an uninterrupted one.
            if saved_at != step:
                save()
        else:
            metrics.update(evaluate_and_save())

    if signalled:
        if world.is_main:
            print(f"stopped by {stopped_by} at step {step}; checkpoint saved. Continue with:\n"
                  f"  python train.py resume={run_dir}", file=sys.stderr)
        writer.close()
        # exit as the signal asked (this also ends a multirun sweep, not just the current job)
        signum = signal.Signals[stop.signal].value if stop.signal else signal.SIGTERM.value
        raise SystemExit(128 + signum)

    metrics["train_time_min"] = elapsed / 60
    metrics["tokens_per_sec"] = (tokens_seen - start_tokens) / max(step_seconds, 1e-9)
    metrics["steps"] = step
    if t.final_full_eval:
        full = full_split_loss(model, corpus.validation, m.block_size, t.batch_size, amp, world)
        metrics["val_loss_full"] = full
        metrics["val_bpc_full"] = bits_per_char(full, len(corpus.validation),
                                                corpus.n_chars["validation"])
        metrics["val_nats_per_char_full"] = metrics["val_bpc_full"] * math.log(2)
        writer.add_scalar("val/loss_full", full, step)
        writer.add_scalar("val/bpc_full", metrics["val_bpc_full"], step)
        if leaky:
            with model.attention_variant(causal_variant(cfg.attention)):
                metrics["causal_val_loss_full"] = full_split_loss(
                    model, corpus.validation, m.block_size, t.batch_size, amp, world)
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
            ("val_nats_per_char_full", "val nats/char (whole split)", "{:.4f}"),
            ("val_bpc_full", "val bits/char (whole split)", "{:.4f}")]
    print(f"\nrun: {run_dir}")
    for key, label, fmt in rows:
        if key in metrics:
            print(f"  {label:<28} {fmt.format(metrics[key])}")
    print(f"sample: python generate.py run={run_dir} prompt='ROMEO:'")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float:
    world = None
    try:
        conf, run_dir, resuming = resolve_run(cfg)
        try:
            world = init_world(conf.train.device)
        except (ValueError, RuntimeError) as exc:  # no CUDA here, or no such device index
            raise UserError(first_line(exc)) from exc
        run_dir = Path(broadcast_from_main(str(run_dir), world))  # rank 0's directory for all
        metrics = train(conf, run_dir, resuming, world)
    except (UserError, CorpusError, CheckpointError, OmegaConfBaseException, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    finally:
        if world is not None:
            shutdown(world)
    if world.is_main:
        report(metrics, run_dir)
        if HydraConfig.get().mode.name == "RUN":
            link_latest(run_dir)
    return metrics.get("causal_val_loss", math.nan)


# ----------------------------------------------------------------------------- command line


def preflight(argv: list[str]) -> None:
    """Checks that must come before Hydra, which creates hydra.run.dir and writes .hydra/ into it
    before main runs: a directory holding a checkpoint is never written into by a new run, and
    one that cannot be created is reported in one line."""
    if any(a in ("-m", "--multirun") for a in argv):
        return
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in argv if not a.startswith("-")])
    except Exception:  # Hydra reports an unparsable override itself
        return
    options = {o.key_or_group: o.value() for o in parsed if not o.is_delete()}
    run_dir = options.get("hydra.run.dir")
    if not isinstance(run_dir, str) or "${" in run_dir:
        return
    path = Path(run_dir)
    if not options.get("resume") and holds_checkpoints(path):
        raise UserError(f"{path} already holds a checkpoint; resume it with resume={path} "
                        "or choose another hydra.run.dir")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"cannot create the run directory {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"cannot create the run directory {path}: {existing} is not writable")
    try:
        path.mkdir(parents=True, exist_ok=True)  # as Hydra is about to, but with a clear error
    except OSError as exc:
        raise UserError(f"cannot create the run directory {path}: {exc.strerror}") from exc


def cli() -> None:
    """python train.py ...: Hydra's main, with the mistakes Hydra finds itself (an unknown key or
    option, an unparsable override, a run directory it cannot create) reported in one line too.
    HYDRA_FULL_ERROR=1 set by the user still shows Hydra's full traceback."""
    user_wants_trace = os.environ.get("HYDRA_FULL_ERROR") == "1"
    if int(os.environ.get("RANK", "0")) > 0:
        # Under torchrun only rank 0 owns a run directory; the others write nothing of Hydra's.
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null",
                     "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            preflight(sys.argv[1:])
        os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing several lines
        main()
    except (UserError, HydraException, OmegaConfBaseException, OSError) as exc:
        if user_wants_trace:
            raise
        print(f"error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("error: interrupted; the last complete checkpoint, if any, is kept", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()
