"""A stand-in for the `pynvml` module of nvidia-ml-py, for hosts without an NVIDIA GPU.

Same function names, constants, error codes and NVMLError subclass hierarchy as the real binding
(tests check the constants against the installed nvidia-ml-py). Behaviour copied from real GPUs:
- the energy counter (mJ, starting at an arbitrary large value) only advances every ~100 ms;
- nvmlDeviceGetPowerUsage is a 1-s trailing average (Hopper), the POWER_INSTANT field is instant;
- calls before nvmlInit raise UNINITIALIZED; a lost GPU raises GPU_IS_LOST on every call;
- pre-Volta GPUs raise NOT_SUPPORTED for the energy counter; a per-field failure of
  nvmlDeviceGetFieldValues is reported in that value's `nvmlReturn`, not raised.
Every call is recorded in `state().calls`; nvmlDeviceSet* calls are recorded and refused.

Use: `gpu = FakeGpu(power_w=lambda t: ...)`, `fake = install(monkeypatch, [gpu])`.

Processes a test starts (a daemon, benchmark workers) get the same GPUs through `subprocess_env(gpus)`:
its variables put tests/fakes/nvml_shim first on PYTHONPATH, whose `pynvml` is this module simulating the
GPUs described in JOULEPILOT_FAKE_GPUS (constant power; each process has its own clock and counters).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import string
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4


class NVMLError(Exception):
    """Like pynvml.NVMLError: NVMLError(code) returns an instance of the code's subclass."""

    _valClassMapping: dict[int, type] = {}
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __str__(self):
        return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = Exception.__hash__


def _make_error_classes() -> None:
    module = sys.modules[__name__]
    for name in [n for n in dir(module) if n.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        value = getattr(module, name)

        def new(cls, *args, _value=value):
            return NVMLError.__new__(cls, _value)

        error_class = type(class_name, (NVMLError,), {"__new__": new})
        error_class.__module__ = __name__
        setattr(module, class_name, error_class)
        NVMLError._valClassMapping[value] = error_class


_make_error_classes()


def nvmlExceptionClass(code: int) -> type:
    return NVMLError._valClassMapping[code]


# ---- the simulated hardware --------------------------------------------------------------------
@dataclass
class FakeGpu:
    name: str = "NVIDIA H100 80GB HBM3"
    uuid: str = "GPU-00000000-1111-2222-3333-444444444444"
    power_w: float | Callable[[float], float] = 300.0  # watts, or a function of seconds since install
    energy_counter: bool = True  # False: a pre-Volta GPU
    instant_field: bool = True  # False: NVML_FI_DEV_POWER_INSTANT unsupported (older driver)
    power_limit_w: float = 700.0
    memory_total: int = 80 * 2**30
    counter_step_s: float = 0.1
    counter_origin_mj: int = 987_654_321
    utilization_pct: int = 0
    processes: list[int] = field(default_factory=list)
    process_sm_pct: dict[int, int] | None = field(default_factory=dict)  # None: unsupported
    lost: bool = False

    def power_at(self, t: float) -> float:
        return float(self.power_w(t)) if callable(self.power_w) else float(self.power_w)


class FakeNvml:
    """State behind the module functions: GPUs, clock, init refcount and the call log."""

    DT = 0.001  # integration step of the true energy (s)

    def __init__(self, gpus: list[FakeGpu], driver: str = "550.54.15", init_error: int | None = None,
                 call_latency_s: float = 0.0) -> None:
        self.gpus = gpus
        self.driver = driver
        self.init_error = init_error
        self.call_latency_s = call_latency_s
        self.t0 = time.perf_counter()
        self.refcount = 0
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._refcount_lock = threading.Lock()  # nvmlInit/nvmlShutdown are thread-safe in the real library
        self._cum: list[list[float]] = [[0.0] for _ in gpus]  # cumulative J at k*DT

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def true_energy_j(self, index: int, t: float) -> float:
        """Exact (to DT) integral of the GPU's power from install time to t."""
        gpu = self.gpus[index]
        if not callable(gpu.power_w):
            return gpu.power_at(0.0) * max(0.0, t)
        with self._lock:
            cum = self._cum[index]
            k = int(t / self.DT)
            while len(cum) <= k + 1:
                j = len(cum) - 1
                cum.append(cum[-1] + 0.5 * (gpu.power_at(j * self.DT) + gpu.power_at((j + 1) * self.DT)) * self.DT)
            frac = (t - k * self.DT) / self.DT
            return cum[k] + frac * (cum[k + 1] - cum[k])

    def counter_mj(self, index: int, t: float) -> int:
        step = self.gpus[index].counter_step_s
        return self.gpus[index].counter_origin_mj + int(self.true_energy_j(index, math.floor(t / step) * step) * 1000)


_state: FakeNvml | None = None


def install(monkeypatch, gpus: list[FakeGpu] | None = None, **kwargs) -> FakeNvml:
    """Make `import pynvml` return this module, simulating `gpus`; returns the simulation state."""
    global _state
    _state = FakeNvml(gpus if gpus is not None else [FakeGpu()], **kwargs)
    monkeypatch.setitem(sys.modules, "pynvml", sys.modules[__name__])
    return _state


GPUS_ENV = "JOULEPILOT_FAKE_GPUS"
SHIM_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nvml_shim")
_SUBPROCESS_FIELDS = ("name", "uuid", "power_w", "utilization_pct", "processes", "counter_step_s", "power_limit_w")


def subprocess_env(gpus: list[FakeGpu], *, call_latency_s: float = 0.0035) -> dict[str, str]:
    """Environment variables under which `import pynvml` in a process this test starts is this fake with
    `gpus` (their constant power, utilisation and processes as they are now) and real NVML's 3-4 ms calls."""
    for gpu in gpus:
        if callable(gpu.power_w):
            raise ValueError("a GPU simulated in another process needs a constant power_w")
    spec = {"call_latency_s": call_latency_s,
            "gpus": [{k: v for k, v in dataclasses.asdict(g).items() if k in _SUBPROCESS_FIELDS} for g in gpus]}
    path = [SHIM_DIR, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != SHIM_DIR]]
    return {GPUS_ENV: json.dumps(spec), "PYTHONPATH": os.pathsep.join(path)}


