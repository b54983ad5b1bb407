from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest

from kairos.common.config import ConfigSource, setting
from kairos.common.errors import ConfigError
from kairos.common.runtime import Service, configure_logging, freeze_startup_heap, run


def test_run_uses_uvloop_where_it_is_installed() -> None:
    pytest.importorskip("uvloop")

    async def loop_module() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert run(loop_module()).startswith("uvloop")


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_startup_heap_collects_garbage_then_freezes_what_lives() -> None:
    kept, garbage = _Node(), _Node()
    garbage.other, garbage.other.other = _Node(), garbage  # a cycle only the collector frees
    gone = weakref.ref(garbage)
    del garbage
    try:
        freeze_startup_heap()
        assert gone() is None  # collected, not frozen for good
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of every generation's scan
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class _Settings:
    name: str = setting("default", help="its name")
    port: int = setting(1, help="its port")


def _service(serve) -> Service[_Settings]:  # type: ignore[no-untyped-def]
    return Service("toy", "a toy service", ConfigSource(_Settings, "toy", "KAIROS_TOY_", "toy"), serve)


def test_a_service_serves_its_settings_from_yaml_environment_and_flags_until_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served: list[tuple[_Settings, bool]] = []

    async def serve(settings: _Settings, stop: asyncio.Event) -> None:
        served.append((settings, stop.is_set()))

    config = tmp_path / "toy.yaml"
    config.write_text("toy:\n  name: from-yaml\n  port: 2\n")
    monkeypatch.setenv("KAIROS_TOY_PORT", "3")
    service = _service(serve)
    args = service.parser().parse_args(["--config", str(config), "--log-level", "warning"])
    assert args.log_level == "WARNING"
    assert service.run(args, {"name": "from-flags"}) == 0
    assert served == [(_Settings(name="from-flags", port=3), False)]
    served.clear()
    assert service.main(["--config", str(config), "--name", "from-main"]) == 0  # the flags derived from _Settings
    assert served == [(_Settings(name="from-main", port=3), False)]


@pytest.mark.parametrize(
    ("failure", "status", "said"),
    [
        (ConfigError("port must be > 0"), 2, "kairos toy: error: port must be > 0"),
        (OSError(98, "address already in use"), 1, "kairos toy: error: [Errno 98] address already in use"),
    ],
)
def test_a_failing_service_says_why_in_one_line_and_exits_with_its_status(
    failure: Exception, status: int, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    async def serve(settings: _Settings, stop: asyncio.Event) -> None:
        raise failure

    service = _service(serve)
    assert service.run(service.parser().parse_args([]), {}) == status
    assert capsys.readouterr().err.splitlines() == [said]


def test_an_unknown_setting_is_an_error_before_serving(capsys: pytest.CaptureFixture[str]) -> None:
    async def serve(settings: _Settings, stop: asyncio.Event) -> None:
        raise AssertionError("never served")

    service = _service(serve)
    assert service.run(service.parser().parse_args([]), {"colour": "red"}) == 2
    assert capsys.readouterr().err.startswith("kairos toy: error: unknown setting 'colour'")


def test_a_components_log_level_applies_under_the_kairos_command(monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # as `kairos` set it up
    monkeypatch.setattr(root, "level", logging.INFO)
    configure_logging(None)  # no --log-level of its own: the kairos command's stays
    assert root.level == logging.INFO
    configure_logging("DEBUG")  # a second basicConfig would have been ignored
    assert root.level == logging.DEBUG
