#!/usr/bin/env bash
# One device call of the GPU sweep: installs the carried wheels and the project, then sweeps the given
# models into OUT/NAME/gpu_sweep.db, stopping new runs before the call's limit.
# Usage (on the GPU machine, from the repo root):
#   benchmarks/device_sweep.sh NAME MODELS MAX_MINUTES [WARM_START] [gpu_sweep.py options ...]
# e.g. benchmarks/device_sweep.sh vitma vit 4 "" --modes max-autotune-no-cudagraphs --precisions bf16
set -uo pipefail
export PYTHONUNBUFFERED=1
name=$1 models=$2 minutes=$3 warm=${4-default/fp32}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
dir=${OUT:-/tmp/out}/$name
mkdir -p "$dir"
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu,clocks.sm --format=csv | tee "$dir/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$dir/device.txt"
python3 benchmarks/gpu_sweep.py --models "$models" --min-seconds 3 --budget-s 45 --warm-start "$warm" \
  --max-minutes "$minutes" --reserve-s 70 --out "$dir" --db "$dir/gpu_sweep.db" "${@:5}" 2>&1 | tee "$dir/log.txt"
python3 - "$dir/gpu_sweep.db" <<'PY'
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
conn.execute("PRAGMA journal_mode=DELETE")
conn.close()
PY
rm -f "$dir/runs.jsonl" "$dir"/*.db-wal "$dir"/*.db-shm
ls -la "$dir"
