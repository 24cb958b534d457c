"""A loopback stand-in for W&B's sweep service, so the real ``wandb agent`` runs with no network.

``wandb agent`` (wandb 0.31) takes its runs from the W&B server only: it reads the sweep's config
(``SweepWithRuns``), registers (``CreateAgent``) and polls ``agentHeartbeat`` for ``run`` / ``exit``
commands, all as GraphQL through wandb-core; the "local controller" (``wandb.controller``) also keeps
its state on that server. This serves those four operations (and ``Viewer``, the login check) for one
grid sweep: each heartbeat with no run in flight gets the grid's next point, then ``exit``. Everything
else (wandb-core's telemetry) gets an empty answer.
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml


def grid(sweep: dict):
    """The grid's points in order, each as an agent command's ``args`` (``{name: {"value": v}}``)."""
    names = list(sweep["parameters"])
    for values in itertools.product(*(sweep["parameters"][n]["values"] for n in names)):
        yield {n: {"value": v} for n, v in zip(names, values)}


class SweepService(ThreadingHTTPServer):
    """``with SweepService(sweep) as url``: the service on ``127.0.0.1``; ``handed`` lists the runs given out."""

    def __init__(self, sweep: dict):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.sweep, self.points, self.handed = sweep, grid(sweep), []

    def __enter__(self) -> str:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def answer(self, query: str, variables: dict) -> dict:
        if "viewer" in query:
            return {"viewer": {"id": "local", "entity": "local", "username": "local", "email": None, "flags": "{}",
                               "teams": {"edges": []}}}
        if "SweepWithRuns" in query:
            return {"project": {"sweep": {"id": "sweep", "name": variables["sweep"], "method": self.sweep["method"],
                                          "state": "RUNNING", "config": yaml.safe_dump(self.sweep),
                                          "runs": {"edges": []}}}}
        if "CreateAgent" in query:
            return {"createAgent": {"agent": {"id": "agent"}}}
        if "agentHeartbeat" in query:
            busy = any(json.loads(variables.get("runState") or "{}").values())
            point = None if busy else next(self.points, None)
            if point is not None:
                self.handed.append(point)
            commands = [] if busy else [{"type": "exit"}] if point is None else \
                [{"type": "run", "run_id": f"run{len(self.handed)}", "program": self.sweep["program"], "args": point}]
            return {"agentHeartbeat": {"agent": {"id": "agent"}, "commands": json.dumps(commands)}}
        return {}


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        request = json.loads(body) if self.path == "/graphql" else {}
        reply = json.dumps({"data": self.server.answer(request.get("query", ""), request.get("variables") or {})})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply.encode())

    def log_message(self, *args) -> None:
        pass
