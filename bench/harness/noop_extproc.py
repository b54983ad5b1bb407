"""The Kairos ext_proc service with nothing to decide: the floor under the gateway's overhead.

It runs the real gRPC service (:class:`kairos.extproc.server.ExternalProcessor` on
:func:`kairos.extproc.server.start_grpc_server`, so the same grpc.aio server, options and answer
encoding) in front of a dispatcher stand-in that routes every request to one fixed upstream at
once: no JSON parse, no token count, no policy, no Redis. ``bench/micro/gateway_overhead.py`` puts
Envoy + this beside Envoy alone and the whole gateway: what this adds over Envoy alone is the
floor of Envoy's ext_proc filter and grpcio on the machine; the rest is the dispatcher's own work.

    python -m bench.harness.noop_extproc --port PORT --destination HOST:PORT [--header NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from kairos.common import contracts as c
from kairos.extproc.dispatcher import RequestHead, Routed
from kairos.extproc.server import start_grpc_server

NOOP_ROUTE = "noop"  # the x-kairos-route this server sets, so the upstream can tell who routed


class FixedRoute:
    """Answers every request with the same :class:`Routed`, as fast as Python can."""

    def __init__(self, destination: str, headers: tuple[tuple[str, str], ...] = ((c.H_ROUTE, NOOP_ROUTE),)) -> None:
        self.routed = Routed(destinations=(destination,), set_headers=headers, remove_headers=(), decision=None)

    async def route(self, head: RequestHead, body: bytes | None) -> Routed:
        return self.routed

    def check_headers(self, head: RequestHead) -> None:
        """Refuses nothing at the headers: every request waits for its body and is routed."""
        return None


async def serve(host: str, port: int, destination: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
    route = FixedRoute(destination, headers) if headers else FixedRoute(destination)
    server, bound = await start_grpc_server(route, host, port)  # type: ignore[arg-type]
    print(f"no-op ext_proc listening on {host}:{bound}, routing to {destination}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--destination", required=True, help="host:port every request is sent to")
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help=f"a header to set, instead of {c.H_ROUTE}: {NOOP_ROUTE} (repeatable): e.g. the routing headers of the "
        "P/D path, for a no-op in front of a decode node's sidecar",
    )
    args = parser.parse_args()
    headers = tuple(tuple(h.split("=", 1)) for h in args.header)
    asyncio.run(serve(args.host, args.port, args.destination, headers))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main())
