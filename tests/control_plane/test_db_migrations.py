"""Schema migrations on SQLite and PostgreSQL, and where the default database lives."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from inferplane.control_plane import db, db_url
from inferplane.control_plane.orm import Base

TABLES = {"tenants", "api_keys", "models", "usage", "audit_log", "alerts", "tenant_webhooks", "alert_deliveries",
          "responses"}


def _tables(engine: sa.Engine) -> set[str]:
    return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}


def test_upgrade_downgrade_upgrade_round_trip(db_url: str) -> None:
    engine = db.make_engine(db_url)
    try:
        assert db.current_revision(engine) is None
        db.upgrade(engine)
        assert db.current_revision(engine) == db.head_revision()
        assert _tables(engine) == TABLES
        db.downgrade(engine, "base")
        assert db.current_revision(engine) is None
        assert _tables(engine) == set()
        db.upgrade(engine, "head")
        assert _tables(engine) == TABLES
        # upgrading an up-to-date database is a no-op, so the gateway may run it at every start
        db.upgrade(engine)
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()


def test_orm_matches_migrations(engine: sa.Engine) -> None:
    """The ORM classes and the migration scripts describe the same schema (else autogenerate would
    propose changes)."""
    with engine.connect() as connection:
        diff = compare_metadata(
            MigrationContext.configure(connection, opts={"compare_type": True}), Base.metadata
        )
    assert diff == []


def test_postgres_schemas_are_isolated(pg_url: str) -> None:
    """The per-test schema trick really isolates: tables land in the schema named in the URL."""
    engine = db.init_db(pg_url)
    try:
        schema = pg_url.rsplit("%3D", 1)[1]
        with engine.connect() as c:
            found = set(
                c.execute(
                    sa.text("SELECT table_name FROM information_schema.tables WHERE table_schema = :s"),
                    {"s": schema},
                ).scalars()
            )
        assert TABLES | {"alembic_version"} <= found
    finally:
        engine.dispose()


def test_default_url_is_sqlite_under_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(db_url.ENV_DB_URL, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("INFERPLANE_HOME", raising=False)
    assert db_url.default_db_url() == f"sqlite:///{tmp_path / '.inferplane' / 'inferplane.db'}"
    assert db_url.default_db_url(tmp_path / "x") == f"sqlite:///{tmp_path / 'x' / 'inferplane.db'}"
    monkeypatch.setenv(db_url.ENV_DB_URL, "sqlite:////elsewhere.db")
    assert db_url.default_db_url() == "sqlite:////elsewhere.db"
    # an explicit home beats the environment: `--home` is the more specific instruction
    assert db_url.default_db_url(tmp_path / "y") == f"sqlite:///{tmp_path / 'y' / 'inferplane.db'}"


def test_init_db_creates_the_state_folder(tmp_path: Path) -> None:
    url = db_url.default_db_url(tmp_path / "deep" / "state")
    engine = db.init_db(url)
    try:
        assert (tmp_path / "deep" / "state" / "inferplane.db").is_file()
        assert _tables(engine) == TABLES
        with engine.connect() as c:  # cascades rely on it
            assert c.execute(sa.text("PRAGMA foreign_keys")).scalar() == 1
    finally:
        engine.dispose()


def test_concurrent_upgrades_on_postgres(pg_url: str) -> None:
    """Replicas starting together (separate processes, as in production) all migrate; none trips
    over another's CREATE TABLE."""
    import subprocess
    import sys

    code = "import sys; from inferplane.control_plane import db; db.init_db(sys.argv[1]).dispose()"
    procs = [subprocess.Popen([sys.executable, "-c", code, pg_url], stderr=subprocess.PIPE) for _ in range(3)]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    engine = db.make_engine(pg_url)
    try:
        assert db.current_revision(engine) == db.head_revision()
    finally:
        engine.dispose()
