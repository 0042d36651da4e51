"""Checks the GPU meter on real hardware (issue #2 acceptance). Runs in about two minutes.

(a) Agreement: a 10-s window of steady bf16 matmuls; the energy counter's window energy against the
    trapezoid integral of instant-power samples (NVML_FI_DEV_POWER_INSTANT) taken at 10 Hz by a
    separate thread. Target: within 3 %. An informational bursty run (0.5 s on / 0.5 s off) follows.
(b) Overhead: iterations/s of a GPU workload (8192^2 bf16 matmuls) over ~10 s with the EnergyMeter's
    sampler on and off, alternated three times each to cancel drift. Target: ratio on/off >= 0.99.
    An informational launch-bound run (tiny matmuls, the Python thread busy launching) follows: the
    harsher case for a sampler thread that shares the GIL.

Usage: python benchmarks/telemetry_check.py [--out benchmarks/results/telemetry_check.json] [--device 0]
Never changes power limits, clocks or persistence mode.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

AGREEMENT_TARGET = 0.03
RATIO_TARGET = 0.99


def fail(message: str) -> None:
    print(f"telemetry_check: {message}", file=sys.stderr)
    sys.exit(2)


def require_gpu(index: int):
    try:
        import torch
    except ImportError:
        fail("PyTorch is not installed; install a CUDA build of torch on a GPU host")
    if not torch.cuda.is_available():
        fail("no CUDA GPU visible to PyTorch (torch.cuda.is_available() is False); run this on a GPU host")
    from joulepilot.telemetry import NvmlMeter, TelemetryError

    try:
        meter = NvmlMeter([index])
    except TelemetryError as exc:
        fail(f"cannot read NVML on cuda:{index}: {exc}")
    if meter.methods()[f"gpu:{index}"]["energy"] != "counter":
        fail(f"cuda:{index} has no NVML energy counter (pre-Volta); check (a) needs it")
    return torch, meter


class Workload:
    """Large bf16 matmuls: steady, power-hungry, a few ms per launch batch."""

    def __init__(self, torch, index: int, n: int = 8192) -> None:
        self.torch = torch
        self.device = torch.device(f"cuda:{index}")
        self.a = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        self.b = torch.randn(n, n, device=self.device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)

    def step(self, iters: int = 10) -> None:
        for _ in range(iters):
            self.torch.matmul(self.a, self.b, out=self.c)

    def run_for(self, seconds: float, iters: int = 10) -> int:
        """Iterations completed in `seconds` (synchronised every batch so the count is honest)."""
        done, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.step(iters)
            self.torch.cuda.synchronize(self.device)
            done += iters
        return done

    def bursty_for(self, seconds: float, period_s: float = 1.0) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.run_for(period_s / 2)
            time.sleep(period_s / 2)


class InstantSampler(threading.Thread):
    """Instant power at 10 Hz on its own thread, timestamped with perf_counter."""

    def __init__(self, meter, device_id: str, hz: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.meter, self.device_id, self.period = meter, device_id, 1.0 / hz
        self.samples: list[tuple[float, float]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            t = time.perf_counter()
            p = self.meter.power_w()[self.device_id]
            self.samples.append((0.5 * (t + time.perf_counter()), p))
            self.stop_event.wait(max(0.0, t + self.period - time.perf_counter()))


def integrate(samples: list[tuple[float, float]], t0: float, t1: float) -> float:
    """Trapezoid integral of piecewise-linear power over exactly [t0, t1]."""
    def at(t: float) -> float:
        for (ta, pa), (tb, pb) in zip(samples, samples[1:], strict=False):
            if ta <= t <= tb:
                return pa + (pb - pa) * (t - ta) / (tb - ta) if tb > ta else pa
        return samples[0][1] if t < samples[0][0] else samples[-1][1]

    points = [(t0, at(t0))] + [(t, p) for t, p in samples if t0 < t < t1] + [(t1, at(t1))]
    return sum(0.5 * (pa + pb) * (tb - ta) for (ta, pa), (tb, pb) in zip(points, points[1:], strict=False))


def agreement(torch, meter, workload: Workload, device_id: str, seconds: float, bursty: bool) -> dict:
    sampler = InstantSampler(meter, device_id)
    sampler.start()
    workload.run_for(3.0)  # warm up to steady clocks and temperature
    torch.cuda.synchronize(workload.device)
    t0, e0 = time.perf_counter(), meter.energy_j()[device_id]
    if bursty:
        workload.bursty_for(seconds)
    else:
        workload.run_for(seconds)
    torch.cuda.synchronize(workload.device)
    t1, e1 = time.perf_counter(), meter.energy_j()[device_id]
    time.sleep(0.3)  # one more sample past t1 for interpolation
    sampler.stop_event.set()
    sampler.join()
    counter_j = e1 - e0
    integral_j = integrate(sampler.samples, t0, t1)
    rel = abs(counter_j - integral_j) / counter_j
    return {"window_s": t1 - t0, "counter_energy_j": counter_j, "sampled_integral_j": integral_j,
            "relative_difference": rel, "avg_power_w": counter_j / (t1 - t0),
            "samples": sum(1 for t, _ in sampler.samples if t0 <= t <= t1)}


def overhead(index: int, workload: Workload, seconds: float, repeats: int, iters: int = 4) -> dict:
    from joulepilot.telemetry import EnergyMeter

    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(repeats):
        for mode in ("off", "on"):
            with EnergyMeter(f"cuda:{index}", sampler=(mode == "on")) as em:
                with em.window("throughput") as w:
                    t = time.perf_counter()
                    n = workload.run_for(seconds, iters=iters)
                    rates[mode].append(n / (time.perf_counter() - t))
            if mode == "on":
                assert w.measurement.devices[0].samples > 0, "the sampler took no samples"
    ratio = statistics.mean(rates["on"]) / statistics.mean(rates["off"])
    return {"iterations_per_s_off": rates["off"], "iterations_per_s_on": rates["on"], "ratio_on_off": ratio,
            "ratio_median": statistics.median(rates["on"]) / statistics.median(rates["off"]), "seconds_each": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/telemetry_check.json")
    parser.add_argument("--device", type=int, default=0, help="CUDA index (as this process sees GPUs)")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--throughput-s", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch, meter = require_gpu(args.device)
    device_id = f"gpu:{args.device}"
    info = meter.devices()[0]
    started = time.perf_counter()
    try:
        workload = Workload(torch, args.device)
        steady = agreement(torch, meter, workload, device_id, args.window_s, bursty=False)
        bursty = agreement(torch, meter, workload, device_id, args.window_s, bursty=True)
    finally:
        meter.close()
    throughput = overhead(args.device, workload, args.throughput_s, args.repeats)
    del workload
    small = Workload(torch, args.device, n=256)
    launch_bound = overhead(args.device, small, args.throughput_s / 2, args.repeats, iters=50)

    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": info.name, "device_uuid": info.uuid, "driver": info.driver,
        "power_limit_w": info.power_limit_w, "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda, "python": platform.python_version(), "host": platform.node(),
        "agreement_steady": steady, "agreement_bursty_informational": bursty, "throughput": throughput,
        "throughput_launch_bound_informational": launch_bound,
        "targets": {"agreement_max_relative_difference": AGREEMENT_TARGET, "throughput_min_ratio": RATIO_TARGET},
        "pass": {"agreement": steady["relative_difference"] <= AGREEMENT_TARGET,
                 "throughput": throughput["ratio_on_off"] >= RATIO_TARGET},
        "runtime_s": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{info.name}, driver {info.driver}, torch {torch.__version__}")
    print(f"{'check':<34}{'figure':>22}{'target':>12}{'result':>8}")
    rows = [
        ("(a) counter vs sampled, steady", f"{steady['counter_energy_j']:.0f} J vs {steady['sampled_integral_j']:.0f} J",
         "", ""),
        ("    relative difference", f"{100 * steady['relative_difference']:.2f} %", f"<= {100 * AGREEMENT_TARGET:.0f} %",
         "pass" if result["pass"]["agreement"] else "FAIL"),
        ("    bursty (informational)", f"{100 * bursty['relative_difference']:.2f} %", "", ""),
        ("(b) iterations/s off (mean)", f"{statistics.mean(throughput['iterations_per_s_off']):.1f}", "", ""),
        ("    iterations/s on (mean)", f"{statistics.mean(throughput['iterations_per_s_on']):.1f}", "", ""),
        ("    ratio on/off", f"{throughput['ratio_on_off']:.4f}", f">= {RATIO_TARGET}",
         "pass" if result["pass"]["throughput"] else "FAIL"),
        ("    launch-bound ratio (info)", f"{launch_bound['ratio_on_off']:.4f}", "", ""),
    ]
    for name, figure, target, verdict in rows:
        print(f"{name:<34}{figure:>22}{target:>12}{verdict:>8}")
    print(f"wrote {out} ({result['runtime_s']:.0f} s)")
    return 0 if all(result["pass"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
