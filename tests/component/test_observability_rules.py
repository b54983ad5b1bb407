"""promtool (Debian's prometheus package; scripts/test.sh installs it) checks the rules, runs their
unit tests (compose/observability/kairos-rules.test.yml: each alert fires on its condition after
its ``for`` and not before) and checks the example Prometheus configuration."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.observability import OBSERVABILITY, PROMETHEUS_CONFIG, RULES, RULES_TEST

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)"
)


def promtool(*args: str) -> str:
    done = subprocess.run(["promtool", *args], cwd=OBSERVABILITY, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_promtool_checks_the_rules() -> None:
    assert "SUCCESS: 13 rules found" in promtool("check", "rules", str(RULES))


def test_promtool_runs_the_alert_unit_tests() -> None:
    assert "SUCCESS" in promtool("test", "rules", str(RULES_TEST))


def test_promtool_checks_the_example_config() -> None:
    assert "is valid prometheus config file syntax" in promtool("check", "config", str(PROMETHEUS_CONFIG))
