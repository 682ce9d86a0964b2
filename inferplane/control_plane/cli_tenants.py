"""`inferplane tenants create|list`: platform-admin tenant management straight on the database."""

from __future__ import annotations

import argparse
from typing import Any

from inferplane.control_plane.cli_common import add_db_arguments, cli_actor, print_json, run_cli_command


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
    create.add_argument("--json", action="store_true")
    add_db_arguments(create)
    listing = sub.add_parser("list", help="list tenants")
    listing.add_argument("--json", action="store_true")
    add_db_arguments(listing)


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
        )
    if args.json:
        print_json(tenant)
    else:
        print(f"created tenant {tenant.id}")
    return 0


def _list(args: argparse.Namespace, sessions: Any) -> int:
    from inferplane.control_plane.tenants import list_tenants

    with sessions() as s:
        tenants = list_tenants(s)
    if args.json:
        print_json(tenants)
        return 0
    print(f"{'TENANT':<24} {'QUOTA/MONTH':>14}  {'CREATED':<20} NAME")
    for t in tenants:
        quota = "unlimited" if t.monthly_token_quota is None else str(t.monthly_token_quota)
        print(f"{t.id:<24} {quota:>14}  {t.created_at:%Y-%m-%d %H:%M:%S}  {t.display_name or ''}")
    return 0


def run(args: argparse.Namespace) -> int:
    command = {"create": _create, "list": _list}[args.tenants_command]
    return run_cli_command(command, args)
