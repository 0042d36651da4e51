"""Real servers for the tests that need one (a fleet's Redis): the operating system's package, started by the
test on loopback in a temporary folder, as a non-root user (nobody) when the tests run as root, and stopped after.
Skipped, with the install command, where the package is not installed (Debian/Ubuntu: apt-get install
redis-server)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _unprivileged() -> list[str]:
    """The prefix that runs a server as nobody when the tests run as root (a server need not run as root)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("the tests run as root and setpriv (util-linux) is missing to start the server as nobody")
    return [setpriv, "--reuid=nobody", "--regid=nogroup", "--clear-groups"]


@dataclass
class RedisServer:
    port: int
    password: str
    process: subprocess.Popen
    folder: Path

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)


def start_redis() -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian/Ubuntu: apt-get install redis-server)")
    pytest.importorskip("redis", reason="the redis package is not installed (pip install 'joulepilot[fleet]')")
    folder = Path(tempfile.mkdtemp(prefix="joulepilot-redis-"))
    folder.chmod(0o777)
    password = "fleet-" + os.urandom(6).hex()
    for _ in range(5):
        port = _free_port()
        process = subprocess.Popen(
            [*_unprivileged(), binary, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder),
             "--save", "", "--appendonly", "no", "--requirepass", password, "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        server = RedisServer(port, password, process, folder)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if server.client().ping():
                    return server
            except Exception:
                time.sleep(0.05)
        process.kill()
        process.wait()
    shutil.rmtree(folder, ignore_errors=True)
    raise RuntimeError("redis-server did not start on a free loopback port in 5 tries")


def stop(server: RedisServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    shutil.rmtree(server.folder, ignore_errors=True)
