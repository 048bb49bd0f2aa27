"""TensorBoard logging: scalars, text samples, and the HParams summary of a finished run."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch.utils.tensorboard import SummaryWriter

from training.config import Config


class NullWriter:
    """Stands in for the SummaryWriter where nothing is logged (ranks other than 0)."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def open_writer(run_dir: Path, purge_step: Optional[int], enabled: bool = True):
    """Events go straight into the run directory, so the run's folder name is its TensorBoard run
    name. On resume, purge_step (the checkpoint's step + 1) tells TensorBoard to drop anything an
    earlier process logged after the checkpoint's step: curves continue without duplicates.
    Under DDP only rank 0 logs (enabled=world.is_main); the others get a NullWriter."""
    if not enabled:
        return NullWriter()
    return SummaryWriter(log_dir=str(run_dir), purge_step=purge_step, flush_secs=10)


def hparams_of(cfg: Config) -> dict:
    """The knobs that distinguish runs, flattened for the HParams dashboard."""
    m, a, o, t = cfg.model, cfg.attention, cfg.optim, cfg.train
    return {
        "variant": a.name, "seed": cfg.seed, "n_layer": m.n_layer, "n_head": m.n_head,
        "n_embd": m.n_embd, "block_size": m.block_size, "dropout": m.dropout,
        "tokenizer": cfg.tokenizer.kind.value, "lr": o.lr, "batch_size": t.batch_size,
        "max_steps": t.max_steps, "scale": a.scale.value, "mask_mode": a.mask_mode.value,
        "mask_value": str(a.mask_value), "out_proj": a.out_proj,
    }


# The final metrics shown in the HParams table.
HPARAM_METRICS = ("causal_val_loss", "val_loss", "train_loss", "val_bpc", "val_loss_full",
                  "causal_val_loss_full", "val_bpc_full")


def write_hparams(writer: SummaryWriter, cfg: Config, metrics: dict) -> None:
    """Metrics are stored under hparam/<name> in the run itself (run_name='.'), so the HParams
    table and the scalar dashboard show the same run."""
    writer.add_hparams(hparams_of(cfg), {f"hparam/{k}": v for k, v in metrics.items()},
                       run_name=".")
