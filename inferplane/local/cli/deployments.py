"""`inferplane deployments apply|list|get|delete`: InferenceDeployments on a running `inferplane up`,
through its admin API (`/admin/v1/deployments`).

`apply -f FILE` takes the YAML `kubectl apply -f` takes; a changed deployment rolls over with no
request failed (local/deployment_control.py), and `--wait` returns once it has. The gateway is the
one `inferplane up --home HOME` runs (its run.json), or `--url`; the credential is the platform
admin key (`$INFERPLANE_ADMIN_KEY`, else `<home>/admin-key`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from inferplane.control_plane.cli.remote import add_remote_arguments


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="deployments_command", required=True)
    apply = sub.add_parser("apply", help="create or change deployments from InferenceDeployment YAML")
    apply.add_argument("-f", "--filename", required=True, action="append",
                       help="a YAML file (several documents allowed); repeatable")
    apply.add_argument("--wait", action="store_true", help="return once every replica of each serves")
    apply.add_argument("--timeout", type=float, default=600.0, help="seconds --wait waits (default: 600)")
    listing = sub.add_parser("list", help="deployments, their replicas and rollouts")
    listing.add_argument("--json", action="store_true")
    get = sub.add_parser("get", help="one deployment as applied, with its status (JSON)")
    get.add_argument("name")
    delete = sub.add_parser("delete", help="remove a deployment: off the routes at once, its replicas drain")
    delete.add_argument("name")
    for p in (apply, listing, get, delete):
        p.add_argument("--home", default=None, help="the `inferplane up` home (default: ~/.inferplane)")
        add_remote_arguments(p)


def _gateway_url(args: argparse.Namespace) -> str:
    """--url, else the gateway the `up` of --home runs (its run.json)."""
    from inferplane.control_plane.cli.remote import RemoteError
    from inferplane.control_plane.db_url import default_home
    from inferplane.local import runstate

    if args.gateway_url:
        return args.gateway_url
    home = Path(args.home).expanduser() if args.home else default_home()
    state = runstate.read(home)
    if state is None:
        raise RemoteError(503, f"no `inferplane up` runs with home {home}; start one, or pass --url")
    return state["gateway"]["url"]


def _documents(paths: list[str]) -> list[dict[str, Any]]:
    import yaml

    docs = []
    for path in paths:
        with open(path) as f:
            docs.extend(d for d in yaml.safe_load_all(f) if d)
    return docs


def _settled(view: dict[str, Any]) -> bool:
    status = view["status"]
    return status["rollout"] == "complete" and status["readyReplicas"] >= view["spec"].get("replicas", 1)


def _apply(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.cli.remote import RemoteError

    try:
        docs = _documents(args.filename)
    except OSError as exc:
        raise RemoteError(400, f"{exc.filename}: {exc.strerror}") from None
    names = []
    for doc in docs:
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc, dict) else None
        if not name:
            raise RemoteError(400, "metadata.name: required")
        answer = api.call("PUT", f"/admin/v1/deployments/{name}", json=doc)
        print(f"deployment/{name} {answer['action']}", flush=True)
        names.append(name)
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout
    waiting = set(names)
    while waiting:
        for name in sorted(waiting):
            view = api.call("GET", f"/admin/v1/deployments/{name}")
            if view["status"]["rollout"].startswith("stalled"):
                raise RemoteError(500, f"deployment/{name}: {view['status']['rollout']}")
            if _settled(view):
                print(f"deployment/{name} ready ({view['status']['readyReplicas']} replicas)", flush=True)
                waiting.discard(name)
        if waiting and time.monotonic() > deadline:
            raise RemoteError(504, f"not ready after {args.timeout:.0f} s: {', '.join(sorted(waiting))}")
        time.sleep(0.5)
    return 0


def _list(args: argparse.Namespace, api: Any) -> int:
    views = api.call("GET", "/admin/v1/deployments")["data"]
    if args.json:
        print(json.dumps(views, indent=2))
        return 0
    print(f"{'NAME':<28} {'MODEL':<28} {'RUNTIME':<10} {'READY':>7}  ROLLOUT")
    for view in views:
        status = view["status"]
        print(f"{view['metadata']['name']:<28} {status['servedModel']:<28} {status['runtime'] or '-':<10} "
              f"{status['readyReplicas']:>3}/{status['replicas']:<3}  {status['rollout']}")
    return 0


def _get(args: argparse.Namespace, api: Any) -> int:
    print(json.dumps(api.call("GET", f"/admin/v1/deployments/{args.name}"), indent=2))
    return 0


def _delete(args: argparse.Namespace, api: Any) -> int:
    api.call("DELETE", f"/admin/v1/deployments/{args.name}")
    print(f"deployment/{args.name} deleted")
    return 0


def run(args: argparse.Namespace) -> int:
    from inferplane.control_plane.cli.remote import RemoteError, run_remote

    try:
        args.gateway_url = _gateway_url(args)
    except RemoteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    command = {"apply": _apply, "list": _list, "get": _get, "delete": _delete}[args.deployments_command]
    return run_remote(command, args)
