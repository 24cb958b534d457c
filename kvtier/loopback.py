"""Loopback networking: what kvtier starts listens on 127.0.0.1 only.

A server that cannot be told to (the Mooncake store client's transfer engine, a local Ray cluster)
runs in a private network namespace, whose only interface is ``lo``: every address there is loopback,
so its wildcard binds reach nothing else. ``unshare -rn`` makes one without privileges where the
kernel allows unprivileged user namespaces.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

from kvtier.errors import TierIOError

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], port: int, name: str, timeout_s: float, ready=lambda sock: True) -> subprocess.Popen:
    """Start ``cmd``, a server that listens on ``HOST:port``, and wait until it accepts a connection on which
    ``ready(sock)`` holds; a server that exits or is not ready within ``timeout_s`` is killed and raises
    TierIOError with the end of its output."""
    with tempfile.TemporaryFile() as log:  # not a pipe: a chatty server would block once it filled
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection((HOST, port), timeout=1.0) as sock:
                    if ready(sock):
                        return proc
            except OSError:
                pass
            time.sleep(0.02)
        proc.kill()
        proc.wait()
        log.seek(0)
        out = log.read()[-4000:].decode(errors="replace")
    raise TierIOError(f"{name} did not start on {HOST}:{port} within {timeout_s} s: {' '.join(cmd)}\n{out}")


def interfaces() -> set[str]:
    """This process's network interfaces (asked of its own network namespace; /sys may show another's)."""
    return {name for _, name in socket.if_nameindex()}


def in_private_network() -> bool:
    """Whether loopback is this process's only network interface."""
    return interfaces() == {"lo"}


def private_network_command(argv: list[str]) -> list[str]:
    """``argv`` run in a fresh private network namespace with ``lo`` up."""
    return ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]


def private_network_unavailable() -> str | None:
    """Why :func:`private_network_command` cannot run here, in one line; None when it can."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return f"no private network namespace: {' and '.join(missing)} not found"
    probe = subprocess.run(private_network_command(["true"]), capture_output=True, text=True, timeout=30)
    if probe.returncode:
        return f"no private network namespace: unshare -rn failed ({probe.stderr.strip().splitlines()[-1:]})"
    return None
