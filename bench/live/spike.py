"""A spike: N streaming completions opened at once against ``kairos up``, each one classed by
what its client got.

For each N (default 2,000 and 5,000) and each arm (admission control on, and off with
``KAIROS_DISPATCHER_ADMISSION=off``), a fresh ``kairos up --time-scale 20`` (one dispatcher, 2P2D)
is started from a source tree (``--tree``, default this checkout: ``--tree /tmp/spike-before``
measures another commit), N clients connect and each sends one streamed completion at once, and
every client's outcome is one of:

- ``served``: a 200 whose SSE stream ended with ``data: [DONE]`` and the chunked terminator;
- ``shed``: a 429 or 503 with an OpenAI-style JSON error body (``Retry-After`` counted apart);
- ``other``: any other status, or a 429/503 that is not such JSON;
- ``reset``: the connection closed or reset before a complete answer;
- ``hung``: no complete answer within ``--deadline-s`` (60 s).

Also: p50/max latency of the served and of the shed (to the last byte), the peak RSS of Envoy and
the dispatcher during the spike (``/proc``), goodput during the spike (completion tokens of served
streams per second, from the first request sent to the last served stream's end), and whether
the cluster serves afterwards (five plain requests, each a 200); who answered each refusal (the
bodies counted: Envoy's name its reason, e.g. ``overflow``, ``per-message_timeout_exceeded``) and
whether a reset came before or after a status line. Prints a table and writes
``bench/results/spike.json``.

    .venv/bin/python -m bench.live.spike                       # both N, both arms, this checkout
    git worktree add /tmp/spike-before HEAD               # the tree before a change, then:
    .venv/bin/python -m bench.live.spike --tree /tmp/spike-before --arms off --json bench/results/spike-before.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness.results import write_result
from kairos.launcher.processes import free_port

REPO = Path(__file__).resolve().parents[2]
SHED_STATUSES = (429, 503)
TOP_LINE = re.compile(r"kairos top --dispatcher (http://[\d.]+:\d+)")
ADMISSION_ENV = "KAIROS_DISPATCHER_ADMISSION"  # DispatcherConfig.admission, from the environment


@dataclass(slots=True)
class Outcome:
    kind: str  # served, shed, other, reset, hung
    status: int = 0
    latency_s: float = 0.0
    completion_tokens: int = 0
    retry_after: bool = False
    detail: str = ""


@dataclass
class Spike:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


def _request(port: int, max_tokens: int, i: int) -> bytes:
    body = json.dumps(
        {
            "model": "kairos-tiny-llama",
            "prompt": f"spike {i}: the quick brown fox jumps over the lazy dog " * 4,
            "max_tokens": max_tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _read_answer(
    reader: asyncio.StreamReader, seen: list[int] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and the whole body (chunked or of a declared length) of one response;
    ``seen`` gets the status as soon as it is read (what a reset cut short)."""
    status_line = await reader.readuntil(b"\r\n")
    status = int(status_line.split()[1])
    if seen is not None:
        seen.append(status)
    headers: dict[str, str] = {}
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                return status, headers, bytes(body)
            body += chunk[:-2]
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    return status, headers, await reader.read()  # to the close


def _classify(status: int, headers: dict[str, str], body: bytes, latency_s: float) -> Outcome:
    if status == 200:
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        if not events or events[-1].strip() != b"[DONE]":
            return Outcome("reset", status, latency_s, detail="stream without [DONE]")
        tokens = sum(1 for e in events[:-1] if b'"text"' in e)
        return Outcome("served", status, latency_s, completion_tokens=tokens)
    try:
        error = json.loads(body)["error"]
        shaped = isinstance(error, dict) and "message" in error and "type" in error
    except (ValueError, KeyError, TypeError):
        shaped = False
    kind = "shed" if status in SHED_STATUSES and shaped else "other"
    detail = body[:400].decode("utf-8", "replace")
    return Outcome(kind, status, latency_s, retry_after="retry-after" in headers, detail=detail)


