"""`inferplane tenants create|update|list|set-webhook|list-webhooks|remove-webhook`: platform-admin
tenant management straight on the database, or with `--url` through a running gateway's admin API
(cli/remote.py). `update` changes a tenant's flow control (priority band,
concurrent-sequence limit). The webhook commands manage where a tenant's alerts are sent (see
`control_plane.alerts`), with the same URL validation as the admin API."""

from __future__ import annotations

import argparse
from typing import Any

from inferplane.api.priority import BANDS
from inferplane.control_plane.cli.common import (
    add_db_arguments,
    cli_actor,
    limit_cell,
    print_json,
    run_cli_command,
)

NONE = "none"  # what `update` takes to remove a band or a limit


def _limit_or_none(text: str) -> int | None:
    """`update`'s value of a limit: a number, or "none" to remove it."""
    if text.strip().lower() == NONE:
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid limit {text!r}: a positive integer or {NONE!r}") from None


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="tenants_command", required=True)
    create = sub.add_parser("create", help="create a tenant")
    create.add_argument("tenant_id", help="slug: lower-case letters, digits and '-'")
    create.add_argument("--display-name", default=None)
    create.add_argument("--quota", type=int, default=None, help="monthly token quota (default: unlimited)")
    create.add_argument("--key-rpm-max", type=int, default=None,
                        help="ceiling for every key's requests per minute (default: none)")
    create.add_argument("--key-tpm-max", type=int, default=None,
                        help="ceiling for every key's tokens per minute (default: none)")
    create.add_argument("--priority", choices=BANDS, default=None,
                        help="priority band of its requests; a key's own band may only lower it (default: the "
                             "deployment's, else standard)")
    create.add_argument("--max-concurrent-sequences", type=int, default=None,
                        help="sequences all its keys may have in flight at once (default: no limit)")
    create.add_argument("--json", action="store_true")
    add_db_arguments(create)
    update = sub.add_parser("update", help="change a tenant's priority band or concurrent-sequence limit")
    update.add_argument("tenant_id")
    update.add_argument("--priority", choices=(*BANDS, NONE), default=None,
                        help=f"priority band ({NONE!r} removes it)")
    update.add_argument("--max-concurrent-sequences", type=_limit_or_none, default=argparse.SUPPRESS,
                        metavar="N", help=f"sequences in flight at once ({NONE!r} removes the limit)")
    update.add_argument("--json", action="store_true")
    add_db_arguments(update)
    listing = sub.add_parser("list", help="list tenants")
    listing.add_argument("--json", action="store_true")
    add_db_arguments(listing)
    set_hook = sub.add_parser("set-webhook", help="add a URL the tenant's alerts are POSTed to (or give it a new "
                                                  "secret)")
    set_hook.add_argument("tenant_id")
    set_hook.add_argument("url", help="http:// or https:// URL")
    set_hook.add_argument("--secret", default=None,
                          help="HMAC secret the deliveries are signed with, 16 characters or more (visible in ps; "
                               "default: a generated one, printed once)")
    set_hook.add_argument("--json", action="store_true")
    add_db_arguments(set_hook)
    list_hooks = sub.add_parser("list-webhooks", help="list the tenant's alert webhooks")
    list_hooks.add_argument("tenant_id")
    list_hooks.add_argument("--json", action="store_true")
    add_db_arguments(list_hooks)
    remove_hook = sub.add_parser("remove-webhook", help="remove one of the tenant's alert webhooks")
    remove_hook.add_argument("tenant_id")
    remove_hook.add_argument("webhook", help="the webhook's id or its exact URL")
    add_db_arguments(remove_hook)


