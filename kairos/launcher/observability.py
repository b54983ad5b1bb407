"""The operator's files for a running cluster: the Prometheus config, alert rules and Grafana
dashboard of compose/observability (package data, ``kairos.observability``), written into a
``kairos up`` workdir with the config's ``file_sd`` reading that cluster's targets file, so that
an installed Kairos needs no checkout to be watched."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path

import yaml

PACKAGE = "kairos.observability"
PROMETHEUS_CONFIG = "prometheus.yml"
RULES = "kairos-rules.yml"
DASHBOARD = "kairos-dashboard.json"
_HEADER = (
    "# Written by `kairos up` from kairos.observability's prometheus.yml, with file_sd reading this\n"
    "# cluster's targets. Run: prometheus --config.file={config}\n"
)


def packaged(name: str) -> Traversable:
    """One of the packaged files (``PROMETHEUS_CONFIG``, ``RULES``, ``DASHBOARD``)."""
    return resources.files(PACKAGE) / name


def write_observability(folder: Path, targets: Path) -> Path:
    """Write the rules and the dashboard into ``folder``, and a Prometheus config there that
    loads the rules and scrapes what ``targets`` (Prometheus's ``file_sd`` format) lists; returns
    the config's path."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (RULES, DASHBOARD):
        (folder / name).write_bytes(packaged(name).read_bytes())
    config = yaml.safe_load(packaged(PROMETHEUS_CONFIG).read_text(encoding="utf-8"))
    for job in config["scrape_configs"]:
        for discovery in job.get("file_sd_configs", ()):
            discovery["files"] = [str(targets.resolve())]
    path = folder / PROMETHEUS_CONFIG
    # rule_files stay relative: Prometheus reads them from the config's own folder.
    path.write_text(_HEADER.format(config=path) + yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path
