"""How an area of the gate (payments, expiry, operations…) plugs into the process.

Each area module exposes `install(gate) -> Extension` and, if it has commands,
`add_commands(subparsers) -> None`. The core wires every area listed in
`AREAS` into the HTTP app, the background workers and the `gate` command, so an
area never edits the core's files to add a route, a loop or a command.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

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
    "gate.webhooks",
    "gate.console",
)


class ConsoleAction(Protocol):
    """An area's console action, POST /console/api/deals/{id}/{name}: called after the
    console checked the operator's session and CSRF token, with the request's JSON body
    and the actor the ledger names ("console:<session prefix>"). Bad input raises its
    Problem (400 and the like); returns the answer's body."""

    async def __call__(self, deal_id: int, body: Any, actor: str) -> dict[str, Any]: ...


class ConsolePanel(Protocol):
    """An area's part of the live console (gate/console/, docs/console.md)."""

    @property
    def actions(self) -> Mapping[str, ConsoleAction]:
        """Action name -> the action; a name must not be one of the console's own."""
        ...

    async def fields(self, deal_ids: list[int]) -> dict[int, dict[str, Any]]:
        """Per shown deal (at most the snapshot's DEALS_SHOWN_MAX), the fields merged
        into its snapshot entry; a deal the area has nothing for is left out. Called
        once per snapshot (at most once a second per process): bounded reads, one
        round trip per store for all the deals, never one per deal."""
        ...


class ConsoleGateAction(Protocol):
    """An area's gate-wide console action, POST /console/api/panels/{panel}/{name}:
    called after the console checked the session and CSRF token, with the JSON body
    and the actor ("console:<session prefix>"). Bad input raises its Problem."""

    async def __call__(self, body: Any, actor: str) -> dict[str, Any]: ...


class ConsoleGatePanel(Protocol):
    """An area's part of the live console that belongs to the whole gate rather than
    to one deal (the webhooks' endpoints): its fields appear in the snapshot's
    "panels" under `name`."""

    @property
    def name(self) -> str: ...

    @property
    def actions(self) -> Mapping[str, ConsoleGateAction]: ...

    async def gate_fields(self) -> dict[str, Any]:
        """The panel's fields: bounded reads, called once per snapshot (at most once
        a second per process)."""
        ...


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
    # The console's panels and actions of the area (gate/console/ reads them from
    # every installed extension when it builds a snapshot or runs an action).
    console_panels: list[ConsolePanel] = field(default_factory=list)
    console_gate_panels: list[ConsoleGatePanel] = field(default_factory=list)


def area_modules() -> list[ModuleType]:
    return [importlib.import_module(name) for name in AREAS]
