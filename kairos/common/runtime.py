"""Process plumbing shared by the long-running components: how each service starts.

Every service module (the dispatcher, the sidecar, the heartbeat publisher, the emulated node)
declares its :class:`Service`: its configuration dataclass (whose flags, environment variables and
YAML section :mod:`kairos.common.config` derives) and its ``serve``. :meth:`Service.main` is the
whole command line: logging, the settings (defaults < YAML < environment < flags), the event loop,
SIGTERM/SIGINT and the exit status are the same for all. A launcher starts a service with
:meth:`Service.command` and a YAML file of its settings, never a hand-built argv.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from aiohttp import web

from kairos.common.config import ConfigSource, add_flags, flag_values
from kairos.common.errors import KairosError

T = TypeVar("T")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # what every component's --log-level takes
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def announce_listening(host: str, port: int) -> None:
    """The line a supervisor (``kairos up``, the tests) waits for, on stdout: the service takes
    requests from now on."""
    print(f"listening on {host}:{port}", flush=True)


@contextlib.asynccontextmanager
async def serving(runner: web.AppRunner, host: str, port: int) -> AsyncIterator[tuple[str, int]]:
    """An aiohttp service's app, listening on ``host:port`` (port 0: any free one) while the
    block runs, which gets the address it is bound to; cleaned up on the way out."""
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
        bound_host, bound_port = runner.addresses[0][:2]
        yield bound_host, bound_port
    finally:
        await runner.cleanup()


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT. Install it before announcing "listening on": a
    supervisor may signal as soon as it reads that line."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on uvloop's event loop where uvloop is installed (a dependency on
    Linux and macOS), else on asyncio's own. uvloop halves the loop's share of a request's time
    in the aiohttp sidecar (bench/micro/gateway_overhead.py, sidecar_pd and sidecar_deflect)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def freeze_startup_heap() -> None:
    """Take every object alive now out of the cyclic collector's sight, once a server is ready.

    What a long-running component builds before it serves (modules, its app, clients, metrics,
    tokenizer) lives as long as the process, yet each full collection scans it all again: 12 ms
    for the sidecar's 53K objects, 15-22 ms for the dispatcher's 70K on this 2-core machine, a
    pause that lands on whichever request or stream chunk is in flight. Frozen, they are never
    scanned; collections see only what came after. Garbage is collected first, so none of it is
    kept for good.
    """
    gc.collect()
    gc.freeze()


def configure_logging(level: str | None) -> None:
    """Log lines to stderr as every component writes them. Under the ``kairos`` command, which
    set logging up already with its own --log-level, the component's --log-level (when given)
    still applies: a second basicConfig would be ignored."""
    root = logging.getLogger()
    if root.handlers:
        if level is not None:
            root.setLevel(level)
        return
    logging.basicConfig(level=level or "INFO", format=LOG_FORMAT)


@dataclass(frozen=True)
class Service(Generic[T]):
    """How one service starts: its ``kairos`` command name, its settings (``source``: read from
    defaults < --config YAML < environment < flags) and ``serve(config, stop)``, run until
    ``stop`` is set by SIGTERM or SIGINT."""

    name: str
    description: str
    source: ConfigSource[T]
    serve: Callable[[T, asyncio.Event], Coroutine[Any, Any, None]]
    uvloop: bool = False  # serve on uvloop's event loop (see :func:`run`)

    def parser(self) -> argparse.ArgumentParser:
        """The command line, named as the ``kairos`` command runs it: the flags every service has
        (--config and --log-level), then one per setting of its configuration."""
        p = argparse.ArgumentParser(prog=f"kairos {self.name}", description=self.description)
        section = self.source.section
        p.add_argument(
            "--config", type=Path, help=f"YAML file of its settings{f' (section {section})' if section else ''}"
        )
        p.add_argument(
            "--log-level",
            type=str.upper,
            choices=LOG_LEVELS,
            help="DEBUG, INFO, WARNING or ERROR, in any case (default INFO, or the kairos command's --log-level)",
        )
        add_flags(p, self.source.config_class)
        return p

    def main(self, argv: Sequence[str] | None = None) -> int:
        """The service run from its command line until SIGTERM or SIGINT."""
        args = self.parser().parse_args(argv)
        return self.run(args, flag_values(args, self.source.config_class))

    def run(self, args: argparse.Namespace, overrides: Mapping[str, Any]) -> int:
        """The service's ``main`` once its flags are parsed (``overrides``: the settings they
        give): logging set up, the settings read, ``serve`` run. A setting it cannot take or a
        file it cannot read (a :class:`KairosError`) ends it with one line and status 2; an
        ``OSError`` (an address it cannot listen on, a file it cannot open) with one line and
        status 1. The signal handlers are in place before ``serve`` starts: a supervisor may
        signal as soon as it reads the "listening on" line."""
        configure_logging(args.log_level)
        try:
            config = self.source.load(args.config, overrides)

            async def serve_until_stopped() -> None:
                await self.serve(config, stop_on_signals())

            if self.uvloop:
                run(serve_until_stopped())
            else:
                asyncio.run(serve_until_stopped())
        except KairosError as exc:
            print(f"kairos {self.name}: error: {exc.message}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"kairos {self.name}: error: {exc}", file=sys.stderr)
            return 1
        return 0