def _create(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.tenants import create_tenant

    with sessions.begin() as s:
        tenant = create_tenant(
            s,
            args.tenant_id,
            actor=cli_actor(),
            display_name=args.display_name,
            monthly_token_quota=args.quota,
            key_requests_per_minute_max=args.key_rpm_max,
            key_tokens_per_minute_max=args.key_tpm_max,
            priority=args.priority,
            max_concurrent_sequences=args.max_concurrent_sequences,
        )
    _print_created(args, tenant)
    return 0


def _print_created(args: argparse.Namespace, tenant: Any) -> None:
    if args.json:
        print_json(tenant)
    else:
        print(f"created tenant {tenant.id}")


def _create_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.cli.remote import record
    from inferplane.control_plane.tenants import TenantInfo

    body = {"id": args.tenant_id, "display_name": args.display_name, "monthly_token_quota": args.quota,
            "key_requests_per_minute_max": args.key_rpm_max, "key_tokens_per_minute_max": args.key_tpm_max,
            "priority": args.priority, "max_concurrent_sequences": args.max_concurrent_sequences}
    _print_created(args, record(api.call("POST", "/admin/v1/tenants",
                                         json={k: v for k, v in body.items() if v is not None}), TenantInfo))
    return 0


def _update(args: argparse.Namespace, sessions: Any) -> int:
    """Only the options given change (as the admin API's PATCH)."""
    from inferplane.control_plane.tenants import get_tenant, set_flow_control

    with sessions.begin() as s:
        tenant = get_tenant(s, args.tenant_id)
        priority = tenant.priority if args.priority is None else None if args.priority == NONE else args.priority
        limit = getattr(args, "max_concurrent_sequences", tenant.max_concurrent_sequences)
        tenant = set_flow_control(s, args.tenant_id, actor=cli_actor(), priority=priority,
                                  max_concurrent_sequences=limit)
    _print_updated(args, tenant)
    return 0


def _print_updated(args: argparse.Namespace, tenant: Any) -> None:
    if args.json:
        print_json(tenant)
    else:
        print(f"updated tenant {tenant.id}: priority {tenant.priority or 'unset'}, max concurrent sequences "
              f"{tenant.max_concurrent_sequences or 'unlimited'}")


def _list(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.tenants import list_tenants

    with sessions() as s:
        tenants = list_tenants(s)
    _print_tenants(args, tenants)
    return 0


def _list_remote(args: argparse.Namespace, api: Any) -> int:
    from inferplane.control_plane.cli.remote import record
    from inferplane.control_plane.tenants import TenantInfo

    _print_tenants(args, [record(t, TenantInfo) for t in api.call("GET", "/admin/v1/tenants")["data"]])
    return 0


def _print_tenants(args: argparse.Namespace, tenants: list[Any]) -> None:
    if args.json:
        print_json(tenants)
        return
    print(f"{'TENANT':<24} {'QUOTA/MONTH':>14} {'KEY REQ/MIN':>12} {'KEY TOK/MIN':>12} {'SEQS':>6} {'BAND':<10} "
          f"{'CREATED':<20} NAME")
    for t in tenants:
        quota = "unlimited" if t.monthly_token_quota is None else str(t.monthly_token_quota)
        print(f"{t.id:<24} {quota:>14} {limit_cell(t.key_requests_per_minute_max):>12} "
              f"{limit_cell(t.key_tokens_per_minute_max):>12} {limit_cell(t.max_concurrent_sequences):>6} "
              f"{t.priority or '-':<10} {t.created_at:%Y-%m-%d %H:%M:%S}  {t.display_name or ''}")


def _set_webhook(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.alerts.webhooks import set_webhook
    from inferplane.control_plane.outbound import OutboundPolicy

    # The gateway's allow-list, from the same variable: a URL it would refuse is refused here too.
    outbound = OutboundPolicy.from_env()
    with sessions.begin() as s:
        result = set_webhook(s, args.tenant_id, args.url, actor=cli_actor(), secret=args.secret, outbound=outbound)
    _print_set_webhook(args, result.webhook.__dict__, result.created, result.generated_secret)
    return 0


def _print_set_webhook(args: argparse.Namespace, webhook: dict[str, Any], created: bool, secret: str | None) -> None:
    if args.json:
        print_json({**webhook, "created": created, "secret": secret})
        return
    print(f"{'added' if created else 'updated'} webhook {webhook['id']} of tenant {args.tenant_id}: {webhook['url']}")
    if secret is not None:
        print(f"signing secret (shown once): {secret}")


def _set_webhook_remote(args: argparse.Namespace, api: Any) -> int:
    body = {"url": args.url, **({"secret": args.secret} if args.secret is not None else {})}
    status, answer = api.exchange("PUT", f"/admin/v1/tenants/{args.tenant_id}/webhooks", json=body)
    secret = answer.pop("secret", None)
    _print_set_webhook(args, answer, status == 201, secret)  # 201: added; 200: a new secret for an existing URL
    return 0


def _list_webhooks(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.alerts.webhooks import list_webhooks

    with sessions() as s:
        hooks = list_webhooks(s, args.tenant_id)
    _print_webhooks(args, hooks)
    return 0


def _print_webhooks(args: argparse.Namespace, hooks: list[Any]) -> None:
    if args.json:
        print_json(hooks)
        return
    print(f"{'ID':>6}  {'CREATED':<20} URL")
    for h in hooks:
        print(f"{h.id:>6}  {h.created_at:%Y-%m-%d %H:%M:%S}  {h.url}")


def _webhooks_remote(api: Any, tenant_id: str) -> list[Any]:
    from inferplane.control_plane.alerts.webhooks import WebhookInfo
    from inferplane.control_plane.cli.remote import record

    return [record(h, WebhookInfo) for h in api.call("GET", f"/admin/v1/tenants/{tenant_id}/webhooks")["data"]]


def _list_webhooks_remote(args: argparse.Namespace, api: Any) -> int:
    _print_webhooks(args, _webhooks_remote(api, args.tenant_id))
    return 0


def _remove_webhook(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.alerts.webhooks import remove_webhook

    with sessions.begin() as s:
        removed = remove_webhook(s, args.tenant_id, args.webhook, actor=cli_actor())
    print(f"removed webhook {removed.id} of tenant {args.tenant_id}: {removed.url}")
    return 0


def _remove_webhook_remote(args: argparse.Namespace, api: Any) -> int:
    """By id, or by its exact URL (looked up in the tenant's list, as the database form does)."""
    from inferplane.control_plane.cli.remote import RemoteError

    webhook = args.webhook
    if not webhook.isdigit():
        found = [h.id for h in _webhooks_remote(api, args.tenant_id) if h.url == webhook]
        if not found:
            raise RemoteError(404, f"tenant {args.tenant_id!r} has no webhook {webhook!r}")
        webhook = str(found[0])
    removed = api.call("DELETE", f"/admin/v1/tenants/{args.tenant_id}/webhooks/{webhook}")
    print(f"removed webhook {removed['id']} of tenant {args.tenant_id}: {removed['url']}")
    return 0


def _update_remote(args: argparse.Namespace, api: Any) -> int:
    """Only the options given are sent (PATCH); "none" sends null, which removes the band or limit."""
    from inferplane.control_plane.cli.remote import record
    from inferplane.control_plane.tenants import TenantInfo

    body: dict[str, Any] = {}
    if args.priority is not None:
        body["priority"] = None if args.priority == NONE else args.priority
    if hasattr(args, "max_concurrent_sequences"):
        body["max_concurrent_sequences"] = args.max_concurrent_sequences
    _print_updated(args, record(api.call("PATCH", f"/admin/v1/tenants/{args.tenant_id}", json=body), TenantInfo))
    return 0


def run(args: argparse.Namespace) -> int:
    command = {"create": _create, "update": _update, "list": _list, "set-webhook": _set_webhook,
               "list-webhooks": _list_webhooks, "remove-webhook": _remove_webhook}[args.tenants_command]
    remote = {"create": _create_remote, "update": _update_remote, "list": _list_remote,
              "set-webhook": _set_webhook_remote, "list-webhooks": _list_webhooks_remote,
              "remove-webhook": _remove_webhook_remote}[args.tenants_command]
    return run_cli_command(command, args, remote)
