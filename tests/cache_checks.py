"""What a warm start's compile caches may show, for every test that warm-starts a real compile."""

from __future__ import annotations

import warnings


def assert_compiled_from_caches(caches: dict, why: list[str] | None, graphs: int) -> None:
    """Each of the `graphs` saved graphs was an AOTAutograd hit, or a bypass that torch gave a reason for (the
    worker records it; its graph is then looked up in the FX-graph cache directly, a hit too, so a bypass after a
    failed load counts two FX-graph hits), and no graph missed the FX-graph cache. `caches`: the warm start's
    counters; `why`: its recorded bypass lines. A bypass has been seen only in whole-suite runs on the CPU (one
    frame in three of a model with graph breaks; the one graph of the built-in MLP), never in a test alone."""
    why = why or []
    hits, bypassed = caches.get("autograd_cache_hit", 0), caches.get("autograd_cache_bypass", 0)
    assert hits + bypassed == graphs and (not bypassed or why), (caches, why)
    assert caches.get("fxgraph_cache_hit", 0) >= graphs and "fxgraph_cache_miss" not in caches, (caches, why)
    if bypassed:  # shown in the run's warnings summary: why torch bypassed the cache is still to be learnt
        warnings.warn(f"warm start: torch bypassed AOTAutograd's cache for {bypassed} graph(s): {why}", stacklevel=2)
