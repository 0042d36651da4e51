"""What a warm start needs besides the Inductor caches, and where its time goes.

A warm start is a fresh process that loads a configuration's saved artifacts (`compiler.artifacts`)
before compiling. The FX-graph and AOTAutograd entries spare it Inductor's code generation, the
packed kernel binaries spare it the C++ build (on a CPU every generated kernel is compiled with the
system compiler, which the cache entries alone do not carry), and Dynamo's caching precompile, where
this torch has it, spares it tracing the model again: the compiled frames saved with the artifacts are
installed when `torch.compile` is called.

Precompile is off unless asked for: `bench(precompile=True)`, the benchmark's `--precompile on|both`, or
`JOULEPILOT_PRECOMPILE=1` in the environment of bench, the daemon and a serving process (`precompile_opted_in`).
On torch 2.11 it broke ordinary cold compiles (a model class defined in a function cannot be packaged), so
a cold compile that fails with it on is measured again without it (`compiler.bench.measure_config`).

Precompile is recorded by the cold compile (`enable_precompile`, for the whole worker process: the
guards Dynamo builds while tracing must be the portable ones) and used by a warm start only inside
`precompile_scope`, around `torch.compile`, so the process's other compiles are left as they were.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

PRECOMPILE_ENV = "JOULEPILOT_PRECOMPILE"

# Dynamo's compile timers (torch._dynamo.utils.compilation_time_metrics) a warm start reports. They
# nest (tracing contains the backend call, which contains Inductor's loading), so they are not summed.
COMPILE_TIMERS = {
    "_compile.compile_inner": "dynamo_total_s",
    "bytecode_tracing": "dynamo_tracing_s",
    "build_guards": "guards_s",
    "precompile_build_guards": "precompile_guards_s",
    "OutputGraph.call_user_compiler": "backend_s",
    "AOTAutogradCache.inductor_load": "inductor_cache_load_s",
    "fx_codegen_and_compile": "inductor_codegen_s",
    "PyCodeCache.load_by_key_path": "load_compiled_module_s",
    "compile_file": "cpp_build_s",
    "async_compile.wait": "kernel_compile_wait_s",
    "TritonBundler.read_and_emit": "triton_bundle_load_s",
}


def precompile_opted_in() -> bool:
    """Whether $JOULEPILOT_PRECOMPILE asks for Dynamo's caching precompile (1, true, yes, on); off by default."""
    return os.environ.get(PRECOMPILE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def precompile_available() -> bool:
    """Whether this torch has Dynamo's caching precompile (torch._dynamo.config.caching_precompile)."""
    from torch._dynamo import config

    return hasattr(config, "caching_precompile")


def enable_precompile() -> bool:
    """Turn Dynamo's caching precompile on for this process (a benchmark worker); False where torch lacks it."""
    if not precompile_available():
        return False
    from torch._dynamo import config

    config.caching_precompile = True
    return True


def precompile_enabled() -> bool:
    if not precompile_available():
        return False
    from torch._dynamo import config

    return bool(config.caching_precompile)


@contextmanager
def precompile_scope(enabled: bool) -> Iterator[None]:
    """Caching precompile on inside the block (where torch has it and `enabled`); as it was after."""
    if not enabled or not precompile_available():
        yield
        return
    from torch._dynamo import config

    with config.patch(caching_precompile=True):
        yield


def compile_timers() -> dict[str, float]:
    """Seconds spent so far in Dynamo's and Inductor's compile steps (COMPILE_TIMERS that ran); none when
    this process never imported Dynamo (an eager run compiles nothing, and importing it costs a second)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return {}
    compilation_time_metrics = utils.compilation_time_metrics

    timers: dict[str, float] = {}
    for key, name in COMPILE_TIMERS.items():
        values = compilation_time_metrics.get(key)
        if values:
            timers[name] = round(float(sum(values)), 4)
    return timers

