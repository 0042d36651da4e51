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

# jp_daemon_toml DIR DB MIN_SECONDS BUDGET_S: DIR/daemon.toml for one `daemon --once` pass over DIR/policies into
# DB, measuring at once (a second of idle is enough, other processes allowed) with no exporter.
jp_daemon_toml() {
  cat > "$1/daemon.toml" <<TOML
db = "$2"
policies = ["$1/policies"]
lock_dir = "$1/locks"
[idle]
min_idle_s = 1.0
allow_other_processes = true
poll_s = 0.5
[bench]
min_seconds = $3
budget_s = $4
[exporter]
enabled = false
TOML
}

# jp_collect_lanes DIR OUT: each of DIR's lanes (DIR/laneN, as the *_gpu_lanes.sh scripts leave them) as one tar
# in OUT, write-ahead logs left out (the lanes close their databases), with DIR's device.txt; then each lane's
# last lines.
jp_collect_lanes() {
  local lane
  for lane in "$1"/lane*; do
    [ -d "$lane" ] && tar --exclude='*.db-wal' --exclude='*.db-shm' -czf "$2/$(basename "$lane").tar.gz" -C "$1" "$(basename "$lane")"
  done
  cp "$1/device.txt" "$2/" 2>/dev/null
  tail -n 4 "$1"/lane*/lane.log
}

# jp_mark_lanes DIR: record this process's group in DIR/pgid (a lanes script started with setsid leads its own);
# jp_stop_lanes DIR: end that whole group, every lane's sweep, daemon and worker included. Killing the lanes script
# alone leaves the steps it started running: a sweep still under way then shares the GPU with what runs next.
jp_mark_lanes() { ps -o pgid= $$ | tr -d ' ' > "$1/pgid"; }
jp_stop_lanes() {
  local pgid; pgid=$(cat "$1/pgid" 2>/dev/null) || { echo "no $1/pgid: nothing started there" >&2; return 1; }
  kill -TERM -- "-$pgid" 2>/dev/null; sleep 3; kill -KILL -- "-$pgid" 2>/dev/null
  echo "stopped process group $pgid"
}
