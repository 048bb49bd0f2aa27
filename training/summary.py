"""The run's summary: the final scores (`final_metrics`, the whole split and the generation path),
the units they are given in, the warnings the overfitting guard writes, and the lines a finished
run prints (`report`). `run` is train.py's `Run`; what is logged goes to train.py's log."""
from __future__ import annotations

import logging
import math
from pathlib import Path

from safeio.cli import python_command
from training.checkpoint import CHECKPOINTS, WEIGHTS, load_weights
from training.config import CONF_DIR
from data.batches import sequential_windows
from training.evaluate import bits_per_char, decoded_losses, full_split_loss, prefix_losses
from training.tb import log_attention_maps, write_hparams

log = logging.getLogger("train")  # train.py's: Hydra sends it to the console and to train.log


def to_bpc(run, nats_per_token: float) -> float:
    """Bits per character: every token but the first is predicted, so the split's nats are the
    mean times N - 1 tokens (bench/score.py, the frozen evaluator, counts the same way)."""
    corpus = run.corpus
    return bits_per_char(nats_per_token, len(corpus.validation) - 1, corpus.n_chars["validation"])


def to_nats_per_char(run, nats_per_token: float) -> float:
    """The headline unit: nats per character of the validation split, whatever the tokenizer."""
    return to_bpc(run, nats_per_token) * math.log(2)


def final_metrics(run, meter) -> dict:
    """Scores of the finished run: the whole validation split (every token once), speed (`meter`,
    the loop's Speedometer), and the HParams summary in TensorBoard."""
    cfg, p, w, model = run.cfg, run.progress, run.writer, run.model
    metrics = {"train_time_min": p.elapsed / 60, "tokens_per_sec": meter.rate(), "steps": p.step,
               "tokens_seen": p.tokens_seen, "best_val_loss": p.best_val, "best_step": p.best_step,
               "attention": cfg.attention.name, "leaky": run.leaky, "your_layer": cfg.your_layer,
               "fewer_steps": cfg.train.fewer_steps, "eval_batches": len(run.eval_batches),
               "cached_batches": min(cfg.train.cached_eval_batches, len(run.eval_batches)),
               "log_interval": cfg.train.log_interval}
    if run.overfitting and cfg.train.early_stop:
        log.info(f"stopped early at step {p.step}: scoring the best weights (step {p.best_step})")
        load_weights(model, run.run_dir / CHECKPOINTS / "best" / WEIGHTS)
    if cfg.train.final_full_eval:
        split, block, batch = run.corpus.validation, cfg.model.block_size, cfg.train.batch_size
        if cfg.your_layer:  # a learner's layer: each position from its prefix alone too
            windows = list(sequential_windows(split, block, batch))
            full, causal = prefix_losses(model, windows, run.amp, run.world)
        else:
            full = causal = full_split_loss(model, split, block, batch, run.amp, run.world)
        metrics.update(val_loss_full=full, val_bpc_full=to_bpc(run, full),
                       causal_val_loss_full=causal)
        if run.leaky and not cfg.your_layer:
            with model.attention_variant(cfg.attention.causal_variant()):
                metrics["causal_val_loss_full"] = full_split_loss(model, split, block, batch,
                                                                  run.amp, run.world)
        metrics["val_nats_per_char_full"] = to_nats_per_char(run, metrics["causal_val_loss_full"])
        w.add_scalar("val/loss_full", full, p.step)
        w.add_scalar("val/bpc_full", metrics["val_bpc_full"], p.step)
        w.add_scalar("val/causal_loss_full", metrics["causal_val_loss_full"], p.step)
        w.add_scalar("val/nats_per_char_full", metrics["val_nats_per_char_full"], p.step)
    if cfg.train.cached_eval_batches:  # the generation path against the forward pass
        batches = run.eval_batches[:cfg.train.cached_eval_batches]
        with model.attention_variant(cfg.attention.causal_variant()):  # as when generating
            cached, causal = decoded_losses(model, batches, run.amp, cfg.train.cached_eval,
                                            run.world)
        metrics.update(cached_val_loss=cached, cache_gap=cached - causal)
        w.add_scalar("val/cached_loss", metrics["cached_val_loss"], p.step)
        w.add_scalar("val/cache_gap", metrics["cache_gap"], p.step)
        if cfg.train.attention_maps:  # the maps of the generation path (decoding_layer<i>)
            log_attention_maps(w, model, run.corpus.validation, run.corpus.tokenizer,
                               min(cfg.train.attention_map_tokens, cfg.model.block_size), p.step,
                               run.amp, cached=True, how=cfg.train.cached_eval)
    write_hparams(w, cfg)  # its metrics are the last values of val/ and train/ (training/tb.py)
    return metrics


