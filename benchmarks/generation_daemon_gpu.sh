#!/usr/bin/env bash
# The daemon on a generation policy with a power envelope, from an empty store, on a GPU: one `daemon --once`
# pass deciding the ~0.8 B random-weight Llama of benchmarks/generation_energy.py (prompt 512, 256 new tokens) in
# joules per generated token over modes x precisions x batch sizes under `max_avg_power_w`; then what it chose,
# why, and what the pass cost (the runs, the decision, `policy explain` and the daemon's log stay in OUT/NAME).
# Usage (on the GPU machine, from the repo root; the carried wheels in .whl/ when the host lacks them):
#   benchmarks/generation_daemon_gpu.sh NAME MAX_AVG_POWER_W [MODES] [PRECISIONS] [BATCH_SIZES]
# e.g. benchmarks/generation_daemon_gpu.sh llama_chat 200 eager,default,reduce-overhead bf16 1,8
# CUDA_VISIBLE_DEVICES chooses the GPU; TIMEOUT_S bounds the pass (default 480); MODEL (a generation_energy.py model,
# default llama), PROMPT_LEN and NEW_TOKENS change the workload (MODEL=tiny PROMPT_LEN=8 NEW_TOKENS=4 runs on a CPU).
set -uo pipefail
export PYTHONUNBUFFERED=1
name=$1 watts=$2 modes=${3-eager,default,reduce-overhead} precisions=${4-bf16} batches=${5-1,8}
. benchmarks/device_common.sh
jp_install || exit 1
dir=${OUT:-/tmp/out}/$name
mkdir -p "$dir/policies" "$dir/locks"
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv | tee "$dir/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
  | tee -a "$dir/device.txt"
toml_list() { python3 -c 'import json, sys; print(json.dumps([int(v) if v.isdigit() else v for v in sys.argv[1].split(",") if v]))' "$1"; }
# The model options are generation_energy.py's, so the decision is comparable with its table.
model=${MODEL:-llama}
spec=$(python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from generation_energy import MODELS; print(MODELS[sys.argv[1]]["spec"])' "$model") || exit 1
options=$(python3 -c '
import sys; sys.path.insert(0, "benchmarks")
from generation_energy import MODELS
print("\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in MODELS[sys.argv[1]]["options"].items()))' "$model")
cat > "$dir/policies/$name.toml" <<TOML
name = "$name"
workload = "$spec"
task = "generate"
batch_size = 1
prompt_len = ${PROMPT_LEN:-512}
new_tokens = ${NEW_TOKENS:-256}
[objective]
minimize = "energy"
expected_tokens = 100_000_000
[limits]
max_avg_power_w = $watts
[search]
strategy = "guided"
modes = $(toml_list "$modes")
precisions = $(toml_list "$precisions")
batch_sizes = $(toml_list "$batches")
[model_options]
$options
TOML
jp_daemon_toml "$dir" "$dir/daemon.db" 2.0 240.0
cat "$dir/policies/$name.toml"
start=$(date +%s)
timeout "${TIMEOUT_S:-480}" joulepilot daemon --config "$dir/daemon.toml" --once --json > "$dir/pass.json" 2>> "$dir/daemon.log"
echo "daemon rc $? in $(( $(date +%s) - start )) s" | tee -a "$dir/device.txt"
joulepilot runs --db "$dir/daemon.db" --limit 0 --json > "$dir/runs.json"
joulepilot policy explain "$dir/policies/$name.toml" --db "$dir/daemon.db" --json > "$dir/explain.json" 2>>"$dir/daemon.log"
joulepilot policy explain "$dir/policies/$name.toml" --db "$dir/daemon.db" > "$dir/explain.txt" 2>>"$dir/daemon.log"
joulepilot runs export "$dir/runs_export.json" --db "$dir/daemon.db" 2>>"$dir/daemon.log"
tail -8 "$dir/daemon.log"
cat "$dir/explain.txt"
jp_close_db "$dir/daemon.db"
ls -la "$dir"
