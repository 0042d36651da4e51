"""Process-wide state that a test may change only if it puts it back (the guard in tests/conftest.py).

What one test leaves changed, the tests after it on the same process inherit (a Dynamo limit, a thread count, a
signal handler, an environment variable), and in random order that is a different test on every run. Torch's parts
are read only where torch is already imported: the guard pays no import and stays cheap (about a millisecond a
test, most of it copying Inductor's config)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGCHLD",
                                                     "SIGXFSZ", "SIGALRM", "SIGPIPE") if hasattr(signal, name))
TORCH_CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config")
# pytest's own variable, set anew for every phase of every test; and those a library sets once, when the first test
# uses it (scikit-learn's OpenMP runtime's at import; Inductor's for its C++ kernels' loader, at a first compile)
_OWN_VARIABLES = {"PYTEST_CURRENT_TEST", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK",
                  "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
# joulepilot names its threads so (meters, samplers, zygote starters, progress): one a test leaves running meters or
# writes on into the tests after it. A thread given a moment to end after its stop is not left running.
OWN_THREADS = "joulepilot-"
THREAD_GRACE_S = 2.0
_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
_MISSING = object()


def _torch_switches(torch) -> dict:
    return {"torch.get_num_threads()": torch.get_num_threads(),
            "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision(),
            "torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.is_grad_enabled()": torch.is_grad_enabled(),
            "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
            "torch.backends.cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}


def _deleted_keys(config) -> frozenset:
    """A torch config's keys that were deleted (`delattr`): torch then answers 'does not exist' for them until they
    are set again, although a copy of the config still lists their default. pytest >= 9.1's monkeypatch.setattr
    deletes a config key on undo, as the key is not in the module's __dict__."""
    entries = getattr(config, "_config", {})
    return frozenset(name for name, entry in entries.items() if getattr(entry, "hide", False))


def _environ() -> dict:
    """os.environ but the variables above, and Inductor's cache folder where it is Inductor's default: Inductor
    sets TORCHINDUCTOR_CACHE_DIR to it at its first compile (to another folder, it is a change: a test's own
    temporary folder there would be every later compile's cache)."""
    environ = {k: v for k, v in os.environ.items() if k not in _OWN_VARIABLES}
    cache_dirs = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if cache_dirs is not None and environ.get(_INDUCTOR_CACHE) == os.path.abspath(cache_dirs.default_cache_dir()):
        del environ[_INDUCTOR_CACHE]
    return environ


def snapshot() -> dict:
    """The process-wide state now, one comparable value per part."""
    root = logging.getLogger()
    state = {"os.environ": _environ(),
             "working folder": os.getcwd(),
             "joulepilot threads": frozenset((t.ident, t.name) for t in threading.enumerate()
                                             if t.name.startswith(OWN_THREADS)),
             "signal handlers": {signal.Signals(sig).name: signal.getsignal(sig) for sig in SIGNALS},
             "root logger": (root.level, tuple(root.handlers))}
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):  # not while torch is still importing
        state.update(_torch_switches(torch))
    for name in TORCH_CONFIGS:
        config = sys.modules.get(name)
        if config is not None and hasattr(config, "get_config_copy"):
            state[name] = config.get_config_copy()
            state[f"{name}, deleted:"] = _deleted_keys(config)
    return state


def left_threads(before: dict, grace_s: float = THREAD_GRACE_S) -> list[threading.Thread]:
    """joulepilot's threads started since `before` that are still running `grace_s` later."""
    started = [t for t in threading.enumerate()
               if t.name.startswith(OWN_THREADS) and (t.ident, t.name) not in before["joulepilot threads"]]
    deadline = time.monotonic() + grace_s
    for thread in started:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in started if t.is_alive()]


def changes(before: dict, after: dict) -> list[str]:
    """What differs between two snapshots, named (for a mapping, each key that differs), among the parts both
    have: a test that imports torch for the first time changes nothing."""
    out = []
    for part in sorted(before.keys() & after.keys()):
        old, new = before[part], after[part]
        if isinstance(old, dict):
            out += [f"{part}[{key}]" for key in sorted(map(str, old.keys() | new.keys()))
                    if old.get(key, _MISSING) != new.get(key, _MISSING)]
        elif part == "joulepilot threads":  # threads ending is no change; those started and left running are
            out += [f"a thread left running: {name}" for name in sorted(name for _, name in new - old)]
        elif isinstance(old, frozenset):
            out += [f"{part} {key}" for key in sorted(old ^ new)]
        elif old != new:
            out.append(part)
    return out


def put_back(before: dict, after: dict) -> None:
    """Restores what `after` has changed from `before`."""
    if before["os.environ"] != after["os.environ"]:
        own = {k: v for k, v in os.environ.items() if k in _OWN_VARIABLES}
        os.environ.clear()
        os.environ.update({**before["os.environ"], **own})
        if _INDUCTOR_CACHE not in before["os.environ"]:  # Inductor sets its default again when it needs it
            os.environ.pop(_INDUCTOR_CACHE, None)
    if before["working folder"] != after["working folder"]:
        os.chdir(before["working folder"])
    for sig in SIGNALS:
        handler = before["signal handlers"][signal.Signals(sig).name]
        if handler is not None and after["signal handlers"][signal.Signals(sig).name] != handler:
            signal.signal(sig, handler)
    root = logging.getLogger()
    root.setLevel(before["root logger"][0])
    root.handlers[:] = before["root logger"][1]
    torch = sys.modules.get("torch")
    if "torch.get_num_threads()" in before and "torch.get_num_threads()" in after:
        torch.set_num_threads(before["torch.get_num_threads()"])
        torch.set_float32_matmul_precision(before["torch.get_float32_matmul_precision()"])
        torch.set_default_dtype(before["torch.get_default_dtype()"])
        torch.set_grad_enabled(before["torch.is_grad_enabled()"])
        torch.use_deterministic_algorithms(before["torch.are_deterministic_algorithms_enabled()"])
        torch.backends.cudnn.allow_tf32 = before["torch.backends.cudnn.allow_tf32"]
    for name in TORCH_CONFIGS:
        if name in before and name in after:
            config = sys.modules[name]
            for key, value in before[name].items():
                # setting a deleted key brings it back
                if after[name].get(key, _MISSING) != value or key in after[f"{name}, deleted:"]:
                    setattr(config, key, value)
