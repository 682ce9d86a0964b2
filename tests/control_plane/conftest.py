"""Fixtures for the control plane's data layer: a migrated database on SQLite *and* PostgreSQL.

PostgreSQL is real (127.0.0.1:5432, trust auth, database `test`, or `$INFERPLANE_TEST_PG_URL`), started
by `scripts/test_services.sh` (which `.ci/run` runs). Without it the PostgreSQL cases skip with the
reason, except under CI (`CI` set), where they fail: CI must never pass by skipping them. Other
test runs may share that database, so every test gets its own uniquely named schema, selected
through the URL's `search_path`, and drops it afterwards. Nothing here is autouse: the routing tests
in this folder are unaffected.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from tests.services import missing_service

PG_BASE_URL = os.environ.get("INFERPLANE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
_pg_checked: list[str | None] = []


def _pg_unavailable() -> str | None:
    """None if PostgreSQL answers, else why not (checked once per session)."""
    if not _pg_checked:
        try:
            engine = sa.create_engine(PG_BASE_URL, connect_args={"connect_timeout": 3})
            with engine.connect() as c:
                c.execute(sa.text("SELECT 1"))
            engine.dispose()
            _pg_checked.append(None)
        except Exception as e:  # noqa: BLE001 - any failure means "not available"
            _pg_checked.append(f"PostgreSQL at {PG_BASE_URL} unavailable: {e}")
    return _pg_checked[0]


def pg_schema_url(schema: str) -> str:
    sep = "&" if "?" in PG_BASE_URL else "?"
    return f"{PG_BASE_URL}{sep}options=-csearch_path%3D{schema}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A URL whose connections live in a fresh, empty PostgreSQL schema (dropped afterwards)."""
    reason = _pg_unavailable()
    if reason:
        missing_service(reason)
    schema = f"ip_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_BASE_URL)
    with admin.begin() as c:
        c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield pg_schema_url(schema)
    finally:
        with admin.begin() as c:
            c.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a SQLite file, or a private PostgreSQL schema."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'inferplane.db'}"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    from inferplane.control_plane.db import init_db

    eng = init_db(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def sessions(engine: sa.Engine) -> sessionmaker[Session]:
    from inferplane.control_plane.db import session_factory

    return session_factory(engine)


@pytest.fixture
def two_tenants(sessions: sessionmaker[Session]) -> tuple[str, str]:
    from inferplane.control_plane.tenants import create_tenant

    with sessions.begin() as s:
        create_tenant(s, "acme", actor="test")
        create_tenant(s, "globex", actor="test")
    return "acme", "globex"


def write_gguf(path: Path, *, arch: str = "llama", context_length: int = 2048, seed: int = 0) -> Path:
    """A tiny but real GGUF file (one tensor), written with gguf's own writer."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_context_length(context_length)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.full((4, 8), float(seed), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def make_gguf():
    """`write_gguf` as a fixture, so tests need not import this conftest by module name."""
    return write_gguf


@pytest.fixture
def gguf_file(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny-llama.gguf")


REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_url() -> str:
    """The tests' Redis (scripts/test_services.sh starts it; CI fails without it)."""
    import redis

    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        missing_service(f"Redis is not reachable at {REDIS_URL} ({exc})")
    return REDIS_URL


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    """The tiny model's tokenizer: what a gateway in front of a fake worker tokenizes with."""
    from inferplane.bench.tiny_model import make_tiny_model
    from inferplane.worker.model.tokenizer import load_hf_tokenizer

    return load_hf_tokenizer(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC honours http_proxy for localhost targets in some environments."""
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "grpc_proxy"):
        monkeypatch.delenv(var, raising=False)
