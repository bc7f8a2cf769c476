"""How an area of the gate (payments, expiry, operations…) plugs into the process.

Each area module exposes `install(gate) -> Extension` and, if it has commands,
`add_commands(subparsers) -> None`. The core wires every area listed in
`AREAS` into the HTTP app, the background workers and the `gate` command, so an
area never edits the core's files to add a route, a loop or a command.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from gate.reserve.ports import AdmissionPort, QueuedOrders, QueuePort
from gate.store.scripts import Script

if TYPE_CHECKING:
    from gate.web.edge import EdgeRoute
    from gate.web.recorder import RequestRecorder

Worker = Callable[[asyncio.Event], Coroutine[Any, Any, None]]

# Area modules, in installation order. Operations comes first so that its request
# middleware (request ids, one log line and metrics per request) wraps all others.
AREAS = (
    "gate.api.ops",
    "gate.payments",
    "gate.expiry",
    "gate.room",
    "gate.queuemode",
    "gate.console",
)


@dataclass
class Extension:
    name: str
    routes: list[BaseRoute] = field(default_factory=list)
    # Background loops run by `gate serve` (unless --no-background): each gets the
    # stop event and must return soon after it is set.
    workers: list[Worker] = field(default_factory=list)
    middleware: list[Middleware] = field(default_factory=list)
    # Inside the fast lane (gate/api/app.py FastLane): behind the HTTP guard, and never
    # reached by a reservation (the fast lane answers those first), so a lane of an
    # area's own costs the hot path nothing.
    inner_middleware: list[Middleware] = field(default_factory=list)
    # Answered by the HTTP protocol itself when a request comes whole (gate/web/edge.py);
    # each beside an ASGI route of its own that answers the same.
    edge: list[EdgeRoute] = field(default_factory=list)
    # The request metrics and log line (gate/web/recorder.py): the edge records its answers with
    # the same recorder as the request middleware.
    recorder: RequestRecorder | None = None
    on_start: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    # Lua scripts of the area's own, by name: the runner loads them with the core's.
    scripts: dict[str, Script] = field(default_factory=dict)
    # Run before the mirror syncs a deal into Redis (deal id, sync mode).
    before_sync: list[Callable[[int, str], Awaitable[None]]] = field(default_factory=list)
    # Plugs of the reservation path (gate/reserve/ports.py); at most one area gives each.
    admission: AdmissionPort | None = None
    queue: QueuePort | None = None
    queued_orders: QueuedOrders | None = None


def area_modules() -> list[ModuleType]:
    return [importlib.import_module(name) for name in AREAS]
