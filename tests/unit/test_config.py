"""kairos.common.config: one declaration per setting, its flag, variable and YAML key derived."""

from __future__ import annotations

import argparse
import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kairos.common.config import (
    ConfigSource,
    add_flags,
    config_mapping,
    flag_values,
    internal,
    load_config,
    part,
    setting,
    settings_of,
)
from kairos.common.errors import ConfigError


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition("/")
    return int(a), int(b)


@dataclass(frozen=True)
class Limits:
    timeout_s: float = setting(1.0, help="how long")
    size: int = setting(8, help="how big")

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"size must be >= 1, got {self.size}")


@dataclass(frozen=True)
class Rules:
    stale_s: float = setting(0.5, help="stale after")
    names: tuple[str, ...] = setting((), help="names, comma-separated")


@dataclass(frozen=True)
class Inner:
    stale_s: float = setting(0.5, help="stale after, for the inner part too")
    rules: Rules = part(Rules, help="rules")


@dataclass(frozen=True)
class Root:
    host: str = setting("127.0.0.1", help="where", flags=("--host", "--bind"))
    colour: Colour = setting(Colour.RED, help="which colour")
    verbose: bool = setting(False, help="talk more", form="switch")
    caching: bool = setting(True, help="cache", flags=("--enable-caching",), form="negatable")
    pair: tuple[int, int] = setting((1, 2), help="A/B", parse=_pair, format=lambda p: f"{p[0]}/{p[1]}")
    limit: int | None = setting(None, help="an integer, or none")
    limits: Limits = part(Limits, help="limits", prefix="limit_")
    inner: Inner = part(Inner, help="inner")
    secret_port: int = internal(0)


def test_a_part_is_flattened_with_its_prefix_and_shared_names_set_every_field() -> None:
    names = settings_of(Root)
    assert "limit_timeout_s" in names and "limit_size" in names and "timeout_s" not in names
    assert names["stale_s"].paths == (("inner", "stale_s"), ("inner", "rules", "stale_s"))
    assert "secret_port" not in names
    config = load_config(Root, overrides={"stale_s": "2", "limit_size": "3"})
    assert config.inner.stale_s == config.inner.rules.stale_s == 2.0
    assert config.limits == Limits(size=3)


@dataclass(frozen=True)
class Other:
    stale_s: float = setting(9.0, help="another default")


@dataclass(frozen=True)
class Clash:
    a: Inner = part(Inner, help="a")
    b: Other = part(Other, help="b")


@dataclass(frozen=True)
class Launcher:
    inner: Inner = part(Inner, help="inner", omit=("names",))


@dataclass(frozen=True)
class Bare:
    x: int = 1


def test_two_parts_declaring_one_name_differently_is_a_declaration_error() -> None:
    with pytest.raises(TypeError, match="stale_s"):
        settings_of(Clash)


def test_omitted_settings_are_the_composites_to_set() -> None:
    assert "names" not in settings_of(Launcher)
    with pytest.raises(ConfigError, match="unknown setting 'names'"):
        load_config(Launcher, overrides={"names": "a"})


def test_precedence_is_defaults_yaml_environment_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"svc": {"limit_size": 4, "host": "yaml", "names": ["a", "b"]}}))
    env = {"SVC_HOST": "env", "SVC_COLOUR": "blue"}
    config = load_config(Root, path, section="svc", env_prefix="SVC_", overrides={"colour": "red"}, environ=env)
    assert (config.host, config.colour, config.limits.size) == ("env", Colour.RED, 4)
    assert config.inner.rules.names == ("a", "b")


def test_unknown_keys_and_bad_values_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("svc: {sizes: 4}\n")
    with pytest.raises(ConfigError, match="unknown keys \\['sizes'\\]"):
        load_config(Root, path, section="svc")
    with pytest.raises(ConfigError, match="'purple' is not one of"):
        load_config(Root, overrides={"colour": "purple"})
    with pytest.raises(ConfigError, match="size must be >= 1"):
        load_config(Root, overrides={"limit_size": "0"})
    with pytest.raises(ConfigError, match=r"Root\.pair"):
        load_config(Root, overrides={"pair": "x/y"})


def test_flags_are_derived_with_their_help_spellings_and_forms() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Root)
    args = parser.parse_args(
        [
            "--bind",
            "0.0.0.0",
            "--verbose",
            "--no-enable-caching",
            "--limit-size",
            "5",
            "--pair",
            "3/4",
            "--limit",
            "none",
        ]
    )
    values = flag_values(args, Root)
    assert values == {
        "host": "0.0.0.0",
        "verbose": True,
        "caching": False,
        "limit_size": "5",
        "pair": "3/4",
        "limit": "none",
    }
    config = load_config(Root, overrides=values)
    assert (config.host, config.verbose, config.caching, config.limits.size, config.pair) == (
        "0.0.0.0",
        True,
        False,
        5,
        (3, 4),
    )
    assert config.limit is None
    help_text = parser.format_help()
    assert "talk more (default off)" in help_text and "--stale-s" in help_text


def test_a_setting_without_help_has_no_flag() -> None:
    with pytest.raises(TypeError, match="'x' has no help text"):
        add_flags(argparse.ArgumentParser(), Bare)
    assert load_config(Bare, overrides={"x": "2"}).x == 2  # still a setting: a YAML key and a variable


def test_the_mapping_reads_back_to_an_equal_config(tmp_path: Path) -> None:
    config = dataclasses.replace(
        load_config(Root, overrides={"stale_s": "3", "names": "x,y", "limit_size": "7"}),
        colour=Colour.BLUE,
        pair=(5, 6),
    )
    mapping = config_mapping(config)
    assert mapping == {"stale_s": 3.0, "names": ["x", "y"], "limit_size": 7, "colour": "blue", "pair": "5/6"}
    source = ConfigSource(Root, section="root", env_prefix="ROOT_", module="x")
    path = source.write(tmp_path / "root.yaml", config, skip=("limit_size",))
    assert source.load(path, environ={"ROOT_LIMIT_SIZE": "7"}) == config
    assert source.command(path, "DEBUG")[-4:] == ["--config", str(path), "--log-level", "DEBUG"]
    assert source.env_var("limit_size") == "ROOT_LIMIT_SIZE"


def test_a_shared_setting_whose_fields_differ_cannot_be_written() -> None:
    config = Root(inner=Inner(stale_s=1.0))
    with pytest.raises(ValueError, match="shared setting 'stale_s'"):
        config_mapping(config)
