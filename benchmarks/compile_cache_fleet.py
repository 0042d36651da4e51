"""A host's first compile of a configuration: cold, against one from the fleet's Redis (Inductor's remote caches).

    python benchmarks/compile_cache_fleet.py --spec convnet --mode default --repeats 3             # starts a Redis
    python benchmarks/compile_cache_fleet.py --spec torchvision:resnet50 --mode max-autotune-no-cudagraphs \\
        --device cuda:0 --redis-url "$JOULEPILOT_REDIS_URL" --json

Each repeat is three `bench` runs of the one configuration, each as a new host would make it (a home and a
database of its own; every worker has fresh local cache folders anyway): `cold`, with no remote cache; `fills`,
with the remote cache on a server just emptied (a miss that uploads); `from the fleet`, with the remote cache the
previous run filled. The figures are each run's `compile_s` (the first call, compilation included, less one
eager call) and its cache counters (`extra.compile_caches`). Without --redis-url a redis-server from the
operating system's package is started on loopback for the run (as nobody when run as root) and stopped after;
with it, that server's database is flushed before each repeat, so give one that holds nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from joulepilot.compiler import CompileConfig, bench
from joulepilot.compiler.remote_cache import URL_ENV, redacted, unreachable


def _start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server), or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"] if os.geteuid() == 0 else []
    folder.chmod(0o777)
    process = subprocess.Popen([*prefix, binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder),
                                "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while unreachable(url, 0.5) and time.monotonic() < deadline:
        time.sleep(0.1)
    return process, url


def _flush(url: str) -> None:
    import redis

    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


def _one(spec: str, config: CompileConfig, device: str, home: Path, url: str | None, min_seconds: float
         ) -> dict[str, Any]:
    home.mkdir(parents=True)
    saved = {k: os.environ.get(k) for k in ("JOULEPILOT_HOME", URL_ENV)}
    os.environ["JOULEPILOT_HOME"] = str(home)
    os.environ.pop(URL_ENV, None)
    if url:
        os.environ[URL_ENV] = url
    try:
        [run] = bench(spec, [config], device=device, min_seconds=min_seconds, db=home / "j.db")
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    extra = run["extra"] if isinstance(run["extra"], dict) else json.loads(run["extra"] or "{}")
    return {"status": run["status"], "reason": run.get("reason"), "compile_s": run.get("compile_s"),
            "compile_caches": extra.get("compile_caches") or {}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", default="convnet")
    parser.add_argument("--mode", default="default")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.2)
    parser.add_argument("--redis-url", help="a server to use (flushed before each repeat); default: start one")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = CompileConfig(mode=args.mode, precision=args.precision, batch_size=args.batch_size)
    work = Path(tempfile.mkdtemp(prefix="joulepilot-fleet-cache-"))
    server = None
    try:
        url = args.redis_url
        if url is None:
            server, url = _start_redis(Path(tempfile.mkdtemp(prefix="joulepilot-redis-", dir=work.parent)))
        problem = unreachable(url)
        if problem:
            sys.exit(problem)
        rows = []
        for repeat in range(args.repeats):
            _flush(url)
            for kind, with_url in (("cold", None), ("fills", url), ("from the fleet", url)):
                row = _one(args.spec, config, args.device, work / f"r{repeat}-{kind.replace(' ', '-')}", with_url,
                           args.min_seconds)
                rows.append({"repeat": repeat, "kind": kind, **row})
                reason = f" ({row['reason']})" if row["reason"] else ""
                took = "-" if row["compile_s"] is None else f"{row['compile_s']:.2f}"
                print(f"[{repeat + 1}/{args.repeats}] {kind}: {row['status']}{reason}, "
                      f"compile {took} s, caches {row['compile_caches']}", file=sys.stderr, flush=True)
        summary = {kind: statistics.median(r["compile_s"] for r in rows if r["kind"] == kind and r["status"] == "ok")
                   for kind in ("cold", "fills", "from the fleet")}
        result = {"spec": args.spec, "config": config.label, "device": args.device, "redis": redacted(url),
                  "median_compile_s": summary, "runs": rows}
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"{args.spec} {config.label} on {args.device}, median of {args.repeats}: cold "
                  f"{summary['cold']:.2f} s, filling the cache {summary['fills']:.2f} s, from the fleet's cache "
                  f"{summary['from the fleet']:.2f} s ({summary['from the fleet'] / summary['cold']:.0%} of cold)")
        return 0
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=10)
            shutil.rmtree(server.args[server.args.index("--dir") + 1], ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
