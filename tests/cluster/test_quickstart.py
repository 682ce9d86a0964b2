"""docs/getting-started/cluster.md's one-node walk-through, run as written: its shell blocks, verbatim, by bash.

The quickstart says every command in it is one the tests ran; this is that test. The first block
(the two lines `make cluster` prints) is given as the environment; the second goes from `helm
install` to a first answer; the third cleans up and runs even when the second failed.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.cluster.conftest import ROOT
from tests.cluster.node import NodeCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]
QUICKSTART = ROOT / "docs" / "getting-started" / "cluster.md"


def walkthrough_blocks() -> list[str]:
    """The `sh` blocks of section 0, in order."""
    text = QUICKSTART.read_text()
    section = text[text.index("## 0."):text.index("## 1.")]
    return re.findall(r"```sh\n(.*?)```", section, flags=re.DOTALL)


def test_the_walkthrough_has_the_three_blocks_the_test_runs() -> None:
    environment, install, cleanup = walkthrough_blocks()
    assert "KUBECONFIG" in environment and "IMAGE" in environment
    assert "helm install" in install and "/v1/chat/completions" in install
    assert "helm uninstall" in cleanup


def test_the_quickstart_runs_as_written(node: NodeCluster, images: dict, helm, kubectl) -> None:
    _, install, cleanup = walkthrough_blocks()
    env = {**os.environ, "KUBECONFIG": str(node.kubeconfig), "IMAGE": images["image"]["ref"],
           "PATH": f"{helm.parent}:{kubectl.parent}:{os.environ['PATH']}"}

    def bash(script: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=1800)

    try:
        ran = bash(install)
        assert ran.returncode == 0, f"{ran.stdout[-3000:]}\n{ran.stderr[-3000:]}"
        assert '"object":"chat.completion"' in ran.stdout, ran.stdout[-3000:]
    finally:
        cleaned = bash(cleanup)
    assert cleaned.returncode == 0, cleaned.stderr[-3000:]
