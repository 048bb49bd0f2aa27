"""Train a GPT with Hydra configs (default: byte-level BPE on the works of Shakespeare).

    python train.py                                   # the default: 2,500 steps, 7 to 11 min on 2 CPU cores
    python train.py +experiment=smoke                 # a few seconds
    python train.py +experiment=gpu                   # the recipe for one large GPU (docs/gpu.md)
    python train.py model.n_layer=6 tokenizer=char    # any value in conf/ can be overridden
    python train.py attention=no_scale                # one of the attention pitfalls
    python train.py resume=runs/<run dir>             # continue from the latest checkpoint
    python train.py -m +experiment=ablations          # the whole pitfall study (multirun)

Read `train()` first: it is the whole loop. The pieces it calls follow it in reading order:
`build_run` (data, model, optimizer, logging, restored state), `optimizer_step` (one step over
its micro-batches), `evaluate` (validation losses, then what follows from them) and
`stop_after_signal`. The run's summary is training/summary.py's (`final_metrics`, `report`).
The command line comes last; its checks are in guard/.
"""
from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from check_attention.your_layer import keep_layer, run_model
from data.batches import RandomWindows, check_split_lengths, fixed_windows, training_windows
from data.config import DataConfig
from data.prepare import PreparedCorpus, prepare_corpus
from guard.launch import Launch
from guard.preflight import Job, start_model
from model.gpt import GPT
from safeio.cli import UserError, python_command
from training.checkpoint import (CHECKPOINTS, Progress, link_latest, restore, rng_state, save_best,
                                 save_checkpoint, seed_everything, set_rng_state, write_run_config,
                                 write_run_files)
from training.budget import PROBE_STEPS, StepBudget
from training.config import Config, NonFinite, register_configs
from training.cpu_memory import keep_freed_memory
from training.dtype_probe import choose_dtype
from training.evaluate import (attention_diagnostics, mean_loss, prefix_losses, qk_grad_norms,
                               rising_validation, sample_text)
from training.optim import Optimizers, lr_at, make_optimizer
from training.runtime import (Speedometer, StopFlag, World, all_mean, all_sum, barrier,
                              broadcast_from_main, init_world, shutdown)
from training.summary import (final_metrics, leak_message, overfitting_message, report, to_bpc,
                              to_nats_per_char)
from training.tb import log_attention_maps, open_writer, write_config

register_configs()
log = logging.getLogger("train")  # Hydra sends it to the console and to the run's train.log


@dataclass
class Run:
    """Everything one training run works with, made once by `build_run`."""

    cfg: Config
    run_dir: Path
    world: World
    corpus: PreparedCorpus
    model: GPT                      # the weights: what checkpoints save and evaluation runs
    step_model: torch.nn.Module     # what the training step calls: model under DDP / compile
    optimizer: Optimizers
    sampler: RandomWindows
    eval_batches: list              # the same validation batches at every evaluation
    amp: contextlib.AbstractContextManager
    writer: object                  # SummaryWriter on rank 0, NullWriter elsewhere
    progress: Progress
    ddp: Optional[DDP] = None       # the DDP wrapper, when there are several processes
    compiled: bool = False          # step_model is torch.compile's
    saved_at: Optional[int] = None  # step of the newest checkpoint on disk
    metrics: dict = field(default_factory=dict)  # of the latest evaluation
    last_train_loss: float = math.nan
    overfitting: bool = False       # the guard has fired (and train.early_stop asks to stop)
    leak_reported: bool = False     # the guard has said a leaky variant's causal loss rises
    asked_steps: int = 0            # train.max_steps as this process started (budget: before it)

    @property
    def tokens_per_step(self) -> int:
        t = self.cfg.train
        return t.batch_size * t.grad_accum * self.world.size * self.cfg.model.block_size

    @property
    def leaky(self) -> bool:  # ours by its config; a learner's layer by measure (causal > own)
        gap = self.metrics.get("causal_val_loss", 0.0) - self.metrics.get("val_loss", 0.0)
        return not self.cfg.attention.is_causal() or bool(self.cfg.your_layer) and gap > 0.01


@dataclass
class StepResult:
    loss: float            # mean over the step's micro-batches and processes
    grad_norm: float       # before clipping
    lr: float
    qk_norms: list = field(default_factory=list)  # [(|dW_Q|, |dW_K|)] per layer, at log steps


