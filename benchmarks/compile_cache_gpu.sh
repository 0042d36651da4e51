#!/usr/bin/env bash
# On the lent GPU machine, from the repo root: a host's first compile of a decided configuration, cold and from the
# fleet's Redis (benchmarks/compile_cache_fleet.py), with a redis-server carried from Debian's package, since the
# machine has no package registry. Here, once: put redis-server and the libraries it lacks in .redis/ (git-ignored:
# `apt-get download redis-server libjemalloc2 liblzf1`, `dpkg -x`, then copy usr/bin/redis-server and the two
# libraries' .so files to .redis/ and .redis/lib/; .redis/extra/ may hold this machine's copies of the
# others it links, used only where the GPU machine lacks them), and the Python client in .whl/ (../shared/tools/device-wheels.sh
# redis); carry both. Results go to $OUT.
#   SPEC=torchvision:resnet50 MODE=reduce-overhead PRECISION=bf16 BATCH=32 REPEATS=3 bash benchmarks/compile_cache_gpu.sh
set -uo pipefail
source benchmarks/device_common.sh
jp_install || exit 1
# redis-server runs as nobody: give it a copy it may execute, outside the checkout
rm -rf /tmp/jp-redis && cp -r .redis /tmp/jp-redis && chmod -R a+rX /tmp/jp-redis
export PATH=/tmp/jp-redis:$PATH LD_LIBRARY_PATH=/tmp/jp-redis/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
redis-server --version >/dev/null 2>&1 || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/jp-redis/extra
redis-server --version || exit 1
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
name=$(echo "${SPEC:-torchvision:resnet50}_${MODE:-reduce-overhead}_${PRECISION:-bf16}_b${BATCH:-32}" | tr ':/' '__')
python3 benchmarks/compile_cache_fleet.py --spec "${SPEC:-torchvision:resnet50}" --mode "${MODE:-reduce-overhead}" \
  --precision "${PRECISION:-bf16}" --batch-size "${BATCH:-32}" --device cuda:0 --repeats "${REPEATS:-3}" --min-seconds 1 --json \
  > "$OUT/$name.json" 2> >(tee "$OUT/$name.log" >&2)
