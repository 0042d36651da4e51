#!/usr/bin/env bash
# On the lent two-GPU machine, from the repo root: the fleet sweep (benchmarks/fleet_sweep.py). One daemon on cuda:0,
# then two daemons (cuda:0 and cuda:1, each as a host of its own) sharing a PostgreSQL store, sweep one policy (16
# configurations by default); then the decided configuration's first compile on a new host, cold and from the
# fleet's Redis. The machine has no package registry, so PostgreSQL, redis-server and the Python clients are carried.
# Here, once (Debian 12's PostgreSQL 15, about 13 MB packed; psql is not needed):
#   echo /.postgres/ >> "$(git rev-parse --git-path info/exclude)"
#   mkdir -p .postgres/root && cd .postgres && apt-get download postgresql-15 libpq5 libicu72 libldap-2.5-0 &&
#     for f in *.deb; do dpkg -x "$f" root; done && cd root && b=usr/lib/postgresql/15 &&
#     find $b/bin -type f ! -name initdb ! -name postgres -delete &&
#     find $b/lib -mindepth 1 -maxdepth 1 ! -name plpgsql.so ! -name dict_snowball.so -exec rm -rf {} + &&
#     rm -rf usr/share/doc usr/share/man usr/share/locale usr/share/lintian usr/share/postgresql/15/man \
#       usr/lib/x86_64-linux-gnu/libicu{io,test,tu}* &&
#     tar -cJf ../postgres.tar.xz usr && cd .. && rm -rf root ./*.deb && cd ..
# The tree keeps dpkg's layout: postgres finds its share/ and lib/ folders relative to its own binary. The
# libraries packed beside it (libpq, ICU 72, OpenLDAP 2.5) are used only where the machine lacks them. For the cache
# phase, .redis/ as benchmarks/compile_cache_gpu.sh describes (without it the cache phase is left out). The Python
# clients in .whl/: ../shared/tools/device-wheels.sh redis psycopg psycopg-binary. Carry .whl, .postgres and .redis.
# Results go to $OUT: fleet_sweep[_PHASES].json (the script's --json), .log (its stderr, the daemons' logs
# included) and _daemons.tar.gz (each daemon's config, log and pass summary), and gpu.txt.
#   bash benchmarks/fleet_sweep_gpu.sh                          # all phases in one call, on cuda:0,cuda:1 (DEVICES)
#   SPEC=convnet BATCH=32 MODES=eager,default PRECISIONS=fp32,bf16 FUSION=default,aggressive-fusion \
#     MIN_SECONDS=2 bash benchmarks/fleet_sweep_gpu.sh
# A call may run at most 10 minutes: where both sweeps do not fit in one, run PHASES=one first, put its JSON in the
# tree, and run PHASES=fleet,cache PREVIOUS=that.json (the phases not run are taken from it).
set -uo pipefail
export PYTHONUNBUFFERED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID
source benchmarks/device_common.sh
jp_install || exit 1
# PostgreSQL runs as nobody: unpack it where nobody may read and execute it, outside the checkout
rm -rf /tmp/jp-postgres && mkdir -p /tmp/jp-postgres && tar -xJf .postgres/postgres.tar.xz -C /tmp/jp-postgres || exit 1
chmod -R a+rX /tmp/jp-postgres
pgbin=$(ls -d /tmp/jp-postgres/usr/lib/postgresql/*/bin | tail -1)
export PATH=$pgbin:$PATH
# LD_LIBRARY_PATH is searched before the system's folders, so the packed libraries go on it only when needed
{ postgres --version && initdb --version; } >/dev/null 2>&1 ||
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}/tmp/jp-postgres/usr/lib/x86_64-linux-gnu
{ postgres --version && initdb --version; } || exit 1
cache=()
if [ -d .redis ]; then
  rm -rf /tmp/jp-redis && cp -r .redis /tmp/jp-redis && chmod -R a+rX /tmp/jp-redis
  export PATH=/tmp/jp-redis:$PATH LD_LIBRARY_PATH=/tmp/jp-redis/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  redis-server --version >/dev/null 2>&1 || export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:/tmp/jp-redis/extra
  redis-server --version || exit 1
  cache=(--start-redis)
fi
nvidia-smi --query-gpu=index,name,driver_version,power.limit --format=csv,noheader > "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/gpu.txt"
extra=()
[ -n "${MODES-}" ] && extra+=(--modes "$MODES")
[ -n "${PRECISIONS-}" ] && extra+=(--precisions "$PRECISIONS")
[ -n "${FUSION-}" ] && extra+=(--fusion "$FUSION")
[ -n "${PREVIOUS-}" ] && extra+=(--previous "$PREVIOUS")
phases=${PHASES:-one,fleet,cache}
name=fleet_sweep${PHASES:+_${PHASES//,/-}}
rm -rf /tmp/jp-fleet-logs
python3 benchmarks/fleet_sweep.py --devices "${DEVICES:-cuda:0,cuda:1}" --spec "${SPEC:-mlp}" --batch-size "${BATCH:-8}" \
  --min-seconds "${MIN_SECONDS:-1}" --min-repeats "${MIN_REPEATS:-1}" --phases "$phases" \
  --phase-timeout-s "${PHASE_TIMEOUT_S:-500}" --logs /tmp/jp-fleet-logs "${cache[@]}" "${extra[@]}" --json \
  > "$OUT/$name.json" 2> >(tee "$OUT/$name.log" >&2)
rc=$?
# the daemons' homes hold compile artifacts, and the cache phase's runs their own stores: not needed
tar -czf "$OUT/${name}_daemons.tar.gz" --exclude=home --exclude=cache -C /tmp jp-fleet-logs
echo "fleet_sweep.py exited $rc" | tee -a "$OUT/gpu.txt"
exit $rc