def train(cfg: Config, run_dir: Path, resuming: bool, world: World) -> dict:
    run = build_run(cfg, run_dir, resuming, world)
    if run is None:
        return {}  # a finished run was resumed: nothing to do
    t, p = cfg.train, run.progress
    run.asked_steps = t.max_steps
    meter = Speedometer()
    budget = StepBudget(t.budget_minutes, p.step, t.eval_interval)
    started = time.perf_counter() - p.elapsed
    bar = tqdm(total=t.max_steps, initial=p.step, dynamic_ncols=True, unit="step", file=sys.stderr,
               disable=True if not (t.progress and world.is_main) else None)
    stop_asked = False
    with StopFlag() as stop, logging_redirect_tqdm():
        while p.step < t.max_steps:
            tick = time.perf_counter()
            result = optimizer_step(run, stop)
            if result is None:  # a signal between micro-batches: the step was taken back
                stop_asked = True
                break
            seconds = time.perf_counter() - tick
            meter.add(run.tokens_per_step, seconds)
            if budget.add(p.step, seconds):  # train.budget_minutes: the step count, (re)fixed now
                fit_budget(run, budget, bar)
            if (p.step % t.log_interval == 0 or p.step == t.max_steps) and p.loss_window:
                tokens_per_sec = meter.window_rate()
                log_training(run, result, tokens_per_sec)
                bar.set_postfix(loss=f"{run.last_train_loss:.3f}", tok_s=f"{tokens_per_sec:,.0f}",
                                refresh=False)
            bar.update(1)
            p.elapsed = time.perf_counter() - started
            # every rank must take the same branch below: agree on the stop conditions
            stop_asked, out_of_time = (v > 0 for v in all_sum(
                [float(stop.signal is not None),
                 float(t.max_minutes is not None and p.elapsed >= 60 * t.max_minutes)], world))
            if p.step % t.eval_interval == 0 and p.step < t.max_steps and not out_of_time:
                evaluate(run)
            if stop_asked or out_of_time or (run.overfitting and t.early_stop):
                break
        bar.close()
    if stop_asked:  # by a signal, here or to another process: save, say how to continue, exit
        stop_after_signal(run, stop)
    if p.step < t.max_steps:  # train.max_minutes or train.early_stop ended it
        stopped_early(run, out_of_time)
    if not p.history or p.history[-1][0] != p.step:  # unless this step was just evaluated
        evaluate(run, last=True)
    elif not t.sample_every_eval and t.sample_tokens > 0 and world.is_main:  # (none logged)
        log_sample(run)
    metrics = run.metrics | final_metrics(run, meter)
    run.writer.close()
    return metrics


# ----------------------------------------------------------------------------- the pieces


