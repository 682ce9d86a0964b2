"""`inferplane gateway` options: where the database URL, namespaces and secrets come from, how it
fails outside a cluster, and that the Helm chart's command line parses. The end-to-end run against
an API server and a worker is in test_kube_sync_cluster.py."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferplane.cli import main
from inferplane.control_plane.cli import gateway as cli

ROOT = Path(__file__).resolve().parents[2]
ENV = ("INFERPLANE_DATABASE_URL", "INFERPLANE_DB_URL", "INFERPLANE_NAMESPACE", "INFERPLANE_BOOTSTRAP_KEY",
       "INFERPLANE_BOOTSTRAP_KEY_FILE", "INFERPLANE_JWT_ALGORITHM", "INFERPLANE_JWT_KEY", "INFERPLANE_JWT_KEY_FILE",
       "INFERPLANE_SALT_SECRET", "INFERPLANE_SALT_SECRET_FILE", "INFERPLANE_HOME", "INFERPLANE_PORT",
       "INFERPLANE_GRPC_PORT", "INFERPLANE_METRICS_PORT", "INFERPLANE_HOST", "KUBECONFIG", "KUBERNETES_SERVICE_HOST",
       "KUBERNETES_SERVICE_PORT")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user-home"))  # no ~/.kube/config


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    return parser.parse_args(list(argv))


def test_db_url_flag_then_chart_env_then_cli_env_then_sqlite_under_home(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    assert cli.db_url(parse("--home", str(tmp_path))) == f"sqlite:///{tmp_path / 'inferplane.db'}"
    monkeypatch.setenv("INFERPLANE_DB_URL", "sqlite:///b.db")
    assert cli.db_url(parse()) == "sqlite:///b.db"
    monkeypatch.setenv("INFERPLANE_DATABASE_URL", "postgresql+psycopg://db/a")
    assert cli.db_url(parse()) == "postgresql+psycopg://db/a"
    assert cli.db_url(parse("--db-url", "sqlite:///c.db")) == "sqlite:///c.db"


def test_namespaces_flags_then_env_then_the_pods_own_then_default(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-file")
    assert cli.namespaces(parse(), missing) == ["default"]
    own = tmp_path / "namespace"
    own.write_text("inference\n")
    assert cli.namespaces(parse(), str(own)) == ["inference"]
    monkeypatch.setenv("INFERPLANE_NAMESPACE", "x,y")
    assert cli.namespaces(parse(), str(own)) == ["x", "y"]
    assert cli.namespaces(parse("-n", "a", "--namespace", "b,c"), str(own)) == ["a", "b", "c"]
    assert cli.namespaces(parse("--all-namespaces"), str(own)) is None
    with pytest.raises(SystemExit):
        parse("-A", "-n", "a")  # one scope or the other


def test_secrets_come_from_files_or_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "boot").write_text("ipadmin_from-file\n")
    (tmp_path / "jwt").write_text("a-shared-secret-long-enough-for-hs256-0123456789\n")
    (tmp_path / "salt").write_text("00ff10\n")
    settings = cli.gateway_settings(parse("--bootstrap-key-file", str(tmp_path / "boot"), "--jwt-algorithm", "HS256",
                                          "--jwt-key-file", str(tmp_path / "jwt"), "--salt-secret-file",
                                          str(tmp_path / "salt"), "--grpc-port", "9001",
                                          "--jwt-issuer", "https://idp.example", "--drain-grace-seconds", "45"))
    assert settings.bootstrap_key == "ipadmin_from-file"
    assert settings.jwt_issuer == "https://idp.example" and settings.drain_grace_seconds == 45
    assert (settings.jwt_algorithm, settings.jwt_key) == ("HS256", "a-shared-secret-long-enough-for-hs256-0123456789")
    assert settings.salt_secret == b"\x00\xff\x10" and settings.grpc_port == 9001
    monkeypatch.setenv("INFERPLANE_BOOTSTRAP_KEY", "ipadmin_from-env")
    monkeypatch.setenv("INFERPLANE_SALT_SECRET", "not hex at all")
    settings = cli.gateway_settings(parse())
    assert settings.bootstrap_key == "ipadmin_from-env" and settings.salt_secret == b"not hex at all"
    assert settings.grpc_port is None and settings.jwt_algorithm is None


@pytest.mark.parametrize("argv, message", [
    (["--jwt-algorithm", "HS256"], "both --jwt-algorithm and a key"),
    (["--bootstrap-key-file", "/no/such/file"], "cannot read the bootstrap key file"),
    (["--port", "0"], "--port must be"),
])
def test_bad_options_exit_2_with_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err


def test_a_weak_jwt_secret_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERPLANE_JWT_KEY", "short")
    assert main(["gateway", "--jwt-algorithm", "HS256"]) == 2
    assert "JWT key: an HS256 secret needs at least" in capsys.readouterr().err


def test_without_a_cluster_or_kubeconfig_it_exits_1_with_one_line(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    assert main(["gateway", "--home", str(tmp_path), "--salt-secret-file", __file__]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no Kubernetes API: not in a cluster") and "kubeconfig" in err
    assert "\n" not in err
    assert main(["gateway", "--home", str(tmp_path), "--kubeconfig", str(tmp_path / "nope")]) == 1
    assert str(tmp_path / "nope") in capsys.readouterr().err


def _control_plane_args(helm: Path, values: list[str]) -> list[str]:
    out = subprocess.run([str(helm), "template", "demo", str(ROOT / "helm" / "inferplane"), "--namespace", "inference",
                          *values], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    docs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(out.stdout) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-control-plane")]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["inferplane", "gateway"]
    assert "INFERPLANE_DATABASE_URL" in {e["name"] for e in container["env"]}
    return container["args"]


@pytest.mark.parametrize("values, expected", [
    ([], ["inference"]),
    (["--set", "operator.watchNamespaces={a,b}"], ["a", "b"]),
    (["--set", "operator.rbacMode=cluster"], None),
])
def test_the_charts_command_line_parses_and_follows_the_operators_namespaces(helm: Path, values: list[str],
                                                                             expected: list[str] | None) -> None:
    args = parse(*_control_plane_args(helm, values))
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", 8000, 9090)
    assert cli.namespaces(args, "/no/such/file") == expected


def test_the_keep_alive_is_the_gateways_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferplane.control_plane.gateway.server import GatewaySettings

    assert cli.gateway_settings(parse()).keep_alive_seconds == GatewaySettings("x").keep_alive_seconds
    assert cli.gateway_settings(parse("--keep-alive-seconds", "120")).keep_alive_seconds == 120
    monkeypatch.setenv("INFERPLANE_KEEP_ALIVE_SECONDS", "90")
    assert cli.gateway_settings(parse()).keep_alive_seconds == 90
    for refused in ("0", "-1", "nan", "inf"):
        with pytest.raises(cli.UsageError, match="--keep-alive-seconds"):
            cli.gateway_settings(parse("--keep-alive-seconds", refused))


def test_how_often_a_stream_may_move_is_the_gateways_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli.gateway_settings(parse()).max_migrations == 2
    assert cli.gateway_settings(parse("--max-migrations", "0")).max_migrations == 0
    monkeypatch.setenv("INFERPLANE_MAX_MIGRATIONS", "5")
    assert cli.gateway_settings(parse()).max_migrations == 5
    with pytest.raises(cli.UsageError, match="--max-migrations"):
        cli.gateway_settings(parse("--max-migrations", "-1"))
