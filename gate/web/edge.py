"""The edge: a buyer's hottest requests answered by the HTTP protocol itself.

uvicorn's httptools protocol hands every request to the ASGI application in a task
of its own, through the middleware (request id, metrics, the HTTP guard,
Starlette's error handling), and writes each answer in two parts, headers then
body. For a request answered from memory (a sold-out deal, a remembered rate limit,
an invalid request) that machinery was most of the cost: half of a sold-out
answer's CPU (docs/hotpath.md, lever 41). `EdgeProtocol` is that protocol with the
routes the areas register (`EdgeRoute`) answered by itself:

    data_received ─▶ httptools ─▶ on_headers_complete
        an edge route (method and path), nothing in flight on the connection,
        no Expect: 100-continue, no upgrade, no body on a GET?
          no ─▶ uvicorn's ASGI cycle, unchanged (every other request)
          yes ─▶ headers kept, the body gathered (at most the bound and a byte)
                   ─▶ on_message_complete (or at once: a body declared or gathered
                      past the bound, answered 413 as the ASGI route answers it
                      by a route that reads one; the rest of it skipped, also while
                      an answer is still being made)
                   ─▶ the HTTP guard's bound ─▶ route.handle(EdgeRequest)
                        answered at once (sold out, limited, invalid) ─▶ one write
                        or later, by a task (`EdgeRequest.run`) ─▶ one write
        a read ends before the body does ─▶ the guard's body deadline: the rest by
        then, or 408 and the connection closed (meanwhile the request holds no
        slot and no task, only its connection and what came of it)

What the middleware does for every other request, the edge does for its own: the
request id (taken or made, echoed in X-Request-Id), the log context, the request
metrics and log line (gate/web/recorder.py `RequestRecorder`), the HTTP guard's concurrency
bound and body deadline, the 500 answer of an unexpected error, the server span with
traces on (decided at once only with a `traceparent`: gate/base/tracing.py). An edge route
answers exactly what its ASGI route answers (the same functions make both answers);
the ASGI route answers what the edge does not take (a pipelined request behind one
in flight, Expect: 100-continue, a mounted application, a path spelled otherwise).

While an edge request waits for its answer, uvicorn sees an `_EdgeCycle` in its
place: a pipelined request behind it is queued by uvicorn's own code and started
when the edge answers; a disconnect marks it, so nothing is written; a graceful
shutdown lets it finish, then closes the connection.

Closes that do not reset the connection (`Linger`), reading held while the client
does not read (`Flow`) and trailer fields (`Trailers`): gate/web/edge_transport.py.

One connection holds a bounded part of the worker (docs/api.md, "Pipelining and
back-pressure"), whether the edge or the ASGI application answers:

    data_received ─▶ a read of at most 4 KiB, nothing held ─▶ the parser, at once
                  ─▶ otherwise ─▶ the backlog (the transport's reading stopped)
                        ─▶ one 4 KiB slice per turn of the event loop, while nothing
                           holds parsing (`_held`): the client's answers past the
                           write buffer's high water mark (`Flow.pause_writing`),
                           uvicorn's pause (a large body not yet read), requests
                           waiting in uvicorn's pipeline
                        ─▶ the backlog parsed: the transport reads again

The protocol depends on uvicorn's HttpToolsProtocol internals (the parser callbacks,
`cycle`, `pipeline`, `flow`, `headers`, `on_response_complete`): pyproject.toml pins
uvicorn to one minor release, and tests/web/test_edge.py and
tests/web/test_edge_backpressure.py cover each of them over real sockets.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gate.base import logs, tracing
from gate.base.errors import Encoded, Problem
from gate.base.metrics import METRICS
from gate.web.edge_transport import (
    FEED_SLICE_BYTES,
    WRITE_HIGH_WATER_BYTES,
    Flow,
    HeadTooLarge,
    Linger,
    Trailers,
    declared_too_long,
    has_body,
)
from gate.web.guard import body_timeout

if TYPE_CHECKING:
    from gate.web.guard import Guard
    from gate.web.recorder import RequestRecorder

log = logging.getLogger("gate.edge")

_REQUEST_ID = b"x-request-id"
_CLOSE = b"connection: close\r\n"
_MALFORMED = Problem(
    "INVALID_REQUEST", "Malformed HTTP request; the connection is closed.", cacheable=True
)
# A request's line and headers together (httptools itself bounds neither: a 20 MB
# header was read whole). nginx reads 4 × 8 KiB of headers by default; a buyer's
# request with its token is well under 2 KiB. Past it: 400 (nginx's answer too) and
# the connection closed.
HEAD_MAX_BYTES = 32 * 1024
_HEAD_TOO_LARGE = Problem(
    "INVALID_REQUEST",
    f"The request line and headers must be at most {HEAD_MAX_BYTES} bytes; the connection is"
    " closed.",
    cacheable=True,
)


INTERNAL = Problem("INTERNAL", "Internal error.")
# A closed connection's lingering (`Linger`): at most this long, this many bytes.
# Up to 18 digits are below the largest id (gate/web/http_io.py IdConvertor does the same).
ID_DIGITS_MAX = 18

EDGE_REQUESTS = METRICS.counter(
    "gate_edge_requests_total",
    "Requests answered by the HTTP protocol itself (gate/web/edge.py), not the ASGI application.",
)
_ANSWERED = METRICS.counter_tally(EDGE_REQUESTS)
_MALFORMED_ANSWERED = METRICS.counter(
    "gate_http_malformed_total",
    "Requests HTTP/1.1 cannot frame, or whose head passed its bound: answered 400, the"
    " connection closed.",
)


class _NoMalformedWarning(logging.Filter):
    """uvicorn logs a warning for every request it cannot parse, before it calls
    `send_400_response`: a log line any client could ask for by the thousand a second.
    `gate serve`'s protocol counts them instead (gate_http_malformed_total)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Invalid HTTP request received."


