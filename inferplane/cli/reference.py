"""The CLI reference page (docs/cli.md), generated from the argparse parsers themselves.

`python -m inferplane.cli.reference > docs/cli.md` rewrites it; `--check docs/cli.md` exits 1 when
the committed page differs (tests/docs/test_docs_site.py runs the same comparison). The page is
rendered from the same `configure(parser)` functions `inferplane --help` runs, so an option added to
a subcommand cannot be missing from the docs.

Why a clean environment: several defaults are read from the environment or the machine when
`configure` runs (`--home` is `$INFERPLANE_HOME` or the user's home folder, the operator's ports and
registry URL come from `$INFERPLANE_*`). Rendering them as found would write the generating
machine's paths into the page and make it differ on every machine, so parsers are built with
a placeholder home folder, no other variables and a fixed terminal width, and the placeholder is
written as `~`: defaults then read as a user would write them (`~/.inferplane`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from inferplane.cli.main import _available

# inferplane.cli re-exports main() under the module's name, so the module is fetched by its path.
_CLI_DOC = importlib.import_module("inferplane.cli.main").__doc__ or ""
WIDTH = 100  # the terminal width argparse wraps usage lines to
REGENERATE = "python -m inferplane.cli.reference > docs/cli.md"
_HOME = "/__home__"  # the placeholder home folder, written `~` on the page
_CLEAN_ENV = {"HOME": _HOME, "COLUMNS": str(WIDTH), "LINES": "50", "LC_ALL": "C.UTF-8"}


@contextlib.contextmanager
def _clean_environment() -> Iterator[None]:
    """The process environment replaced by `_CLEAN_ENV` while parsers are built and rendered."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(_CLEAN_ENV)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def build_parser() -> argparse.ArgumentParser:
    """The `inferplane` parser with every available subcommand, as `inferplane.cli.main.main` builds it."""
    parser = argparse.ArgumentParser(prog="inferplane", description=_CLI_DOC.splitlines()[0])
    parser.add_argument("--version", action="version", version="inferplane VERSION")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in _available().items():
        importlib.import_module(module_name).configure(sub.add_parser(name, help=help_text))
    return parser


def _escape(text: str) -> str:
    """Help text as literal markdown (no emphasis from `*`/`_`, no HTML from `<...>`); its `code` spans stay code."""
    out = text.replace("\\", "\\\\")
    for char in "*_[]|":
        out = out.replace(char, "\\" + char)
    return out.replace("<", "&lt;").replace(">", "&gt;")


def _subparsers(parser: argparse.ArgumentParser) -> tuple[argparse._SubParsersAction | None, dict[str, str]]:
    """The parser's subcommand action, if any, and each subcommand's one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return action, helps
    return None, {}


def _option_line(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """One option as a list item: its spellings, its default where it has a meaningful one, its help."""
    formatter = parser._get_formatter()
    if action.option_strings:
        metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
        names = ", ".join(f"`{option}{metavar}`" for option in action.option_strings)
    else:
        names = f"`{formatter._format_args(action, action.dest)}`"
    help_text = formatter._expand_help(action) if action.help else ""
    line = f"- {names}"
    if help_text:
        line += f": {_escape(' '.join(help_text.split()))}"
    default = action.default
    if (action.option_strings and action.nargs != 0 and default not in (None, argparse.SUPPRESS, [], "")
            and "default" not in (action.help or "")):
        line += f" (default: `{default}`)"
    return line


def _options(parser: argparse.ArgumentParser, out: list[str]) -> None:
    """Each argument group's options (not -h, and not the subcommands, which get sections of their own)."""
    for group in parser._action_groups:
        actions = [a for a in group._group_actions
                   if a.help is not argparse.SUPPRESS and not isinstance(a, (argparse._HelpAction,
                                                                             argparse._SubParsersAction))]
        if not actions:
            continue
        out.append(f"**{_escape(group.title or 'options')}**\n")
        if group.description:
            out.append(_escape(" ".join(group.description.split())) + "\n")
        out.append("\n".join(_option_line(parser, action) for action in actions) + "\n")


def _render(parser: argparse.ArgumentParser, path: list[str], help_line: str, out: list[str]) -> None:
    """`parser`'s section, then its subcommands' sections, depth first in the order they were added."""
    out.append(f"{'#' * min(len(path), 4)} {' '.join(path)}\n")
    if help_line:
        out.append(_escape(help_line) + "\n")
    if parser.description and parser.description.strip() != help_line.strip():
        out.append(_escape(" ".join(parser.description.split())) + "\n")
    out.append("```text\n" + parser.format_usage().rstrip() + "\n```\n")
    _options(parser, out)
    subcommands, helps = _subparsers(parser)
    if subcommands is not None:
        out.append("Subcommands: " + ", ".join(f"`{name}`" for name in subcommands.choices) + ".\n")
        for name, child in subcommands.choices.items():
            _render(child, [*path, name], helps.get(name, ""), out)


def _bench_names(out: list[str]) -> None:
    """`inferplane bench NAME`: each benchmark's own options are its module's (`inferplane bench NAME --help`)."""
    from inferplane.cli.bench import BENCHMARKS

    out.append("### Benchmarks\n")
    out.append("What `inferplane bench NAME` runs; each takes its own options (`inferplane bench NAME --help`). "
               "Figures, dates and commands: [Benchmarks](benchmarks.md).\n")
    out.append("\n".join(f"- `{name}`: {_escape(help_text)}" for name, (_, help_text) in sorted(BENCHMARKS.items()))
               + "\n")


def render() -> str:
    """The whole page, the same on every machine."""
    with _clean_environment():
        parser = build_parser()
        out = ["# CLI reference\n",
               f"<!-- Generated by `{REGENERATE}` from the argparse parsers; do not edit by hand. -->\n",
               "Every subcommand of `inferplane`, with its usage and options as `inferplane ... --help` prints "
               "them. Defaults that depend on the environment are shown as on a machine with none of "
               "`$INFERPLANE_*` set, with `~` for the home folder.\n"]
        subcommands, helps = _subparsers(parser)
        assert subcommands is not None
        out.append("```text\n" + parser.format_usage().rstrip() + "\n```\n")
        _options(parser, out)
        out.append("\n".join(f"- [`inferplane {name}`](#inferplane-{name}): {_escape(helps.get(name, ''))}"
                             for name in subcommands.choices) + "\n")
        for name, child in subcommands.choices.items():
            _render(child, ["inferplane", name], helps.get(name, ""), out)
            if name == "bench":
                _bench_names(out)
    return "\n".join(out).replace(_HOME, "~")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m inferplane.cli.reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="FILE", type=Path, help="exit 1 if FILE differs from the generated page")
    args = parser.parse_args(argv)
    page = render()
    if args.check is None:
        sys.stdout.write(page)
        return 0
    if args.check.read_text() == page:
        return 0
    print(f"{args.check} is stale; regenerate it with: {REGENERATE}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
