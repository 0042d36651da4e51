# Sourced by the scripts that run on the lent GPU machine (device_sweep.sh, guided_daemon_gpu.sh,
# generation_daemon_gpu.sh, generation_gpu_lanes.sh), from the repo root.

# jp_install: the carried pure-Python wheels (.whl/, into /tmp/site on PYTHONPATH) and the project, editable;
# once per process tree (JP_INSTALLED, exported, tells the scripts this one starts that it is done).
jp_install() {
  [ -n "${JP_INSTALLED-}" ] && return 0
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || return 1
    export PYTHONPATH=/tmp/site
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  export JP_INSTALLED=1
}

# jp_close_db DB: fold the database's write-ahead log into it and leave it in rollback-journal mode, so that the
# one file comes back from the machine whole.
jp_close_db() {
  python3 - "$1" <<'PY'
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
conn.execute("PRAGMA journal_mode=DELETE")
conn.close()
PY
  rm -f "$1-wal" "$1-shm"
}
