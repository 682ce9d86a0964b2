"""Issue 53, item 9: a damaged SQLite database stops the start with one line naming the file.

64 damaged bytes in the write-ahead log started the server without a word and lost a tenant
(SQLite stops reading the log at the first bad frame and forgets every commit after it); other
damage exited with a 130-line traceback naming no file. The states here are made as a `kill -9`
leaves them: a real process writes tenants and is killed, its log never checkpointed.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from inferplane.control_plane.db import DatabaseUnusable, init_db

TENANTS = [f"t{i}" for i in range(12)]
_KILLED = """
import os, signal, sys
from inferplane.control_plane.db import init_db, session_factory
from inferplane.control_plane.tenants import create_tenant
sessions = session_factory(init_db(sys.argv[1]))
for tenant in sys.argv[2:]:
    with sessions.begin() as session:
        create_tenant(session, tenant, actor="test")
os.kill(os.getpid(), signal.SIGKILL)  # as kill -9: the log is left as it is
"""


def _killed_home(home: Path) -> Path:
    """A home whose database a killed process left: migrations and 12 tenants, one commit each."""
    db = home / "inferplane.db"
    result = subprocess.run([sys.executable, "-c", _KILLED, f"sqlite:///{db}", *TENANTS], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == -9, result.stderr
    assert Path(f"{db}-wal").stat().st_size > 32, "the kill left no write-ahead log"
    return db


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _killed_home(tmp_path_factory.mktemp("killed"))


def _copy(db: Path, to: Path) -> Path:
    to.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal", "-shm"):
        source = Path(f"{db}{suffix}")
        if source.exists():
            Path(f"{to / db.name}{suffix}").write_bytes(source.read_bytes())
    return to / db.name


def _frames(db: Path) -> tuple[int, int]:
    """(page size, number of frames) of the database's log."""
    page = int.from_bytes(Path(f"{db}-wal").read_bytes()[8:12], "big")
    return page, (Path(f"{db}-wal").stat().st_size - 32) // (24 + page)


def _damage(path: Path, at: int, size: int = 64) -> None:
    data = bytearray(path.read_bytes())
    data[at:at + size] = bytes((b ^ 0x5A) or 1 for b in data[at:at + size])
    path.write_bytes(bytes(data))


def _tenants_sqlite_sees(db: Path) -> list[str]:
    connection = sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return [row[0] for row in connection.execute("SELECT id FROM tenants ORDER BY id")]
    except sqlite3.OperationalError:  # no tenants table: the whole schema was in the dropped log
        return []
    finally:
        connection.close()


def _wal_at(db: Path, where: str) -> int:
    page, frames = _frames(db)
    middle = 32 + (frames // 2) * (24 + page)
    return {"a middle frame's page": middle + 24 + page // 2, "a middle frame's header": middle + 8,
            "the log's header": 0, "the first frame": 32 + 24}[where]


@pytest.mark.parametrize("where", ["a middle frame's page", "a middle frame's header", "the log's header",
                                   "the first frame"])
def test_a_damaged_write_ahead_log_is_refused_naming_the_file(killed: Path, tmp_path: Path, where: str) -> None:
    db = _copy(killed, tmp_path / "copy")
    _damage(Path(f"{db}-wal"), _wal_at(db, where))
    lost = set(TENANTS) - set(_tenants_sqlite_sees(_copy(db, tmp_path / "probe")))
    assert lost, "the damage must cost SQLite committed tenants, else this test proves nothing"
    with pytest.raises(DatabaseUnusable) as refused:
        init_db(f"sqlite:///{db}")
    message = str(refused.value)
    assert str(db) in message and "inferplane.db-wal" in message and "\n" not in message, message
    assert "restore" in message and "wal_checkpoint(TRUNCATE)" in message
    assert _tenants_sqlite_sees(_copy(db, tmp_path / "after")) == sorted(set(TENANTS) - lost), \
        "the check must not change the files it refuses"


def test_an_intact_log_after_a_kill_starts_with_every_tenant(killed: Path, tmp_path: Path) -> None:
    db = _copy(killed, tmp_path / "copy")
    engine = init_db(f"sqlite:///{db}")
    engine.dispose()
    assert set(TENANTS) <= set(_tenants_sqlite_sees(db))


def test_a_torn_last_write_is_a_crash_not_damage(killed: Path, tmp_path: Path) -> None:
    """The last frame cut short (a crash while writing it) or its page damaged: SQLite drops that
    last, never acknowledged transaction, and the start goes on."""
    for name, cut in (("short", lambda wal: wal.write_bytes(wal.read_bytes()[:-100])),
                      ("tail", lambda wal: _damage(wal, wal.stat().st_size - 200))):
        db = _copy(killed, tmp_path / name)
        cut(Path(f"{db}-wal"))
        init_db(f"sqlite:///{db}").dispose()


def test_a_damaged_database_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    db = tmp_path / "state" / "inferplane.db"
    init_db(f"sqlite:///{db}").dispose()  # a clean close: the log is copied in and removed
    assert not Path(f"{db}-wal").exists()
    header = _copy(db, tmp_path / "header")
    _damage(header, 0, 64)
    with pytest.raises(DatabaseUnusable, match=rf"database {header} cannot be read as SQLite .*restore"):
        init_db(f"sqlite:///{header}")
    page = _copy(db, tmp_path / "page")  # a b-tree page's header: what quick_check reads
    page_size = int.from_bytes(db.read_bytes()[16:18], "big")
    _damage(page, 2 * page_size, 16)
    with pytest.raises(DatabaseUnusable, match=rf"database {page} .*(quick_check|cannot be read)"):
        init_db(f"sqlite:///{page}")


def test_a_new_database_and_an_empty_log_start(tmp_path: Path) -> None:
    db = tmp_path / "new" / "inferplane.db"
    init_db(f"sqlite:///{db}").dispose()
    Path(f"{db}-wal").write_bytes(b"")
    init_db(f"sqlite:///{db}").dispose()


def test_the_gateway_refuses_too(killed: Path, tmp_path: Path) -> None:
    from inferplane.control_plane.gateway.server import Gateway, GatewaySettings

    db = _copy(killed, tmp_path / "copy")
    _damage(Path(f"{db}-wal"), _wal_at(db, "a middle frame's page"))
    with pytest.raises(DatabaseUnusable, match=str(db)):
        Gateway(GatewaySettings(db_url=f"sqlite:///{db}"))


@pytest.mark.parametrize(("command", "code"), [
    (["tenants", "list"], 1),
    (["up", "--port", "0", "--grpc-port", "0", "--ready-timeout", "1"], 2),  # fails fast were it to start
])
def test_the_commands_say_it_in_one_line(killed: Path, tmp_path: Path, command: list[str], code: int) -> None:
    db = _copy(killed, tmp_path / "home")
    _damage(Path(f"{db}-wal"), _wal_at(db, "a middle frame's page"))
    env = {k: v for k, v in os.environ.items() if k not in ("INFERPLANE_DB_URL", "INFERPLANE_HOME")}
    result = subprocess.run([sys.executable, "-m", "inferplane.cli", *command, "--home", str(db.parent)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and str(db) in lines[0], result.stderr
