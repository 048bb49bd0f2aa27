"""`train.dtype=auto` on a CPU: bf16 autocast or fp32, whichever trains this model faster here.

A CPU flag says what a CPU can do, not what is fast: on a 2-core Xeon with AVX512-BF16 but no
AMX the default step measured 255 ms in bf16 and 226 ms in fp32 (1.13x slower), the 6 x 256
model 1.47x slower; without bf16 units (AVX2 only) bf16 is emulated and slower still; with AMX
it is faster. So the run measures: a few training steps of the configured model itself (its
shapes, attention, optimizer and thread count; random tokens), fp32 and bf16 interleaved, the
median of each: a few seconds (fewer repetitions past CAP_S; one when bf16's step is already
CLEAR times fp32's, as emulated bf16's is). bf16 is chosen only when it is at least MARGIN
faster, as fp32 is the more accurate. The timings are cached per machine, torch version, thread
count and model shape in `<data.cache_dir>/dtype.json`, next to the token cache, so the probe
costs seconds once; the choice itself is always `decide(timings)`, so a cached entry and a
fresh one decide alike (docs/dtype.md).

train.py records the resolved dtype in the run's config.yaml: a resumed run keeps it, whatever
a probe would say on the machine it resumes on. CUDA takes bf16 autocast and MPS fp32 without a
probe (training/device.py), and SCRATCH_GPT_CPU_BF16=1/0 decides for the CPU without one (the
test suite's --cpu-bf16).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from safeio.cli import UserError
from safeio.files import read_json
from training.checkpoint import atomic_write
from training.config import Config
from training.device import NATIVE_BF16_ENV, autocast, cpu_fields, forced_cpu_bf16, pick_dtype

# /proc/cpuinfo's fields that tell CPUs apart in speed (x86, then ARM), beside the model name
SPEED_FIELDS = ("vendor_id", "cpu family", "model", "flags",
                "CPU implementer", "CPU architecture", "CPU part", "Features")
MARGIN = 0.05        # bf16 must be at least 5% faster to be taken over the more accurate fp32
WARMUP = 1           # untimed steps per dtype (allocator, first-call costs)
MIN_REPS, MAX_REPS = 3, 7   # timed steps per dtype: at least MIN_REPS, more while in budget
BUDGET_S = 3.0       # a probe stops adding repetitions once it has run this long ...
CAP_S = 15.0         # ... and stops short of MIN_REPS past this (a big model, a loaded machine)
CLEAR = 2.0          # or once bf16's step is this many times fp32's (emulated bf16)
CACHE_FILE = "dtype.json"
CACHE_FORMAT = 1
MAX_CACHE_BYTES = 1 << 20  # an entry is about 150 bytes
STEP_S = (1e-6, 3600.0)    # a step time a cached entry may hold (decide divides by them)
NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class Choice:
    """The dtype a run trains in, and why (the line printed at the start)."""

    name: str    # float32 | bfloat16: what config.yaml records
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return {v: k for k, v in NAMES.items()}[self.name]

    @property
    def line(self) -> str:
        return f"dtype: {self.name} ({self.reason})"

    def autocast(self, device: torch.device):
        """The context the run's forward passes compute in: this dtype on device."""
        return autocast(device, self.dtype)


def decide(float32_s: float, bfloat16_s: float, margin: float = MARGIN) -> Choice:
    """The choice from the two median step times (seconds): bf16 when it is at least `margin`
    faster, fp32 otherwise."""
    speedup = float32_s / bfloat16_s
    if speedup >= 1 + margin:
        return Choice("bfloat16", f"measured {speedup:.2f}x faster than float32 here")
    if speedup < 1:
        return Choice("float32", f"bf16 measured {1 / speedup:.2f}x slower here")
    return Choice("float32", f"bf16 measured only {speedup:.2f}x faster here, under the "
                             f"{margin:.0%} it must gain")


def choose_dtype(cfg: Config, vocab_size: int, device: torch.device) -> Choice:
    """What `cfg.train.dtype` means for this run: a value it names, CUDA's or MPS's default, or on
    a CPU the cached or freshly measured faster one."""
    name = cfg.train.dtype
    if name != "auto":
        return Choice(name, f"train.dtype={name}")
    if device.type != "cpu":
        dtype = NAMES[pick_dtype(name, device)]
        return Choice(dtype, f"auto on {device.type}")
    forced = forced_cpu_bf16()
    if forced is not None:
        return Choice("bfloat16" if forced else "float32",
                      f"auto: {NATIVE_BF16_ENV}={int(forced)}")
    path = Path(cfg.data.cache_dir) / CACHE_FILE
    key = probe_key(cfg, vocab_size)
    timings = read_cache(path).get(key)
    if timings is not None:
        choice = decide(*timings)
        return Choice(choice.name, f"{choice.reason}; cached in {path}")
    started = time.perf_counter()
    timings = measure(cfg, vocab_size, device)
    write_cache(path, key, timings)
    choice = decide(*timings)
    return Choice(choice.name, f"{choice.reason}: a step float32 {timings[0] * 1e3:.0f} ms, "
                               f"bfloat16 {timings[1] * 1e3:.0f} ms; probe "
                               f"{time.perf_counter() - started:.1f} s")


# ----------------------------------------------------------------------------- the probe


