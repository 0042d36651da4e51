#!/usr/bin/env bash
# The daemon's guided search on a GPU, from a store that holds no run of the model (only the other models'
# committed sweeps, held-out grids included, for the trade-off model to learn from; the synthetic sweep, made up for
# the tests, left out, as a daemon's store holds measured runs only): one `daemon --once` pass over a policy whose grid is
# the configurations GRID recorded for SPEC; then what it chose, its regret against GRID's oracle and the fraction
# of GRID's seconds it spent (benchmarks/guided_vs_grid.py). The runs, the decision and the pass summary stay in
# OUT/NAME.
# Usage (on the GPU machine, from the repo root; the carried wheels in .whl/ when the host lacks them):
#   python benchmarks/gpu_sweep.py --models convnet --out $OUT/grid ...       # the grid (OUT/grid/runs.json)
#   benchmarks/guided_daemon_gpu.sh NAME GRID.json SPEC BATCH SEQ_LEN|-
# GRID `-` runs the pass beside the grid's own sweep (on another GPU, both at once): the search space is then
# MODES, PRECISIONS and FUSIONS from the environment (comma lists, as the grid's sweep was given them), and the
# score is taken afterwards: python benchmarks/guided_vs_grid.py OUT/NAME/runs.json GRID.json --explain
# OUT/NAME/explain.json. CUDA_VISIBLE_DEVICES chooses the GPU; PASS_TIMEOUT_S (default 540) bounds the daemon's pass;
# BUDGET_S (default 45, as the grid's device_sweep.sh) each worker's first calls.
set -uo pipefail
export PYTHONUNBUFFERED=1
name=$1 grid=$2 spec=$3 batch=$4 seq=$5
. benchmarks/device_common.sh
jp_install || exit 1
dir=${OUT:-/tmp/out}/$name
mkdir -p "$dir/policies" "$dir/locks"
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv | tee "$dir/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$dir/device.txt"
# The other models' runs to learn from, and the policy's search space: the modes, precisions and fusion
# presets of the configurations GRID holds for SPEC.
python3 - "$spec" "$dir/others.json" "$grid" "$dir/search.toml" tests/data/*.json tests/data/heldout/*.json <<'PY'
import json, sys
spec, out, grid, search, paths = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
def synthetic(record):  # tests/data/synthetic_sweep.json's runs were made up for tests, not measured
    extra = record["run"].get("extra") or {}
    return bool((json.loads(extra) if isinstance(extra, str) else extra).get("synthetic"))
records = [r for p in paths for r in json.load(open(p)) if r["workload"]["spec"] != spec and not synthetic(r)]
json.dump(records, open(out, "w"))
print(f"{len(records)} measured runs of other workloads to learn from", file=sys.stderr)
if grid == "-":
    import os
    lists = {key: sorted(v for v in os.environ[env].split(",") if v)
             for key, env in (("mode", "MODES"), ("precision", "PRECISIONS"), ("fusion", "FUSIONS"))}
    configs = []
else:
    configs = [r["config"] for r in json.load(open(grid)) if r["workload"]["spec"] == spec]
    if not configs:
        sys.exit(f"{grid} holds no run of {spec}")
    lists = {key: sorted({c[key] for c in configs}) for key in ("mode", "precision", "fusion")}
with open(search, "w") as f:
    f.write(f'modes = {json.dumps(lists["mode"])}\nprecisions = {json.dumps(lists["precision"])}\n'
            f'fusion = {json.dumps(lists["fusion"])}\n')
print(f"grid of {len({c['id'] for c in configs}) or 'the given'} configurations: {lists}", file=sys.stderr)
PY
[ $? -eq 0 ] || exit 1
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
$(cat "$dir/search.toml")
TOML
jp_daemon_toml "$dir" "$dir/guided.db" 3.0 "${BUDGET_S:-45}"
start=$(date +%s)
timeout "${PASS_TIMEOUT_S:-540}" joulepilot daemon --config "$dir/daemon.toml" --once --json > "$dir/pass.json" 2> "$dir/daemon.log"
echo "daemon rc $? in $(( $(date +%s) - start )) s" | tee -a "$dir/device.txt"
joulepilot runs --db "$dir/guided.db" --workload "$spec" --limit 0 --json > "$dir/runs.json"
joulepilot policy explain "$dir/policies/$name.toml" --db "$dir/guided.db" --json > "$dir/explain.json" 2>>"$dir/daemon.log"
tail -5 "$dir/daemon.log"
[ "$grid" != "-" ] && python3 benchmarks/guided_vs_grid.py "$dir/runs.json" "$grid" --explain "$dir/explain.json" | tee "$dir/score.txt"
jp_close_db "$dir/guided.db"
rm -f "$dir/others.json"
ls -la "$dir"
