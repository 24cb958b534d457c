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

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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
