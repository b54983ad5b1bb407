"""A Docker daemon of the test's own, and docker compose against it.

The daemon runs as root with its sockets, pid file and exec root under the test's folder, and no
bridge network or firewall rules (``--bridge=none --iptables=false``): containers use the host's
network, as compose/docker-compose.yml asks. Its data root (images, build cache) lives in
``.cache/compose/docker`` (ignored by git), so a second run reuses the images; CI's clean clone
builds them cold. Stopping it leaves nothing: containers and networks go with ``compose down``,
the daemon by its PID, then any mount under its folders and any process still naming them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "compose"
# Debian's docker.io: its client matches its daemon (another `docker` may come first on PATH).
DOCKER_BIN = Path("/usr/bin")
TOOLS = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}


def missing_tools() -> list[str]:
    """Debian packages this tier needs that are not installed (scripts/bootstrap.sh installs them)."""
    missing = [pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if not (DOCKER_BIN / "docker").exists():
        missing.append("docker.io")
    return sorted(set(missing))


def storage_driver() -> str:
    """overlay2 where the kernel has overlayfs (a copy-on-write layer per container), else vfs
    (a full copy of the image per container: slower and bigger, but it runs anywhere)."""
    filesystems = Path("/proc/filesystems").read_text()
    return "overlay2" if "\toverlay\n" in filesystems else "vfs"


class DockerDaemon:
    def __init__(self, folder: Path, data_root: Path = CACHE / "docker") -> None:
        self.folder = folder
        self.data_root = data_root
        self.exec_root = folder / "exec"
        self.socket = folder / "docker.sock"
        self.pidfile = folder / "docker.pid"
        self.log = folder / "dockerd.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment for docker and docker-compose: this daemon, the package's client first."""
        env = dict(os.environ)
        env["DOCKER_HOST"] = f"unix://{self.socket}"
        env["PATH"] = f"{DOCKER_BIN}:/usr/sbin:{env.get('PATH', '')}"
        env.pop("DOCKER_CONTEXT", None)
        env.pop("DOCKER_BUILDKIT", None)  # the legacy builder: --network host works without buildx
        return env

    def start(self, timeout_s: float = 120.0) -> DockerDaemon:
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        argv = [
            "dockerd",
            "--data-root", str(self.data_root),
            "--exec-root", str(self.exec_root),
            "-H", f"unix://{self.socket}",
            "--pidfile", str(self.pidfile),
            "--storage-driver", storage_driver(),
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)

        def ready() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"dockerd exited ({self.process.returncode}):\n{self.log.read_text()[-3000:]}")
            return self.docker("version", check=False, timeout=30).returncode == 0

        wait_until(ready, timeout_s=timeout_s, what="dockerd answering", interval_s=0.5)
        return self

    def docker(self, *args: str, check: bool = True, timeout: float = 600.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(DOCKER_BIN / "docker"), *args], env=self.env, capture_output=True, text=True, timeout=timeout,
            check=check,
        )  # fmt: skip

    def stop(self, timeout_s: float = 60.0) -> tuple[list[int], list[str]]:
        """Stop the daemon by its PID and unmount its network namespace files (dockerd leaves
        ``EXEC_ROOT/netns/*`` mounted), then end and unmount whatever else still lives under its
        folders: those are returned, as leaks (containers compose did not remove, say)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        netns = str(self.exec_root / "netns") + "/"
        for mount in self.leftover_mounts():
            if mount.startswith(netns):
                subprocess.run(["umount", mount], capture_output=True, check=False)
        processes, mounts = self.leftover_processes(), self.leftover_mounts()
        for pid in processes:  # containerd shims of containers compose did not remove
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for mount in reversed(mounts):
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
        return processes, mounts

    def _roots(self) -> tuple[str, ...]:
        return (str(self.exec_root), str(self.data_root), str(self.socket))

    def leftover_mounts(self) -> list[str]:
        mounts = []
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(self._roots()):
                mounts.append(point)
        return mounts

    def leftover_processes(self) -> list[int]:
        """Processes whose command line names this daemon's folders (dockerd, containerd, shims)."""
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(root in cmdline for root in self._roots()):
                pids.append(int(proc.name))
        return pids


class Compose:
    """``docker-compose`` (1.29, Debian's) with this project's files, env file and daemon."""

    def __init__(self, daemon: DockerDaemon, files: Sequence[Path], env_file: Path, project: str,
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        self.daemon = daemon
        self.files = list(files)
        self.env_file = env_file
        self.project = project
        self.extra_env = env or {}

    def argv(self, *args: str) -> list[str]:
        files = [arg for f in self.files for arg in ("-f", str(f))]
        return ["docker-compose", "--env-file", str(self.env_file), "-p", self.project, *files, *args]

    def run(self, *args: str, check: bool = True, timeout: float = 900.0) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self.argv(*args), env={**self.daemon.env, **self.extra_env}, capture_output=True, text=True,
            timeout=timeout, cwd=ROOT,
        )  # fmt: skip
        if check and proc.returncode != 0:
            command = " ".join(self.argv(*args))
            raise AssertionError(f"{command} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def states(self) -> dict[str, dict[str, str]]:
        """Each service's container: status, health, restart count, main PID and id; two docker
        calls for them all (docker-compose itself takes a second of CPU per call)."""
        ids = self.daemon.docker(
            "ps", "-aq", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}"
        ).stdout.split()
        if not ids:
            return {}
        fields = (
            '{{index .Config.Labels "com.docker.compose.service"}}',
            "{{.State.Status}}",
            '{{with index .State "Health"}}{{.Status}}{{else}}none{{end}}',  # no healthcheck: no key
            "{{.RestartCount}}",
            "{{.State.Pid}}",
            "{{.Id}}",
        )
        out = self.daemon.docker("inspect", "-f", " ".join(fields), *ids).stdout.splitlines()
        keys = ("status", "health", "restarts", "pid", "id")
        return {line.split()[0]: dict(zip(keys, line.split()[1:], strict=True)) for line in out}

    def state(self, service: str) -> dict[str, str]:
        return self.states()[service]