def build_run(cfg: Config, run_dir: Path, resuming: bool, world: World) -> Optional[Run]:
    """Data, model, optimizer, sampler and logging for a new run, or all of them restored from
    the run's latest checkpoint. None when a resumed run has already finished."""
    t, m = cfg.train, cfg.model
    if t.threads:
        torch.set_num_threads(t.threads)
    device = world.device
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any matmul left in float32
    if device.type == "cpu":  # each step reuses the memory the last one freed
        keep_freed_memory()
    seed_everything(cfg.seed)

    # Rank 0 builds the token cache first; the others then only read it.
    corpus = prepare_corpus(cfg.data, cfg.tokenizer) if world.is_main else None
    barrier(world)
    corpus = corpus or prepare_corpus(cfg.data, cfg.tokenizer)
    check_split_lengths(corpus.train, corpus.validation, m.block_size)
    # dtype=auto is settled once (on a CPU by measuring, on rank 0) and config.yaml records the
    # result: a resumed run trains in the dtype it started with
    choice = broadcast_from_main(choose_dtype(cfg, corpus.vocab_size, device)
                                 if world.is_main else None, world)
    t.dtype, dtype = choice.name, choice.dtype
    if world.is_main:
        if not resuming:  # (a resume logs it once its checkpoint has been read and judged)
            log.info(choice.line)
        run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.your_layer and not resuming:  # the run keeps the file it trains (rank 0 writes it)
        keep_layer(cfg, run_dir, write=world.is_main)
        barrier(world)
    if world.is_main and not resuming:
        write_run_files(run_dir, corpus.tokenizer, cfg)

    # a new run starts from init_from='s weights; on CUDA, may impl=auto trust our kernel here?
    model = run_model(cfg, corpus.vocab_size, run_dir, trusted=not resuming or cfg.trust_layer)
    model = start_model(model, cfg, resuming, device, dtype)
    optimizer = make_optimizer(model, cfg.optim, dtype)
    sampler = training_windows(cfg.data.order, corpus.train, m.block_size, t.batch_size, cfg.seed,
                               device)
    eval_batches = fixed_windows(corpus.validation, min(m.block_size, len(corpus.validation) - 1),
                                 t.eval_batches, t.batch_size, seed=cfg.seed + 1, device=device)
    progress = Progress()
    if resuming:
        progress = restore(run_dir, model, optimizer, sampler, corpus.tokenizer)
        if progress.step >= t.max_steps:
            log.info(f"{run_dir} already finished ({progress.step} of train.max_steps="
                     f"{t.max_steps} steps); raise train.max_steps to train further.")
            return None
        log.info(f"resuming {run_dir} from step {progress.step}")
        log.info(choice.line)

    # DDP averages gradients over ranks during backward; with accumulation, only the last
    # micro-step of an optimizer step synchronises (no_sync on the others).
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None) \
        if world.distributed else None
    step_model = ddp or model
    compiled = t.compile if t.compile is not None else device.type == "cuda"
    if compiled:
        step_model = torch.compile(step_model, mode=t.compile_mode)
    # On resume, purge from step + 1: what was logged at the checkpoint's own step is part of it
    # (kept), anything later came from the interrupted process and is logged again. A fresh run
    # purges from 0: the curves of an attempt killed before its first checkpoint do not show.
    writer = open_writer(run_dir, purge_step=progress.step + 1 if resuming else 0,
                         enabled=world.is_main)
    for warning in corpus.warnings if world.is_main else ():  # e.g. data.allow_overlap=true
        log.warning(warning)
        writer.add_text("warnings", warning, progress.step)
    if not resuming:
        write_config(writer, cfg)
    run = Run(cfg, run_dir, world, corpus, model, step_model, optimizer, sampler, eval_batches,
              choice.autocast(device), writer, progress, ddp=ddp, compiled=compiled,
              saved_at=progress.step if resuming else None)
    if world.is_main:
        log.info(f"model: {model.num_params() / 1e6:.2f}M parameters, vocab {corpus.vocab_size}, "
                 f"{device.type} {str(dtype).replace('torch.', '')}, {world.size} process(es), "
                 f"{run.tokens_per_step:,} tokens per step (batch {t.batch_size} x accumulation "
                 f"{t.grad_accum} x processes {world.size} x block {m.block_size}), run dir {run_dir}")
    return run


def fit_budget(run: Run, budget: StepBudget, bar) -> None:
    """Fix train.max_steps from the measured step time (training/budget.py); every rank takes the
    mean times, so all agree. config.yaml records the count: a resume keeps the schedule."""
    t, step = run.cfg.train, run.progress.step
    step_seconds, spent = all_mean(torch.tensor([budget.step_seconds(), budget.spent],
                                                dtype=torch.float64), run.world).tolist()
    steps = budget.decide(step, step_seconds, spent, t.max_steps)
    if steps is None:
        return
    if run.world.is_main:
        left = "" if step == PROBE_STEPS else \
            f", {(60 * t.budget_minutes - spent) / 60:.1f} left at step {step:,},"
        log.info(f"time budget: {t.budget_minutes:g} min{left} at {1000 * step_seconds:.0f} ms a "
                 f"step: "
                 + (f"{steps:,} steps" if steps < t.max_steps
                    else f"all train.max_steps={t.max_steps:,} fit"))
    if steps < t.max_steps:
        t.max_steps = bar.total = steps
        bar.refresh()
        fewer_steps(run, f"train.budget_minutes={t.budget_minutes:g} fixed {steps:,} of the "
                         f"{run.asked_steps:,} steps asked, at {1000 * step_seconds:.0f} ms a step")


def fewer_steps(run: Run, why: str) -> None:
    """The run trains fewer steps than it was started with: train.fewer_steps says why, in
    config.yaml (written again now) and in the summary."""
    run.cfg.train.fewer_steps = why
    if run.world.is_main:
        write_run_config(run.run_dir, run.cfg)


