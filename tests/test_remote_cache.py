"""Inductor's remote compile caches in a fleet's Redis (`compiler.remote_cache`): the URL's checks, a server that
does not answer, the daemon config's `[compile_cache]`, and, against a real redis-server (`servers.py`), a second
host compiling a configuration from what the first one compiled."""

from __future__ import annotations

import json
import logging
import socket
import warnings

import pytest
import servers
from joulepilot.compiler import CompileConfig, bench, remote_cache
from joulepilot.compiler.device_pool import worker_env
from joulepilot.controller.daemon_config import DaemonConfigError, load_daemon_config


@pytest.fixture(scope="module")
def redis_server():
    server = servers.start_redis()
    yield server
    servers.stop(server)


@pytest.fixture(autouse=True)
def fresh_reachability(monkeypatch):
    monkeypatch.setattr(remote_cache, "_reachable_at", {})
    monkeypatch.delenv(remote_cache.URL_ENV, raising=False)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


@pytest.mark.parametrize(("url", "says"), [
    ("http://cache:6379", "scheme 'http', not one of redis, rediss, unix"),
    ("redis://:6379/0", "names no host"),
    ("unix://", "names no socket path"),
    ("redis://cache:0/0", "has port 0"),
    ("redis://cache:99999/0", "is not a URL"),
    (" ", "a Redis URL is empty"),
])
def test_a_bad_url_is_one_line_naming_where_and_the_fix(monkeypatch, url, says):
    monkeypatch.setenv(remote_cache.URL_ENV, url)
    with pytest.raises(remote_cache.RemoteCacheError) as caught:
        remote_cache.configured_url()
    message = str(caught.value)
    assert message.startswith("JOULEPILOT_REDIS_URL: ") and says in message and "\n" not in message
    assert "write redis://HOST:PORT/DB" in message


def test_a_password_never_reaches_a_message_or_a_run():
    url = "redis://fleet:s3cret@cache.example:6380/2"
    assert remote_cache.redacted(url) == "redis://fleet:***@cache.example:6380/2"
    assert remote_cache.check_url(url, "x") == url
    with pytest.raises(remote_cache.RemoteCacheError) as caught:
        remote_cache.check_url("http://fleet:s3cret@cache", "x")
    assert "s3cret" not in str(caught.value)
    recorded = remote_cache.recorded_variables(remote_cache.worker_variables(url))
    assert recorded[remote_cache.TORCH_URL] == "redis://fleet:***@cache.example:6380/2"
    assert all(recorded[name] == "1" for name in remote_cache.TORCH_SWITCHES)


def test_without_a_url_nothing_changes():
    assert remote_cache.configured_url() is None
    assert not set(worker_env(1)) & {remote_cache.TORCH_URL, *remote_cache.TORCH_SWITCHES}


def test_a_server_that_does_not_answer_is_one_warning_and_the_work_goes_on(caplog):
    url = f"redis://127.0.0.1:{_closed_port()}/0"
    with caplog.at_level(logging.WARNING, logger="joulepilot.compiler"):
        first, second = worker_env(1, url), worker_env(2, url)
    assert remote_cache.TORCH_URL not in first and remote_cache.TORCH_URL not in second
    warnings = [r.getMessage() for r in caplog.records if r.name == "joulepilot.compiler"]
    assert len(warnings) == 1, warnings  # said once, not at every job
    assert warnings[0].startswith(f"Redis at {url} did not answer (") and "without the remote cache" in warnings[0]


def test_the_daemon_config_takes_a_compile_cache_and_names_a_bad_one(tmp_path):
    path = tmp_path / "daemon.toml"
    path.write_text('[compile_cache]\nredis_url = "redis://:pw@10.0.0.5:6379/1"\n')
    path.chmod(0o640)  # a password where the file's group may read it: refused, the password not shown
    with pytest.raises(DaemonConfigError) as caught:
        load_daemon_config(path)
    assert "compile_cache.redis_url (redis://:***@10.0.0.5:6379/1) holds a password" in str(caught.value)
    assert "its group" in str(caught.value) and "JOULEPILOT_REDIS_URL" in str(caught.value)
    assert ":pw@" not in str(caught.value)
    path.chmod(0o600)
    cfg = load_daemon_config(path)
    assert cfg.compile_cache.redis_url == "redis://:pw@10.0.0.5:6379/1"
    assert cfg.to_dict()["compile_cache"] == {"redis_url": "redis://:***@10.0.0.5:6379/1"}
    assert load_daemon_config(None).compile_cache.redis_url == ""
    path.write_text('[compile_cache]\nredis_url = "10.0.0.5:6379"\n')
    with pytest.raises(DaemonConfigError) as caught:
        load_daemon_config(path)
    assert str(caught.value).startswith(f"{path.resolve()}: compile_cache.redis_url: '10.0.0.5:6379' is not a Redis URL")
    path.write_text('[compile_cache]\nredis = "redis://cache:6379"\n')
    with pytest.raises(DaemonConfigError, match="redis_url"):
        load_daemon_config(path)


