"""`inferplane operator`: run the kopf operator that reconciles InferenceDeployments.

configure() stays import-light (argparse only): the top-level CLI calls it to build --help.
"""

from __future__ import annotations

import argparse
import os

from inferplane.operator.manifests import DEFAULT_IMAGE


def configure(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; globs allowed); default: $WATCH_NAMESPACE")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch the whole cluster")
    parser.add_argument("--peering", default=os.environ.get("INFERPLANE_PEERING", "inferplane"),
                        help="kopf peering name: among replicas sharing it, only one acts (default: %(default)s)")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering and no peering object needed (a single replica; development)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint for the kubelet, or '' for none (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int,
                        default=int(os.environ.get("INFERPLANE_OPERATOR_METRICS_PORT", 9100)),
                        help="Prometheus /metrics port (build info, reconciles by result); 0 disables "
                             "(default: %(default)s)")
    parser.add_argument("--worker-image", default=os.environ.get("INFERPLANE_WORKER_IMAGE", DEFAULT_IMAGE),
                        help="image for worker pods when spec.image is unset (default: %(default)s)")
    models = parser.add_argument_group("registry models (spec.model.name resolved, fetched and verified per node)")
    models.add_argument("--registry-url", default=os.environ.get("INFERPLANE_REGISTRY_URL"),
                        help="the control plane's base URL; unset: a model name is an alias the image knows")
    models.add_argument("--registry-token-file", default=os.environ.get("INFERPLANE_REGISTRY_TOKEN_FILE"),
                        help="a platform admin credential for the registry (re-read on every call)")
    cache = models.add_mutually_exclusive_group()
    cache.add_argument("--model-cache-host-path", default=None,
                       help="share fetched weights between pods of a node in this hostPath (default: per pod)")
    cache.add_argument("--model-cache-pvc", default=None, help="or in this PersistentVolumeClaim")
    kv = parser.add_argument_group("KV disk tiers (engine.kvOffloadDisk)").add_mutually_exclusive_group()
    kv.add_argument("--kv-tier-host-path", default=None,
                    help="keep each deployment's KV disk tier in a folder of this node directory (owned by uid "
                         "10001), so the next pod on the node finds it (default: an emptyDir per pod)")
    kv.add_argument("--kv-tier-pvc", default=None, help="or in this PersistentVolumeClaim")
    models.add_argument("--model-storage-secret", default=None,
                        help="a Secret with AWS_* variables for s3:// weights, given to the fetch-model step")
    models.add_argument("--s3-endpoint-url", default=None, help="an S3-compatible endpoint (MinIO, Ceph...)")
    parser.add_argument("--no-monitoring", action="store_true",
                        help="do not create ServiceMonitor/PrometheusRule (no Prometheus operator CRDs)")
    parser.add_argument("--no-events", action="store_true", help="do not post Kubernetes Events")
    hook = parser.add_argument_group("admission webhook (off unless --webhook-port is given)")
    hook.add_argument("--webhook-port", type=int, default=None, help="serve the validating webhook on this port")
    dial = hook.add_mutually_exclusive_group()
    dial.add_argument("--webhook-service", default=None, metavar="NAMESPACE/NAME",
                      help="the Service the API server dials (port: --webhook-port); the certificate must name "
                           "NAME.NAMESPACE.svc")
    dial.add_argument("--webhook-host", default=None,
                      help="or a host the API server dials by URL, e.g. 127.0.0.1 outside a cluster")
    hook.add_argument("--webhook-cert", default=None, help="TLS certificate (PEM) for the webhook")
    hook.add_argument("--webhook-key", default=None, help="TLS private key (PEM) for the webhook")
    hook.add_argument("--webhook-ca", default=None, help="CA bundle that signed the certificate (for caBundle)")
    hook.add_argument("--webhook-configuration", default="inferplane.io",
                      help="ValidatingWebhookConfiguration kopf keeps up to date, or '' to leave it to helm")
    parser.add_argument("--verbose", "-v", action="store_true")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import kopf

    import inferplane.operator.handlers  # noqa: F401  (registers the handlers)
    from inferplane.operator.config import OperatorConfig, WebhookConfig
    from inferplane.operator.kv_tier import KVTierVolume
    from inferplane.operator.model_pod import ModelCache
    from inferplane.operator.webhook import parse_service

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    webhook = None
    if args.webhook_port is not None:
        service = parse_service(args.webhook_service) if args.webhook_service else None
        webhook = WebhookConfig(port=args.webhook_port, host=args.webhook_host, service=service,
                                certfile=args.webhook_cert, pkeyfile=args.webhook_key, cafile=args.webhook_ca,
                                managed=args.webhook_configuration or None)
    namespaces = args.namespace or [ns for ns in os.environ.get("WATCH_NAMESPACE", "").split(",") if ns]
    if not namespaces and not args.all_namespaces:
        namespaces = ["default"]
    namespaces = [] if args.all_namespaces else namespaces
    # kopf makes peering mandatory whenever a peering name is passed, even with standalone=True,
    # and then pauses every watch for want of the peering object: standalone passes no name.
    peering = None if args.standalone else args.peering
    registry = None
    if args.registry_url:
        from pathlib import Path

        from inferplane.operator.registry_client import RegistryClient

        registry = RegistryClient(args.registry_url,
                                  token_file=Path(args.registry_token_file) if args.registry_token_file else None)
    cache = ModelCache(host_path=args.model_cache_host_path, claim=args.model_cache_pvc,
                       storage_secret=args.model_storage_secret, s3_endpoint_url=args.s3_endpoint_url)
    config = OperatorConfig(worker_image=args.worker_image, monitoring=not args.no_monitoring, webhook=webhook,
                            post_events=not args.no_events, peering_name=peering,
                            namespaces=tuple(namespaces), clusterwide=args.all_namespaces,
                            registry=registry, model_cache=cache,
                            kv_tier=KVTierVolume(host_path=args.kv_tier_host_path, claim=args.kv_tier_pvc))
    if args.metrics_port:
        from inferplane.operator.metrics import METRICS

        METRICS.serve(args.metrics_port)
    asyncio.run(kopf.operator(
        clusterwide=args.all_namespaces, namespaces=namespaces,
        standalone=args.standalone, peering_name=peering, liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(config=config)))
    return 0
