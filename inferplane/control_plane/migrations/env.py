"""Alembic environment: runs on the connection `inferplane.control_plane.db` hands it.

There is no alembic.ini; `db.upgrade()`/`db.downgrade()` build the config in code so the migrations
ship inside the package and run the same from the CLI, the gateway and tests.
"""

from __future__ import annotations

from alembic import context

from inferplane.control_plane.orm import Base

target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError("run migrations through inferplane.control_plane.db.upgrade(engine)")
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table, so later migrations work there.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise RuntimeError("offline (SQL script) migrations are not supported")
run_migrations_online()
