#!/usr/bin/env bash
# The J/token table of benchmarks/generation_energy.py and the daemon on a generation policy, spread over the four
# GPUs of one host (nvidia-h200-x4) as four lanes that run at once, each a sequence of steps that stops starting
# work at a shared deadline. Started detached (setsid) so that later device calls of the same warm machine can
# collect what finished (`collect`), and so that a call's limit does not kill the lanes.
# Usage (on the GPU machine, from the repo root, the carried wheels in .whl/):
#   setsid benchmarks/generation_gpu_lanes.sh start MINUTES DIR &   # DIR e.g. /tmp/lanes; returns at once
#   benchmarks/generation_gpu_lanes.sh collect DIR OUT               # tars DIR's lanes into OUT (one file each)
#   benchmarks/generation_gpu_lanes.sh stop DIR                      # ends every step still running
# PLAN=final (four GPUs) measured what the table lacked after sessions 13 and 15 (batch 32, batch 8 in fp16) beside
# a new forward-pass grid and the daemon's guided pass over it (session 16); PLAN=all (the default) the whole table.
set -uo pipefail
export PYTHONUNBUFFERED=1
verb=$1
. benchmarks/device_common.sh
[ "$verb" = collect ] && { jp_collect_lanes "$2" "$3"; exit 0; }
[ "$verb" = stop ] && { jp_stop_lanes "$2"; exit; }
minutes=$2 dir=$3
deadline=$(( $(date +%s) + ${minutes%.*} * 60 ))
mkdir -p "$dir"
jp_mark_lanes "$dir"
jp_install || exit 1
nvidia-smi --query-gpu=index,name,driver_version,power.limit,temperature.gpu --format=csv > "$dir/device.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' >> "$dir/device.txt"

left_min() { echo $(( (deadline - $(date +%s)) / 60 )); }
# table GPU LANE MODELS BATCHES CONFIGS PRECISIONS: one generation_energy.py step into the lane's database
table() {
  local gpu=$1 lane=$2
  local left; left=$(left_min)
  [ "$left" -ge 2 ] || { echo "deadline: skipped $3 b$4 $5 $6"; return; }
  python3 benchmarks/generation_energy.py --device "cuda:$gpu" --out "$lane" --db "$lane/generation.db" \
    --models "$3" --batches "$4" --configs "$5" --precisions "$6" --min-seconds 2 --budget-s 300 \
    --max-minutes "$left" --reserve-s 100 > "$lane/step_$3_b$4_$6.log" 2>&1
  tail -n 2 "$lane/step_$3_b$4_$6.log"
}
B1="eager,transformers-static-compile,default,reduce-overhead,max-autotune-no-cudagraphs,compiled-dynamic-cache,max-autotune"
BIG="eager,transformers-static-compile,default,reduce-overhead,max-autotune-no-cudagraphs,compiled-dynamic-cache"
FP16="eager,default,reduce-overhead,max-autotune-no-cudagraphs"
lane() {
  local n=$1; shift
  local lane="$dir/lane$n"; mkdir -p "$lane"
  { echo "lane $n start $(date -u +%T)"; "$@"; echo "lane $n done $(date -u +%T)"; } >> "$lane/lane.log" 2>&1
}
lane0() { table 0 "$dir/lane0" llama 1 "$B1" bf16; table 0 "$dir/lane0" llama 1 "$FP16" fp16
          table 0 "$dir/lane0" llama 32 "$BIG" bf16; }
lane1() { table 1 "$dir/lane1" qwen2 1 "$B1" bf16; table 1 "$dir/lane1" qwen2 1 "$FP16" fp16
          table 1 "$dir/lane1" qwen2 32 "$BIG" bf16; }
lane2() { table 2 "$dir/lane2" llama 8 "$BIG" bf16; table 2 "$dir/lane2" qwen2 8 "$BIG" bf16
          table 2 "$dir/lane2" llama 8 "$FP16" fp16; table 2 "$dir/lane2" qwen2 8 "$FP16" fp16; }
# daemon_step GPU LANE: the daemon on a generation policy under a 200 W envelope (generation_daemon_gpu.sh)
daemon_step() {
  local left; left=$(( deadline - $(date +%s) - 60 ))
  [ "$left" -ge 240 ] || { echo "deadline: skipped the daemon"; return; }
  [ "$left" -le 480 ] || left=480
  OUT="$2" CUDA_VISIBLE_DEVICES=$1 TIMEOUT_S=$left JOULEPILOT_HOME=/tmp/jphome$1 \
    benchmarks/generation_daemon_gpu.sh llama_chat_200w 200 eager,default,reduce-overhead bf16 1,8 \
    > "$2/daemon_step.log" 2>&1
  tail -n 4 "$2/daemon_step.log"
}
gpu_tests() {
  CUDA_VISIBLE_DEVICES=$1 JOULEPILOT_HOME=/tmp/jphome$1t timeout 240 python3 -m pytest -m gpu -q -o addopts="-ra" \
    -p no:cacheprovider tests > "$2/gpu_tests.log" 2>&1
  tail -n 3 "$2/gpu_tests.log"
}
lane3() { daemon_step 3 "$dir/lane3"; gpu_tests 3 "$dir/lane3"
          table 3 "$dir/lane3" llama 32 "$FP16" fp16; table 3 "$dir/lane3" qwen2 32 "$FP16" fp16; }
