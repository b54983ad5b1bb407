"""The README's command lines work as written: every ``kairos ...`` line of its code blocks (and
its inline commands) is parsed by the real argument parsers, the component's own included, and
each documented command answers ``--help``. Parsing only: nothing is started."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from kairos.launcher import cli

README = Path(__file__).resolve().parents[2] / "README.md"
_ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PROGRAMS = ("kairos", ".venv/bin/kairos")
# A command line: environment assignments, then one of _PROGRAMS. Anything else (prose in an
# indented list continuation, other programs) is not split at all: shlex would choke on an
# apostrophe there.
_COMMAND_LINE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\.venv/bin/)?kairos(?:\s|$)")


def _code_lines(text: str) -> list[str]:
    """Lines of fenced and indented code blocks, backslash continuations joined."""
    lines: list[str] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.strip()
            else:
                lines.append(line.strip())
    return lines


def readme_commands(text: str) -> list[list[str]]:
    """The argument vectors (program name dropped) of every kairos command the README shows."""
    # Inline commands in prose with arguments, e.g. `kairos up --nodes nodes.yaml ...`; not bare
    # names (`kairos profile`) nor synopses that use [optional] or a|b notation.
    inline = [m for m in re.findall(r"`([^`\n]+)`", text) if not re.search(r"[\[|]|\.\.\.", m)]
    commands: list[list[str]] = []
    for line, min_tokens in [*((line, 2) for line in _code_lines(text)), *((m, 3) for m in inline)]:
        if not _COMMAND_LINE.match(line):
            continue
        tokens = shlex.split(line, comments=True)
        while tokens and _ENV_ASSIGNMENT.match(tokens[0]):
            tokens.pop(0)
        if len(tokens) >= min_tokens and tokens[0] in _PROGRAMS:
            commands.append(tokens[1:])
    return commands


COMMANDS = readme_commands(README.read_text())


def _parse(argv: list[str]) -> None:
    """Parse ``kairos ARGV`` as main() does, down to the component's own parser; raises
    SystemExit (argparse's error) when a flag or value is wrong."""
    parser = cli.build_parser()
    args = cli.parse_command_line(parser, argv)
    if getattr(args, "component", None) is not None:
        cli.component_parser(args.component).parse_args(args.component_argv)


def test_the_readme_documents_the_node_recipe_and_each_subcommand() -> None:
    # Guards the extraction itself: a README rewrite that hides the commands fails here.
    documented = {argv[0] if argv[0] != "--log-level" else argv[2] for argv in COMMANDS}
    assert {"sim", "up", "replay", "profile", "heartbeat", "sidecar"} <= documented
    assert next(a for a in COMMANDS if a[0] == "heartbeat")[:3] == ["heartbeat", "--node-id", "p0"]


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a)[:60] for a in COMMANDS])
def test_each_readme_command_line_parses(argv: list[str]) -> None:
    _parse(argv)


def _help_of(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 0
    return out.getvalue()


COMMAND_PREFIXES = sorted(
    {tuple(a[:2]) if a[0] == "profile" else (a[0],) for a in COMMANDS if a[0] != "--log-level"}
    | {(name,) for name in ("dispatcher", "sidecar", "heartbeat", "emulated-node", "tiny-model")}
)


@pytest.mark.parametrize("prefix", COMMAND_PREFIXES, ids=[" ".join(p) for p in COMMAND_PREFIXES])
def test_each_documented_command_answers_help(prefix: tuple[str, ...]) -> None:
    text = _help_of([*prefix, "--help"])
    assert text.startswith("usage:")


def test_a_component_gets_its_flags_in_order_and_unknown_ones_still_fail() -> None:
    parser = cli.build_parser()
    args = cli.parse_command_line(parser, ["--log-level", "debug", "sidecar", "--port", "0", "--host", "h"])
    assert (args.log_level, args.component, args.component_argv) == ("DEBUG", "sidecar", ["--port", "0", "--host", "h"])
    with pytest.raises(SystemExit):
        cli.component_parser("sidecar").parse_args(["--no-such-flag"])
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        cli.parse_command_line(cli.build_parser(), ["up", "--bogus"])
