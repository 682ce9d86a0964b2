"""`inferplane status`: what `inferplane up` runs from this home, and whether it answers.

Reads the home's run.json (see local/runstate.py) and checks each part live: the gateway's
/readyz, each worker's process and gRPC health. Prints ports, models, runtimes, metrics URLs and
where the logs are; exits 1 when nothing runs, or when a part does not answer.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--home", default=os.environ.get("INFERPLANE_HOME", str(Path.home() / ".inferplane")),
                        help="the state folder `inferplane up` used")
    parser.add_argument("--json", action="store_true", help="the state with live checks, as JSON")


def _grpc_serving(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def run(args: argparse.Namespace) -> int:
    from inferplane.local import runstate

    home = Path(args.home).expanduser()
    state = runstate.read(home)
    if state is None or not runstate.alive(int(state.get("supervisor_pid") or 0)):
        print(f"nothing runs from {home} (start it with `inferplane up`)")
        return 1
    gateway = state["gateway"]
    gateway["ready"] = _http_ok(gateway["url"] + "/readyz")
    healthy = gateway["ready"]
    for deployment in state["deployments"]:
        for replica in deployment["replicas"]:
            replica["running"] = bool(replica.get("pid")) and runstate.alive(replica["pid"])
            replica["serving"] = replica["running"] and _grpc_serving(replica["address"])
            healthy = healthy and replica["serving"]
    if args.json:
        print(json.dumps(state, indent=2))
        return 0 if healthy else 1
    print(f"inferplane up (pid {state['supervisor_pid']}) from {state['home']}")
    ready = "ready" if gateway["ready"] else "NOT READY"
    print(f"gateway  {gateway['url']}/v1  {ready}  metrics {gateway.get('metrics') or 'off'}"
          + (f"  gRPC :{gateway['grpc_port']}" if gateway.get("grpc_port") else ""))
    for deployment in state["deployments"]:
        print(f"deployment {deployment['name']}: model {deployment['served_model']} ({deployment['model']}), "
              f"runtime {deployment['runtime']}, {len(deployment['replicas'])} replica(s)")
        for r in deployment["replicas"]:
            health = "serving" if r["serving"] else ("starting or unhealthy" if r["running"] else "not running")
            print(f"  [{r['index']}] pid {r['pid']}  grpc {r['address']}  {health}  metrics {r['metrics']}  "
                  f"restarts {r['restarts']}  log {r['log']}")
    print(f"logs: {state['logs']}")
    return 0 if healthy else 1
