"""`kairos up` as a user runs it: the printed curl line works and SIGTERM leaves nothing behind."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from kairos.processes import free_port


def _processes() -> list[str]:
    """Every live process as "pid args", untruncated."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_kairos_up_serves_the_printed_curl_line_and_stops_cleanly(tmp_path: Path, model_dir: Path) -> None:
    port = free_port()
    workdir = tmp_path / "up"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kairos.cli", "up", "--port", str(port), "--workdir", str(workdir),
         "--model-dir", str(model_dir), "--time-scale", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.strip().startswith("curl "):
            break
    else:
        proc.kill()
        raise AssertionError("".join(lines))
    curl = lines[-1].strip()
    assert f"127.0.0.1:{port}" in curl
    result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=30, check=True)
    assert "HTTP/1.1 200" in result.stdout and '"completion_tokens":16' in result.stdout

    ours = [a for a in _processes() if str(workdir) in a or str(model_dir) in a]
    assert ours, "the cluster's processes should be visible while it runs"

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    time.sleep(0.5)
    left = [a for a in _processes() if str(workdir) in a or (str(model_dir) in a and "pytest" not in a)]
    assert left == [], left
    assert os.path.exists(workdir / "logs")