def report(metrics: dict, run_dir: Path) -> None:
    """The summary: each figure labelled with what it covers (the fixed evaluation batches, the
    first of them through the KV cache, the whole split), and the command that samples the run."""
    n, cached = metrics.get("eval_batches"), metrics.get("cached_batches")
    rows = [("steps", "steps", "{:,.0f}"), ("tokens_seen", "tokens trained on", "{:,.0f}"),
            ("train_time_min", "train time (min)", "{:.2f}"),
            ("tokens_per_sec", "tokens/s (training)", "{:,.0f}"),
            ("train_loss", f"train loss (last {metrics.get('log_interval')} steps)", "{:.4f}"),
            ("val_loss", f"val loss ({n} eval batches)", "{:.4f}"),
            ("causal_val_loss", f"causal val loss ({n} eval batches)", "{:.4f}"),
            ("cached_val_loss", f"cached val loss (decoding; first {cached} batches)", "{:.4f}"),
            ("cache_gap", f"cache gap (cached - causal, same {cached})", "{:+.2e}"),
            ("val_loss_full", "val loss (whole split)", "{:.4f}"),
            ("val_nats_per_char_full", "val nats/char (whole split)", "{:.4f}"),
            ("val_bpc_full", "val bits/char (whole split)", "{:.4f}")]
    rows = [(label, fmt.format(metrics[key])) for key, label, fmt in rows if key in metrics]
    width = max(len(label) for label, _ in rows)
    lines = [f"run: {run_dir}"] + [f"  {label:<{width}}  {value}" for label, value in rows]
    if metrics.get("fewer_steps"):
        lines.append(f"  fewer steps than configured: {metrics['fewer_steps']}")
    lines.append(f"sample: {python_command()} generate.py run={run_dir} prompt='ROMEO:'"
                 + (" trust_layer=true use_cache=false" if metrics.get("your_layer") else ""))
    if metrics.get("leaky") and metrics["best_step"] < metrics["steps"]:
        lines.append(f"  (attention={metrics['attention']} leaks: generate.py samples its latest "
                     f"weights, what the leak learned; generating is causal, and causally they "
                     f"score {metrics['causal_val_loss']:.2f} nats/token: expect gibberish, the "
                     f"pitfall's cost. weights=best is step {metrics['best_step']}, the lowest "
                     f"causal loss, from before it learned to read ahead)")
    elif metrics.get("leaky"):
        arm = f"leak-{metrics['attention']}"
        lines.append(f"  (attention={metrics['attention']} leaks, but {metrics['steps']:,} steps "
                     f"were too few to show it: the causal loss never rose, the model has not "
                     f"learned to read ahead yet. " + (
                         f"{python_command()} train.py +arm={arm} shows it in about a minute)"
                         if (CONF_DIR / "arm" / f"{arm}.yaml").is_file() else
                         "A longer run shows it.)"))
    log.info("\n".join(lines))


def overfitting_message(run) -> str:
    p, t = run.progress, run.cfg.train
    return (f"warning: step {p.step}: overfitting: validation loss has risen for "
            f"{t.overfit_patience} evaluations ({p.history[-t.overfit_patience - 1][1]:.4f} -> "
            f"{p.history[-1][1]:.4f}) while training loss fell; the best weights (step "
            f"{p.best_step}, val loss {p.best_val:.4f}) are in "
            f"{run.run_dir / CHECKPOINTS / 'best'}. More data, dropout or weight decay, or a "
            f"smaller model would help; train.early_stop=true stops such a run.")


def leak_message(run) -> str:
    p, t = run.progress, run.cfg.train
    before, now = p.history[-t.overfit_patience - 1][1], p.history[-1][1]
    return (f"warning: step {p.step}: the leak, not overfitting: the causal validation loss has "
            f"risen for {t.overfit_patience} evaluations ({before:.4f} -> {now:.4f}) while the "
            f"training loss fell (own validation loss "
            f"{run.metrics.get('val_loss', math.nan):.4f}): "
            + (f"your_layer={run.cfg.your_layer} " if run.cfg.your_layer else
               f"attention={run.cfg.attention.name} ") +
            f"lets each position see the tokens after it, the model learns to read them, and "
            f"without them, as when generating, it does ever worse. More data or dropout would "
            f"not help; the correct mask would. The weights from before it learned to read ahead "
            f"(step {p.best_step}, causal val loss {p.best_val:.4f}) are in "
            f"{run.run_dir / CHECKPOINTS / 'best'}; the latest show what the leak learned.")