def stopped_early(run: Run, out_of_time: bool) -> None:
    """train.max_minutes (out of time) or train.early_stop ended the run before train.max_steps."""
    t, p = run.cfg.train, run.progress
    if out_of_time:
        log.info(f"time budget of {t.max_minutes} min reached at step {p.step}")
    by = f"train.max_minutes={t.max_minutes:g}" if out_of_time else "train.early_stop"
    fewer_steps(run, f"{by} stopped it at step {p.step:,} of train.max_steps={t.max_steps:,}"
                     + ("" if out_of_time else ": the validation loss was rising"))


def optimizer_step(run: Run, stop: Optional[StopFlag] = None) -> Optional[StepResult]:
    """One optimizer step: forward and backward over this process's micro-batches, clip, and
    update unless the loss or the gradient is not finite.

    The host waits for the device once per step, to read the loss and the gradient norm
    together; everything else stays queued on the device. With several micro-batches, a stop
    request (`stop`) is honoured between them: the step is taken back (gradients, the batch
    sampler and the random generators as they were before it) and None returned, so that the
    checkpoint saved next is the one an uninterrupted run had at this step.
    """
    cfg, p, world = run.cfg, run.progress, run.world
    t = cfg.train
    lr = lr_at(p.step, cfg.optim, t.max_steps)
    run.optimizer.set_lr(lr)
    before = (run.sampler.state_dict(), rng_state()) if stop and t.grad_accum > 1 else None
    micro_batches = run.sampler.next_step(t.grad_accum, world.rank, world.size)
    loss_sum = torch.zeros((), device=world.device)
    for i, (x, y) in enumerate(micro_batches):
        if i and before and all_sum([float(stop.signal is not None)], world)[0] > 0:
            run.optimizer.zero_grad(set_to_none=True)
            run.sampler.load_state_dict(before[0])
            set_rng_state(before[1])
            return None
        last = i == len(micro_batches) - 1
        # under DDP, gradients are averaged across processes on the last micro-batch only
        sync = contextlib.nullcontext() if last or run.ddp is None else run.ddp.no_sync()
        with sync:
            # a new step for torch.compile's CUDA graphs (compile_mode=reduce-overhead): the
            # previous step's outputs may be overwritten. Not called uncompiled, where it is a
            # no-op that imports torch's compiler stack (2.5 s of a worker's start on a CPU)
            if run.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            with run.amp:
                _, loss = run.step_model(x, y)
            (loss / len(micro_batches)).backward()
        loss_sum += loss.detach()
    log_now = (p.step + 1) % t.log_interval == 0
    qk = qk_grad_norms(run.model) if log_now else torch.zeros(0, 2, device=world.device)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), clip)
    step_loss = all_mean(loss_sum / len(micro_batches), world)
    loss, norm, *flat_qk = torch.cat([step_loss.view(1), grad_norm.view(1).float(),
                                      qk.flatten()]).tolist()  # the one host sync
    if math.isfinite(loss) and math.isfinite(norm):
        run.optimizer.step()
        p.tokens_seen += run.tokens_per_step
        p.loss_window.append(loss)
    else:
        skip_nonfinite(run, "loss" if not math.isfinite(loss) else "gradient")
    run.optimizer.zero_grad(set_to_none=True)
    p.step += 1
    return StepResult(loss, norm, lr, list(zip(flat_qk[::2], flat_qk[1::2])))


def skip_nonfinite(run: Run, what: str) -> None:
    """A non-finite loss or gradient: stop without saving (the default), or count a skipped step."""
    p = run.progress
    if run.cfg.train.on_nonfinite is NonFinite.stop:
        run.writer.close()
        kept = (f"the last good checkpoint (step {run.saved_at}) is kept in "
                f"{run.run_dir / CHECKPOINTS}" if run.saved_at is not None
                else "no checkpoint had been saved yet")
        raise UserError(f"non-finite {what} at step {p.step}; stopped without saving, {kept} "
                        f"(lower optim.lr, or set train.on_nonfinite=skip)")
    p.skipped += 1
    # logged at step + 1, like everything about this step: a checkpoint at `step` precedes it,
    # so a resumed run purges it rather than logging it twice
    run.writer.add_scalar("train/skipped_steps", p.skipped, p.step + 1)
    log.info(f"step {p.step}: non-finite {what}, step skipped ({p.skipped} so far)")


