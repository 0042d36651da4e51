#!/usr/bin/env bash
# A new held-out forward-pass grid and the daemon's guided pass over it, on the four GPUs of one host
# (nvidia-h200-x4 or nvidia-h100-x4) as four lanes that run at once, each a sequence of steps that stops starting
# work at a shared deadline: issue 26's GPU acceptance in one detached call. Started detached (setsid), so that a
# later device call of the same warm machine collects what finished (`collect`) and a call's limit kills no lane.
# Usage (on the GPU machine, from the repo root, the carried wheels in .whl/):
#   setsid benchmarks/heldout_gpu_lanes.sh start MINUTES DIR MODEL &   # MODEL: a gpu_sweep.py name (regnet, swin)
#   benchmarks/heldout_gpu_lanes.sh collect DIR OUT                    # tars DIR's lanes into OUT (one file each)
#   benchmarks/heldout_gpu_lanes.sh stop DIR                           # ends every step still running (from a call
#                                                                      # whose own command line names no lane step)
# The grid (gpu_sweep.py through device_sweep.sh, 3-s windows): eager, default and reduce-overhead x fp32, tf32,
# bf16 and fp16, no-epilogue-fusion in both compiled modes, 20 configurations; one run of each, split over lanes 0-2
# by precision (lane 0 fp32 then fp16, lane 1 tf32, lane 2 bf16), then a second run of the bf16 and fp16 compiled
# configurations (lane 1 bf16, lane 2 fp16) on another card. The bf16 and fp16 compiled runs also time a warm start
# from their artifacts (the likely contenders: the daemon's repeats of them start from their artifacts, and
# benchmarks/search_replay.py costs a repeat at the warm start its run recorded). Lane 3: the daemon's guided pass
# over the same search space from a store without the model (guided_daemon_gpu.sh with GRID `-`), then
# `pytest -m gpu`. On a host of fewer than four GPUs one lane runs the steps one after another on the first GPU:
# the grid's 20 configurations (no warm starts timed), the guided pass, the GPU
# tests, then the second runs, each while the deadline leaves it time (the grid keeps the pass's back).
# Afterwards, where the lanes were collected: export each grid part's database (`joulepilot runs export
# PART.json --db laneN/grid_*/gpu_sweep.db`; gpu_sweep's own runs.json is not an export), import the parts into one
# store (`joulepilot runs import PART.json --db grid.db`, new run ids), `joulepilot runs export GRID.json --db
# grid.db`, and score the pass against it (one GPU: the one part is GRID.json already): `python
# benchmarks/guided_vs_grid.py lane3/guided_MODEL/runs.json GRID.json --explain lane3/guided_MODEL/explain.json`.
set -uo pipefail
export PYTHONUNBUFFERED=1
verb=$1
. benchmarks/device_common.sh
[ "$verb" = collect ] && { jp_collect_lanes "$2" "$3"; exit 0; }
[ "$verb" = stop ] && { jp_stop_lanes "$2"; exit; }
[ "$verb" = start ] || { echo "usage: $0 start MINUTES DIR MODEL | collect DIR OUT | stop DIR" >&2; exit 2; }
minutes=$2 dir=$3 model=$4
deadline=$(( $(date +%s) + ${minutes%.*} * 60 ))
mkdir -p "$dir"
jp_mark_lanes "$dir"
jp_install || exit 1
read -r spec batch < <(python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_sweep import MODELS; \
m = MODELS['$model']; print(m['spec'], m['batch_size'])") || { echo "unknown model $model" >&2; exit 2; }
nvidia-smi --query-gpu=index,name,driver_version,power.limit,temperature.gpu --format=csv > "$dir/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$dir/device.txt"
echo "model $model: $spec batch $batch" >> "$dir/device.txt"

MODES=eager,default,reduce-overhead FUSIONS=default,no-epilogue-fusion
WARM="default/bf16,reduce-overhead/bf16,default/fp16,reduce-overhead/fp16"
# grid GPU LANE NAME PRECISIONS MODES [RESERVE_S]: one part of the grid into the lane's OUT/NAME, stopping new runs
# RESERVE_S (default 0) before the deadline
grid() {
  local left; left=$(( (deadline - ${6:-0} - $(date +%s)) / 60 - 1 ))
  [ "$left" -ge 2 ] || { echo "deadline: skipped $3"; return; }
  OUT="$2" CUDA_VISIBLE_DEVICES=$1 JOULEPILOT_HOME=/tmp/jphome$1 benchmarks/device_sweep.sh "$3" "$model" "$left" \
    "$WARM" --modes "$5" --precisions "$4" --fusions "$FUSIONS" --fusion-modes default,reduce-overhead \
    > "$2/$3.log" 2>&1
  tail -n 3 "$2/$3.log"
}
guided() {  # guided GPU LANE [RESERVE_S]
  local left; left=$(( deadline - ${3:-0} - $(date +%s) - 60 ))
  [ "$left" -ge 240 ] || { echo "deadline: skipped the guided pass"; return; }
  [ "$left" -le 540 ] || left=540
  env MODES=$MODES PRECISIONS=fp32,tf32,bf16,fp16 FUSIONS=$FUSIONS OUT="$2" CUDA_VISIBLE_DEVICES=$1 \
    JOULEPILOT_HOME=/tmp/jphome$1g PASS_TIMEOUT_S=$left \
    benchmarks/guided_daemon_gpu.sh "guided_$model" - "$spec" "$batch" - > "$2/guided.log" 2>&1
  tail -n 4 "$2/guided.log"
}
gpu_tests() {
  local left; left=$(( deadline - $(date +%s) - 20 ))
  [ "$left" -ge 120 ] || { echo "deadline: skipped the GPU tests"; return; }
  CUDA_VISIBLE_DEVICES=$1 JOULEPILOT_HOME=/tmp/jphome$1t timeout "$left" python3 -m pytest -m gpu -q \
    -o addopts="-ra" -p no:cacheprovider tests > "$2/gpu_tests.log" 2>&1
  tail -n 3 "$2/gpu_tests.log"
}
lane() {
  local n=$1; shift
  local lane="$dir/lane$n"; mkdir -p "$lane"
  { echo "lane $n start $(date -u +%T)"; "$@" "$n" "$lane"; echo "lane $n done $(date -u +%T)"; } >> "$lane/lane.log" 2>&1
}
lane0() { grid "$1" "$2" grid_fp32 fp32 "$MODES"; grid "$1" "$2" grid_fp16 fp16 "$MODES"; }
lane1() { grid "$1" "$2" grid_tf32 tf32 "$MODES"; grid "$1" "$2" grid_bf16_again bf16 default,reduce-overhead; }
lane2() { grid "$1" "$2" grid_bf16 bf16 "$MODES"; grid "$1" "$2" grid_fp16_again fp16 default,reduce-overhead; }
lane3() { guided "$1" "$2"; gpu_tests "$1" "$2"; }
# one GPU: the grid keeps GRID_RESERVE_S (default 300) back for the guided pass (about 0.40 of the grid); the tests
# get what is left
serial() {
  WARM="" grid "$1" "$2" grid fp32,tf32,bf16,fp16 "$MODES" "${GRID_RESERVE_S:-300}"
  guided "$1" "$2"; gpu_tests "$1" "$2"
  grid "$1" "$2" grid_again bf16,fp16 default,reduce-overhead
}
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
if [ "$gpus" -ge 4 ]; then
  lane 0 lane0 & lane 1 lane1 & lane 2 lane2 & lane 3 lane3 &
else
  lane 0 serial &
fi
wait
echo "all lanes done $(date -u +%T)" >> "$dir/device.txt"
