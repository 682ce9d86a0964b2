"""The committed monitoring files are exactly what the code renders (one source, never hand copies),
and the chart ships them: its PrometheusRule is the platform rule file, its ConfigMap the dashboards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from inferplane.monitoring import render

ROOT = Path(__file__).resolve().parents[2]
COPIES = [ROOT / "deploy" / "monitoring", ROOT / "helm" / "inferplane" / "monitoring"]


@pytest.mark.parametrize("directory", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_files_match_the_code(directory: Path) -> None:
    files = render.rendered_files()
    for relative, content in files.items():
        path = directory / relative
        assert path.exists(), f"{path} missing: run `make monitoring`"
        assert path.read_text() == content, f"{path} is stale: run `make monitoring`"
    committed = {str(p.relative_to(directory)) for p in (directory / render.DASHBOARDS).glob("*.json")}
    assert committed == {r for r in files if r.startswith(render.DASHBOARDS)}, "a dashboard no longer generated"


def test_the_chart_wraps_the_same_rules_and_dashboards(helm: Path) -> None:
    from tests.operator.test_helm import render as helm_render

    docs = helm_render(helm, None)
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(render.platform_rules_yaml())
    (dashboards,) = [d for d in docs if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]
    expected = {Path(r).name: json.loads(c) for r, c in render.rendered_files().items() if r.endswith(".json")}
    assert {name: json.loads(text) for name, text in dashboards["data"].items()} == expected


def test_write_removes_a_dashboard_no_longer_generated(tmp_path: Path) -> None:
    (tmp_path / render.DASHBOARDS).mkdir()
    (tmp_path / render.DASHBOARDS / "retired.json").write_text("{}")
    render.write([tmp_path])
    assert not (tmp_path / render.DASHBOARDS / "retired.json").exists()
    assert (tmp_path / render.PLATFORM_RULES).read_text() == render.platform_rules_yaml()
