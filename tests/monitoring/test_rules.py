"""The generated alert and recording rules load in Prometheus and behave as the hand-written tests say.

`rules_test_platform.yaml` and `rules_test_deployment.yaml` are promtool rule unit tests written by
hand from what each alert is meant to catch (not generated from the rule code), so they check the
rules independently. Here the rules are rendered next to copies of them and run through
`promtool check rules` and `promtool test rules`; every generated alert must have a case where it
fires and a near miss where it stays quiet; every alert carries the labels and annotations the
alert routing and the runbook need. A deliberately wrong expectation must make promtool fail, so a
green run means the expectations were checked.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml

from inferplane.api.deployment import InferenceDeploymentSpec
from inferplane.monitoring import render
from inferplane.monitoring.deployment_rules import DeploymentScope, deployment_groups
from inferplane.monitoring.platform_rules import platform_groups
from inferplane.monitoring.rules import RUNBOOK_URL, Group, rule_file, runbook_anchor
from tests.services import installed

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUNBOOK = ROOT / "deploy" / "monitoring" / "RUNBOOK.md"
PLATFORM_TESTS = "rules_test_platform.yaml"
DEPLOYMENT_TESTS = "rules_test_deployment.yaml"
DEPLOYMENT_RULES = "inferplane-deployment.rules.yaml"

# The deployment the hand-written deployment tests assume (see the head of rules_test_deployment.yaml).
SPEC = {"model": {"name": "m"}, "runtime": "radix", "replicas": 2, "minReplicas": 1, "maxReplicas": 4,
        "autoscaling": {"enabled": True}, "tenant": "acme",
        "slo": {"ttftP95Seconds": 2, "errorRatePercent": 1, "availability": 99.5}}
SCOPE = DeploymentScope(namespace="prod", name="chat", deployment="prod/chat", tenant="acme")
DEPLOYMENT_LABELS = {"namespace": "prod", "deployment": "chat", "tenant": "acme"}


def spec() -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.from_dict(SPEC)


def platform() -> list[Group]:
    return platform_groups()


def deployment() -> list[Group]:
    return deployment_groups(spec(), SCOPE)


# test file -> (rule file it loads, its content, the groups it was rendered from)
def rendered() -> dict[str, tuple[str, str, list[Group]]]:
    return {PLATFORM_TESTS: (render.PLATFORM_RULES, render.platform_rules_yaml(), platform()),
            DEPLOYMENT_TESTS: (DEPLOYMENT_RULES, render.deployment_rules_yaml(spec(), SCOPE), deployment())}


def unit_tests(name: str) -> dict[str, Any]:
    return yaml.safe_load((HERE / name).read_text())


def alert_cases(tests: dict[str, Any]) -> Iterable[tuple[dict[str, Any], dict[str, Any]]]:
    """(test group, alert_rule_test case) for every case of a promtool test file."""
    for group in tests["tests"]:
        for case in group.get("alert_rule_test") or ():
            yield group, case


@pytest.fixture(scope="module")
def promtool() -> str:
    return installed("promtool", package="prometheus")


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    """The rendered rule files and copies of the test files, side by side: promtool resolves
    `rule_files:` relative to the test file."""
    for test_file, (rules_name, content, _) in rendered().items():
        (tmp_path / rules_name).write_text(content)
        shutil.copy(HERE / test_file, tmp_path / test_file)
    return tmp_path


def run(promtool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def output(result: subprocess.CompletedProcess[str]) -> str:
    return (result.stdout + result.stderr).strip()


# -- promtool ---------------------------------------------------------------------------------------


def test_the_rule_files_pass_promtool_check(promtool: str, rules_dir: Path) -> None:
    result = run(promtool, "check", "rules", render.PLATFORM_RULES, DEPLOYMENT_RULES, cwd=rules_dir)
    if result.returncode:
        pytest.fail(f"promtool check rules failed:\n{output(result)}", pytrace=False)


@pytest.mark.parametrize("test_file", [PLATFORM_TESTS, DEPLOYMENT_TESTS])
def test_the_rules_pass_their_unit_tests(promtool: str, rules_dir: Path, test_file: str) -> None:
    result = run(promtool, "test", "rules", test_file, cwd=rules_dir)
    if result.returncode:
        pytest.fail(f"promtool test rules {test_file} failed:\n{output(result)}", pytrace=False)


def wrong(case: dict[str, Any], how: str) -> dict[str, Any]:
    case = copy.deepcopy(case)
    if how == "severity":
        labels = case["exp_alerts"][0]["exp_labels"]
        labels["severity"] = "info" if labels["severity"] != "info" else "critical"
    elif how == "label":
        case["exp_alerts"][0]["exp_labels"]["tenant"] = "someone-else"
    elif how == "summary":
        case["exp_alerts"][0]["exp_annotations"]["summary"] += " (wrong)"
    else:  # a firing case expected to stay quiet
        case["exp_alerts"] = []
    return case


@pytest.mark.parametrize("how", ["severity", "label", "summary", "quiet"])
def test_a_wrong_expectation_fails_promtool(promtool: str, rules_dir: Path, how: str) -> None:
    """The harness can fail: one firing case of the platform tests, copied with a wrong expectation."""
    tests = unit_tests(PLATFORM_TESTS)
    group, case = next((g, c) for g, c in alert_cases(tests) if c["exp_alerts"])
    right = {**tests, "tests": [{**group, "alert_rule_test": [case]}]}
    broken = {**tests, "tests": [{**group, "alert_rule_test": [wrong(case, how)]}]}
    (rules_dir / "right.yaml").write_text(yaml.safe_dump(right, sort_keys=False))
    (rules_dir / "broken.yaml").write_text(yaml.safe_dump(broken, sort_keys=False))

    assert run(promtool, "test", "rules", "right.yaml", cwd=rules_dir).returncode == 0
    result = run(promtool, "test", "rules", "broken.yaml", cwd=rules_dir)
    assert result.returncode != 0, f"a wrong {how} passed promtool:\n{output(result)}"
    assert case["alertname"] in output(result)


# -- the test files cover every generated alert -----------------------------------------------------


@pytest.mark.parametrize("test_file", [PLATFORM_TESTS, DEPLOYMENT_TESTS])
def test_the_test_files_load_the_rendered_rules_in_order(test_file: str) -> None:
    rules_name, _, groups = rendered()[test_file]
    tests = unit_tests(test_file)
    assert tests["rule_files"] == [rules_name]
    # Without group_eval_order promtool evaluates the groups in random order: records first, always.
    assert tests["group_eval_order"] == [g.name for g in groups]
    assert [g.name for g in groups if g.records] == [groups[0].name]


@pytest.mark.parametrize("test_file", [PLATFORM_TESTS, DEPLOYMENT_TESTS])
def test_every_alert_has_a_firing_and_a_quiet_case(test_file: str) -> None:
    _, _, groups = rendered()[test_file]
    alerts = {a.name for g in groups for a in g.alerts}
    firing: set[str] = set()
    quiet: set[str] = set()
    for group, case in alert_cases(unit_tests(test_file)):
        name = case["alertname"]
        # a misspelled name would pass every quiet case vacuously
        assert name in alerts, f"{test_file}: {group['name']!r} tests {name!r}, which is no generated alert"
        assert group.get("input_series"), f"{test_file}: {group['name']!r} has no input: a quiet case proves nothing"
        if case.get("exp_alerts"):
            firing.add(name)
            for alert in case["exp_alerts"]:
                assert "severity" in alert.get("exp_labels", {}), f"{name} in {group['name']!r}: no severity"
        else:
            assert case.get("exp_alerts") == [], f"{name} in {group['name']!r}: say `exp_alerts: []`"
            quiet.add(name)
    assert alerts - firing == set(), f"{test_file}: alerts never tested firing"
    assert alerts - quiet == set(), f"{test_file}: alerts never tested quiet"


def test_the_deployment_rules_cover_autoscaling_only_when_enabled() -> None:
    """The test spec enables autoscaling, so the deployment tests cover InferplaneAutoscalerAtMax."""
    names = {a.name for g in deployment() for a in g.alerts}
    assert "InferplaneAutoscalerAtMax" in names
    manual = InferenceDeploymentSpec.from_dict({**SPEC, "autoscaling": {"enabled": False}})
    assert "InferplaneAutoscalerAtMax" not in {a.name for g in deployment_groups(manual, SCOPE) for a in g.alerts}


# -- labels, annotations, runbook -------------------------------------------------------------------


def rendered_alerts(content: str) -> list[dict[str, Any]]:
    body = yaml.safe_load(content)
    return [rule for group in body["groups"] for rule in group["rules"] if "alert" in rule]


@pytest.mark.parametrize("test_file", [PLATFORM_TESTS, DEPLOYMENT_TESTS])
def test_every_alert_has_severity_summary_description_and_runbook(test_file: str) -> None:
    _, content, groups = rendered()[test_file]
    alerts = rendered_alerts(content)
    assert yaml.safe_load(content) == rule_file(groups)
    assert alerts, "no alerts rendered"
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning", "info"), alert["alert"]
        for key in ("summary", "description", "runbook_url"):
            assert alert["annotations"].get(key, "").strip(), f"{alert['alert']}: no {key}"
        if test_file == DEPLOYMENT_TESTS:
            labels = {k: alert["labels"].get(k) for k in DEPLOYMENT_LABELS}
            assert labels == DEPLOYMENT_LABELS, alert["alert"]


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """`## ` heading -> its section's text."""
    parts = re.split(r"^## (.+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2], strict=True)}


def test_every_runbook_url_points_at_a_section_of_the_runbook() -> None:
    assert RUNBOOK_URL.endswith("/" + RUNBOOK.relative_to(ROOT).as_posix())
    sections = runbook_sections()
    anchors = {github_anchor(title) for title in sections}
    names = set()
    for _, content, _ in rendered().values():
        for alert in rendered_alerts(content):
            names.add(alert["alert"])
            url = alert["annotations"]["runbook_url"]
            assert url == f"{RUNBOOK_URL}#{runbook_anchor(alert['alert'])}", alert["alert"]
            assert alert["alert"] in sections, f"RUNBOOK.md has no `## {alert['alert']}`"
            assert url.rsplit("#", 1)[1] in anchors, url
            assert len(sections[alert["alert"]].strip().splitlines()) >= 4, f"{alert['alert']}: section too thin"
    stale = {title for title in sections if title.startswith("Inferplane")} - names
    assert stale == set(), f"RUNBOOK.md sections for alerts that no longer exist: {sorted(stale)}"
