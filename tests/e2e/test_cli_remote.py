"""Issue 59: the admin CLI against a running gateway (`--url`), as against the database: tenants,
their webhooks and flow control, keys (one that answers at once), and the registry (a file under
the gateway's model root registered, shown, listed with its CHAT column, deleted). What only the
database form can do is refused naming the flag, and a refusal of the gateway's is one line with
its status, never a traceback."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from inferplane.api.model_resolution import builtin_model_path
from inferplane.bench.gateway_harness import SERVED_MODEL
from inferplane.cli.main import main
from tests.e2e.single_worker import single_worker_gateway

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    root = tmp_path_factory.mktemp("model-root")
    shutil.copy(builtin_model_path("smollm2-135m"), root / "smol.gguf")
    with single_worker_gateway(tmp_path_factory, max_num_seqs=4,
                               gateway_extra=("--bootstrap-admin", "--model-root", str(root))) as started:
        yield started.gateway, root


def cli(capsys, running, *argv: str) -> tuple[int, str, str]:
    gateway, _ = running
    code = main([*argv, "--url", gateway.base_url])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(autouse=True)
def admin_key(running, monkeypatch, tmp_path):
    monkeypatch.setenv("INFERPLANE_ADMIN_KEY", running[0].admin_key)
    monkeypatch.setenv("INFERPLANE_HOME", str(tmp_path / "no-database-here"))


def test_tenants_webhooks_and_keys_through_the_gateway(running, capsys, tmp_path) -> None:
    gateway, _ = running
    assert cli(capsys, running, "tenants", "create", "acme", "--priority", "standard")[1] == "created tenant acme\n"
    code, out, _ = cli(capsys, running, "tenants", "list")
    assert code == 0 and any(line.startswith("acme ") and "standard" in line for line in out.splitlines())
    code, out, _ = cli(capsys, running, "tenants", "update", "acme", "--priority", "batch",
                       "--max-concurrent-sequences", "3")
    assert code == 0 and "priority batch, max concurrent sequences 3" in out

    code, out, _ = cli(capsys, running, "tenants", "set-webhook", "acme", "https://hooks.acme.test/a")
    assert code == 0 and "added webhook" in out and "signing secret (shown once): whsec_" in out
    code, out, _ = cli(capsys, running, "tenants", "set-webhook", "acme", "https://hooks.acme.test/a")
    assert code == 0 and out.startswith("updated webhook")  # the API's 200: a new secret for the same URL
    code, out, _ = cli(capsys, running, "tenants", "list-webhooks", "acme", "--json")
    assert [h["url"] for h in json.loads(out)] == ["https://hooks.acme.test/a"]
    code, out, _ = cli(capsys, running, "tenants", "remove-webhook", "acme", "https://hooks.acme.test/a")
    assert code == 0 and out.startswith("removed webhook")
    code, _, err = cli(capsys, running, "tenants", "set-webhook", "acme", "ftp://example.com/x")
    assert code == 1 and "url" in err and "(HTTP 4" in err and "Traceback" not in err

    code, out, _ = cli(capsys, running, "keys", "create", "--tenant", "acme", "--rpm", "100", "--json")
    made = json.loads(out)
    assert code == 0 and made["tenant_id"] == "acme" and made["requests_per_minute"] == 100
    answer = httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {made['key']}"},
                        json={"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200  # at once
    code, out, _ = cli(capsys, running, "keys", "list", "--tenant", "acme")
    assert code == 0 and made["id"] in out and " 100 " in out
    assert cli(capsys, running, "keys", "revoke", made["key"])[0] == 0
    refused = httpx.post(f"{gateway.base_url}/v1/completions", headers={"Authorization": f"Bearer {made['key']}"},
                         json={"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert refused.status_code == 401
    assert not (tmp_path / "no-database-here").exists()  # none of it touched a database here


def test_the_registry_through_the_gateway(running, capsys) -> None:
    code, out, err = cli(capsys, running, "models", "register", str(running[1] / "smol.gguf"), "--name", "smol",
                         "--json")
    assert code == 0, err
    registered = json.loads(out)
    assert registered["status"] == "verified" and registered["chat_template"] is True
    code, out, _ = cli(capsys, running, "models", "list")
    row = next(line for line in out.splitlines() if line.startswith("smol "))
    assert row.split()[6] == "yes"  # CHAT
    code, out, _ = cli(capsys, running, "models", "show", "smol")
    assert code == 0 and "architecture:     llama" in out
    code, out, _ = cli(capsys, running, "models", "register", "/etc/passwd", "--name", "x")
    assert code == 1  # outside the gateway's model roots: the gateway's refusal, one line
    code, _, err = cli(capsys, running, "models", "list", "--tenant", "acme")
    assert code == 1 and "--tenant" in err
    code, _, err = cli(capsys, running, "models", "verify", "smol")
    assert code == 2 and "database only" in err
    code, out, _ = cli(capsys, running, "models", "delete", "smol")
    assert code == 0 and out == "deleted smol:1\n"
    assert cli(capsys, running, "models", "show", "smol")[0] == 1


def test_a_missing_admin_key_and_an_unreachable_gateway_are_one_line(running, capsys, monkeypatch) -> None:
    monkeypatch.delenv("INFERPLANE_ADMIN_KEY")
    code, _, err = cli(capsys, running, "tenants", "list")
    assert code == 1 and "no admin key" in err
    monkeypatch.setenv("INFERPLANE_ADMIN_KEY", "ipadmin_wrong")
    code, _, err = cli(capsys, running, "tenants", "list")
    assert code == 1 and "(HTTP 401)" in err
    code = main(["tenants", "list", "--url", "http://127.0.0.1:9"])
    assert code == 1 and "cannot reach the gateway" in capsys.readouterr().err
