"""Helpers shared by `cli_models`, `cli_tenants` and `cli_keys`.

Kept apart from `db` and free of heavy imports at module level: every subcommand's `configure` runs
to build `inferplane --help`, so importing SQLAlchemy here would slow down `inferplane worker` too.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from inferplane.control_plane.db_url import ENV_DB_URL


def add_db_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db-url",
        default=None,
        help=f"database URL (default: ${ENV_DB_URL}, else sqlite:///<home>/inferplane.db)",
    )
    parser.add_argument("--home", default=None, help="state folder (default: ~/.inferplane)")
    from inferplane.control_plane.cli.remote import add_remote_arguments

    add_remote_arguments(parser)


def sessions_from_args(args: argparse.Namespace) -> Any:
    """Migrates the database the CLI points at and returns its session factory."""
    from inferplane.control_plane.db import init_db, session_factory
    from inferplane.control_plane.db_url import default_db_url

    url = args.db_url or default_db_url(args.home)
    return session_factory(init_db(url))


def cli_actor() -> str:
    """Who the audit log names for a CLI action: the OS user (the CLI has no other identity)."""
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # no passwd entry in some containers
        return f"cli:{os.getuid()}"


def run_cli_command(command: Any, args: argparse.Namespace, remote: Any = None) -> int:
    """Runs `command(args, sessions)` and turns control plane errors into a message and exit code 1,
    so a typo in a model name prints one line instead of a traceback. With `--url`, runs
    `remote(args, api)` against that gateway's admin API instead (cli/remote.py); a command without
    a remote form says so rather than quietly using the database."""
    from inferplane.control_plane.db import DatabaseUnusable

    if getattr(args, "gateway_url", None):
        from inferplane.control_plane.cli.remote import run_remote

        if remote is None:
            print("error: this command works on the database only; leave out --url (and $INFERPLANE_URL)",
                  file=sys.stderr)
            return 2
        return run_remote(remote, args)
    with one_line_errors(DatabaseUnusable):  # a damaged SQLite file: one line naming it, not a traceback
        sessions = sessions_from_args(args)
        try:
            return int(command(args, sessions) or 0)
        finally:
            sessions.kw["bind"].dispose()
    return 1


@contextlib.contextmanager
def one_line_errors(*also: type[Exception]) -> Iterator[None]:
    """A control plane error (and any of `also`) printed as one line, `error: ...`, not a traceback;
    the caller exits 1 after the block when it was left that way."""
    from inferplane.control_plane.errors import ControlPlaneError

    try:
        yield
    except (ControlPlaneError, *also) as exc:
        print(f"error: {exc}", file=sys.stderr)


def limit_cell(value: int | None) -> str:
    """A limit in a table: its value, or "-" where none is set."""
    return "-" if value is None else str(value)


def print_json(value: Any) -> None:
    """Prints dataclasses (and lists of them) as JSON, datetimes as ISO 8601."""
    import dataclasses
    import json
    from datetime import datetime

    def default(o: Any) -> Any:
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return dataclasses.asdict(o)
        if isinstance(o, datetime):
            return o.isoformat()
        raise TypeError(f"cannot serialize {type(o).__name__}")

    print(json.dumps(value, default=default, indent=2))
