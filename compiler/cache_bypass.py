"""Why a compile cache was bypassed: Inductor's FX-graph cache and AOTAutograd's cache each skip a graph they
cannot cache (an unpicklable setting, an operator they do not support) and say why only in an INFO log line.
`recording_cache_bypasses()` listens to those two logs while a configuration compiles, so a run whose
`compile_caches` shows a bypass also says why (`extra.compile_cache_bypasses`): a fleet's remote cache that a
host does not hit is then explained rather than guessed at.

This module imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from .log_listen import listening

# The loggers torch names its bypass lines from, and the cache each one speaks for.
LOGGERS = {"torch._inductor.codecache": "fxgraph", "torch._functorch._aot_autograd.autograd_cache": "aot_autograd"}
MARKERS = ("Bypassing FX Graph Cache", "Bypassing autograd cache")
REASON_CHARS = 300
KEPT = 8


class _Collector(logging.Handler):
    def __init__(self, cache: str, into: list[str]) -> None:
        super().__init__(logging.INFO)
        self.cache, self.into = cache, into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a record torch could not format says nothing we could use
            return
        if message.startswith(MARKERS) and len(self.into) < KEPT:
            line = f"{self.cache}: {' '.join(message.split())[:REASON_CHARS]}"
            if line not in self.into:
                self.into.append(line)


@contextmanager
def recording_cache_bypasses() -> Iterator[list[str]]:
    """The bypass lines the two caches log inside the block, as 'CACHE: torch's line', each once. Where nobody
    asked for those loggers' INFO lines, they are taken here and kept out of the process's other handlers."""
    found: list[str] = []
    with listening([(logging.getLogger(name), _Collector(cache, found)) for name, cache in LOGGERS.items()],
                   logging.INFO):
        yield found
