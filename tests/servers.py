"""Real servers for the tests that need one (a fleet's Redis): the operating system's package, started by the
test on loopback in a temporary folder, as a non-root user (nobody) when the tests run as root, and stopped after.
Skipped, with the install command, where the package is not installed (Debian/Ubuntu: apt-get install
redis-server)."""

from __future__ import annotations

import os
import shutil
import signal
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


def stop(server: RedisServer | PostgresServer, timeout_s: float = 10) -> None:
    """End a server's process (killed when it has not stopped within `timeout_s`) and remove its folder."""
    server.process.terminate()
    try:
        server.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
    shutil.rmtree(server.folder, ignore_errors=True)


@dataclass
class PostgresServer:
    """A throwaway PostgreSQL cluster: `url(name)` for a database in it, `new_database()` for a fresh one."""

    port: int
    password: str
    process: subprocess.Popen
    folder: Path
    created: int = 0

    def url(self, database: str = "postgres", password: str | None = None) -> str:
        return f"postgresql://joulepilot:{password or self.password}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a new, empty database (one per test: a test's tables never meet another's)."""
        import psycopg

        self.created += 1
        name = f"jp_{os.getpid()}_{self.created}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        stop(self, timeout_s=20)

    def halt(self) -> None:
        """Shut the server down, keeping its data (`resume` starts it again): SIGINT, PostgreSQL's fast shutdown,
        which cuts the connections (SIGTERM would wait for every client to leave)."""
        self.process.send_signal(signal.SIGINT)
        self.process.wait(timeout=20)

    def resume(self) -> None:
        """Start the halted server again on its port, with its data."""
        import psycopg

        self.process = _launch_postgres(self.folder, self.port)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                with psycopg.connect(self.url(), connect_timeout=2):
                    return
            except psycopg.Error:
                time.sleep(0.1)
        raise RuntimeError(f"postgres did not start again on port {self.port}")


def _launch_postgres(folder: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [*_unprivileged(), _postgres_binary("postgres"), "-D", str(folder / "data"), "-k", str(folder), "-p", str(port),
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "synchronous_commit=off",
         "-c", "full_page_writes=off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)




def _postgres_binary(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True)
    return str(candidates[0]) if candidates else None


def start_postgres() -> PostgresServer:
    """A PostgreSQL cluster initialised in a temporary folder and started on loopback and a socket in that folder,
    as nobody when the tests run as root, with a password login for the user joulepilot."""
    initdb, postgres = _postgres_binary("initdb"), _postgres_binary("postgres")
    if initdb is None or postgres is None:
        pytest.skip("PostgreSQL is not installed (Debian/Ubuntu: apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'joulepilot[fleet]')")
    import psycopg

    folder = Path(tempfile.mkdtemp(prefix="joulepilot-postgres-"))
    folder.chmod(0o777)
    password = "fleet-" + os.urandom(6).hex()
    (folder / "password").write_text(password)
    (folder / "password").chmod(0o644)
    subprocess.run([*_unprivileged(), initdb, "-D", str(folder / "data"), "-U", "joulepilot", "-E", "UTF8",
                    "--auth=scram-sha-256", f"--pwfile={folder / 'password'}", "--no-sync"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(5):
        port = _free_port()
        process = _launch_postgres(folder, port)
        server = PostgresServer(port, password, process, folder)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and process.poll() is None:
            try:
                with psycopg.connect(server.url(), connect_timeout=2):
                    return server
            except psycopg.Error:
                time.sleep(0.1)
        process.kill()
        process.wait()
    shutil.rmtree(folder, ignore_errors=True)
    raise RuntimeError("postgres did not start on a free loopback port in 5 tries")
