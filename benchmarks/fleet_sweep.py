"""A fleet's sweep: daemons of several hosts sharing a PostgreSQL store, against one daemon alone; then a new host's
first compile of the decided configuration from the fleet's Redis, against a cold one.

    python benchmarks/fleet_sweep.py --devices cpu,cpu --modes eager,default --precisions fp32,bf16 \\
        --min-seconds 0.2 --json                                                      # a CPU smoke run
    python benchmarks/fleet_sweep.py --devices cuda:0,cuda:1 --min-seconds 1 --start-redis --json
    JOULEPILOT_DB=postgresql://USER:PASSWORD@HOST/postgres python benchmarks/fleet_sweep.py ...  # a given server
    python benchmarks/fleet_sweep.py --phases one --json > one.json && \\
        python benchmarks/fleet_sweep.py --phases fleet,cache --previous one.json --start-redis --json

One policy file (`exhaustive`, the grid of --modes x --precisions x --fusion: 16 configurations by default, eager
once per precision) is swept by `joulepilot daemon --once` in two phases, each into a new, empty database of
one PostgreSQL server:
- `one`: one daemon, on the first of --devices;
- `fleet`: one daemon per entry of --devices, all started at once, each as a host of its own (a JOULEPILOT_HOME
  of its own, JOULEPILOT_HOSTNAME set to a name of its own, `devices` its one device).
Each phase's wall time runs from the first daemon's start to the last one's exit; `ratio` is fleet / one, against
the target of 0.6. After each phase the store is read back: the runs of every configuration (each energy window
is a run; a worker process's first window has no first_run_id, so `processes` counts those), which host measured
them, and the configurations with more runs than `--min-repeats` (the most the policy asks of any one: its
choice and close contenders get min_repeats, the rest 1): those were measured more often than the policy asks.

Phase `cache` (with --redis-url or --start-redis): the decided configuration compiled as new hosts would
(benchmarks/compile_cache_fleet.py's runs: a home and a database of their own, fresh local caches in every
worker): `cold` with no remote cache, `fills` with the server just emptied, `from the fleet` from what that run
uploaded. A --redis-url server is flushed first: give one that holds nothing else. The sweep phases run without a
remote cache (JOULEPILOT_REDIS_URL is taken out of the daemons' environment), so their compiles are cold alike.

Without --db-url (or JOULEPILOT_DB) a throwaway cluster is started from the operating system's PostgreSQL
(initdb and postgres from PATH or /usr/lib/postgresql/*/bin; Debian/Ubuntu: apt-get install postgresql) on loopback
with a password login, as nobody when run as root, and removed at the end. A given server's role must be allowed to
create databases; the ones this creates (jp_fleet_*) are dropped at the end. Database URLs reach the daemons in
JOULEPILOT_DB only (a password on the command line is refused). Exits 1 when a daemon exits non-zero or a phase
ends with no decision; a ratio over the target is a result, not a failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from joulepilot.store.urls import redacted

DEFAULT_MODES = "eager,default,reduce-overhead,max-autotune-no-cudagraphs"
DEFAULT_PRECISIONS = "fp32,tf32,bf16,fp16"
DEFAULT_FUSION = "default"
TARGET_RATIO = 0.6
POLICY = "fleet-sweep"
PHASES = ("one", "fleet", "cache")
HERE = Path(__file__).resolve().parent


def log(message: str) -> None:
    print(f"[fleet_sweep {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _split(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_nobody() -> list[str]:
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        sys.exit("running as root, and setpriv (util-linux) is missing to start PostgreSQL as nobody")
    return ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


def _postgres_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    found_versions = [p for p in Path("/usr/lib/postgresql").glob(f"*/bin/{name}") if p.parts[-3].isdigit()]
    return str(max(found_versions, key=lambda p: int(p.parts[-3]))) if found_versions else None


@dataclass
class Postgres:
    """A server to create the phases' databases in: `url` names a database to connect to for CREATE DATABASE;
    `process` and `folder` belong to a throwaway cluster this script started."""

    url: str
    process: subprocess.Popen | None = None
    folder: Path | None = None
    created: list[str] = field(default_factory=list)

    def new_database(self, phase: str) -> str:
        import psycopg
        from psycopg import sql

        name = f"jp_fleet_{phase}_{secrets.token_hex(4)}"
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.created.append(name)
        return urlsplit(self.url)._replace(path=f"/{name}").geturl()

    def close(self) -> None:
        if self.process is None:
            import psycopg
            from psycopg import sql

            for name in self.created:
                try:
                    with psycopg.connect(self.url, autocommit=True) as conn:
                        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
                except psycopg.Error as exc:
                    log(f"could not drop database {name}: {exc}")
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def start_postgres() -> Postgres:
    """A PostgreSQL cluster in a temporary folder: loopback and a socket in that folder, a password login for the
    user joulepilot, no fsync (the store's durability is not what is measured)."""
    import psycopg

    initdb, postgres = _postgres_binary("initdb"), _postgres_binary("postgres")
    if initdb is None or postgres is None:
        sys.exit("PostgreSQL is not installed (Debian/Ubuntu: apt-get install postgresql), or pass --db-url")
    folder = Path(tempfile.mkdtemp(prefix="joulepilot-fleet-postgres-"))
    folder.chmod(0o777)  # the server runs as nobody when this runs as root
    password = secrets.token_hex(12)
    (folder / "password").write_text(password)
    (folder / "password").chmod(0o644)
    logfile = open(folder / "postgres.log", "ab")
    done = subprocess.run([*_as_nobody(), initdb, "-D", str(folder / "data"), "-U", "joulepilot", "-E", "UTF8",
                           "--auth=scram-sha-256", f"--pwfile={folder / 'password'}", "--no-sync"],
                          stdout=logfile, stderr=logfile)
    if done.returncode != 0:
        logfile.close()
        tail = (folder / "postgres.log").read_text(errors="replace")[-2000:]
        shutil.rmtree(folder, ignore_errors=True)
        sys.exit(f"initdb failed (exit {done.returncode}):\n{tail}")
    for _ in range(3):
        port = _free_port()
        process = subprocess.Popen(
            [*_as_nobody(), postgres, "-D", str(folder / "data"), "-k", str(folder), "-p", str(port),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
             "-c", "full_page_writes=off", "-c", "max_connections=200"], stdout=logfile, stderr=logfile)
        url = f"postgresql://joulepilot:{password}@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with psycopg.connect(url, connect_timeout=2):
                    logfile.close()
                    return Postgres(url, process, folder)
            except psycopg.Error:
                time.sleep(0.1)
        process.kill()
        process.wait()
    logfile.close()
    tail = (folder / "postgres.log").read_text(errors="replace")[-2000:]
    shutil.rmtree(folder, ignore_errors=True)
    sys.exit(f"postgres did not start on a free loopback port in 3 tries:\n{tail}")


def write_policy(folder: Path, args: argparse.Namespace) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{POLICY}.toml"
    path.write_text(
        f'name = "{POLICY}"\nworkload = {json.dumps(args.spec)}\nbatch_size = {args.batch_size}\n\n'
        '[objective]\nminimize = "energy"\nexpected_inferences = 10_000_000\n\n'
        f"[limits]\nmax_rel_error = {args.max_rel_error!r}\n\n"
        f"[search]\nstrategy = \"exhaustive\"\nmodes = {json.dumps(_split(args.modes))}\n"
        f"precisions = {json.dumps(_split(args.precisions))}\nfusion = {json.dumps(_split(args.fusion))}\n"
        f"min_repeats = {args.min_repeats}\n")
    return path


def policy_configs(path: Path) -> list[str]:
    """The labels of the configurations the policy's grid holds, as the daemon plans them."""
    from joulepilot.policies import candidate_configs, load_policy

    return [config.label for config in candidate_configs(load_policy(path))]


def write_daemon_config(folder: Path, device: str, args: argparse.Namespace) -> Path:
    """One `daemon --once` pass on `device`; no `db` (the URL comes in JOULEPILOT_DB), no exporter."""
    devices = '"cpu"' if device == "cpu" else f"[{int(device.split(':', 1)[1])}]"
    path = folder / "daemon.toml"
    path.write_text(
        f"policies = [{json.dumps(str(folder / 'policies'))}]\nlock_dir = {json.dumps(str(folder / 'locks'))}\n"
        f'devices = {devices}\ninterval_s = 3600\nlog_level = "INFO"\n\n'
        f"[idle]\nmin_idle_s = {args.min_idle_s!r}\nallow_other_processes = true\npoll_s = 0.5\n\n"
        f"[bench]\nmin_seconds = {args.min_seconds!r}\nbudget_s = {args.budget_s!r}\n\n"
        "[exporter]\nenabled = false\n")
    path.chmod(0o600)
    return path


@dataclass
class Daemon:
    host: str
    device: str
    folder: Path
    process: subprocess.Popen
    started: float
    ended: float | None = None
    timed_out: bool = False
    echo: threading.Thread | None = None


def _echo(daemon: Daemon) -> None:
    """The daemon's log to its file and, each line prefixed with its host, to stderr."""
    assert daemon.process.stderr is not None
    with open(daemon.folder / "daemon.log", "w") as out:
        for line in daemon.process.stderr:
            out.write(line)
            print(f"  [{daemon.host}] {line.rstrip()}", file=sys.stderr, flush=True)


def start_daemon(host: str, device: str, folder: Path, policy: Path, url: str, cpus: set[int] | None,
                 args: argparse.Namespace) -> Daemon:
    (folder / "policies").mkdir(parents=True)
    shutil.copy(policy, folder / "policies" / policy.name)  # each host has its own policy folder
    (folder / "home").mkdir()
    config = write_daemon_config(folder, device, args)
    env = dict(os.environ)
    for key in ("JOULEPILOT_REDIS_URL", "JOULEPILOT_LOCK_DIR", "JOULEPILOT_DB"):
        env.pop(key, None)
    env.update(JOULEPILOT_HOME=str(folder / "home"), JOULEPILOT_HOSTNAME=host, JOULEPILOT_DB=url,
               PYTHONUNBUFFERED="1")
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    with open(folder / "pass.json", "w") as stdout:
        process = subprocess.Popen([sys.executable, "-m", "joulepilot", "daemon", "--once", "--json", "--config",
                                    str(config)], env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                                   errors="replace")
    if cpus:
        # before the interpreter has started a thread or a child, so all of them inherit it
        os.sched_setaffinity(process.pid, cpus)
    daemon = Daemon(host, device, folder, process, time.monotonic())
    daemon.echo = threading.Thread(target=_echo, args=(daemon,), daemon=True)
    daemon.echo.start()
    return daemon


def wait_all(daemons: list[Daemon], timeout_s: float) -> None:
    """Until every daemon exited; past `timeout_s` the rest are stopped (SIGTERM, then SIGKILL)."""
    deadline = time.monotonic() + timeout_s
    while any(d.ended is None for d in daemons):
        for d in daemons:
            if d.ended is None and d.process.poll() is not None:
                d.ended = time.monotonic()
                log(f"{d.host} exited {d.process.returncode} after {d.ended - d.started:.1f} s")
        if time.monotonic() > deadline:
            for d in daemons:
                if d.ended is None:
                    log(f"{d.host} still running after {timeout_s:.0f} s: stopping it")
                    d.timed_out = True
                    d.process.terminate()
            for d in daemons:
                if d.ended is None:
                    try:
                        d.process.wait(timeout=60)
                    except subprocess.TimeoutExpired:
                        d.process.kill()
                        d.process.wait()
                    d.ended = time.monotonic()
        time.sleep(0.2)
    for d in daemons:
        if d.echo is not None:
            d.echo.join(timeout=10)


def _summary(daemon: Daemon) -> dict[str, Any]:
    """What a daemon's pass said of itself (its `--once --json` summary), in brief."""
    text = (daemon.folder / "pass.json").read_text(errors="replace")
    out: dict[str, Any] = {"device": daemon.device, "exit_code": daemon.process.returncode,
                           "wall_s": round((daemon.ended or daemon.started) - daemon.started, 2),
                           "timed_out": daemon.timed_out}
    try:
        summary = json.loads(text)
    except ValueError:
        out["summary_error"] = f"no JSON pass summary on stdout ({len(text)} characters)"
        summary = {}
    for key in ("duration_s", "enqueued", "runs_ok", "runs_failed", "requeued", "decided", "policy_errors",
                "device_errors"):
        if key in summary:
            out[key] = summary[key]
    out["repeats"] = len(summary.get("repeats") or [])
    if daemon.process.returncode != 0 or daemon.timed_out:
        out["log_tail"] = (daemon.folder / "daemon.log").read_text(errors="replace").splitlines()[-15:]
    return out


def read_store(url: str, min_repeats: int) -> dict[str, Any]:
    """Runs per configuration and per host, and the decisions, as the phase's database holds them."""
    import psycopg
    from psycopg.rows import dict_row

    with psycopg.connect(url, row_factory=dict_row) as conn:
        runs = conn.execute(
            "SELECT runs.id, runs.status, runs.first_run_id, runs.host_id, hosts.hostname, configs.label, "
            "runs.torch_version, runs.device_name FROM runs JOIN configs ON configs.id = runs.config_id "
            "LEFT JOIN hosts ON hosts.id = runs.host_id ORDER BY runs.id").fetchall()
        decisions = conn.execute(
            "SELECT decisions.id, decisions.config_id, decisions.state, decisions.reason, configs.* FROM decisions "
            "LEFT JOIN configs ON configs.id = decisions.config_id ORDER BY decisions.id DESC").fetchall()
        jobs = {r["state"]: r["n"] for r in conn.execute("SELECT state, COUNT(*) AS n FROM jobs GROUP BY state")}
    per_config: dict[str, dict[str, Any]] = {}
    per_host: dict[str, int] = {}
    for run in runs:
        entry = per_config.setdefault(run["label"], {"runs": 0, "ok": 0, "failed": 0, "processes": 0, "hosts": {}})
        entry["runs"] += 1
        entry["ok" if run["status"] == "ok" else "failed"] += 1
        if run["first_run_id"] is None:
            host = run["hostname"] or run["host_id"]
            entry["processes"] += 1
            entry["hosts"][host] = entry["hosts"].get(host, 0) + 1
            per_host[host] = per_host.get(host, 0) + 1
    over = [{"config": label, "runs": e["runs"], "processes": e["processes"]}
            for label, e in per_config.items() if e["runs"] > min_repeats]
    decision = None
    if decisions:
        row = decisions[0]
        config = {k: row[k] for k in ("mode", "fusion", "options", "precision", "dynamic", "batch_size", "padding",
                                      "regional", "cache", "compile_prefill") if k in row}
        decision = {"config_id": row["config_id"], "state": row["state"], "label": row["label"],
                    "reason": row["reason"], "config": config if row["label"] else None}
    return {
        "runs": len(runs),
        "processes": sum(e["processes"] for e in per_config.values()),
        "failed_runs": sum(e["failed"] for e in per_config.values()),
        "max_runs_per_config": max((e["runs"] for e in per_config.values()), default=0),
        "over_asked": over,
        "per_config": per_config,
        "per_host": per_host,
        "hosts_in_store": len({r["host_id"] for r in runs}),
        "jobs": jobs,
        "decision": decision,
        "decisions": [{"label": d["label"], "state": d["state"]} for d in decisions],
        "torch": next((r["torch_version"] for r in runs if r["torch_version"]), None),
        "device_name": next((r["device_name"] for r in runs if r["device_name"]), None),
    }


def run_phase(phase: str, devices: list[str], server: Postgres, policy: Path, work: Path,
              args: argparse.Namespace) -> dict[str, Any]:
    url = server.new_database(phase)
    log(f"phase {phase}: {len(devices)} daemon(s) on {', '.join(devices)}, database {redacted(url)}")
    cpus: list[set[int] | None] = [None] * len(devices)
    if args.split_cpus and len(devices) > 1:
        mine = sorted(os.sched_getaffinity(0))
        share = max(1, len(mine) // len(devices))
        cpus = [set(mine[i * share:(i + 1) * share]) or set(mine) for i in range(len(devices))]
    daemons = [start_daemon(f"{phase}-{i}", device, work / phase / f"{phase}-{i}", policy, url, cpus[i], args)
               for i, device in enumerate(devices)]
    started = min(d.started for d in daemons)
    try:
        wait_all(daemons, args.phase_timeout_s)
    except BaseException:
        for d in daemons:
            if d.process.poll() is None:
                d.process.terminate()
        raise
    wall = max(d.ended or time.monotonic() for d in daemons) - started
    result: dict[str, Any] = {"wall_s": round(wall, 2), "daemons": {d.host: _summary(d) for d in daemons}}
    result.update(read_store(url, args.min_repeats))
    clean = all(d.process.returncode == 0 and not d.timed_out for d in daemons)
    if clean and len(devices) > 1 and result["hosts_in_store"] < len(devices):
        result["note"] = (f"the store names {result['hosts_in_store']} host(s) for {len(devices)} daemons: "
                          "JOULEPILOT_HOSTNAME did not give each daemon a host of its own")
    log(f"phase {phase}: {result['wall_s']:.1f} s, {result['runs']} runs in {result['processes']} processes, "
        f"at most {result['max_runs_per_config']} of one configuration, "
        f"{len(result['over_asked'])} measured more often than asked; decision: "
        + (f"{result['decision']['label']} ({result['decision']['state']})" if result["decision"] else "none"))
    return result


def _compile_cache_fleet() -> Any:
    spec = importlib.util.spec_from_file_location("compile_cache_fleet", HERE / "compile_cache_fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cache(decision: dict[str, Any], device: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """compile_cache_fleet.py's three runs of one repeat, for the decided configuration."""
    from joulepilot.compiler import CompileConfig
    from joulepilot.compiler.remote_cache import unreachable

    fleet = _compile_cache_fleet()
    config = CompileConfig.from_row(decision["config"])
    server = None
    try:
        url = args.redis_url
        if url is None:
            # in the temporary folder's parent, which nobody (the server's user under root) may enter
            server, url = fleet._start_redis(Path(tempfile.mkdtemp(prefix="joulepilot-redis-")))
        problem = unreachable(url)
        if problem:
            raise RuntimeError(problem)
        fleet._flush(url)
        log(f"phase cache: {args.spec} {config.label} on {device}, Redis {redacted(url)}")
        rows = {}
        for kind, with_url in (("cold", None), ("fills", url), ("from the fleet", url)):
            row = fleet._one(args.spec, config, device, work / "cache" / kind.replace(" ", "-"), with_url,
                             args.min_seconds)
            rows[kind] = row
            took = "-" if row["compile_s"] is None else f"{row['compile_s']:.2f} s"
            log(f"phase cache: {kind}: {row['status']}, first call {took}, caches {row['compile_caches']}")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
            shutil.rmtree(server.args[server.args.index("--dir") + 1], ignore_errors=True)
    cold, fills, warm = (None if rows[k]["compile_s"] is None else round(rows[k]["compile_s"], 3)
                         for k in ("cold", "fills", "from the fleet"))
    result = {"config": config.label, "device": device, "redis": redacted(url), "cold_s": cold, "fills_s": fills,
              "from_fleet_s": warm, "from_fleet_vs_cold": round(warm / cold, 3) if cold and warm is not None else None,
              "runs": rows}
    if config.mode == "eager":
        result["note"] = "the decided configuration is eager: it compiles nothing, so no cache can help it"
    return result


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def print_table(result: dict[str, Any]) -> None:
    print(f"{POLICY}: {result['spec']}, {len(result['configs'])} configurations, min_repeats "
          f"{result['min_repeats']}, devices {', '.join(result['devices'])}")
    print(f"{'phase':<6} {'daemons':>7} {'wall s':>8} {'runs':>5} {'procs':>5} {'max/config':>10} "
          f"{'over-asked':>10}  decision")
    for phase in ("one", "fleet"):
        r = result.get(phase)
        if not r:
            continue
        decision = f"{r['decision']['label']} ({r['decision']['state']})" if r["decision"] else "none"
        print(f"{phase:<6} {len(r['daemons']):>7} {r['wall_s']:>8.1f} {r['runs']:>5} {r['processes']:>5} "
              f"{r['max_runs_per_config']:>10} {len(r['over_asked']):>10}  {decision}")
    if result["ratio"] is not None:
        verdict = "met" if result["ratio"] <= TARGET_RATIO else "not met"
        print(f"fleet / one: {result['ratio']:.2f} (target at most {TARGET_RATIO}: {verdict})")
    fleet = result.get("fleet")
    if fleet:
        print("fleet processes per host: " + ", ".join(f"{h} {n}" for h, n in fleet["per_host"].items()))
        if fleet["over_asked"]:
            print("measured more often than asked: "
                  + ", ".join(f"{o['config']} ({o['runs']} runs)" for o in fleet["over_asked"]))
        if fleet.get("note"):
            print(f"note: {fleet['note']}")
    cache = result.get("cache")
    if cache:
        share = f" ({cache['from_fleet_vs_cold']:.0%} of cold)" if cache["from_fleet_vs_cold"] else ""
        print(f"cache: {cache['config']} on {cache['device']}: first call cold {_seconds(cache['cold_s'])}, "
              f"from the fleet's Redis {_seconds(cache['from_fleet_s'])}{share}")
        if cache.get("note"):
            print(f"note: {cache['note']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="cuda:0,cuda:1",
                        help="one daemon per entry in the fleet phase, cpu or cuda:N (default cuda:0,cuda:1)")
    parser.add_argument("--spec", default="mlp")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--precisions", default=DEFAULT_PRECISIONS)
    parser.add_argument("--fusion", default=DEFAULT_FUSION, help="fusion presets, comma list")
    parser.add_argument("--min-repeats", type=int, default=1)
    parser.add_argument("--max-rel-error", type=float, default=2e-2)
    parser.add_argument("--min-seconds", type=float, default=1.0, help="bench.min_seconds of the daemons")
    parser.add_argument("--budget-s", type=float, default=600.0, help="bench.budget_s of the daemons")
    # 3 s: a GPU's idle baseline is taken from the quiet period when it spans 2 s or more
    parser.add_argument("--min-idle-s", type=float, default=3.0, help="idle.min_idle_s of the daemons")
    parser.add_argument("--phase-timeout-s", type=float, default=3600.0,
                        help="daemons still running this long after a phase's start are stopped (a failure)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help="one,fleet,cache (default; cache only with --redis-url or --start-redis)")
    parser.add_argument("--previous", type=Path,
                        help="the --json output of an earlier call, whose phases this call does not run")
    parser.add_argument("--split-cpus", action="store_true",
                        help="give each fleet daemon its own share of the CPUs, as separate hosts have")
    parser.add_argument("--db-url", default=os.environ.get("JOULEPILOT_DB") or None,
                        help="a PostgreSQL server's database to CREATE DATABASE from (default: $JOULEPILOT_DB, "
                             "else a throwaway cluster)")
    parser.add_argument("--redis-url", help="phase cache: a Redis server to use (it is flushed)")
    parser.add_argument("--start-redis", action="store_true", help="phase cache: start a redis-server")
    parser.add_argument("--logs", type=Path,
                        help="keep the daemons' configs, logs and pass summaries in this new or empty folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.devices = _split(args.devices)
    for device in args.devices:
        if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
            parser.error(f"--devices: {device!r} is neither cpu nor cuda:N")
    args.phases = _split(args.phases)
    if len(args.devices) < 2 and "fleet" in args.phases:
        parser.error("--devices: the fleet phase needs two devices or more (cpu,cpu on a CPU)")
    unknown = [p for p in args.phases if p not in PHASES]
    if unknown:
        parser.error(f"--phases: unknown phase {unknown[0]!r}; use one, fleet, cache")
    cache_asked = args.redis_url is not None or args.start_redis
    if args.phases == list(PHASES) and not cache_asked:
        args.phases = ["one", "fleet"]
    elif "cache" in args.phases and not cache_asked:
        parser.error("--phases cache needs --redis-url or --start-redis")
    if args.db_url and urlsplit(args.db_url).scheme not in ("postgresql", "postgres"):
        parser.error(f"--db-url / JOULEPILOT_DB: {redacted(args.db_url)} is not a postgresql:// URL")
    if args.min_repeats < 1:
        parser.error("--min-repeats must be 1 or more")
    if args.logs is not None and args.logs.exists() and any(args.logs.iterdir()):
        parser.error(f"--logs: {args.logs} is not empty")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous = json.loads(args.previous.read_text()) if args.previous else {}
    work = args.logs or Path(tempfile.mkdtemp(prefix="joulepilot-fleet-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    policy = write_policy(work / "policy", args)
    configs = policy_configs(policy)
    log(f"policy {POLICY}: {args.spec}, {len(configs)} configurations: {', '.join(configs)}")
    for key, value in (("spec", args.spec), ("configs", configs), ("min_repeats", args.min_repeats)):
        if previous and previous.get(key) != value:
            log(f"warning: --previous has {key} {previous.get(key)!r}, this call {value!r}")
    result: dict[str, Any] = {"devices": args.devices, "spec": args.spec, "batch_size": args.batch_size,
                              "min_repeats": args.min_repeats, "min_seconds": args.min_seconds,
                              "configs": configs, "one": previous.get("one"), "fleet": previous.get("fleet"),
                              "ratio": None, "target_ratio": TARGET_RATIO, "cache": previous.get("cache"),
                              "torch": previous.get("torch"), "device_name": previous.get("device_name")}
    failures: list[str] = []
    server: Postgres | None = None
    try:
        sweeps = [p for p in args.phases if p in ("one", "fleet")]
        if sweeps:
            server = Postgres(args.db_url) if args.db_url else start_postgres()
            log(f"PostgreSQL at {redacted(server.url)}" + (" (started here)" if server.process else ""))
        for phase in sweeps:
            devices = args.devices[:1] if phase == "one" else args.devices
            assert server is not None
            result[phase] = run_phase(phase, devices, server, policy, work, args)
            result["torch"] = result[phase]["torch"] or result["torch"]
            result["device_name"] = result[phase]["device_name"] or result["device_name"]
        for phase in sweeps:
            for host, daemon in result[phase]["daemons"].items():
                if daemon["timed_out"]:
                    failures.append(f"phase {phase}: daemon {host} was stopped at --phase-timeout-s")
                elif daemon["exit_code"] != 0:
                    failures.append(f"phase {phase}: daemon {host} exited {daemon['exit_code']}; its log ends:\n    "
                                    + "\n    ".join(daemon.get("log_tail") or []))
            if result[phase]["decision"] is None:
                failures.append(f"phase {phase}: no decision was stored")
        # a phase whose daemon failed swept with fewer daemons than it names: its time compares nothing
        if result["one"] and result["fleet"] and result["one"]["wall_s"] and not failures:
            result["ratio"] = round(result["fleet"]["wall_s"] / result["one"]["wall_s"], 3)
        if "cache" in args.phases:
            decided = next((result[p]["decision"] for p in ("fleet", "one")
                            if result.get(p) and result[p]["decision"] and result[p]["decision"]["config"]), None)
            if decided is None:
                failures.append("phase cache: no decided configuration to compile (run phase one or fleet)")
            else:
                try:
                    result["cache"] = run_cache(decided, args.devices[0], work, args)
                except (RuntimeError, SystemExit) as exc:  # compile_cache_fleet exits where redis-server is missing
                    failures.append(f"phase cache: {exc}")
    finally:
        if server is not None:
            server.close()
        if args.logs is None:
            shutil.rmtree(work, ignore_errors=True)
    result["failures"] = failures
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    for failure in failures:
        print(f"fleet_sweep: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