def measure(cfg: Config, vocab_size: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of one training step (forward under autocast, backward, optimizer step) of
    the configured model on random tokens: (float32, bfloat16). The two dtypes alternate, so a
    neighbour's load on a shared machine falls on both. The global random state is left as it
    was: the run's own initialisation must not depend on whether a probe ran."""
    from model.gpt import GPT  # the model pulls in much; only a probe needs it
    from training.optim import make_optimizer

    batch, block = cfg.train.batch_size, cfg.model.block_size
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GPT(cfg.model, vocab_size, cfg.attention).to(device)
        x = torch.randint(vocab_size, (batch, block), device=device)  # (B, T)
        y = torch.randint(vocab_size, (batch, block), device=device)  # (B, T)
        steps = {}
        for dtype in NAMES:
            optimizer, amp = make_optimizer(model, cfg.optim, dtype), autocast(device, dtype)

            def step(optimizer=optimizer, amp=amp) -> None:
                with amp:
                    _, loss = model(x, y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            steps[dtype] = step
        # the clock starts here: the first optimizer's one-time imports (torch._dynamo, seconds
        # on a busy machine) are not the probe's to count, as training would pay them anyway
        started = time.perf_counter()

        def one_round(times: dict) -> float:
            """A step of each dtype, timed; the bf16 / fp32 ratio of the medians so far."""
            for dtype, step in steps.items():
                tick = time.perf_counter()
                step()
                times[dtype].append(time.perf_counter() - tick)
            return statistics.median(times[torch.bfloat16]) / statistics.median(
                times[torch.float32])

        # The warm-up is never timed, and short of CAP_S bf16 is not taken on one step's
        # evidence: a process's first steps pay one-time costs, which made fp32 look over twice
        # as slow as it is (docs/dtype.md). Only a bf16 step CLEAR times fp32's ends the probe
        # after one timed step of each (emulated bf16 can be 10-20x slower: a further step of
        # it could cost minutes).
        for _ in range(WARMUP):
            one_round({dtype: [] for dtype in NAMES})
        times = {dtype: [] for dtype in NAMES}
        for i in range(MAX_REPS):
            ratio = one_round(times)
            elapsed = time.perf_counter() - started
            if (i + 1 >= MIN_REPS and elapsed > BUDGET_S) or elapsed > CAP_S \
                    or ratio >= CLEAR:
                break
    return statistics.median(times[torch.float32]), statistics.median(times[torch.bfloat16])


def probe_key(cfg: Config, vocab_size: int) -> str:
    """What a step's speed depends on: the machine (its CPU), the torch version, the thread count
    and the step's shapes and work (model, attention, optimizer, batch, vocabulary)."""
    shape = {"model": dataclasses.asdict(cfg.model), "attention": dataclasses.asdict(cfg.attention),
             "optim": str(cfg.optim.name), "batch": cfg.train.batch_size, "vocab": vocab_size}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True, default=str).encode()).hexdigest()
    return (f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads | "
            f"{cfg.model.n_layer}x{cfg.model.n_head}x{cfg.model.n_embd} {digest[:12]}")


def cpu_name() -> str:
    """The CPU's model name and a digest of what sets its speed: vendor, family, model and
    instruction-set flags (ARM: implementer, part, features). A virtual machine may call an
    AVX2-only EPYC and a Zen 4 with AVX512-BF16 both "AMD EPYC", and a disk (a cloud volume,
    this project's own machines) may move between them, and bf16 is far slower on the one and
    far faster on the other (docs/dtype.md): the name alone must not share a timing."""
    fields = cpu_fields()
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown cpu"
    if not fields:  # no /proc/cpuinfo: the platform's name
        return name
    speed = [fields.get(k, "") for k in SPEED_FIELDS]
    return f"{name} [{hashlib.sha256(repr(speed).encode()).hexdigest()[:8]}]"


# ----------------------------------------------------------------------------- the cache


def read_cache(path: Path) -> dict[str, tuple[float, float]]:
    """The cached timings by probe key. The file is read like every file the project reads back
    (safeio/files.py: a regular file of bounded size, opened without blocking: a FIFO would hang
    the run, a link to /dev/zero never end); a missing, unreadable, corrupt or foreign file, and
    any entry that is not two step times in STEP_S, count as nothing cached (so: measure again)."""
    try:
        data = read_json(path, "dtype cache", MAX_CACHE_BYTES)
    except (UserError, OSError):
        return {}
    if data.get("format") != CACHE_FORMAT or not isinstance(data.get("entries"), dict):
        return {}
    entries = {}
    for key, entry in data["entries"].items():
        try:
            pair = (entry["float32_s"], entry["bfloat16_s"])
        except (TypeError, KeyError):
            continue
        if all(type(t) in (int, float) and STEP_S[0] <= t <= STEP_S[1] for t in pair):
            entries[key] = (float(pair[0]), float(pair[1]))
    return entries


def write_cache(path: Path, key: str, timings: tuple[float, float]) -> None:
    """Adds one entry (atomically: a reader sees the old file or the new one). The cache only
    saves time, so a directory that cannot be written to is not an error."""
    entries = read_cache(path)
    entries[key] = timings
    data = {"format": CACHE_FORMAT,
            "entries": {k: {"float32_s": f, "bfloat16_s": b}
                        for k, (f, b) in sorted(entries.items())}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps(data, indent=1) + "\n").encode())
    except OSError:
        pass
