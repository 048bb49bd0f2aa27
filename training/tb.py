"""TensorBoard logging: scalars, text samples, and the HParams summary of a finished run."""
from __future__ import annotations

import time
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


# The hyper-parameters that tell runs apart, which the HParams table must show first. TensorBoard
# sorts the ones an experiment marks as differing first, each group by name, and shows the first
# five; these are marked, the rest are not (any of them can be ticked on in its left pane). The
# run's name is one of the rest: the table's first column (Trial ID) shows it already.
LEADING = ("regime", "seed", "variant")

# The final metrics of the HParams table, in the order its columns are shown: the causal
# validation loss first, since it is the one comparable across attention variants.
HPARAM_METRICS = ("causal_val_loss", "val_loss", "train_loss", "val_bpc", "causal_val_loss_full",
                  "val_loss_full", "val_bpc_full")


def hparams_of(cfg: Config, regime: str = "-") -> dict:
    """The knobs that distinguish runs, flattened for the HParams dashboard (the seed as text:
    TensorBoard shows numbers with four decimals, and lists a text's values as filters)."""
    m, a, o, t = cfg.model, cfg.attention, cfg.optim, cfg.train
    return {
        "regime": regime, "variant": a.name, "seed": str(cfg.seed), "run": cfg.run_name,
        "n_layer": m.n_layer, "n_head": m.n_head, "n_embd": m.n_embd, "block_size": m.block_size,
        "dropout": m.dropout, "tokenizer": cfg.tokenizer.kind.value, "optimizer": o.name.value,
        "lr": o.lr, "batch_size": t.batch_size, "max_steps": t.max_steps, "scale": a.scale.value,
        "mask_mode": a.mask_mode.value, "mask_value": str(a.mask_value), "out_proj": a.out_proj,
    }


def hydra_regime() -> str:
    """The `regime` config group this run was composed with (conf/regime/, chosen by the
    ablation study's arms), or '-' outside Hydra or without one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "-"
    return HydraConfig.get().runtime.choices.get("regime") or "-"


def write_hparams(writer: SummaryWriter, cfg: Config, metrics: dict) -> None:
    """The run's hyper-parameters and final metrics for the HParams dashboard, written into the
    run itself, so the HParams table and the scalar dashboard show the same run.

    Every run writes the same experiment (all of HPARAM_METRICS, LEADING marked), because
    TensorBoard builds the table from whichever run's experiment it reads first.
    """
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    if isinstance(writer, NullWriter):
        return
    hparams = hparams_of(cfg, hydra_regime())
    infos = [api_pb2.HParamInfo(name=name, type=_data_type(value), differs=name in LEADING)
             for name, value in hparams.items()]
    metric_infos = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=f"hparam/{k}"))
                    for k in HPARAM_METRICS]
    start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
    for name, value in hparams.items():
        field = {bool: "bool_value", str: "string_value"}.get(type(value), "number_value")
        setattr(start.hparams[name], field, value)
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS, end_time_secs=time.time())

    file_writer = writer._get_file_writer()
    file_writer.add_summary(_hparams_summary(
        "_hparams_/experiment", experiment=api_pb2.Experiment(hparam_infos=infos,
                                                              metric_infos=metric_infos)))
    file_writer.add_summary(_hparams_summary("_hparams_/session_start_info",
                                             session_start_info=start))
    file_writer.add_summary(_hparams_summary("_hparams_/session_end_info", session_end_info=end))
    for name in HPARAM_METRICS:
        if name in metrics:
            writer.add_scalar(f"hparam/{name}", metrics[name])


def _data_type(value):
    from tensorboard.plugins.hparams import api_pb2

    if isinstance(value, bool):
        return api_pb2.DATA_TYPE_BOOL
    return api_pb2.DATA_TYPE_STRING if isinstance(value, str) else api_pb2.DATA_TYPE_FLOAT64


def _hparams_summary(tag: str, **plugin_data):
    """A Summary holding HParamsPluginData(**plugin_data), as TensorBoard's hparams plugin reads
    it (its own writer for these needs TensorFlow)."""
    from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    content = plugin_data_pb2.HParamsPluginData(version=metadata.PLUGIN_DATA_VERSION, **plugin_data)
    meta = SummaryMetadata(plugin_data=SummaryMetadata.PluginData(
        plugin_name=metadata.PLUGIN_NAME, content=content.SerializeToString()))
    return Summary(value=[Summary.Value(tag=tag, metadata=meta)])
