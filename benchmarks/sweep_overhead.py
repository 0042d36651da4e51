"""Per-configuration overhead of a sweep: each job's wall time against the work it cannot do without.

    python benchmarks/sweep_overhead.py cpu [--repeats 3] [--out benchmarks/results/sweep_overhead]
    python benchmarks/sweep_overhead.py daemon --device cuda:0 [--models torchvision:resnet18,transformers:BertConfig]

`cpu` runs the CPU target of issue 13 exactly as a user types it,
`joulepilot bench mlp --modes eager,default --precision fp32 --min-seconds 2 --device cpu`, each repeat
with a fresh JOULEPILOT_HOME and database (so it is the workload's first sweep, description included),
on a host whose vector-instruction test programs for Inductor are built (`compiler/host_isa.py`: the
host's own folder, built by the first repeat if need be; `--fresh-host` builds them in every repeat, as
the first sweep on a new host does), and compares the command's wall time with the sum of its runs' `compile_s + warmup_s + window_s`.

`daemon` writes one policy per model with six configurations (eager, default and reduce-overhead, each in
fp32 and bf16; `--modes`, `--precisions`; `min_repeats = 1`, so each is one job and one run), runs
`joulepilot daemon --once` on them (`--device cuda:N`, or `cpu`), and compares each job's wall time (the daemon's `extra.job_wall_s`) with the run's irreducible
work; the pass's wall time is compared with the sum over its runs, also from its first job's start (the
daemon first waits out `idle.min_idle_s` of quiet, `--min-idle-s`, default the daemon's 60 s; on a GPU the
first workload's zygote starts during that wait). Warm starts the pass times (for each policy's decided
configuration and runner-up) are listed with their run.

For every configuration both print and save (OUT/<kind>-<date>.json and .md): the job's wall time, the
irreducible parts (cold compile, warm-up, latency pass, energy window), their sum and the ratio; the load
average before and after each repeat (the machine may be shared), the device, the date and the torch
version. A ratio of 1.25 means 25 % of the job was overhead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CPU_COMMAND = ["bench", "mlp", "--modes", "eager,default", "--precision", "fp32", "--min-seconds", "2",
               "--device", "cpu"]
CPU_TARGET = 1.35  # wall / sum(compile_s + warmup_s + window_s)
GPU_TARGET = 1.25  # per configuration, job wall / irreducible
DAEMON_MODELS = "torchvision:resnet18,transformers:BertConfig"
BATCH_SIZES = {"torchvision:resnet18": 32, "transformers:BertConfig": 16}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _extra(run: dict[str, Any]) -> dict[str, Any]:
    extra = run.get("extra") or {}
    return json.loads(extra) if isinstance(extra, str) else dict(extra)


def latency_pass_s(run: dict[str, Any]) -> float:
    """Seconds of the latency pass: recorded by the worker (`extra.latency_s`), or, for runs made before it
    was, its calls times their mean latency."""
    extra = _extra(run)
    if extra.get("latency_s") is not None:
        return float(extra["latency_s"])
    calls, mean_ms = extra.get("latency_calls"), extra.get("latency_ms_mean")
    return float(calls) * float(mean_ms) / 1000.0 if calls and mean_ms else 0.0


def job_wall_s(run: dict[str, Any]) -> float | None:
    """The job's wall time as its caller saw it (`extra.job_wall_s`), else the worker's own span."""
    extra = _extra(run)
    if extra.get("job_wall_s") is not None:
        return float(extra["job_wall_s"])
    started, finished = run.get("started_at_epoch"), run.get("finished_at_epoch")
    return float(finished) - float(started) if started and finished else None


def per_config(run: dict[str, Any]) -> dict[str, Any]:
    parts = {"compile_s": run.get("compile_s") or 0.0, "warmup_s": run.get("warmup_s") or 0.0,
             "latency_s": latency_pass_s(run), "window_s": run.get("window_s") or 0.0}
    irreducible = sum(parts.values())
    wall = job_wall_s(run)
    return {"config": run.get("config_label"), "workload": run.get("workload"), "status": run.get("status"),
            "job_wall_s": wall, **parts, "irreducible_s": irreducible,
            "ratio": wall / irreducible if wall and irreducible else None,
            "warm_start_s": run.get("warm_start_s"), "worker": _extra(run).get("worker_process"),
            "zygote_wait_s": _extra(run).get("zygote_wait_s"), "zygote": _zygote_origin(_extra(run))}


def _zygote_origin(extra: dict[str, Any]) -> str | None:
    """When the job's zygote was started: ahead of the workload's first job (`early`: while the device waited
    or measured another workload), or by that job."""
    if "zygote_early" not in extra:
        return None
    return "early" if extra["zygote_early"] else "by the job"


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _joulepilot() -> list[str]:
    return [sys.executable, "-m", "joulepilot"]


def cpu_repeat(index: int, fresh_host: bool = False) -> dict[str, Any]:
    from joulepilot.compiler.host_isa import PROGRAMS_DIR_ENV, programs_dir

    host_programs = programs_dir().parent  # the host's, as JOULEPILOT_HOME would give it without this script
    home = Path(tempfile.mkdtemp(prefix="sweep-overhead-"))
    programs = home / "vec-isa" if fresh_host else host_programs
    env = dict(os.environ, JOULEPILOT_HOME=str(home), **{PROGRAMS_DIR_ENV: str(programs)})
    env.pop("JOULEPILOT_DB", None)
    built_before = any(programs.glob("*/ready"))
    command = [*_joulepilot(), *CPU_COMMAND, "--db", str(home / "sweep.db"), "--json"]
    load_before = _loadavg()
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    load_after = _loadavg()
    if proc.returncode != 0:
        raise SystemExit(f"repeat {index}: bench failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    runs = json.loads(proc.stdout)
    target_sum = sum((r.get("compile_s") or 0.0) + (r.get("warmup_s") or 0.0) + (r.get("window_s") or 0.0)
                     for r in runs)
    configs = [per_config(r) for r in runs]
    result = {"repeat": index, "command": "joulepilot " + " ".join(CPU_COMMAND), "wall_s": wall,
              "compile_warmup_window_s": target_sum, "ratio": wall / target_sum if target_sum else None,
              "target": CPU_TARGET, "load_before": load_before, "load_after": load_after, "configs": configs,
              "vec_isa_programs": "built before" if built_before else "built by this repeat",
              "device_name": runs[0].get("device_name") if runs else None,
              "torch_version": runs[0].get("torch_version") if runs else None}
    log(f"repeat {index}: wall {wall:.1f} s, compile+warmup+window {target_sum:.1f} s, ratio "
        f"{result['ratio']:.2f} (target {CPU_TARGET}); load {load_before} -> {load_after}")
    return result


def daemon_sweep(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="sweep-overhead-daemon-"))
    policies = work / "policies"
    policies.mkdir()
    models = [m for m in args.models.split(",") if m.strip()]
    for i, spec in enumerate(models):
        (policies / f"model{i}.toml").write_text(
            f'name = "model{i}"\nworkload = "{spec}"\nbatch_size = {BATCH_SIZES.get(spec, 8)}\n'
            f"[search]\nmodes = {json.dumps(args.modes.split(','))}\n"
            f"precisions = {json.dumps(args.precisions.split(','))}\nstrategy = \"exhaustive\"\nmin_repeats = 1\n")
    config = work / "daemon.toml"
    devices = '"cpu"' if args.device == "cpu" else f"[{args.device.partition(':')[2] or '0'}]"
    config.write_text(
        f'db = "{work / "daemon.db"}"\npolicies = ["{policies}"]\ninterval_s = 3600\nlog_level = "INFO"\n'
        f'devices = {devices}\n[bench]\nmin_seconds = {args.min_seconds}\nbudget_s = {args.budget_s}\n'
        f"[idle]\nmin_idle_s = {args.min_idle_s}\npoll_s = 0.5\n[exporter]\nenabled = false\n")
    from joulepilot.compiler.host_isa import PROGRAMS_DIR_ENV, programs_dir

    programs = work / "vec-isa" if args.fresh_host else programs_dir().parent  # the host's, as for `cpu`
    env = dict(os.environ, JOULEPILOT_HOME=str(work), **{PROGRAMS_DIR_ENV: str(programs)})
    load_before = _loadavg()
    launched_epoch = time.time()
    started = time.perf_counter()
    proc = subprocess.run([*_joulepilot(), "daemon", "--config", str(config), "--once", "--json"],
                          capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    load_after = _loadavg()
    (work / "daemon.log").write_text(proc.stderr)
    runs_proc = subprocess.run([*_joulepilot(), "runs", "--db", str(work / "daemon.db"), "--json"],
                               capture_output=True, text=True, env=env)
    if runs_proc.returncode != 0:
        raise SystemExit(f"daemon sweep: runs could not be listed:\n{runs_proc.stderr[-3000:]}\n"
                         f"daemon log:\n{proc.stderr[-3000:]}")
    runs = json.loads(runs_proc.stdout)
    runs = runs.get("runs", runs) if isinstance(runs, dict) else runs
    configs = [per_config(r) for r in sorted(runs, key=lambda r: r.get("id") or 0)]
    irreducible = sum(c["irreducible_s"] for c in configs)
    log(f"daemon pass: exit {proc.returncode}, wall {wall:.1f} s for {len(configs)} runs, irreducible "
        f"{irreducible:.1f} s; log in {work / 'daemon.log'}")
    before_first = before_first_job_s(proc.stderr, launched_epoch)
    after_idle = wall - before_first if before_first is not None else None
    return {"kind": "daemon", "exit_code": proc.returncode, "wall_s": wall, "irreducible_s": irreducible,
            "ratio": wall / irreducible if irreducible else None, "target_per_config": GPU_TARGET,
            "min_idle_s": args.min_idle_s, "before_first_job_s": before_first,
            "ratio_from_first_job": after_idle / irreducible if after_idle and irreducible else None,
            "load_before": load_before, "load_after": load_after, "configs": configs,
            "device_name": runs[0].get("device_name") if runs else None,
            "torch_version": runs[0].get("torch_version") if runs else None}


JOB_START = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \S+ INFO job \d+: .* on \S+$")


def before_first_job_s(daemon_log: str, launched_epoch: float) -> float | None:
    """Seconds from the daemon's launch to its first job's start (its log line; local time, this host): the
    start-up and the quiet period the daemon waits out (`idle.min_idle_s`) before it measures anything."""
    for line in daemon_log.splitlines():
        match = JOB_START.match(line)
        if match:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            return stamp + int(match.group(2)) / 1000.0 - launched_epoch
    return None


def _f(value: Any, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Sweep overhead ({report['kind']}), {report['date']}", "",
             f"Device: {report.get('device_name')}; torch {report.get('torch_version')}; python "
             f"{platform.python_version()}; {os.cpu_count()} CPUs", ""]
    for item in report["results"]:
        head = f"wall {_f(item['wall_s'], 1)} s, ratio {_f(item['ratio'])}"
        if item.get("before_first_job_s") is not None:
            head += (f"; first job after {_f(item['before_first_job_s'], 1)} s (idle.min_idle_s = "
                     f"{_f(item['min_idle_s'], 0)}), ratio from there {_f(item['ratio_from_first_job'])}")
        if "compile_warmup_window_s" in item:
            head += f" (wall / compile+warmup+window {_f(item['compile_warmup_window_s'], 1)} s; target {CPU_TARGET})"
        if item.get("vec_isa_programs"):
            head += f"; Inductor's vector-instruction test programs {item['vec_isa_programs']}"
        lines += [f"## {'repeat ' + str(item['repeat']) if 'repeat' in item else 'pass'}: {head}",
                  f"load average before {item['load_before']}, after {item['load_after']}", "",
                  "| workload | config | status | job wall s | compile s | warm-up s | latency s | window s | "
                  "irreducible s | ratio | warm start s | zygote wait s | zygote | worker |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in item["configs"]:
            lines.append(f"| {c['workload']} | {c['config']} | {c['status']} | {_f(c['job_wall_s'])} | "
                         f"{_f(c['compile_s'])} | {_f(c['warmup_s'])} | {_f(c['latency_s'])} | {_f(c['window_s'])} | "
                         f"{_f(c['irreducible_s'])} | {_f(c['ratio'])} | {_f(c['warm_start_s'])} | "
                         f"{_f(c.get('zygote_wait_s'))} | {c.get('zygote') or '-'} | {c['worker'] or '-'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("cpu", "daemon"))
    parser.add_argument("--repeats", type=int, default=1, help="cpu: how many times to run the command")
    parser.add_argument("--device", default="cuda:0", help="daemon: the GPU to sweep on")
    parser.add_argument("--models", default=DAEMON_MODELS, help="daemon: comma list of workload specs")
    parser.add_argument("--modes", default="eager,default,reduce-overhead", help="daemon: the policies' modes")
    parser.add_argument("--precisions", default="fp32,bf16", help="daemon: the policies' precisions")
    parser.add_argument("--min-seconds", type=float, default=5.0, help="daemon: energy window per run")
    parser.add_argument("--budget-s", type=float, default=600.0, help="daemon: compile budget per run")
    parser.add_argument("--min-idle-s", type=float, default=60.0,
                        help="daemon: quiet seconds before the pass measures (the daemon's default, 60; the "
                             "first workload's zygote starts during them)")
    parser.add_argument("--fresh-host", action="store_true",
                        help="build Inductor's CPU vector-instruction test programs in every repeat (a new host)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sweep_overhead")
    parser.add_argument("--label", default="", help="added to the output file names (e.g. 'before')")
    args = parser.parse_args(argv)

    if args.kind == "cpu":
        results = [cpu_repeat(i + 1, args.fresh_host) for i in range(args.repeats)]
    else:
        results = [daemon_sweep(args)]
    date = time.strftime("%Y-%m-%d")
    report = {"kind": args.kind, "date": date, "label": args.label, "hostname": platform.node(),
              "cpus": os.cpu_count(), "device_name": results[0].get("device_name"),
              "torch_version": results[0].get("torch_version"), "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.kind}-{date}" + (f"-{args.label}" if args.label else "")
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