def install_everywhere(monkeypatch, gpus: list[FakeGpu], *, call_latency_s: float = 0.0035) -> FakeNvml:
    """`install` in this process and `subprocess_env` for the processes the test starts, with every GPU
    visible (no CUDA_VISIBLE_DEVICES): the workers and daemons a test starts see the same fake GPUs."""
    state = install(monkeypatch, gpus, call_latency_s=call_latency_s)
    for name, value in subprocess_env(gpus, call_latency_s=call_latency_s).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return state


def install_from_env() -> FakeNvml:
    """In a process a test started: simulate the GPUs of JOULEPILOT_FAKE_GPUS (see `subprocess_env`)."""
    global _state
    spec = json.loads(os.environ[GPUS_ENV])
    _state = FakeNvml([FakeGpu(**g) for g in spec["gpus"]], call_latency_s=float(spec.get("call_latency_s", 0.0)))
    return _state


def state() -> FakeNvml:
    assert _state is not None, "call fake_pynvml.install() first"
    return _state


def _enter(call: str, handle=None) -> FakeGpu | None:
    s = state()
    s.calls.append(call)
    if s.call_latency_s:
        time.sleep(s.call_latency_s)
    if s.refcount <= 0:
        raise NVMLError(NVML_ERROR_UNINITIALIZED)
    if handle is None:
        return None
    gpu = s.gpus[handle.index]
    if gpu.lost:
        raise NVMLError(NVML_ERROR_GPU_IS_LOST)
    return gpu


# ---- the pynvml functions used by joulepilot -----------------------------------------------------
def nvmlInit() -> None:
    s = state()
    s.calls.append("nvmlInit")
    if s.init_error is not None:
        raise NVMLError(s.init_error)
    with s._refcount_lock:
        s.refcount += 1


def nvmlInitWithFlags(flags: int) -> None:
    nvmlInit()


def nvmlShutdown() -> None:
    _enter("nvmlShutdown")
    with state()._refcount_lock:
        state().refcount -= 1


def nvmlSystemGetDriverVersion() -> str:
    _enter("nvmlSystemGetDriverVersion")
    return state().driver


def nvmlDeviceGetCount() -> int:
    _enter("nvmlDeviceGetCount")
    return len(state().gpus)


