"""TensorBoard logging: scalars, text samples, and the HParams summary of a finished run."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from torch.utils.tensorboard import SummaryWriter

from training.config import Config


def open_writer(run_dir: Path, purge_step: Optional[int]) -> SummaryWriter:
    """Events go straight into the run directory, so the run's folder name is its TensorBoard run
    name. On resume, purge_step (the checkpoint's step + 1) tells TensorBoard to drop anything an
    earlier process logged after the checkpoint's step: curves continue without duplicates."""
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


def write_hparams(writer: SummaryWriter, cfg: Config, metrics: dict) -> None:
    """Metrics are stored under hparam/<name> in the run itself (run_name='.'), so the HParams
    table and the scalar dashboard show the same run."""
    writer.add_hparams(hparams_of(cfg), {f"hparam/{k}": v for k, v in metrics.items()},
                       run_name=".")