def test_a_second_host_compiles_from_what_the_first_one_compiled(redis_server, tmp_path, monkeypatch, own_tmpdir):
    """Two `bench` processes with homes of their own (two hosts: nothing local in common, and each worker gets
    fresh local cache folders anyway) and the fleet's Redis: the first misses and fills the server, the second
    hits Inductor's FX-graph and AOTAutograd caches there; neither run stores the password."""
    monkeypatch.setenv(remote_cache.URL_ENV, redis_server.url)
    config = CompileConfig(mode="default")
    runs = []
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
        monkeypatch.setenv("JOULEPILOT_HOME", str(tmp_path / host))
        [run] = bench("mlp", [config], device="cpu", min_seconds=0.1, db=tmp_path / host / "j.db")
        assert run["status"] == "ok", run.get("reason")
        runs.append(run)
        if host == "a":
            assert redis_server.client().dbsize() > 0
    first, second = (r["extra"] if isinstance(r["extra"], dict) else json.loads(r["extra"]) for r in runs)
    said = [(extra["compile_caches"], extra.get("compile_cache_bypasses")) for extra in (first, second)]
    assert first["compile_caches"].get("fxgraph_cache_miss") == 1 and "fxgraph_cache_hit" not in first["compile_caches"]
    assert second["compile_caches"].get("fxgraph_cache_hit") == 1, said
    # AOTAutograd's cache hits too, unless torch bypassed it on that host (once in a CI run, reason then unknown):
    # the run must then say so and why. A plain miss is a remote cache that did not serve the second host.
    for extra, wanted in ((first, "autograd_cache_miss"), (second, "autograd_cache_hit")):
        caches = extra["compile_caches"]
        assert caches.get(wanted) == 1 or (caches.get("autograd_cache_bypass") and any(
            line.startswith("aot_autograd: ") for line in extra.get("compile_cache_bypasses", []))), said
    if any(extra["compile_caches"].get("autograd_cache_bypass") for extra in (first, second)):
        warnings.warn(f"torch bypassed AOTAutograd's cache: {said}", stacklevel=1)  # its reason, in the summary
    for extra in (first, second):
        assert extra["worker_env"][remote_cache.TORCH_URL] == redis_server.url.replace(redis_server.password, "***")
    assert redis_server.password not in json.dumps(runs, default=str)


def test_a_serving_process_compiles_the_decision_from_the_fleets_cache(redis_server, tmp_path, monkeypatch):
    """`joulepilot.compile` in two fresh processes with local cache folders of their own, `JOULEPILOT_REDIS_URL`
    set: the first compiles the decided configuration into the fleet's Redis, the second from it."""
    from decision_factories import hook_in_new_process, seed_runs, write_policy
    from joulepilot.policies import load_policy, record_decision, resolve
    from joulepilot.store import open_db

    database = open_db(tmp_path / "j.db")
    try:
        policy = write_policy(tmp_path / "policies")
        seed_runs(database, {("default", "fp32"): {"energy_j_per_inference": 0.01, "avg_power_w": 0.2},
                             ("eager", "fp32"): {"energy_j_per_inference": 0.02, "avg_power_w": 0.3}})
        record_decision(database, resolve(load_policy(policy), database, "cpu"))
    finally:
        database.close()
    redis_server.client().flushdb()
    served = []
    for host in ("a", "b"):
        served.append(hook_in_new_process(policy, tmp_path / "j.db", env={
            remote_cache.URL_ENV: redis_server.url, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{host}")}))
        if host == "a":
            assert redis_server.client().dbsize() > 0
    assert [s["label"] for s in served] == ["default/fp32/b8"] * 2 and not any(s["warnings"] for s in served)
    first, second = (s["compile_caches"] for s in served)
    assert first.get("fxgraph_cache_miss") == 1 and "fxgraph_cache_hit" not in first
    assert second.get("fxgraph_cache_hit") == 1 and second.get("autograd_cache_hit") == 1


def test_the_daemons_heartbeat_says_whether_the_cache_answers(redis_server, tmp_path):
    """`status` and the exporter read the remote cache's state from the daemon's heartbeat."""
    from joulepilot.controller.daemon import Daemon
    from joulepilot.controller.daemon_config import parse_daemon_config

    silent = f"redis://:pw@127.0.0.1:{_closed_port()}/0"
    for url, answers in ((redis_server.url, True), (silent, False)):
        cfg = parse_daemon_config({"db": str(tmp_path / "j.db"), "compile_cache": {"redis_url": url}}, tmp_path / "d")
        state = Daemon(cfg)._compile_cache_state()
        assert state["answers"] is answers and state["url"] == remote_cache.redacted(url)
        assert "pw" not in json.dumps(state) and redis_server.password not in json.dumps(state)
        assert (state["problem"] is None) is answers
    no_cache = parse_daemon_config({"db": str(tmp_path / "j.db")}, tmp_path / "d")
    assert Daemon(no_cache)._compile_cache_state() is None


def test_the_daemon_refuses_a_malformed_url_in_its_environment_before_starting(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from joulepilot.cli import main

    monkeypatch.setenv(remote_cache.URL_ENV, "cache.example:6379")
    result = CliRunner().invoke(main, ["daemon", "--once", "--db", str(tmp_path / "j.db")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: JOULEPILOT_REDIS_URL: 'cache.example:6379' is not a Redis URL (scheme 'cache.example', not one of "
        "redis, rediss, unix); write redis://HOST:PORT/DB (rediss:// for TLS, unix:///path/to/redis.sock)")
    assert not (tmp_path / "j.db").exists()