# On uvicorn's logger, in every process that imports the protocol (each worker).
logging.getLogger("uvicorn.error").addFilter(_NoMalformedWarning())

_UPGRADES_REFUSED = METRICS.counter(
    "gate_http_upgrades_refused_total",
    "Requests that asked to upgrade the connection (WebSocket, h2c): answered as HTTP/1.1,"
    " then the connection closed.",
)


class EdgeRoute:
    """One route answered at the edge: `method` and a path of `prefix`, an id of at
    most 18 ASCII digits, `suffix` (the gate's buyer routes are all of that shape;
    a longer id, or any other spelling, goes to the ASGI route, which answers it).
    A route whose id is not a number (an order's) overrides `key_of`, which gives 0
    for what it accepts; its handler reads the id from `req.path`. `label` is the
    route's template, for the request metrics. A GET route takes no body: a GET that
    comes with one goes to the ASGI route (which ignores it) rather than have body
    bytes arrive while its answer is still being made."""

    __slots__ = ("label", "method", "prefix", "suffix", "takes_body")

    def __init__(self, method: bytes, prefix: bytes, suffix: bytes, label: str) -> None:
        self.method = method
        self.prefix = prefix
        self.suffix = suffix
        self.label = label
        self.takes_body = method != b"GET"

    def key_of(self, middle: bytes) -> int | None:
        """The id in the path (between prefix and suffix), or None: not the edge's."""
        if 0 < len(middle) <= ID_DIGITS_MAX and middle.isdigit():
            return int(middle)
        return None

    def handle(self, req: EdgeRequest) -> None:
        """Answer `req` now (`req.answer`) or later (`req.run`). A Problem raised here
        is answered as problem+json, anything else as a 500."""
        raise NotImplementedError


