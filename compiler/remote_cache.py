"""Inductor's remote compile caches in a Redis server shared by a fleet of hosts.

With a Redis URL (`[compile_cache] redis_url` in the daemon config, or `JOULEPILOT_REDIS_URL` for `bench`, the
daemon and `joulepilot.compile`), every worker compiles with Inductor's remote FX-graph cache, AOTAutograd cache
and autotuning-results cache in that server: a host that has never compiled a configuration starts from what
another host compiled (the local caches stay per job: each worker still gets fresh cache folders). torch reads
these settings from its environment (`TORCHINDUCTOR_*_REMOTE_CACHE`, `TORCHINDUCTOR_REDIS_URL`), so they are
handed to the worker processes as variables; what hit is in each run's `extra.compile_caches`.

torch needs the `redis` package for this (`pip install 'joulepilot[fleet]'`). A server that cannot be reached is
said once and the work goes on without it: a cache saves seconds, it never decides anything.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any
from urllib.parse import urlsplit

from joulepilot.store.urls import redacted

from .options import ConfigError

URL_ENV = "JOULEPILOT_REDIS_URL"
SCHEMES = ("redis", "rediss", "unix")
# torch's switches for its three remote caches, and where its Redis client finds the server.
TORCH_SWITCHES = ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
                  "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE")
TORCH_URL = "TORCHINDUCTOR_REDIS_URL"
CONNECT_TIMEOUT_S = 2.0
RECHECK_S = 60.0  # a server found unreachable is tried again after this long (a daemon runs for weeks)
log = logging.getLogger("joulepilot.compiler")
_reachable_at: dict[str, tuple[float, str | None]] = {}  # url -> (when checked, why it was unreachable or None)


class RemoteCacheError(ConfigError):
    """The Redis URL is malformed; the message names where it came from and the fix."""


def check_url(url: str, where: str) -> str:
    """`url` when it names a Redis server (redis://HOST:PORT/DB, rediss:// for TLS, unix:///PATH), else a
    RemoteCacheError naming `where` (a config key or variable)."""
    fix = "write redis://HOST:PORT/DB (rediss:// for TLS, unix:///path/to/redis.sock)"
    if not isinstance(url, str) or not url.strip():
        raise RemoteCacheError(f"{where}: a Redis URL is empty; {fix}, or leave it out for no remote cache")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise RemoteCacheError(f"{where}: {redacted(url)!r} is not a URL ({exc}); {fix}") from None
    if parts.scheme not in SCHEMES:
        raise RemoteCacheError(f"{where}: {redacted(url)!r} is not a Redis URL (scheme {parts.scheme or 'missing'!r}, "
                               f"not one of {', '.join(SCHEMES)}); {fix}")
    if parts.scheme == "unix" and not parts.path:
        raise RemoteCacheError(f"{where}: {redacted(url)!r} names no socket path; {fix}")
    if parts.scheme != "unix" and not parts.hostname:
        raise RemoteCacheError(f"{where}: {redacted(url)!r} names no host; {fix}")
    if port == 0:
        raise RemoteCacheError(f"{where}: {redacted(url)!r} has port 0; {fix}")
    return url.strip()


def configured_url(explicit: str | None = None) -> str | None:
    """The Redis URL to compile with: `explicit` (a daemon config's; "" or None for none), else
    `JOULEPILOT_REDIS_URL`, else None."""
    if explicit:
        return check_url(explicit, "[compile_cache] redis_url")
    from_env = os.environ.get(URL_ENV)
    return check_url(from_env, URL_ENV) if from_env else None


def worker_variables(url: str | None) -> dict[str, str]:
    """The variables that make a worker's torch compile with the remote caches in `url`; {} for None."""
    if not url:
        return {}
    return {**{name: "1" for name in TORCH_SWITCHES}, TORCH_URL: url}


def recorded_variables(env: dict[str, str]) -> dict[str, str]:
    """A worker's variables as a run records them: the Redis URL's password redacted."""
    return {k: redacted(v) if k == TORCH_URL else v for k, v in env.items()}


def unreachable(url: str, timeout_s: float = CONNECT_TIMEOUT_S) -> str | None:
    """None when the server at `url` answers a PING; else one line saying why not (the package missing, the
    connection refused, a wrong password), with the password redacted."""
    try:
        import redis
    except ImportError:
        return ("the remote compile cache needs the redis package, which is not installed: "
                "pip install 'joulepilot[fleet]'")
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:  # every failure of the client is the same news: no remote cache this time
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"Redis at {redacted(url)} did not answer ({detail})"
    return None


def usable_variables(url: str | None) -> dict[str, str]:
    """`worker_variables(url)` when the server answers, else {} with one warning: checked once a minute at
    most per URL and process, so a daemon picks the cache up again when the server returns."""
    if not url:
        return {}
    now = time.monotonic()
    checked = _reachable_at.get(url)
    if checked is None or now - checked[0] > RECHECK_S:
        problem = unreachable(url)
        if problem and (checked is None or checked[1] is None):
            log.warning("%s; compiling without the remote cache until it does", problem)
        elif problem is None and checked is not None and checked[1] is not None:
            log.warning("Redis at %s answers again; compiling with the remote cache", redacted(url))
        _reachable_at[url] = checked = (now, problem)
    return {} if checked[1] else worker_variables(url)


def cache_state(url: str | None) -> dict[str, Any] | None:
    """What `status` and the exporter say of the remote cache in `url`: {'url' (redacted), 'answers',
    'problem'}, from the last check (made now when due); None without a URL."""
    if not url:
        return None
    usable_variables(url)
    problem = _reachable_at[url][1]
    return {"url": redacted(url), "answers": problem is None, "problem": problem}


def use_in_this_process(url: str | None) -> bool:
    """Compile in this process with the remote caches in `url` (a serving process's `joulepilot.compile`: its
    torch is already imported, so its settings are set rather than its environment); True when they are on. A
    server that does not answer leaves them as they were (one warning, as for a worker)."""
    variables = usable_variables(url)
    if not variables:
        return False
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    os.environ[TORCH_URL] = variables[TORCH_URL]  # torch's Redis client reads it when it first connects
    inductor_config.fx_graph_remote_cache = True
    inductor_config.autotune_remote_cache = True
    functorch_config.enable_remote_autograd_cache = True
    return True
