"""A private redis-server for the queue tests: its own temporary directory, a free port (never a fixed
one) and a unix socket, append-only persistence (so a restart loses nothing), a password user for URL
tests, optionally passwords for the default user (as requirepass); stopped at the end. Tests are
skipped where redis-server is not installed (`.ci/run` installs it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

USER, PASSWORD = "worker", "s3cret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, workdir: Path, tls: dict | None = None, passwords: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.tls = tls  # {"cert": ..., "key": ..., "ca": ...}: serve TLS only
        self.passwords = passwords  # the default user's (any one of them is accepted); none: no password
        self.socket = workdir / "redis.sock"
        self.port: int | None = None
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        """Starts the server; a restart keeps the port (clients keep their URL)."""
        restart = self.port is not None
        for _attempt in range(5):  # another process may take a free port before redis binds it
            port = self.port if restart else free_port()
            listen = ["--port", str(port)]
            if self.tls:
                listen = ["--port", "0", "--tls-port", str(port), "--tls-cert-file", self.tls["cert"],
                          "--tls-key-file", self.tls["key"], "--tls-ca-cert-file", self.tls["ca"],
                          "--tls-auth-clients", "no"]
            self.port = port
            default_user = ["--user", "default", "on", *(f">{p}" for p in self.passwords), "~*", "&*", "+@all"]
            self.process = subprocess.Popen(
                ["redis-server", *listen, "--bind", "127.0.0.1", "--dir", str(self.workdir), "--save", "",
                 "--appendonly", "yes", "--appendfsync", "always", "--loglevel", "warning",
                 "--logfile", str(self.workdir / "redis.log"),
                 "--unixsocket", str(self.socket), "--unixsocketperm", "700",
                 "--user", USER, "on", f">{PASSWORD}", "~*", "&*", "+@all", *(default_user if self.passwords else [])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            if self._wait_ready():
                return self
            self.process.kill()
            self.process.wait()
            time.sleep(0.2)
        raise RuntimeError(f"redis-server did not start; see {self.workdir / 'redis.log'}")

    def _wait_ready(self, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            try:
                if redis.Redis.from_url(self.url(), **self.client_options()).ping():
                    return True
            except redis.RedisError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        """A clean shutdown (SIGTERM): the append-only file is complete."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)

    def restart(self) -> None:
        self.stop()
        self.start()

    def url(self, user: str | None = None, password: str | None = None) -> str:
        """A URL for `user`; without one, the default user (with its first password, if it has one)."""
        scheme = "rediss" if self.tls else "redis"
        auth = f"{user}:{password}@" if user else f":{quote(self.passwords[0], safe='')}@" if self.passwords else ""
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def client_options(self) -> dict:
        return {"ssl_ca_certs": self.tls["ca"]} if self.tls else {}

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url(), **self.client_options())


def self_signed_tls(workdir: Path) -> dict:
    """RedisServer's tls argument: a self-signed certificate for 127.0.0.1 (made with openssl), its own CA."""
    cert, key = workdir / "cert.pem", workdir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return {"cert": str(cert), "key": str(key), "ca": str(cert)}


def start_server(tmp_path_factory, name: str = "redis") -> RedisServer:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does it)")
    return RedisServer(tmp_path_factory.mktemp(name)).start()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_server(tmp_path_factory)
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own: tests share a server, never keys."""
    return f"t{uuid.uuid4().hex[:10]}"