def log_training(run: Run, result: StepResult, tokens_per_sec: float) -> None:
    """The training curves, every train.log_interval steps and at the last step."""
    p, w = run.progress, run.writer
    run.last_train_loss = float(np.mean(p.loss_window))
    p.loss_window = []
    w.add_scalar("train/loss", run.last_train_loss, p.step)
    w.add_scalar("train/lr", result.lr, p.step)
    w.add_scalar("train/grad_norm", result.grad_norm, p.step)
    w.add_scalar("train/tokens_per_sec", tokens_per_sec, p.step)
    w.add_scalar("train/tokens_seen", p.tokens_seen, p.step)
    for i, (q, k) in enumerate(result.qk_norms):
        w.add_scalar(f"weights/grad_norm_q/layer{i}", q, p.step)
        w.add_scalar(f"weights/grad_norm_k/layer{i}", k, p.step)


def evaluate(run: Run, last: bool = False) -> dict:
    """One evaluation: the validation losses, then what follows from them (last: the run's
    final one)."""
    metrics = validation_losses(run)
    if run.world.is_main:
        log_evaluation(run, metrics, last)
    keep_best(run, metrics["causal_val_loss"])
    run.metrics = metrics
    check_overfitting(run)
    save(run)
    log.info(f"step {run.progress.step}: train loss {run.last_train_loss:.4f}, val loss "
             f"{metrics['val_loss']:.4f}" + (f", causal val loss {metrics['causal_val_loss']:.4f}"
                                              if run.leaky else ""))
    return metrics


def validation_losses(run: Run) -> dict:
    """Validation loss on the fixed batches, and for a leaky variant the causal loss the same
    weights get with the correct mask (all a model has when generating). Every rank scores its
    share of the batches."""
    model, batches = run.model, run.eval_batches
    if run.cfg.your_layer:  # a learner's layer: the causal loss of each position from its prefix
        own, causal = prefix_losses(model, batches, run.amp, run.world)
    else:
        own = causal = mean_loss(model, batches, run.amp, run.world)
        if run.leaky:
            with model.attention_variant(run.cfg.attention.causal_variant()):
                causal = mean_loss(model, batches, run.amp, run.world)
    return {"val_loss": own, "train_loss": run.last_train_loss, "causal_val_loss": causal}


def log_evaluation(run: Run, metrics: dict, last: bool = False) -> None:
    """An evaluation in TensorBoard (rank 0): the losses, per character too (so runs with
    different tokenizers share one axis), the attention diagnostics and maps, a text sample
    (with train.sample_every_eval=false, at the last evaluation only).

    TensorBoard sorts its sections by name and opens the first two: train/ and val/, the
    losses; weights/ (the attention's numbers and maps) comes after them. Every run logs the
    causal loss, the one comparable across attention variants (a causal variant's is its own)."""
    cfg, step, w, model = run.cfg, run.progress.step, run.writer, run.model
    w.add_scalar("val/loss", metrics["val_loss"], step)
    w.add_scalar("val/bpc", to_bpc(run, metrics["val_loss"]), step)
    w.add_scalar("val/causal_loss", metrics["causal_val_loss"], step)
    w.add_scalar("val/nats_per_char", to_nats_per_char(run, metrics["causal_val_loss"]), step)
    for i, d in enumerate(attention_diagnostics(model, run.eval_batches[0][0], run.amp)):
        w.add_scalar(f"weights/max_weight/layer{i}", d["max_weight"], step)
        w.add_scalar(f"weights/entropy/layer{i}", d["entropy"], step)
        w.add_scalar(f"weights/future_weight/layer{i}", d["future_weight"], step)
    if cfg.train.attention_maps:  # the same validation window at every evaluation, every run
        log_attention_maps(w, model, run.corpus.validation, run.corpus.tokenizer,
                           min(cfg.train.attention_map_tokens, cfg.model.block_size), step, run.amp)
    if cfg.train.sample_tokens > 0 and (cfg.train.sample_every_eval or last):
        log_sample(run)


