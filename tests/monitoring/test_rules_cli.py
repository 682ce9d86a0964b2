"""`inferplane monitoring rules MANIFEST`: one rule file for every deployment in the manifest.

Prometheus and promtool read only the first YAML document of a rule file, so a manifest of several
InferenceDeployments must come out as ONE document whose `groups:` hold every deployment's groups
(names unique); with several documents the later deployments' rules vanished while promtool said
SUCCESS.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from inferplane.cli.monitoring import deployment_rules
from tests.services import installed

DEPLOYMENTS = [("prod", "chat"), ("prod", "embed"), ("staging", "chat")]


def _manifest(tmp_path: Path, deployments: list[tuple[str, str]], *, namespaced: bool = True) -> Path:
    docs = [{"apiVersion": "inferplane.io/v1alpha1", "kind": "InferenceDeployment",
             "metadata": {"name": name, **({"namespace": ns} if namespaced else {})},
             "spec": {"model": {"name": "m"}, "replicas": 1}} for ns, name in deployments]
    path = tmp_path / "deployments.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return path


def _groups_by_deployment(text: str) -> dict[str, list[str]]:
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    assert len(docs) == 1, f"{len(docs)} YAML documents: Prometheus reads only the first"
    names = [g["name"] for g in docs[0]["groups"]]
    assert len(names) == len(set(names)), f"duplicate group names: {names}"
    found: dict[str, list[str]] = {}
    for name in names:
        found.setdefault(name.rsplit(".", 1)[0], []).append(name)
    return found


@pytest.mark.parametrize("count", [1, 2, 3])
def test_every_deployment_of_a_manifest_is_in_the_one_rule_document(tmp_path: Path, count: int) -> None:
    text = deployment_rules(_manifest(tmp_path, DEPLOYMENTS[:count]))
    found = _groups_by_deployment(text)
    assert sorted(found) == sorted(f"inferplane.deployment.{ns}.{name}" for ns, name in DEPLOYMENTS[:count])
    for groups in found.values():  # each deployment's recording rules and its alerts
        assert [g.rsplit(".", 1)[1] for g in groups] == ["records", "alerts"]


def test_local_scope_merges_too(tmp_path: Path) -> None:
    text = deployment_rules(_manifest(tmp_path, [("x", "a"), ("y", "b")], namespaced=False), local=True)
    assert sorted(_groups_by_deployment(text)) == ["inferplane.deployment.local.a", "inferplane.deployment.local.b"]


@pytest.mark.parametrize("local", [False, True])
def test_a_deployment_named_twice_is_refused_naming_it(tmp_path: Path, local: bool) -> None:
    """The same namespace/name twice would give two groups one name (promtool refuses the file)."""
    path = _manifest(tmp_path, [("prod", "chat"), ("prod", "other"), ("prod", "chat")])
    with pytest.raises(ValueError, match=r"prod/chat|local/chat"):
        deployment_rules(path, local=local)


def test_the_cli_says_which_deployment_is_named_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from inferplane.cli.main import main

    path = _manifest(tmp_path, [("prod", "chat"), ("prod", "chat")])
    assert main(["monitoring", "rules", str(path)]) == 2
    assert "prod/chat" in capsys.readouterr().err


def test_promtool_loads_every_deployments_rules_without_lint_errors(tmp_path: Path) -> None:
    """promtool counts the rules of all three deployments (with several documents it counted the
    first's and said SUCCESS), and its duplicate-rules lint finds none: the deployments' recording
    rules share names but not labels."""
    promtool = installed("promtool", package="prometheus")
    rules = tmp_path / "rules.yaml"
    rules.write_text(deployment_rules(_manifest(tmp_path, DEPLOYMENTS)))
    check = subprocess.run([promtool, "check", "rules", "--lint-fatal", str(rules)], capture_output=True,
                           text=True, timeout=300)
    output = check.stdout + check.stderr
    assert check.returncode == 0, output
    total = sum(len(g["rules"]) for doc in yaml.safe_load_all(rules.read_text()) for g in doc["groups"])
    single = deployment_rules(_manifest(tmp_path, DEPLOYMENTS[:1]))
    assert total == 3 * sum(len(g["rules"]) for g in yaml.safe_load(single)["groups"])
    assert f"SUCCESS: {total} rules found" in output
    assert "duplicate" not in output
