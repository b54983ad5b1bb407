"""The ``kairos`` command line: a component's own flags reach it untouched."""

from __future__ import annotations

from pathlib import Path

import pytest

from kairos.launcher.cli import build_parser, component_parser, main, parse_command_line


def parse_args(argv: list[str]):  # type: ignore[no-untyped-def]
    return parse_command_line(build_parser(), argv)


@pytest.mark.parametrize(
    ("argv", "command", "rest"),
    [
        # A component's flags first: argparse's REMAINDER alone calls them unrecognized.
        (["sidecar", "--host", "127.0.0.1", "--port", "8200"], "sidecar", ["--host", "127.0.0.1", "--port", "8200"]),
        (["emulated-node", "--node-id", "d0", "--help"], "emulated-node", ["--node-id", "d0", "--help"]),
        (["--log-level", "DEBUG", "heartbeat", "--node-id", "p0"], "heartbeat", ["--node-id", "p0"]),
        (["tiny-model", "/models/tiny"], "tiny-model", ["/models/tiny"]),
        (["dispatcher"], "dispatcher", []),
    ],
)
def test_a_components_arguments_pass_through(argv: list[str], command: str, rest: list[str]) -> None:
    args = parse_args(argv)
    assert (args.command, args.component_argv) == (command, rest)


def test_the_global_log_level_stays_the_commands() -> None:
    args = parse_args(["--log-level", "WARNING", "dispatcher", "--log-level", "DEBUG"])
    assert args.log_level == "WARNING" and args.component_argv == ["--log-level", "DEBUG"]


def test_other_subcommands_keep_their_own_parsers() -> None:
    assert parse_args(["sim", "--rps", "6,7"]).rps == (6.0, 7.0)
    with pytest.raises(SystemExit):
        parse_args(["sim", "--no-such-flag"])


@pytest.mark.parametrize(("command", "flag"), [("sidecar", "--local-vllm"), ("emulated-node", "--kv-capacity-tokens")])
def test_kairos_component_help_is_the_components(command: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # What compose's services run: `kairos sidecar --host ...` must reach the sidecar's parser.
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert flag in capsys.readouterr().out


@pytest.mark.parametrize("name", ["dispatcher", "sidecar", "heartbeat", "emulated-node"])
def test_every_service_parser_is_built_the_same_way(name: str) -> None:
    parser = component_parser(name)
    assert parser.prog == f"kairos {name}"
    args = parser.parse_args(["--config", "cluster.yaml", "--log-level", "debug"])
    assert (args.config, args.log_level) == (Path("cluster.yaml"), "DEBUG")
