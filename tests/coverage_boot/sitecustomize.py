"""Test-suite only (tests/conftest.py puts this folder first on PYTHONPATH for the processes the suite
starts): in a process that coverage measures, the tracer is paused while torch is imported for the first time.

Coverage measures joulepilot alone, but its tracer still sees every Python call of every module, and importing
torch runs a great deal of Python: about 0.3 s more CPU per process under the tracer, in the hundred-odd
processes that import it (workers, zygotes, hook scripts). No joulepilot code runs inside that import, so the
figures do not change. Only the first, top-level `import torch` is paused: imports made later, during a
compile, stay traced (Dynamo must see the tracer as it was)."""

from __future__ import annotations

import builtins
import sys


def _tracing_coverage():
    """The Coverage whose tracer is the one running in this thread, or None (none, or another tool's on top)."""
    import coverage

    measuring = coverage.Coverage.current()
    collector = getattr(measuring, "_collector", None)
    stack = getattr(type(collector), "_collectors", None)
    if collector is None or not stack or stack[-1] is not collector:
        return None
    return measuring


def _pause_coverage_while_torch_imports() -> None:
    try:
        import coverage  # noqa: F401 - only where coverage is installed
    except ImportError:
        return
    real_import = builtins.__import__

    def importing(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 - the builtin's signature
        if level == 0 and "torch" not in sys.modules and name.partition(".")[0] == "torch":
            # Once torch is in, this wrapper goes: Dynamo would otherwise meet it at every import statement in
            # the code it compiles (a Python function where it expects the builtin).
            builtins.__import__ = real_import
            measuring = _tracing_coverage()
            if measuring is not None:
                measuring.stop()
                try:
                    return real_import(name, globals, locals, fromlist, level)
                finally:
                    measuring.start()
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = importing


_pause_coverage_while_torch_imports()
