"""Engines, sessions and schema migrations for the control plane database.

SQLite (a file under the state folder) is the default so one machine needs no server; PostgreSQL is
the production choice. Both are reached through one URL. A PostgreSQL schema other than `public` can
be selected in the URL itself (`?options=-csearch_path%3Dmyschema`), which is how tests and several
installations share one database without seeing each other.

A SQLite file is checked before it is used (`init_db`, sqlite_check.py): damage in the file or in
its write-ahead log stops the start with one line naming the file and what to do
(`DatabaseUnusable`), instead of SQLite silently dropping transactions after a damaged log frame
or a migration failing with a long traceback.

Transactions: every query function in this package takes a `Session` and never commits; the caller
owns the transaction, typically `with sessions.begin() as s: ...`. Sessions are made with
`expire_on_commit=False`, and query functions return frozen dataclasses, so results stay usable after
the session closes (the gateway caches them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from inferplane.control_plane.db_url import default_db_url
from inferplane.control_plane.sqlite_check import DatabaseUnusable, check_sqlite_file

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # Foreign keys are off by default in SQLite (ON DELETE CASCADE would silently do nothing); WAL
    # lets the gateway read while the usage recorder writes; busy_timeout waits instead of failing.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def sqlite_file(url: str) -> Path | None:
    """The file a SQLite URL names (None: another database, or SQLite in memory)."""
    parsed = make_url(url)
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def make_engine(url: str, **kwargs: Any) -> Engine:
    """An engine for `url`; for a SQLite file its folder is created and safe pragmas set."""
    if make_url(url).get_backend_name() == "sqlite":
        path = sqlite_file(url)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        kwargs.setdefault("connect_args", {}).setdefault("check_same_thread", False)
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def _alembic_config(connection: Any) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # env.py runs on this connection instead of opening its own from a URL.
    config.attributes["connection"] = connection
    return config


# Any constant works; it only has to be the same for every process migrating this database.
_MIGRATION_LOCK_ID = 0x1F3E_0001


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrates to `revision`. Safe to run from several gateway replicas starting at once: on
    PostgreSQL they queue on an advisory lock, and whoever comes second finds nothing to do."""
    from alembic import command
    from sqlalchemy import text

    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        command.upgrade(_alembic_config(connection), revision)


def downgrade(engine: Engine, revision: str = "base") -> None:
    from alembic import command

    with engine.begin() as connection:
        command.downgrade(_alembic_config(connection), revision)


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_alembic_config(None)).get_current_head()
    assert head is not None
    return head


def init_db(url: str | None = None, **engine_kwargs: Any) -> Engine:
    """Migrate the database at `url` (default: `default_db_url()`) to head and return its engine.
    A SQLite file is checked first; `DatabaseUnusable` (one line naming the file) if it is damaged
    or SQLite cannot read it."""
    from sqlalchemy.exc import DatabaseError

    url = url or default_db_url()
    path = sqlite_file(url)
    if path is not None:
        check_sqlite_file(path)
    engine = make_engine(url, **engine_kwargs)
    try:
        upgrade(engine)
    except DatabaseError as exc:
        if path is None:
            raise
        engine.dispose()
        reason = " ".join(str(exc.orig or exc).split())
        raise DatabaseUnusable(f"database {path} cannot be used ({reason}): restore it from a backup, or point "
                               "--db-url or --home at another database") from None
    return engine
