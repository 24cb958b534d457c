"""LocalMooncakeMaster: a real ``mooncake_master`` on 127.0.0.1 for MooncakeTier's ``master: local``.

The binary is the one the ``mooncake-transfer-engine`` wheel ships (the ``kvtier[mooncake]`` extra). Its
RPC and metrics servers listen on loopback on free ports; the HTTP metadata server stays off (the
client's P2P handshake needs none), nothing is persisted, and it lives until :meth:`stop`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvtier.errors import MissingDependencyError
from kvtier.loopback import HOST, free_port, start_server


def mooncake_master_binary() -> str:
    """Path of the ``mooncake_master`` inside the installed ``mooncake`` package."""
    spec = importlib.util.find_spec("mooncake")
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master" if spec else None
    if path is None or not path.is_file():
        raise MissingDependencyError("mooncake-transfer-engine-non-cuda", "mooncake", "a local Mooncake master")
    return str(path)


class LocalMooncakeMaster:
    """``mooncake_master`` on ``127.0.0.1:<free port>``; ``address`` is ``127.0.0.1:PORT``."""

    def __init__(self, timeout_s: float = 20.0):
        self.port, self.metrics_port = free_port(), free_port()
        cmd = [mooncake_master_binary(), f"--rpc_address={HOST}", f"--rpc_port={self.port}",
               f"--metrics_host={HOST}", f"--metrics_port={self.metrics_port}",
               "--enable_http_metadata_server=false", "--enable_metric_reporting=false"]
        self.proc = start_server(cmd, self.port, "mooncake_master", timeout_s)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def stop(self) -> None:
        """Kill the master (it persists nothing: a graceful stop would only take a second longer)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
