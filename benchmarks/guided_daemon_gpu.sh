#!/usr/bin/env bash
# The daemon's guided search on a GPU, from a store that holds no run of the policy's model (only other
# models' committed sweeps, for the trade-off model to learn from), one `daemon --once` pass; then the
# runs, the decision and the pass summary are left in OUT/NAME for benchmarks/guided_vs_grid.py.
# Usage (on the GPU machine, from the repo root, with the carried wheels in .whl/):
#   benchmarks/guided_daemon_gpu.sh NAME SPEC BATCH SEQ_LEN EXCLUDE_SPEC
set -uo pipefail
export PYTHONUNBUFFERED=1
name=$1 spec=$2 batch=$3 seq=$4 exclude=$5
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
dir=${OUT:-/tmp/out}/$name
mkdir -p "$dir/policies" "$dir/locks"
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv | tee "$dir/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$dir/device.txt"
python3 - "$exclude" "$dir/others.json" tests/data/*.json <<'PY'
import json, sys
exclude, out, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
records = [r for p in paths for r in json.load(open(p)) if r["workload"]["spec"] != exclude]
json.dump(records, open(out, "w"))
print(f"{len(records)} runs of other workloads to learn from", file=sys.stderr)
PY
joulepilot runs import "$dir/others.json" --db "$dir/guided.db" || exit 1
seq_line=""; [ "$seq" != "-" ] && seq_line="seq_len = $seq"
cat > "$dir/policies/$name.toml" <<TOML
name = "$name"
workload = "$spec"
batch_size = $batch
$seq_line
[objective]
minimize = "energy"
expected_inferences = 10_000_000
[limits]
max_rel_error = 2e-2
[search]
strategy = "guided"
modes = ["eager", "default", "reduce-overhead"]
precisions = ["fp32", "tf32", "bf16", "fp16"]
TOML
cat > "$dir/daemon.toml" <<TOML
db = "$dir/guided.db"
policies = ["$dir/policies"]
lock_dir = "$dir/locks"
[idle]
min_idle_s = 1.0
allow_other_processes = true
poll_s = 0.5
[bench]
min_seconds = 3.0
budget_s = 45.0
[exporter]
enabled = false
TOML
start=$(date +%s)
timeout 480 joulepilot daemon --config "$dir/daemon.toml" --once --json > "$dir/pass.json" 2> "$dir/daemon.log"
echo "daemon rc $? in $(( $(date +%s) - start )) s" | tee -a "$dir/device.txt"
joulepilot runs --db "$dir/guided.db" --workload "$spec" --limit 0 --json > "$dir/runs.json"
joulepilot policy explain "$dir/policies/$name.toml" --db "$dir/guided.db" --json > "$dir/explain.json" 2>>"$dir/daemon.log"
tail -5 "$dir/daemon.log"
python3 - "$dir/guided.db" <<'PY'
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1]); conn.execute("PRAGMA wal_checkpoint(TRUNCATE)"); conn.execute("PRAGMA journal_mode=DELETE"); conn.close()
PY
rm -f "$dir/others.json" "$dir"/*.db-wal "$dir"/*.db-shm
ls -la "$dir"
