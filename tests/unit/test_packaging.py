"""What the kairos-gateway distribution carries: every file in its packages' folders ships (as a
module or as package data, pyproject.toml), product code never finds a file from where its own
module lies, and the observability files ``kairos up`` writes are the packaged ones, pointed at
its cluster. tests/e2e/test_installed_wheel.py builds the wheel, installs it and runs it."""

from __future__ import annotations

import fnmatch
import tokenize
import tomllib
from pathlib import Path

import pytest
import yaml

from kairos.launcher.observability import DASHBOARD, PROMETHEUS_CONFIG, write_observability

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
OBSERVABILITY = ROOT / "compose" / "observability"
# Files in a package's folder that are not runtime files, and why.
NOT_SHIPPED = {
    "compose/observability/kairos-rules.test.yml": "promtool's cases for the rules, run by the test suite",
}


def package_folders() -> dict[str, Path]:
    """Each package of the distribution and its folder: package-dir maps a package or a parent."""
    mapped = SETUPTOOLS["package-dir"]
    out: dict[str, Path] = {}
    for package in SETUPTOOLS["packages"]:
        parts = package.split(".")
        parent = next((i for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in mapped), None)
        if parent is None:
            out[package] = ROOT.joinpath(*parts)
        else:
            out[package] = ROOT / mapped[".".join(parts[:parent])] / Path(*parts[parent:])
    return out


def test_every_file_of_a_package_folder_ships_and_every_package_data_pattern_matches_one() -> None:
    folders = package_folders()
    patterns = {(package, pattern) for package, globs in SETUPTOOLS["package-data"].items() for pattern in globs}
    assert {package for package, _ in patterns} <= set(folders), "package-data names a package that is not shipped"
    unshipped, matched = [], set()
    for package, folder in folders.items():
        assert folder.is_dir(), f"{package}: no folder {folder}"
        for path in folder.rglob("*"):
            if not path.is_file() or "__pycache__" in path.parts or path.suffix == ".py":
                continue
            owner = max((f for f in folders.values() if path.is_relative_to(f)), key=lambda f: len(f.parts))
            if owner != folder:  # a subpackage's file: checked with that package
                continue
            relative = path.relative_to(folder).as_posix()
            hits = {(package, p) for p in SETUPTOOLS["package-data"].get(package, ()) if fnmatch.fnmatch(relative, p)}
            matched |= hits
            if not hits and path.relative_to(ROOT).as_posix() not in NOT_SHIPPED:
                unshipped.append(path.relative_to(ROOT).as_posix())
    assert unshipped == [], "runtime files the wheel would not carry: add them to package-data"
    assert patterns == matched, f"package-data patterns that match no file: {patterns - matched}"


def test_every_python_package_under_a_shipped_folder_ships() -> None:
    # setuptools ships the packages it is told of, not their subfolders: a new subpackage
    # (kairos/core/policies/) left out of the list would be missing from the wheel.
    folders = package_folders()
    shipped = set(folders.values())
    missing = sorted(
        init.parent.relative_to(ROOT).as_posix()
        for folder in shipped
        for init in folder.rglob("__init__.py")
        if "__pycache__" not in init.parts and init.parent not in shipped
    )
    assert missing == [], "Python packages the wheel would not carry: add them to [tool.setuptools] packages"


def test_the_runtime_files_live_in_package_folders() -> None:
    # What kairos up renders and writes: the Envoy template and the observability files.
    folders = package_folders()
    assert (folders["kairos.envoy"] / "envoy.yaml.j2").is_file()
    for name in (PROMETHEUS_CONFIG, "kairos-rules.yml", DASHBOARD):
        assert (folders["kairos.observability"] / name).is_file(), name


def test_product_code_never_finds_a_file_from_where_its_module_lies() -> None:
    # An installed package lies in site-packages: a path walked up from __file__ leaves it.
    # Files are package data, read with importlib.resources.
    found = []
    for folder in sorted(set(package_folders().values())):
        for path in folder.glob("*.py"):
            with tokenize.open(path) as source:
                for token in tokenize.generate_tokens(source.readline):
                    if token.type == tokenize.NAME and token.string == "__file__":
                        found.append(f"{path.relative_to(ROOT)}:{token.start[0]}")
    assert found == []


def test_kairos_up_writes_the_packaged_observability_files_pointed_at_its_own_targets(tmp_path: Path) -> None:
    targets = tmp_path / "prometheus-targets.json"
    path = write_observability(tmp_path / "observability", targets)
    assert path == tmp_path / "observability" / PROMETHEUS_CONFIG
    text = path.read_text()
    assert f"prometheus --config.file={path}\n" in text
    written = yaml.safe_load(text)
    expected = yaml.safe_load((OBSERVABILITY / PROMETHEUS_CONFIG).read_text())
    discovery = [sd for job in expected["scrape_configs"] for sd in job.get("file_sd_configs", ())]
    assert discovery, "the packaged config reads its targets from a file"
    for sd in discovery:
        sd["files"] = [str(targets)]
    assert written == expected  # the packaged config, but for the targets file
    # Its rules lie beside it (Prometheus resolves rule_files from the config's folder), and the dashboard.
    assert written["rule_files"]
    for name in (*written["rule_files"], DASHBOARD):
        assert (path.parent / name).read_bytes() == (OBSERVABILITY / name).read_bytes(), name


def test_a_relative_targets_path_is_written_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `kairos up --workdir run1`: Prometheus runs from anywhere, so the config names the file whole.
    monkeypatch.chdir(tmp_path)
    path = write_observability(Path("run1") / "observability", Path("run1") / "prometheus-targets.json")
    config = yaml.safe_load(path.read_text())
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "run1" / "prometheus-targets.json")]
