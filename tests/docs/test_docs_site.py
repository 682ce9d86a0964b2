"""The user guide: the MkDocs site builds strictly, the CLI reference is the parsers', the README is
short and its links lead somewhere, and the blocks the e2e test walks are marked."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from inferplane.cli import reference
from tests.docs.walked import LOCAL_PAGE, README, ROOT, walked_blocks

CLI_PAGE = ROOT / "docs" / "cli.md"


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """--strict turns every warning into a failure: a link to a missing page or anchor, a page left
    out of the nav, a nav entry without its page."""
    site = tmp_path / "site"
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stdout + built.stderr
    assert (site / "cli" / "index.html").exists() and (site / "getting-started" / "local" / "index.html").exists()


def test_the_cli_reference_is_current() -> None:
    assert CLI_PAGE.read_text() == reference.render(), (
        f"docs/cli.md is stale; regenerate it with: {reference.REGENERATE}")


def test_the_check_flag_names_the_command_that_regenerates(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    stale = tmp_path / "cli.md"
    stale.write_text(reference.render().replace("--kv-offload-memory", "--kv-offload-mem"))
    assert reference.main(["--check", str(stale)]) == 1
    assert reference.REGENERATE in capsys.readouterr().err
    stale.write_text(reference.render())
    assert reference.main(["--check", str(stale)]) == 0


def test_the_cli_reference_is_the_same_on_any_machine(tmp_path: Path) -> None:
    """Defaults read from the environment or the home folder, and the terminal width, leave no trace."""
    env = {**os.environ, "HOME": str(tmp_path), "INFERPLANE_HOME": str(tmp_path / "state"), "COLUMNS": "37",
           "INFERPLANE_PORT": "1234", "INFERPLANE_OPERATOR_METRICS_PORT": "4321", "WATCH_NAMESPACE": "elsewhere"}
    elsewhere = subprocess.run([sys.executable, "-m", "inferplane.cli.reference"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert elsewhere.stdout == reference.render()
    assert str(tmp_path) not in elsewhere.stdout and str(Path.home()) + "/" not in elsewhere.stdout


def test_the_cli_reference_covers_nested_subcommands_and_every_option() -> None:
    page = CLI_PAGE.read_text()
    parser = reference.build_parser()

    def walk(p, path):
        for action in p._actions:
            if isinstance(action, argparse._HelpAction) or action.help is argparse.SUPPRESS:
                continue  # what --help does not show either
            for option in action.option_strings:
                assert f"`{option}" in page, f"{' '.join(path)} {option} is missing from docs/cli.md"
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    assert re.search(rf"^#+ {' '.join([*path, name])}$", page, flags=re.M), (path, name)
                    walk(child, [*path, name])

    walk(parser, ["inferplane"])
    for name in ("inferplane models register-adapter", "inferplane keys revoke", "inferplane tenants set-webhook"):
        assert f" {name}\n" in page
    assert "- `kv-routing`:" in page  # bench's names, each with its one line


def test_the_readme_is_short_and_its_relative_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert relative, "the README links into docs/"
    missing = [t for t in relative if not (ROOT / t.split("#")[0]).is_file()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_the_quickstarts_mark_the_blocks_the_e2e_test_walks() -> None:
    readme, page = walked_blocks(README), walked_blocks(LOCAL_PAGE)
    assert readme and any("/v1/chat/completions" in code for _, code in readme)
    languages = [language for language, _ in page]
    assert "python" in languages and languages.count("bash") >= 2
