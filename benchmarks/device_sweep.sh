#!/usr/bin/env bash
# One device call of the GPU sweep: installs the carried wheels and the project, then sweeps the given
# models into OUT/NAME/gpu_sweep.db, stopping new runs before the call's limit.
# Usage (on the GPU machine, from the repo root):
#   benchmarks/device_sweep.sh NAME MODELS MAX_MINUTES [WARM_START] [gpu_sweep.py options ...]
# BUDGET_S (default 45) bounds each worker's first calls (compiler/budget.py).
# e.g. benchmarks/device_sweep.sh vitma vit 4 "" --modes max-autotune-no-cudagraphs --precisions bf16
set -uo pipefail
export PYTHONUNBUFFERED=1
name=$1 models=$2 minutes=$3 warm=${4-default/fp32}
. benchmarks/device_common.sh
jp_install || exit 1
dir=${OUT:-/tmp/out}/$name
mkdir -p "$dir"
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu,clocks.sm --format=csv | tee "$dir/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$dir/device.txt"
python3 benchmarks/gpu_sweep.py --models "$models" --min-seconds 3 --budget-s "${BUDGET_S:-45}" --warm-start "$warm" \
  --max-minutes "$minutes" --reserve-s 70 --out "$dir" --db "$dir/gpu_sweep.db" "${@:5}" 2>&1 | tee "$dir/log.txt"
jp_close_db "$dir/gpu_sweep.db"
rm -f "$dir/runs.jsonl"
ls -la "$dir"
