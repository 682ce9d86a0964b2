"""`inferplane monitoring`: the platform's rules and dashboards, and one deployment's rules.

`render --write DIR...` updates the committed files (`make monitoring`: deploy/monitoring and the
chart's monitoring/). `rules MANIFEST` prints the rule file of an InferenceDeployment, for a
Prometheus without the Prometheus Operator (in a cluster the operator creates a PrometheusRule);
`--local` scopes it to `inferplane up`, whose scrape config labels each worker with
namespace="local" and service=<deployment name>. `scrape-config` prints that Prometheus config for
what `inferplane up` runs now (from its run.json), rule files included:

    prometheus --config.file=<(inferplane monitoring scrape-config --rules my.yaml)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

LOCAL_NAMESPACE = "local"


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="monitoring_command", required=True)
    render = sub.add_parser("render", help="print the platform rules, or write every generated file")
    render.add_argument("--write", nargs="+", type=Path, metavar="DIR",
                        help="write platform rules and dashboards into these directories")
    rules = sub.add_parser("rules", help="print the alert and recording rules of an InferenceDeployment manifest")
    rules.add_argument("manifest", type=Path)
    rules.add_argument("--namespace", default=None, help="default: the manifest's, else 'default'")
    rules.add_argument("--local", action="store_true", help="scope to `inferplane up` (namespace 'local')")
    scrape = sub.add_parser("scrape-config", help="a Prometheus config scraping what `inferplane up` runs")
    scrape.add_argument("--home", type=Path, default=None, help="inferplane up's --home (default: ~/.inferplane)")
    scrape.add_argument("--rule-file", action="append", default=[], type=Path, metavar="PATH",
                        help="rule files for Prometheus to load (repeatable), e.g. from `rules --local`")
    scrape.add_argument("--operator", default=None, metavar="HOST:PORT",
                        help="also scrape an operator's metrics there")
    scrape.add_argument("--interval", default="15s", help="scrape and evaluation interval (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from inferplane.monitoring import render

    if args.monitoring_command == "render":
        if not args.write:
            sys.stdout.write(render.platform_rules_yaml())
            return 0
        for path in render.write(args.write):
            print(f"wrote {path}")
        return 0
    if args.monitoring_command == "scrape-config":
        import yaml

        from inferplane.control_plane.db_url import default_home
        from inferplane.local import runstate

        state = runstate.read(args.home or default_home())
        if state is None:
            print("error: no run.json: is `inferplane up` running with this --home?", file=sys.stderr)
            return 1
        config = scrape_config(state, rule_files=args.rule_file, operator=args.operator, interval=args.interval)
        sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
        return 0
    try:
        text = deployment_rules(args.manifest, namespace=args.namespace, local=args.local)
    except (OSError, ValueError) as exc:  # a SpecError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


def _netloc(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).netloc


def scrape_config(state: dict, *, rule_files: list[Path] = (), operator: str | None = None,  # type: ignore[assignment]
                  interval: str = "15s") -> dict:
    """A Prometheus config for one `inferplane up` (its run.json `state`): the gateway's metrics
    listener (not its API port; none when `up --metrics-port 0` turned it off), and each worker
    labelled as a ServiceMonitor would label it in a cluster, so `rules --local` matches."""
    workers = [{"targets": [_netloc(r["metrics"])],
                "labels": {"namespace": LOCAL_NAMESPACE, "service": d["name"], "pod": f"{d['name']}-{r['index']}"}}
               for d in state["deployments"] for r in d["replicas"]]
    gateway = state["gateway"].get("metrics")
    jobs = [{"job_name": "inferplane-gateway", "static_configs": [{"targets": [_netloc(gateway)]}]}] if gateway else []
    jobs.append({"job_name": "inferplane-workers", "static_configs": workers})
    if operator:
        jobs.append({"job_name": "inferplane-operator", "static_configs": [{"targets": [operator]}]})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in rule_files], "scrape_configs": jobs}


def deployment_rules(manifest: Path, *, namespace: str | None = None, local: bool = False) -> str:
    """ONE rule file for every InferenceDeployment in `manifest`: Prometheus and promtool read only
    the first YAML document of a rule file, so the deployments' groups go into one `groups:` list
    (their names carry namespace and name, so they are unique). ValueError naming a deployment that
    appears twice (two groups of one name: promtool refuses the file) or a document that is not one."""
    import yaml

    from inferplane.api.deployment import InferenceDeploymentSpec
    from inferplane.monitoring import render
    from inferplane.monitoring.deployment_rules import DeploymentScope

    scoped = []
    seen: set[tuple[str, str]] = set()
    for index, body in enumerate(d for d in yaml.safe_load_all(manifest.read_text()) if d):
        name = (body.get("metadata") or {}).get("name") if isinstance(body, dict) else None
        if not name:
            raise ValueError(f"{manifest}: document {index + 1} has no metadata.name")
        spec = InferenceDeploymentSpec.from_dict(body.get("spec") or {})
        if local:
            scope = DeploymentScope(LOCAL_NAMESPACE, name, name, spec.tenant)
        else:
            scope = DeploymentScope.in_cluster(namespace or body["metadata"].get("namespace") or "default", name, spec)
        if (scope.namespace, scope.name) in seen:
            raise ValueError(f"{manifest}: deployment {scope.namespace}/{scope.name} appears twice")
        seen.add((scope.namespace, scope.name))
        scoped.append((spec, scope))
    return render.deployments_rules_yaml(scoped)