def log_sample(run: Run) -> None:
    """A text sample in TensorBoard, from its own generator (logging fewer changes no number)."""
    cfg, step = run.cfg, run.progress.step
    run.writer.add_text("sample", sample_text(run.model, run.corpus.tokenizer, cfg.train,
                                              cfg.seed + step, run.world.device, run.amp), step)


def keep_best(run: Run, causal_val_loss: float) -> None:
    """The best weights so far (lowest causal validation loss), and the evaluation's history."""
    p = run.progress
    if causal_val_loss < p.best_val:
        p.best_val, p.best_step = causal_val_loss, p.step
        if run.world.is_main:
            save_best(run.run_dir, run.model, p.step, p.best_val)
    p.history.append([p.step, causal_val_loss, run.last_train_loss])


def check_overfitting(run: Run) -> None:
    """Say so when validation loss has risen for train.overfit_patience evaluations in a row
    while training loss fell, and name the best checkpoint; with train.early_stop, stop.

    The loss watched is the causal one. For a leaky variant it rises for another reason: the
    model learns to read the tokens it predicts, which lowers its training loss and its own
    validation loss, and the same weights do worse and worse without them. That is the leak, not
    overfitting: it is said as such (once), and it does not stop the run."""
    p, t = run.progress, run.cfg.train
    rising = rising_validation(p.history, t.overfit_patience)
    overfitting = rising and not run.leaky
    run.writer.add_scalar("val/overfitting", float(overfitting), p.step)
    if rising and (run.leaky and not run.leak_reported or overfitting and not run.overfitting):
        message = leak_message(run) if run.leaky else overfitting_message(run)
        log.warning(message)
        run.writer.add_text("warnings", message, p.step)
        run.leak_reported = run.leak_reported or run.leaky
    run.overfitting = overfitting


def save(run: Run) -> None:
    p = run.progress
    if run.world.is_main:
        run.writer.flush()  # everything logged up to this step is on disk before the checkpoint
        state = {"optimizer": run.optimizer.state_dict(), "sampler": run.sampler.state_dict(),
                 "rng": rng_state(), **p.state_dict()}
        save_checkpoint(run.run_dir, p.step, run.model, state, run.cfg.train.keep_checkpoints)
    run.saved_at = p.step


def stop_after_signal(run: Run, stop: StopFlag) -> None:
    """A checkpoint only (an evaluation would log an extra val/loss point and could move `best`;
    the resumed run must match an uninterrupted one), how to continue, and exit as the signal
    asked (`stop.signal`, or another process's): this ends a multirun sweep too, not just a job."""
    cfg, p = run.cfg, run.progress
    if run.saved_at != p.step:
        save(run)
    run.writer.close()
    cache = "" if cfg.data.cache_dir == DataConfig.cache_dir else \
        f" data.cache_dir={cfg.data.cache_dir}"  # (a resume takes its cache from its command)
    log.info(f"stopped by {stop.signal or 'a signal to another process'} at step {p.step}; "
             f"checkpoint saved. Continue with:\n  {python_command()} train.py "
             f"resume={run.run_dir}{cache}")
    signum = signal.Signals[stop.signal].value if stop.signal else signal.SIGTERM.value
    raise SystemExit(128 + signum)


# ----------------------------------------------------------------------------- command line


def main(job: Job) -> dict:
    """Train the run `job` holds (on every process under torchrun: rank 0's directory); its
    final metrics ({} where there are none: a finished run resumed, a rank > 0)."""
    world = None
    try:
        world = init_world(job.checked.device)
        run_dir = Path(broadcast_from_main(str(job.checked.run_dir), world))
        metrics = train(job.checked.cfg, run_dir, job.checked.resuming, world)
    finally:
        if world is not None:
            shutdown(world)
    if not (world.is_main and metrics):
        return {}
    report(metrics, run_dir)
    if job.single:
        link_latest(run_dir)
    return metrics


def cli() -> None:
    """python train.py ...: composed and checked in full before a byte is written (guard/), then
    trained (a -m sweep's arms by Hydra's launcher). Every mistake is one `error:` line
    (HYDRA_FULL_ERROR=1: the traceback); a new run that fails before it trained leaves nothing."""
    import train  # this file by its name: a launcher's workers import `train.main` from it
    Launch(sys.argv[1:]).run(train.main, interrupted="interrupted; the last complete "
                                                     "checkpoint, if any, is kept")


if __name__ == "__main__":
    cli()
