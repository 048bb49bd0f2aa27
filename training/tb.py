"""TensorBoard logging: the writer, the config, attention maps, and the HParams summary of a
finished run."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from torch.utils.tensorboard import SummaryWriter

from safeio.files import dump_run_config
from training.attention_maps import attention_weights, card_image, map_labels, map_window
from training.config import CachedEval, Config


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


# TensorBoard's Custom Scalars tab (http://localhost:6006/#custom_scalars): the two curves that
# tell a leak from learning, side by side at the top, one line per run. Time Series sorts its
# cards by name, which puts val/causal_loss fourth among val/'s, below the fold.
LEAK_LAYOUT = {"the leak: training loss falls, causal loss climbs": {
    "train/loss: falls in every run": ["Multiline", ["^train/loss$"]],
    "val/causal_loss: the same weights, correct mask (a leak climbs)":
        ["Multiline", ["^val/causal_loss$"]]}}


def write_config(writer, cfg: Config) -> None:
    """The run's config, as its config.yaml says it, in TensorBoard's text tab (at step 0), and
    LEAK_LAYOUT (each run carries it: TensorBoard merges the runs' layouts)."""
    writer.add_text("config", "```\n" + dump_run_config(cfg) + "\n```", 0)
    writer.add_custom_scalars(LEAK_LAYOUT)


# The section of TensorBoard the attention maps go to (log_attention_maps says why this one).
MAP_GROUP = "weights"


def log_attention_maps(writer, model, split, tokenizer, n: int, step: int, amp,
                       cached: bool = False, how: CachedEval = CachedEval.tokens) -> None:
    """One image per layer in TensorBoard (tag weights/attention_layer<i>): `card_image` of its
    heads on the split's fixed window of n tokens (`map_window`: the same text at every
    evaluation, in every run), titled with the layer's future weight on it. cached: the
    generation path's maps (`attention_weights`, fed `how`), tag weights/decoding_layer<i>.

    Why under weights/: TensorBoard's Time Series tab (where it opens) sorts the cards by tag,
    groups them by the tag's first part and expands the first two groups; under weights/ the maps
    follow train/ and val/, so it opens on the losses, with the maps in a section below them
    (MAP_GROUP; tests/test_newcomer.py checks the order)."""
    window = map_window(split, tokenizer, n)
    weights, leaks = attention_weights(model, window, amp, cached, how)  # [L, h, n, n], [L]
    labels = map_labels(tokenizer, window, cached, how)
    tag, what = (f"{MAP_GROUP}/decoding_layer", "through the KV cache, ") if cached else \
        (f"{MAP_GROUP}/attention_layer", "")
    for layer, (w, leak) in enumerate(zip(weights, leaks)):
        title = f"layer {layer}, step {step}: {what}future weight {leak:.3f}"
        writer.add_image(f"{tag}{layer}", card_image(w, labels, title), step, dataformats="HWC")


# TensorBoard's HParams table shows five hyper-parameters at first (any other is ticked on in
# its left pane): those an experiment marks as differing, in order of their names. These five
# are marked. `arm` is what tells the study's runs apart (conf/arm/: regime-variant, or the
# variant alone outside the study); lr, n_layer and tokenizer tell most other runs apart. The
# run's name is the table's first column (Trial ID) already.
LEADING = ("arm", "lr", "n_layer", "seed", "tokenizer")

# The table's metrics, in the order of its columns (the first five are shown): the last value of
# each series. The run's headline leads (train.headline: a study's, set by its
# conf/experiment/), then the causal losses: they are the ones comparable across attention
# variants, and nats/char across tokenizers.
HPARAM_METRICS = ("val/causal_loss", "val/nats_per_char", "val/loss", "train/loss",
                  "val/nats_per_char_full", "val/bpc", "val/causal_loss_full", "val/loss_full",
                  "val/bpc_full", "val/cached_loss", "val/cache_gap")


def hparam_metrics(cfg: Config) -> tuple[str, ...]:
    """HPARAM_METRICS with the run's headline (train.headline) first."""
    first = f"val/{cfg.train.headline.value}"
    return (first, *(tag for tag in HPARAM_METRICS if tag != first))


def hparams_of(cfg: Config, regime: str = "-") -> dict:
    """The knobs that distinguish runs, flattened for the HParams dashboard. Integers are given
    as text: TensorBoard writes every number with five digits (4 as 4.0000), and lists a text's
    values as filters; lr and dropout stay numbers."""
    m, a, o, t = cfg.model, cfg.attention, cfg.optim, cfg.train
    return {
        "arm": a.name if regime == "-" else f"{regime}-{a.name}", "regime": regime,
        "variant": a.name, "seed": str(cfg.seed), "run": cfg.run_name,
        "n_layer": str(m.n_layer), "n_head": str(m.n_head), "n_embd": str(m.n_embd),
        "block_size": str(m.block_size), "dropout": m.dropout,
        "tokenizer": cfg.tokenizer.kind.value, "optimizer": o.name.value, "lr": o.lr,
        "batch_size": str(t.batch_size), "max_steps": str(t.max_steps), "scale": a.scale.value,
        "mask_mode": a.mask_mode.value, "mask_value": str(a.mask_value), "out_proj": a.out_proj,
    }


def hydra_regime() -> str:
    """The `regime` config group this run was composed with (conf/regime/, chosen by the
    ablation study's arms), or '-' outside Hydra or without one."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return "-"
    return HydraConfig.get().runtime.choices.get("regime") or "-"


def write_hparams(writer: SummaryWriter, cfg: Config) -> None:
    """The run's hyper-parameters for the HParams dashboard, written into the run itself, so the
    HParams table and the scalar dashboard show the same run; its metrics are the last values of
    the run's own series (HPARAM_METRICS, the headline first), so no chart repeats them.

    Every run of a study writes the same experiment (all of HPARAM_METRICS, LEADING marked, its
    headline first), because TensorBoard builds the table from whichever run's experiment it
    reads first.
    """
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    if isinstance(writer, NullWriter):
        return
    hparams = hparams_of(cfg, hydra_regime())
    infos = [api_pb2.HParamInfo(name=name, type=_data_type(value), differs=name in LEADING)
             for name, value in hparams.items()]
    metric_infos = [api_pb2.MetricInfo(name=api_pb2.MetricName(tag=tag))
                    for tag in hparam_metrics(cfg)]
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