def nvmlDeviceGetHandleByIndex(index: int):
    _enter("nvmlDeviceGetHandleByIndex")
    if not 0 <= index < len(state().gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return SimpleNamespace(index=index)


def nvmlDeviceGetHandleByUUID(uuid: str):
    _enter("nvmlDeviceGetHandleByUUID")
    for i, gpu in enumerate(state().gpus):
        if gpu.uuid == uuid:
            return SimpleNamespace(index=i)
    raise NVMLError(NVML_ERROR_NOT_FOUND)


def nvmlDeviceGetIndex(handle) -> int:
    _enter("nvmlDeviceGetIndex", handle)
    return handle.index


def nvmlDeviceGetName(handle) -> str:
    return _enter("nvmlDeviceGetName", handle).name


def nvmlDeviceGetUUID(handle) -> str:
    return _enter("nvmlDeviceGetUUID", handle).uuid


def nvmlDeviceGetMemoryInfo(handle, version=None):
    gpu = _enter("nvmlDeviceGetMemoryInfo", handle)
    return SimpleNamespace(total=gpu.memory_total, free=gpu.memory_total, used=0)


def nvmlDeviceGetEnforcedPowerLimit(handle) -> int:
    return int(_enter("nvmlDeviceGetEnforcedPowerLimit", handle).power_limit_w * 1000)


def nvmlDeviceGetTotalEnergyConsumption(handle) -> int:
    gpu = _enter("nvmlDeviceGetTotalEnergyConsumption", handle)
    if not gpu.energy_counter:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return state().counter_mj(handle.index, state().now())


def nvmlDeviceGetPowerUsage(handle) -> int:
    _enter("nvmlDeviceGetPowerUsage", handle)
    s, t = state(), state().now()
    window = min(1.0, t)
    if window <= 0:
        return int(s.gpus[handle.index].power_at(0.0) * 1000)
    return int((s.true_energy_j(handle.index, t) - s.true_energy_j(handle.index, t - window)) / window * 1000)


def nvmlDeviceGetFieldValues(handle, fieldIds):
    gpu = _enter("nvmlDeviceGetFieldValues", handle)
    t = state().now()
    values = []
    for field_id in fieldIds:
        ok = field_id == NVML_FI_DEV_POWER_INSTANT and gpu.instant_field
        milliwatts = int(gpu.power_at(t) * 1000) if ok else 0
        values.append(SimpleNamespace(
            fieldId=field_id, scopeId=0, timestamp=int(time.time() * 1e6), latencyUsec=0,
            valueType=NVML_VALUE_TYPE_UNSIGNED_INT,
            nvmlReturn=NVML_SUCCESS if ok else NVML_ERROR_NOT_SUPPORTED,
            value=SimpleNamespace(uiVal=milliwatts, ulVal=milliwatts, ullVal=milliwatts, dVal=float(milliwatts),
                                  sllVal=milliwatts, siVal=milliwatts, usVal=milliwatts & 0xFFFF),
        ))
    return values


def nvmlDeviceGetUtilizationRates(handle):
    gpu = _enter("nvmlDeviceGetUtilizationRates", handle)
    return SimpleNamespace(gpu=gpu.utilization_pct, memory=0)


def nvmlDeviceGetComputeRunningProcesses(handle):
    gpu = _enter("nvmlDeviceGetComputeRunningProcesses", handle)
    return [SimpleNamespace(pid=pid, usedGpuMemory=2**30, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            for pid in gpu.processes]


def nvmlDeviceGetProcessUtilization(handle, timeStamp):
    gpu = _enter("nvmlDeviceGetProcessUtilization", handle)
    if gpu.process_sm_pct is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    if not gpu.process_sm_pct:
        raise NVMLError(NVML_ERROR_NOT_FOUND)
    stamp = int(time.time() * 1e6)
    return [SimpleNamespace(pid=pid, timeStamp=stamp, smUtil=sm, memUtil=0, encUtil=0, decUtil=0)
            for pid, sm in gpu.process_sm_pct.items()]


def _refuse(name: str):
    def setter(*args, **kwargs):
        state().calls.append(name)
        raise AssertionError(f"{name} called: joulepilot must never change GPU settings")

    setter.__name__ = name
    return setter


def __getattr__(name: str):
    # Every NVML setter (power limit, clocks, persistence, compute mode, ...) exists here only to
    # record and refuse the call, so a test can prove the meters never try one.
    if name.startswith("nvmlDeviceSet") or name.startswith("nvmlSet"):
        return _refuse(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
