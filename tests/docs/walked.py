"""The guide's walked blocks: fenced code marked `<!-- walked -->`, run as written by a test.

A page marks a block it promises works when pasted with an HTML comment on the line before the
fence. `tests/e2e/test_up_newcomer.py` runs the README's and the local getting-started page's blocks
against a real `inferplane up`; `tests/docs/test_docs_site.py` checks the markers are there.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LOCAL_PAGE = ROOT / "docs" / "getting-started" / "local.md"
SERVE_PAGE = ROOT / "docs" / "getting-started" / "serve.md"
MARKER = "<!-- walked -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\n```(\w+)\n(.*?)```", flags=re.DOTALL)


def walked_blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of each marked block, in page order."""
    return _BLOCK.findall(page.read_text())


def fenced_block_after(page: Path, heading: str) -> str:
    """The first fenced block after a heading (the banner example on the local page)."""
    text = page.read_text()
    start = text.index(heading)
    return re.search(r"```\w*\n(.*?)```", text[start:], flags=re.DOTALL).group(1)


def as_shell_script(blocks: list[tuple[str, str]], substitutions: dict[str, str]) -> str:
    """One bash script running the blocks in order (so an `export` carries on), Python blocks through
    `python -`. `substitutions` replace what a reader's machine has and a test's does not (the key
    the banner printed, the port, the home folder), nothing else."""
    parts = ["set -euo pipefail"]
    for language, code in blocks:
        for placeholder, value in substitutions.items():
            code = code.replace(placeholder, value)
        if language in ("bash", "sh"):
            parts.append(code)
        elif language == "python":
            parts.append(f"python - <<'WALKED_PY'\n{code}WALKED_PY")
        else:
            raise ValueError(f"a walked block in {language!r}: only bash, sh and python blocks can be run")
    return "\n".join(parts) + "\n"
