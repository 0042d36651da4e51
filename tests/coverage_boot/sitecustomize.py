"""Test-suite only (tests/conftest.py puts this folder first on PYTHONPATH for the processes the suite
starts, pytest's own included): where coverage measures a process, its tracer is paused in a thread while that
thread runs torch's own Python, in two places:

- while a torch module executes on import (torch itself and every torch.* module, Dynamo and Inductor among
  them);
- while Dynamo compiles a frame (between its compile start and end callbacks): tracing, AOTAutograd, Inductor's
  lowering and code generation.

Coverage measures joulepilot alone, but its tracer still sees every Python call and line of every module, and
made that work about half as slow again: 0.3 s more CPU per process to import torch, another second or so per
compile, in a suite that starts a few hundred processes and runs dozens of real compiles. No joulepilot code
runs inside an import of torch's; inside a compile, only what Dynamo calls back (a counting backend) would, so
the figure can come out lower, never higher. The tracer is paused and resumed in the same frame, so its record
of the frames it is in stays as it was; other threads keep theirs."""

from __future__ import annotations

import sys
from _thread import get_ident
from importlib.machinery import PathFinder

# thread -> [how many pauses are open in it, the tracer to start again when the last one closes (or None)]
_paused: dict[int, list] = {}


def _pause() -> None:
    entry = _paused.get(get_ident())
    if entry is not None:
        entry[0] += 1
        return
    tracer = sys.gettrace()
    if type(tracer).__name__ == "CTracer" and type(tracer).__module__.startswith("coverage"):
        tracer.stop()  # it takes itself off this thread at its next event
    else:
        tracer = None  # not coverage's (or none): leave it be
    _paused[get_ident()] = [1, tracer]


def _resume() -> None:
    entry = _paused.get(get_ident())
    if entry is None:
        return
    entry[0] -= 1
    if entry[0] == 0:
        del _paused[get_ident()]
        if entry[1] is not None:
            entry[1].start()


def _on_compile(_args) -> None:
    _pause()


def _after_compile(_args) -> None:
    _resume()


class _TorchImports:
    """A finder for torch's modules: each loads as it would, inside a pause; when Dynamo's callback module has
    loaded, a compile pauses too."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != "torch" and not name.startswith("torch."):
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def load_paused(module) -> None:
            _pause()
            try:
                load(module)
            finally:
                _resume()
            if name == "torch._dynamo.callback":
                handler = getattr(module, "callback_handler", None)
                if handler is not None and hasattr(handler, "register_start_callback"):
                    handler.register_start_callback(_on_compile)
                    handler.register_end_callback(_after_compile)

        spec.loader.exec_module = load_paused
        return spec


try:
    import coverage  # noqa: F401 - only where coverage is installed
except ImportError:
    pass
else:
    sys.meta_path.insert(0, _TorchImports)
