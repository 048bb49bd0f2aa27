"""What does a switch cost per training step? Each arm's step time against the default's.

    python -m bench.arm_cost arms="data.order=epochs;model.qk_norm=true;model.mlp_ratio=5" threads=1
    python -m bench.arm_cost arms="model.n_layer=5" reps=21 optim=adamw   # other overrides: all arms

The last line is the first arm's ratio (`ratio=1.04`: 4% slower a step than the default).
docs/budget.md gives each arm of a round its cost per step this way. The arms (`;` between arms,
spaces within one) and the default are built as train.py would build them and take turns within
every repetition (`interleaved_medians`); one step is forward, backward, clipping and the
optimizer step on fixed random tokens, in train.dtype (auto: bf16 on CUDA, fp32 on a CPU).
Switches that act outside the step (the data order) cost nothing here, by construction.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from bench.common import (BenchArgs, compose_config, fmt, interleaved_medians, print_header,
                          print_headline, print_table, resolve_repetitions, setup, usage)
from bench.train_step import build_step
from safeio.cli import UserError, parse_key_values, run_cli
from training.device import pick_dtype

REPS, WARMUP = 15, 3


@dataclass
class ArmCostArgs(BenchArgs):
    arms: str = ""  # the arms to time against the default: `;` between arms, spaces within one


def main(argv: list[str]) -> int:
    def body() -> int:
        args, overrides = parse_key_values(argv, ArmCostArgs, usage("bench.arm_cost"),
                                           about=__doc__.split("\n\n")[0], overrides=True)
        arms = {" ".join(arm.split()): arm.split() for arm in args.arms.split(";") if arm.strip()}
        if not arms:
            raise UserError('give the arms to time, e.g. arms="model.qk_norm=true;model.mlp_ratio=5"')
        device = setup(args)
        reps, warmup = resolve_repetitions(args, reps=REPS, quick_reps=3, warmup=WARMUP,
                                           quick_warmup=1)
        configs = {"default": compose_config(overrides)}
        configs |= {name: compose_config(overrides + arm) for name, arm in arms.items()}
        dtype = pick_dtype(configs["default"].train.dtype, device)
        print_header("cost per training step of each arm, against the default", device,
                     f"{' '.join(overrides) or 'no other overrides'}; {dtype}; random tokens; "
                     f"median of {reps} interleaved steps after {warmup} warm-up")
        steps = {name: build_step(cfg, dtype, None, device) for name, cfg in configs.items()}
        seconds = interleaved_medians(steps, device, reps, warmup)
        base = seconds["default"]
        print_table(["arm", "ms/step", "x default"],
                    [[name, fmt(1000 * s, ".1f"), fmt(s / base, ".3f")]
                     for name, s in seconds.items()])
        print_headline(seconds[next(iter(arms))] / base)  # the first arm's
        return 0
    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
