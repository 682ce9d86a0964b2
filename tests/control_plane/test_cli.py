"""`inferplane tenants|keys|models ...` end to end through the real dispatcher and database."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inferplane.cli import main
from inferplane.control_plane.auth import KeyCache
from inferplane.control_plane.db import init_db, session_factory
from inferplane.control_plane.errors import Unauthenticated


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_tenants_keys_lifecycle(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    db = ("--db-url", db_url)
    assert _run(capsys, "tenants", "create", "acme", "--quota", "1000", *db)[0] == 0
    code, _, err = _run(capsys, "tenants", "create", "acme", *db)
    assert code == 1 and "already exists" in err
    code, _, err = _run(capsys, "tenants", "create", "Bad_Name", *db)
    assert code == 1 and "invalid tenant id" in err
    code, out, _ = _run(capsys, "tenants", "list", "--json", *db)
    assert [(t["id"], t["monthly_token_quota"]) for t in json.loads(out)] == [("acme", 1000)]
    assert _run(capsys, "tenants", "create", "capped", "--key-tpm-max", "500", *db)[0] == 0
    code, _, err = _run(capsys, "keys", "create", "--tenant", "capped", "--tpm", "501", *db)
    assert code == 1 and "at most 500" in err

    code, out, _ = _run(
        capsys, "keys", "create", "--tenant", "acme", "--scopes", "infer", "--expires-in", "30d", *db
    )
    key = out.splitlines()[0]
    assert code == 0 and key.startswith("ip_")
    code, out, _ = _run(capsys, "keys", "list", "--tenant", "acme", "--json", *db)
    listed = json.loads(out)
    assert [k["id"] for k in listed] == [key.split("_")[1]] and key not in out  # never the secret
    assert listed[0]["scopes"] == ["infer"] and listed[0]["expires_at"] is not None

    engine = init_db(db_url)
    cache = KeyCache(session_factory(engine))
    cache.refresh()
    assert cache.verify(key, "infer").tenant_id == "acme"
    assert _run(capsys, "keys", "revoke", key.split("_")[1], *db)[0] == 0
    cache.refresh()
    with pytest.raises(Unauthenticated):
        cache.verify(key)
    engine.dispose()
    code, out, _ = _run(capsys, "keys", "list", *db)
    assert "revoked" in out
    code, _, err = _run(capsys, "keys", "revoke", "0" * 16, *db)
    assert code == 1 and "not found" in err
    code, _, err = _run(capsys, "keys", "create", "--tenant", "nobody", *db)
    assert code == 1 and "not found" in err


def test_models_commands(
    tmp_path: Path, gguf_file: Path, make_gguf, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    monkeypatch.delenv("INFERPLANE_DB_URL", raising=False)
    home = ("--home", str(tmp_path / "home"))  # the default SQLite location under --home
    code, out, _ = _run(capsys, "models", "register", str(gguf_file), "--name", "tiny", "--json", *home)
    assert code == 0 and json.loads(out)["status"] == "verified"
    assert (tmp_path / "home" / "inferplane.db").is_file()
    assert _run(capsys, "models", "register", str(gguf_file), "--name", "tiny", *home)[0] == 0  # version 2
    code, _, _ = _run(
        capsys, "models", "register", str(gguf_file), "--name", "tiny", "--sha256", "0" * 64, *home
    )
    assert code == 1  # recorded as failed: non-zero exit
    code, out, _ = _run(capsys, "models", "list", "--json", *home)
    assert [(m["name"], m["version"], m["status"]) for m in json.loads(out)] == [
        ("tiny", "1", "verified"),
        ("tiny", "2", "verified"),
        ("tiny", "3", "failed"),
    ]
    code, out, _ = _run(capsys, "models", "list", *home)
    assert code == 0 and "llama" in out and "2048" in out
    header, row = out.splitlines()[:2]
    assert header.split()[4:6] == ["ARCH", "KIND"] and row.split()[4:6] == ["llama", "generate"]
    code, out, _ = _run(capsys, "models", "show", "tiny:1", *home)
    assert "kind:" in out and "generate" in out
    code, out, _ = _run(capsys, "models", "show", "tiny:2", *home)
    assert code == 0 and "context_length:" in out and "2048" in out
    code, out, _ = _run(capsys, "models", "versions", "tiny", "--json", *home)
    assert [m["version"] for m in json.loads(out)] == ["1", "2", "3"]
    assert _run(capsys, "models", "delete", "tiny:3", *home)[0] == 0
    code, _, err = _run(capsys, "models", "show", "tiny:3", *home)
    assert code == 1 and "not found" in err
    code, _, err = _run(capsys, "models", "register", str(tmp_path / "nope.gguf"), *home)
    assert code == 1 and "no such model file" in err
    gpt2 = make_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    code, _, err = _run(capsys, "models", "register", str(gpt2), *home)
    assert code == 1 and "architecture 'gpt2' is not supported" in err
    code, out, _ = _run(capsys, "models", "versions", "gpt2", "--json", *home)
    assert code == 1  # nothing was recorded


def test_models_tenant_visibility_via_cli(
    db_url: str, gguf_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = ("--db-url", db_url)
    for tenant in ("acme", "globex"):
        _run(capsys, "tenants", "create", tenant, *db)
    assert (
        _run(capsys, "models", "register", str(gguf_file), "--name", "mine", "--tenant", "acme", *db)[0] == 0
    )
    _, out, _ = _run(capsys, "models", "list", "--tenant", "globex", "--json", *db)
    assert json.loads(out) == []
    _, out, _ = _run(capsys, "models", "list", "--tenant", "acme", "--json", *db)
    assert [(m["name"], m["visibility"]) for m in json.loads(out)] == [("mine", "private")]
    code, _, err = _run(capsys, "models", "delete", "mine", "--tenant", "globex", *db)
    assert code == 1 and "not found" in err


def test_env_db_url(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    url = f"sqlite:///{tmp_path / 'env.db'}"
    monkeypatch.setenv("INFERPLANE_DB_URL", url)
    assert _run(capsys, "tenants", "create", "acme")[0] == 0
    assert (tmp_path / "env.db").is_file()
    assert "acme" in _run(capsys, "tenants", "list")[1]


def test_bad_duration_is_a_usage_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["keys", "create", "--tenant", "a", "--expires-in", "soon", "--home", str(tmp_path)])
    assert e.value.code == 2 and "invalid duration" in capsys.readouterr().err


def test_cli_modules_import_cheaply() -> None:
    """`inferplane --help` imports every subcommand module: ours must not drag SQLAlchemy in."""
    import subprocess
    import sys

    code = (
        "import sys, inferplane.control_plane.cli.models, inferplane.control_plane.cli.keys, "
        "inferplane.control_plane.cli.tenants; "
        "print(sorted(m for m in ('sqlalchemy', 'alembic', 'gguf', 'jwt', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_tables_show_limits_and_bands(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 59: `tenants list` and `keys list` hid the limits and bands a key or tenant runs under."""
    db = ("--db-url", db_url)
    assert _run(capsys, "tenants", "create", "acme", "--key-rpm-max", "700", "--priority", "batch",
                "--max-concurrent-sequences", "9", *db)[0] == 0
    assert _run(capsys, "keys", "create", "--tenant", "acme", "--rpm", "600", "--tpm", "12345",
                "--priority", "batch", "--max-concurrent-sequences", "3", *db)[0] == 0
    header, row = _run(capsys, "tenants", "list", *db)[1].splitlines()
    assert "KEY REQ/MIN" in header and "BAND" in header and "SEQS" in header
    assert row.split()[:6] == ["acme", "unlimited", "700", "-", "9", "batch"]
    header, row = _run(capsys, "keys", "list", *db)[1].splitlines()
    assert "REQ/MIN" in header and "TOK/MIN" in header and "BAND" in header
    assert row.split()[5:9] == ["600", "12345", "3", "batch"]  # after the two default scopes


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"inferplane {version('inferplane')}"