async def _one(port: int, request: bytes, deadline_s: float, started: threading.Event) -> Outcome:
    t0 = time.perf_counter()
    writer = None
    seen: list[int] = []
    try:
        async with asyncio.timeout(deadline_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            writer.write(request)
            status, headers, body = await _read_answer(reader, seen)
        return _classify(status, headers, body, time.perf_counter() - t0)
    except TimeoutError:
        return Outcome("hung", latency_s=time.perf_counter() - t0)
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as exc:
        after = f"after a {seen[0]}" if seen else "before a status"
        return Outcome("reset", latency_s=time.perf_counter() - t0, detail=f"{type(exc).__name__} {after}")
    finally:
        if writer is not None:
            writer.close()


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _watch_rss(pids: dict[str, int], peak: dict[str, float], stop: threading.Event) -> None:
    while not stop.wait(0.1):
        for name, pid in pids.items():
            peak[name] = max(peak.get(name, 0.0), _rss_mb(pid))


async def spike(port: int, n: int, max_tokens: int, deadline_s: float, pids: dict[str, int]) -> Spike:
    requests = [_request(port, max_tokens, i) for i in range(n)]
    result = Spike(peak_rss_mb={name: _rss_mb(pid) for name, pid in pids.items()})
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_rss, args=(pids, result.peak_rss_mb, stop), daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    result.outcomes = await asyncio.gather(*(_one(port, r, deadline_s, stop) for r in requests))
    result.wall_s = time.perf_counter() - t0
    stop.set()
    watcher.join()
    return result


def summarize(n: int, s: Spike) -> dict[str, Any]:
    kinds = Counter(o.kind for o in s.outcomes)
    served = sorted(o.latency_s for o in s.outcomes if o.kind == "served")
    shed = sorted(o.latency_s for o in s.outcomes if o.kind == "shed")
    # Goodput during the spike: the served streams' tokens over the time until the last of them ended.
    served_until = max(served, default=0.0)
    tokens = sum(o.completion_tokens for o in s.outcomes if o.kind == "served")

    def pct(xs: list[float], q: float) -> float | None:
        return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None

    return {
        "n": n,
        **{k: kinds.get(k, 0) for k in ("served", "shed", "other", "reset", "hung")},
        "shed_by_status": dict(Counter(str(o.status) for o in s.outcomes if o.kind == "shed")),
        "shed_with_retry_after": sum(1 for o in s.outcomes if o.kind == "shed" and o.retry_after),
        "other_examples": sorted({f"{o.status} {o.detail}" for o in s.outcomes if o.kind == "other"})[:5],
        # Who answered each refusal: Envoy's replies name their reason in the message (e.g.
        # no_healthy_upstream, ext_proc_error_gRPC_error_8), the dispatcher's say why it refused.
        "shed_examples": dict(Counter(f"{o.status} {o.detail.strip()}" for o in s.outcomes if o.kind == "shed")),
        "reset_examples": dict(Counter(o.detail for o in s.outcomes if o.kind == "reset")),
        "reset_p50_s": pct(sorted(o.latency_s for o in s.outcomes if o.kind == "reset"), 0.5),
        "served_p50_s": pct(served, 0.5),
        "served_max_s": pct(served, 1.0),
        "shed_p50_s": pct(shed, 0.5),
        "shed_max_s": pct(shed, 1.0),
        "wall_s": round(s.wall_s, 2),
        "goodput_tokens_per_s": round(tokens / served_until, 1) if served_until else 0.0,
        "served_per_s": round(len(served) / served_until, 1) if served_until else 0.0,
        "peak_rss_mb": {k: round(v, 1) for k, v in s.peak_rss_mb.items()},
    }


# ---------------------------------------------------------------------------------------------
# The cluster: `kairos up` from a source tree, in its own process group
# ---------------------------------------------------------------------------------------------
def _python_path(tree: Path) -> str:
    """A PYTHONPATH that imports ``kairos`` (and its subpackages kept at the top of the tree) from
    ``tree``: a folder of links laid out as the installed package is (pyproject's package-dir)."""
    if tree.resolve() == REPO:
        return os.environ.get("PYTHONPATH", "")
    shim = Path(tempfile.mkdtemp(prefix="spike-tree-"))
    pkg = shim / "kairos"
    pkg.mkdir()
    for item in (tree / "kairos").iterdir():
        (pkg / item.name).symlink_to(item)
    for sub, folder in (
        ("extproc", "extproc"),
        ("nodeagent", "nodeagent"),
        ("sim", "sim"),
        ("profiling", "profiling"),
        ("envoy", "envoy"),
        ("observability", "compose/observability"),
    ):
        if (tree / folder).is_dir() and not (pkg / sub).exists():
            (pkg / sub).symlink_to(tree / folder)
    # This environment's editable install of kairos would still answer for its mapped subpackages
    # (kairos.sim, ...): take its finder out at start-up, in every process of the cluster.
    (shim / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
    )
    return str(shim)


class Cluster:
    def __init__(self, tree: Path, admission: bool, time_scale: float, workdir: Path) -> None:
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": _python_path(tree), "PYTHONUNBUFFERED": "1"}
        if not admission:
            env[ADMISSION_ENV] = "off"
        self.workdir = workdir
        argv = [sys.executable, "-m", "kairos", "up", "--time-scale", f"{time_scale:g}", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*argv, "--workdir", str(workdir)],
            cwd=workdir,  # not the tree: its kairos/ folder alone lacks the mapped subpackages
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.metrics_url = ""
        self.lines: list[str] = []
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(180.0) or not self.metrics_url:
            self.stop()
            raise RuntimeError("kairos up did not become ready:\n" + "".join(self.lines[-30:]))

    def _read(self, ready: threading.Event) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := TOP_LINE.search(line):  # printed after the ready line
                self.metrics_url = m.group(1)
                ready.set()
        ready.set()  # it exited: the caller sees no metrics URL

    def pids(self) -> dict[str, int]:
        """Envoy's and the dispatcher's pids: children of ``kairos up``, by command line."""
        found: dict[str, int] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().split(b"\0")
                parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
                if parent != self.proc.pid:  # each child of kairos up runs in a session of its own
                    continue
            except OSError:
                continue
            if cmdline and cmdline[0].endswith(b"envoy"):
                found["envoy"] = int(proc.name)
            elif b"kairos.extproc" in cmdline:
                found["dispatcher"] = int(proc.name)
        return found

    def log_count(self, name: str, needle: str) -> int:
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text(errors="replace").count(needle) if path.exists() else 0

    def shedding_metric(self) -> dict[str, float]:
        """The dispatcher's kairos_dispatcher_shed_total by reason (empty on a tree without it)."""
        import urllib.request

        try:
            text = urllib.request.urlopen(f"{self.metrics_url}/metrics", timeout=5).read().decode()
        except OSError:
            return {}
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("kairos_dispatcher_shed_total{"):
                labels, _, value = line.rpartition(" ")
                out[labels[len("kairos_dispatcher_shed_total") :]] = float(value)
        return out

    def serves(self, n: int = 5) -> bool:
        async def go() -> list[Outcome]:
            return [await _one(self.port, _request(self.port, 4, 10**6 + i), 30.0, threading.Event()) for i in range(n)]

        return all(o.kind == "served" for o in asyncio.run(go()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # kairos up stops its children, then exits
            try:
                self.proc.wait(60.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_arm(tree: Path, admission: bool, n: int, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spike-") as tmp:
        cluster = Cluster(tree, admission, args.time_scale, Path(tmp))
        try:
            pids = cluster.pids()
            result = summarize(n, asyncio.run(spike(cluster.port, n, args.max_tokens, args.deadline_s, pids)))
            result["serves_after"] = cluster.serves()
            result["envoy_overflow_lines"] = cluster.log_count("envoy", "overflow")
            result["dispatcher_shed_total"] = cluster.shedding_metric()
        finally:
            cluster.stop()
    result["admission"] = admission
    return result


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'N':>5} {'admission':>9} {'served':>6} {'shed':>5} {'other':>5} {'hung':>5} {'reset':>5} "
        f"{'p50 s':>6} {'max s':>6} {'shed p50':>8} {'goodput tok/s':>13} {'envoy MB':>8} {'disp MB':>7} {'after':>5}"
    )
    out = [head]
    for r in rows:
        rss = r["peak_rss_mb"]
        out.append(
            f"{r['n']:>5} {'on' if r['admission'] else 'off':>9} {r['served']:>6} {r['shed']:>5} {r['other']:>5} "
            f"{r['hung']:>5} {r['reset']:>5} {r['served_p50_s'] or '-':>6} {r['served_max_s'] or '-':>6} "
            f"{r['shed_p50_s'] or '-':>8} {r['goodput_tokens_per_s']:>13} {rss.get('envoy', 0):>8} "
            f"{rss.get('dispatcher', 0):>7} {'yes' if r['serves_after'] else 'NO':>5}"
        )
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[2000, 5000], help="concurrent streams per spike")
    p.add_argument("--arms", nargs="+", choices=("on", "off"), default=["on", "off"], help="admission control")
    p.add_argument("--tree", type=Path, default=REPO, help="source tree to run kairos up from")
    p.add_argument("--time-scale", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--deadline-s", type=float, default=60.0, help="a stream not answered by then is hung")
    p.add_argument("--json", type=Path, help="default bench/results/spike.json")
    args = p.parse_args(argv)
    rows = [run_arm(args.tree, arm == "on", n, args) for n in args.n for arm in args.arms]
    print(_table(rows))
    write_result(
        "spike",
        {
            "command": shlex.join(["python", "-m", "bench.live.spike", *(argv if argv is not None else sys.argv[1:])]),
            "tree": str(args.tree),
            "commit": subprocess.run(
                ["git", "-C", str(args.tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "cluster": f"kairos up --time-scale {args.time_scale:g} (2P2D, one dispatcher)",
            "host": f"{os.cpu_count()} cores, shared with other work while it ran",
            "max_tokens": args.max_tokens,
            "deadline_s": args.deadline_s,
            "rows": rows,
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