# Two GPUs (nvidia-h200-x2): batch 1 in full, then batch 8 in bf16, then the daemon and the GPU tests, then batch 32.
lane0_of2() { table 0 "$dir/lane0" llama 1 "$B1" bf16; table 0 "$dir/lane0" llama 1 "$FP16" fp16
              table 0 "$dir/lane0" llama 8 "$BIG" bf16; daemon_step 0 "$dir/lane0"
              table 0 "$dir/lane0" llama 32 "$BIG" bf16; table 0 "$dir/lane0" llama 8 "$FP16" fp16; }
lane1_of2() { table 1 "$dir/lane1" qwen2 1 "$B1" bf16; table 1 "$dir/lane1" qwen2 1 "$FP16" fp16
              table 1 "$dir/lane1" qwen2 8 "$BIG" bf16; gpu_tests 1 "$dir/lane1"
              table 1 "$dir/lane1" qwen2 32 "$BIG" bf16; table 1 "$dir/lane1" qwen2 8 "$FP16" fp16; }
# PLAN=final, four GPUs: what the issue's table still lacks (batch 32 in both precisions; batch 8 in fp16, and
# max-autotune-no-cudagraphs and the compiled dynamic cache in bf16), on lanes 0, 1 and 3; beside them, for the
# judge's issue, a new 20-configuration forward-pass grid (torchvision convnext_tiny, batch 32: eager, default and
# reduce-overhead x fp32, tf32, bf16 and fp16, no-epilogue-fusion in both compiled modes) on lane 2, and the
# daemon's guided pass over the same search space, from a store without that model, on lane 3 (both at once).
CORE="eager,default,reduce-overhead,max-autotune-no-cudagraphs,compiled-dynamic-cache"
GRID_ENV="MODES=eager,default,reduce-overhead PRECISIONS=fp32,tf32,bf16,fp16 FUSIONS=default,no-epilogue-fusion"
grid_step() {
  local left; left=$(( (deadline - $(date +%s)) / 60 - 2 ))
  OUT="$2" CUDA_VISIBLE_DEVICES=$1 benchmarks/device_sweep.sh convnext_grid convnext "$left" "" \
    --modes eager,default,reduce-overhead --precisions fp32,tf32,bf16,fp16 --fusions default,no-epilogue-fusion \
    --fusion-modes default,reduce-overhead > "$2/grid_step.log" 2>&1
  tail -n 3 "$2/grid_step.log"
}
guided_step() {
  env $GRID_ENV OUT="$2" CUDA_VISIBLE_DEVICES=$1 JOULEPILOT_HOME=/tmp/jphome$1g \
    benchmarks/guided_daemon_gpu.sh guided_convnext - torchvision:convnext_tiny 32 - > "$2/guided_step.log" 2>&1
  tail -n 4 "$2/guided_step.log"
}
final0() { table 0 "$dir/lane0" llama 32 "$CORE" bf16; table 0 "$dir/lane0" llama 32 "$FP16" fp16
           table 0 "$dir/lane0" qwen2 8 compiled-dynamic-cache bf16; }
final1() { table 1 "$dir/lane1" qwen2 32 "$CORE" bf16; table 1 "$dir/lane1" qwen2 32 "$FP16" fp16
           table 1 "$dir/lane1" llama 8 "max-autotune-no-cudagraphs,compiled-dynamic-cache" bf16; }
final2() { grid_step 2 "$dir/lane2"; gpu_tests 2 "$dir/lane2"; }
final3() { guided_step 3 "$dir/lane3"; table 3 "$dir/lane3" llama 8 "$FP16" fp16
           table 3 "$dir/lane3" qwen2 8 "$FP16" fp16; }
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
case "${PLAN:-all}/$([ "$gpus" -ge 4 ] && echo 4 || echo 2)" in
  all/4) lane 0 lane0 & lane 1 lane1 & lane 2 lane2 & lane 3 lane3 & ;;
  all/2) lane 0 lane0_of2 & lane 1 lane1_of2 & ;;
  final/4) lane 0 final0 & lane 1 final1 & lane 2 final2 & lane 3 final3 & ;;
  *) echo "PLAN must be all or final (final on four GPUs), not ${PLAN}" >&2; exit 2 ;;
esac
wait
echo "all lanes done $(date -u +%T)" >> "$dir/device.txt"