class Edge:
    """What the edge of one application answers: its routes, the HTTP guard it
    shares with the ASGI side, the request recorder, the body bound. Put on the
    Starlette app's state as `edge`; an application without one (or wrapped in
    another) is served by uvicorn unchanged."""

    def __init__(
        self, routes: list[EdgeRoute], guard: Guard, recorder: RequestRecorder, body_max_bytes: int
    ) -> None:
        self.by_method: dict[bytes, tuple[EdgeRoute, ...]] = {}
        for route in routes:
            self.by_method[route.method] = (*self.by_method.get(route.method, ()), route)
        self.guard = guard
        self.recorder = recorder
        self.body_max_bytes = body_max_bytes

    def route_of(self, method: bytes, url: bytes) -> tuple[EdgeRoute, int, bytes] | None:
        """The route, the id and the path of a request target, if the edge answers
        it: an origin-form path without percent-encoding (a query is ignored, as
        Starlette's router ignores it)."""
        routes = self.by_method.get(method)
        if routes is None:
            return None
        path = url.split(b"?", 1)[0] if b"?" in url else url
        for route in routes:
            if path.startswith(route.prefix) and path.endswith(route.suffix):
                id_ = route.key_of(path[len(route.prefix) : len(path) - len(route.suffix)])
                if id_ is not None:
                    return route, id_, path
        return None


class _NoEvent:
    """uvicorn sets its cycle's message event on a disconnect; the edge waits on none."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()


class _EdgeCycle:
    """Stands in for uvicorn's RequestResponseCycle while the edge answers: what
    uvicorn's protocol reads and writes of its current cycle."""

    __slots__ = ("disconnected", "keep_alive", "message_event", "response_complete")

    def __init__(self, keep_alive: bool) -> None:
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = keep_alive
        self.message_event = _NO_EVENT


class EdgeRequest:
    """One request the edge answers, and the one answer it gets."""

    __slots__ = (
        "body",
        "client",
        "context",
        "cycle",
        "edge",
        "headers",
        "id",
        "late",
        "method",
        "path",
        "protocol",
        "request_id",
        "route",
        "started",
        "traceparent",
        "tracestate",
        "watched",
    )

    def __init__(
        self,
        protocol: EdgeProtocol,
        edge: Edge,
        route: EdgeRoute,
        method: str,
        path: str,
        id_: int,
        headers: list[tuple[bytes, bytes]],
        client: tuple[str, int] | None,
    ) -> None:
        self.protocol = protocol
        self.edge = edge
        self.route = route
        self.method = method
        self.path = path
        self.id = id_
        self.headers = headers
        self.client = client
        self.body = b""
        self.started = 0.0
        self.request_id = ""
        self.cycle: _EdgeCycle | None = None
        self.context: contextvars.Context | None = None
        self.watched = False  # its body's deadline is with the guard
        self.late = False  # that deadline passed: answered 408
        self.traceparent: bytes | None = None  # read only with traces on
        self.tracestate: bytes | None = None

    def header(self, name: bytes) -> str | None:
        """The first header of that (lower-case) name, decoded as latin-1."""
        for k, v in self.headers:
            if k == name:
                return v.decode("latin-1")
        return None

    def headers_in(self, names: frozenset[bytes]) -> dict[bytes, str]:
        """The headers of these names (the last of each), decoded as latin-1."""
        return {k: v.decode("latin-1") for k, v in self.headers if k in names}

    def answer(self, answer: Encoded) -> None:
        """Write the answer (once; another is dropped) and record the request."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        edge = self.edge
        edge.guard.in_flight -= 1
        edge.recorder.record(
            self.route.label, self.method, answer[0], time.perf_counter() - self.started
        )
        if tracing.ENABLED and self.context is not None:
            ctx = self.context.get(logs.current)
            if ctx is not None and ctx.trace is not None:  # decided: traced or dropped
                tracing.finish(ctx, self.method, self.route.label, answer[0], self.path)
        self.protocol.write_answer(cycle, answer, self.request_id)

    def run(self, work: Coroutine[Any, Any, Encoded]) -> None:
        """Answer with what `work` returns, in a task of its own (in the request's log
        context), tracked as uvicorn tracks its request tasks (a graceful shutdown
        waits for it)."""
        protocol = self.protocol
        task = protocol.loop.create_task(self._finish(work), context=self.context)
        task.add_done_callback(protocol.tasks.discard)
        protocol.tasks.add(task)

    async def _finish(self, work: Coroutine[Any, Any, Encoded]) -> None:
        try:
            answer = await work
        except Problem as problem:
            answer = problem.encoded(self.path)
        except Exception:
            log.exception("unhandled error on %s %s", self.method, self.path)
            answer = INTERNAL.encoded(self.path)
        self.answer(answer)


class EdgeProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the edge's routes answered by itself (see
    the module docstring). Named in `gate serve`'s uvicorn configuration."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        state = getattr(self.app, "state", None)
        self.edge: Edge | None = getattr(state, "edge", None) if state is not None else None
        # The current request head's size, from the reads alone (no parser callback
        # per header: they cost a sold-out answer a tenth): the read it began in, and
        # the reads that fell wholly inside it (a header still coming).
        self._in_head = False
        self._heads = 0
        self._read_bytes = 0
        self._head_first = 0
        self._head_reads = 0
        self.head_too_large = False
        # A chunked request's chunk (or trailer section) being parsed: the bytes of
        # the slices fed wholly after its chunk header began, and of its body among
        # them (what is not body is a trailer, bounded with the head).
        self._in_chunk = False
        self._chunk_fresh = False
        self._chunk_bytes = 0
        self._chunk_body_bytes = 0
        self._head_bytes = 0
        # The request whose headers the edge took and whose body is still coming.
        self._pending: EdgeRequest | None = None
        self._linger: Linger | None = None
        # Back-pressure (`Flow`): what was read and not yet parsed (from
        # `_backlog_at` on; the transport's reading stopped meanwhile), the parse of
        # its next slice when scheduled, and whether the transport's reading is stopped.
        self._backlog = b""
        self._backlog_at = 0
        self._feeding: asyncio.Handle | None = None
        self._reading_stopped = False
        self._raw: asyncio.Transport | None = None
        # The ASGI request being answered: with requests pipelined behind it, uvicorn's
        # `cycle` is the last one parsed, not this one.
        self._asgi_cycle: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = Flow(transport, self)
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        self._raw = transport
        self.transport = self._linger = Linger(transport)

    def timeout_keep_alive_handler(self) -> None:
        if self._linger is not None:
            self._linger.at_once = True
        super().timeout_keep_alive_handler()

    def shutdown(self) -> None:
        if self._linger is not None:
            self._linger.at_once = True
            if self._linger.lingering:
                self._linger.finish()
        super().shutdown()

    def send_400_response(self, msg: str) -> None:
        """What httptools cannot parse (a malformed chunk, two Content-Lengths, bytes no
        request line may hold): a problem+json 400 like every other refusal, rather
        than uvicorn's text/plain one; the connection closed (lingering) after it,
        since nothing that follows on it can be framed."""
        _MALFORMED_ANSWERED.inc()
        status, headers, body = (_HEAD_TOO_LARGE if self.head_too_large else _MALFORMED).encoded()
        parts = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        parts += (b"x-request-id: ", logs.new_request_id().encode("ascii"), b"\r\n")
        parts += (_CLOSE, b"\r\n", body)
        # A request cut short (a malformed chunk, its trailers past the bound) and the
        # one answered before it: their application sees a disconnect and writes
        # nothing after this answer.
        self._disconnect_asgi()
        self.transport.write(b"".join(parts))
        self.transport.close()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """The client shut its write side. Requests it sent whole are still answered,
        then the connection is closed (`on_response_complete`), as a client that
        half-closes after its request expects. Anything else ends here: asyncio
        closes the transport when this returns None (through `Linger.close`, which
        now closes at once)."""
        linger = self._linger
        if linger is None:
            return None
        linger.peer_done = True
        cycle = self.cycle  # the last request parsed
        if (
            linger.lingering
            or self._backlog  # read, not yet parsed: answered first
            or self._pending is not None  # an edge request short of its body
            or self._in_head
            or cycle is None
            or cycle.response_complete
            or getattr(cycle, "more_body", False)  # an ASGI request short of its body
        ):
            return None
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()  # the next pipelined request is started
        self.go_on()
        self._close_if_done()

    def _close_if_done(self) -> None:
        linger, cycle = self._linger, self.cycle
        if (
            linger is not None
            and linger.peer_done
            and not self._backlog
            and cycle is not None
            and cycle.response_complete
            and not self.transport.is_closing()
        ):
            # The last request of a client that shut its write side is answered.
            self.transport.close()

    # -- uvicorn's callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._heads += 1
        self._head_first = self._read_bytes
        self._head_reads = 0
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_head = False
        # What the reads say the head may be: the one it began in, those wholly inside
        # it and the one it ends in (the same as the first when it began in this one).
        reads = self._head_first + self._head_reads + self._read_bytes
        if reads > HEAD_MAX_BYTES and self._head_size() > HEAD_MAX_BYTES:
            # Stops the parser; uvicorn answers its error with send_400_response.
            self.head_too_large = True
            raise HeadTooLarge
        edge = self.edge
        if edge is not None and not self.root_path:
            cycle = self.cycle
            if (
                (cycle is None or cycle.response_complete)
                and not self.pipeline
                and not self.expect_100_continue
                and not self.parser.should_upgrade()
            ):
                method = self.parser.get_method()
                found = edge.route_of(method, self.url)
                if found is not None and (found[0].takes_body or not has_body(self.headers)):
                    route, id_, path = found
                    req = EdgeRequest(
                        self,
                        edge,
                        route,
                        method.decode("ascii"),
                        path.decode("ascii"),
                        id_,
                        self.headers,
                        self.client,
                    )
                    if declared_too_long(self.headers, edge.body_max_bytes):
                        # Answered now (413), as the ASGI route answers it before it
                        # reads a byte; uvicorn's parser skips the body that follows.
                        self._dispatch(req)
                    else:
                        self._pending = req
                    return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if self._in_chunk:
            self._chunk_body_bytes += len(body)
        req = self._pending
        if req is None:
            if isinstance(self.cycle, _EdgeCycle):
                # The rest of a body declared past the bound, of a request the edge
                # took at its headers and answers later (a route that reads no body):
                # skipped, as after a 413. uvicorn's own code would append it to the
                # cycle, which an edge cycle does not have (a 400 and a closed
                # connection, not the route's answer).
                return
            super().on_body(body)
            return
        req.body += body
        if len(req.body) > req.edge.body_max_bytes:
            # Past the bound (a chunked body): answered now (413), the rest skipped.
            self._take(req)
            self._dispatch(req)

    def on_message_complete(self) -> None:
        req = self._pending
        if req is None:
            if isinstance(self.cycle, _EdgeCycle):
                return  # the end of such a skipped body
            super().on_message_complete()
            return
        self._take(req)
        self._dispatch(req)

    def on_chunk_header(self) -> None:
        """A chunk's size line was parsed: its data, or after the last one the trailer
        section, follows. At the first chunk uvicorn's `on_header` is pointed at a
        `Trailers` (the request keeps the list its head filled)."""
        if not isinstance(self.headers, Trailers):
            self._head_bytes = self._head_size()
            self.headers = Trailers(self, HEAD_MAX_BYTES - self._head_bytes)
        self._in_chunk = True
        self._chunk_fresh = True
        self._chunk_bytes = 0
        self._chunk_body_bytes = 0

    def on_chunk_complete(self) -> None:
        self._in_chunk = False

    def data_received(self, data: bytes) -> None:
        linger = self._linger
        if linger is not None and linger.lingering:
            linger.dropped(len(data))
            return
        if self._backlog or len(data) > FEED_SLICE_BYTES or self._held():
            # Parsed a slice at a time, or when the client has read its answers.
            self._backlog = self._backlog[self._backlog_at :] + data
            self._backlog_at = 0
            self.stop_reading()
            self.go_on()
            return
        self._feed(data)

    def stop_reading(self) -> None:
        """The transport reads no more (until `go_on` finds nothing holds it)."""
        raw = self._raw
        if not self._reading_stopped and raw is not None and not raw.is_closing():
            self._reading_stopped = True
            raw.pause_reading()

    def _held(self) -> bool:
        """Nothing more is parsed: the client's answers are unread (past the high
        water mark), uvicorn paused reading (a large body not yet read), or requests
        wait in uvicorn's pipeline (uvicorn itself resumes reading after each answer,
        and one read can queue thousands of pipelined requests)."""
        flow = self.flow
        return flow.read_paused or flow.write_paused or bool(self.pipeline)

    def go_on(self) -> None:
        """Reading may go on, unless `_held`: the backlog's next slice is parsed in the
        loop's next turn, or, with none left, the transport reads again."""
        if self._held():
            return
        if self._backlog:
            if self._feeding is None:
                self._feeding = self.loop.call_soon(self._feed_backlog)
            return
        raw = self._raw
        if self._reading_stopped and raw is not None and not raw.is_closing():
            self._reading_stopped = False
            raw.resume_reading()

    def _feed_backlog(self) -> None:
        self._feeding = None
        if self.transport.is_closing():
            self._backlog = b""  # nothing more is answered on this connection
            return
        if self._held():
            return  # `go_on` comes back
        at = self._backlog_at
        data = self._backlog[at : at + FEED_SLICE_BYTES]
        at += len(data)
        if at >= len(self._backlog):
            self._backlog, self._backlog_at = b"", 0
        else:
            self._backlog_at = at
        self._feed(data)
        if self.transport.is_closing():
            self._backlog = b""
            return
        self.go_on()
        if not self._backlog:
            self._backlog_parsed()

    def _backlog_parsed(self) -> None:
        """All that was read is parsed: if the client has shut its write side, the
        connection ends as `eof_received` would have ended it then."""
        linger = self._linger
        if linger is not None and linger.peer_done and not linger.lingering:
            if self.eof_received() is None:
                self.transport.close()
            else:
                self._close_if_done()

    def _feed(self, data: bytes) -> None:
        """One read, or one slice of a read, to the parser."""
        in_head, heads = self._in_head, self._heads
        self._read_bytes = len(data)
        super().data_received(data)
        if self._in_head and in_head and heads == self._heads:
            # The whole read was part of one head, still incomplete: a header the
            # parser keeps until it ends. (A read in which a head began is not
            # counted: the bound is off by one read at most, never too strict.)
            self._head_reads += len(data)
            if self._head_reads > HEAD_MAX_BYTES and not self.transport.is_closing():
                self.head_too_large = True
                self.send_400_response("")
                return
        if self._in_chunk:
            if self._chunk_fresh:
                # The slice its chunk header came in is not counted (it holds what
                # came before too): off by one slice at most, never too strict.
                self._chunk_fresh = False
                self._chunk_body_bytes = 0
            else:
                self._chunk_bytes += len(data)
                trailer_bytes = self._chunk_bytes - self._chunk_body_bytes
                if (
                    trailer_bytes > HEAD_MAX_BYTES - self._head_bytes
                    and not self.transport.is_closing()
                ):
                    # A trailer field still coming (httptools keeps it until it ends).
                    self.head_too_large = True
                    self.send_400_response("")
                    return
        req = self._pending
        if req is not None and not req.watched and not self.transport.is_closing():
            # The read ended before the body did: the rest is due by the guard's
            # body deadline.
            req.watched = True
            req.edge.guard.watch(id(req), lambda: self._late(req))

    def _unsupported_upgrade_warning(self) -> None:
        """A request asking to upgrade (WebSocket, h2c), which `gate serve` does not
        (uvicorn's `ws` is "none"): it is answered as HTTP/1.1 by its route, then the
        connection is closed, because the parser reads nothing after an upgrade
        request. uvicorn would log two warnings per such request, a log any client
        could flood; they are counted instead."""
        _UPGRADES_REFUSED.inc()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
        elif not self.transport.is_closing():
            self.transport.close()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._asgi_cycle = cycle
        super()._start_asgi_task(cycle, app)

    def _disconnect_asgi(self) -> None:
        """The ASGI requests of the connection see a disconnect (uvicorn marks only the
        last one parsed: the one being answered, with requests pipelined behind it,
        would write on a closed transport, a 500 and a traceback logged)."""
        for cycle in (self.cycle, self._asgi_cycle):
            if cycle is not None and not cycle.response_complete and not cycle.disconnected:
                cycle.disconnected = True
                cycle.message_event.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disconnect_asgi()
        if self._feeding is not None:
            self._feeding.cancel()
            self._feeding = None
        self._backlog = b""
        linger = self._linger
        if linger is not None and linger.timer is not None:
            linger.timer.cancel()
            linger.timer = None
        req = self._pending
        if req is not None:
            self._take(req)
        super().connection_lost(exc)

    # -- the edge -------------------------------------------------------------------------

    def _head_size(self) -> int:
        """The finished head's size as parsed (only asked when its reads say it may be
        past the bound: they also hold pipelined requests and bodies)."""
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)

    def _take(self, req: EdgeRequest) -> None:
        """The request is no longer waiting for its body."""
        self._pending = None
        if req.watched:
            req.edge.guard.unwatch(id(req))

    def _late(self, req: EdgeRequest) -> None:
        """The body did not come in time (the guard's watchdog): 408, closed."""
        if self._pending is not req or self.transport.is_closing():
            return
        self._pending = None
        req.late = True
        self._dispatch(req)

    def _dispatch(self, req: EdgeRequest) -> None:
        _ANSWERED.inc()
        cycle = _EdgeCycle(self.parser.should_keep_alive())
        self.cycle = cycle  # type: ignore[assignment]
        req.cycle = cycle
        req.started = time.perf_counter()
        rid = None
        if tracing.ENABLED:  # the three headers in one pass
            raw, req.traceparent, req.tracestate = tracing.request_headers(req.headers)
            rid = logs.sane_request_id(raw) if raw is not None else None
        else:
            for name, value in req.headers:
                if name == _REQUEST_ID:
                    rid = logs.sane_request_id(value)
                    break
        req.request_id = rid or logs.new_request_id()
        # The request's own log context, as its task would have had; a task it
        # starts inherits it.
        req.context = context = contextvars.copy_context()
        context.run(self._handle, req)

    @staticmethod
    def _handle(req: EdgeRequest) -> None:
        ctx = logs.begin_request(req.request_id, req.started)
        if req.traceparent is not None:  # without one, the first traced work decides
            tracing.begin_remote(ctx, req.traceparent, req.tracestate, {"url.path": req.path})
        guard = req.edge.guard
        guard.in_flight += 1  # answer() counts it down
        if req.late:
            req.answer(body_timeout(guard.body_timeout_seconds).encoded(req.path))
            return
        if guard.in_flight > guard.concurrency_max:
            req.answer(guard.busy.encoded(req.path))
            return
        try:
            req.route.handle(req)
        except Problem as problem:
            req.answer(problem.encoded(req.path))
        except Exception:
            log.exception("unhandled error on %s %s", req.method, req.path)
            req.answer(INTERNAL.encoded(req.path))

    def write_answer(self, cycle: _EdgeCycle, answer: Encoded, request_id: str) -> None:
        """The status line, the server's default headers, the answer's, the request
        id, and the body: one write. Then what uvicorn does after an answer."""
        cycle.response_complete = True
        transport = self.transport
        if cycle.disconnected or transport.is_closing():
            return
        status, headers, body = answer
        keep_alive = cycle.keep_alive
        closing = False  # the answer says Connection: close itself
        parts = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            parts += (name, b": ", value, b"\r\n")
        for name, value in headers:
            if name == b"connection" and b"close" in value.lower():
                keep_alive = False
                closing = True
            parts += (name, b": ", value, b"\r\n")
        parts += (b"x-request-id: ", request_id.encode("ascii"), b"\r\n")
        if not keep_alive and not closing:
            parts.append(_CLOSE)
        parts += (b"\r\n", body)
        transport.write(b"".join(parts))
        if not keep_alive:
            transport.close()
        self.on_response_complete()
