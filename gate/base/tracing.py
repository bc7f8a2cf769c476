"""Traces over OpenTelemetry (the optional `otel` extra): the one module the rest of
the gate calls. Off, every entry point is a global read (`ENABLED`) and nothing else.

    configure(env), once per serving process (gate/api/ops.py, at start-up; `check`
    when the settings are read):
      OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none, or no OTLP endpoint
      (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT) ──> off
      the extra not installed ──> off, one warning
      a sampler, protocol or exporter the gate cannot honour ──> SettingsError (exit 2)
      otherwise ──> ENABLED: the SDK's TracerProvider (resource from OTEL_SERVICE_NAME,
        OTEL_RESOURCE_ATTRIBUTES), its BatchSpanProcessor (OTEL_BSP_*) and the OTLP/HTTP
        exporter (OTEL_EXPORTER_OTLP_*): spans leave from the SDK's own thread

A request keeps its trace on its log context (`logs.RequestContext.trace`):

    a valid W3C traceparent ──> the sampler decides now (parent-based samplers: the
        caller's sampled flag): a server span, child of the caller's span; or DROPPED
    none, at the ASGI middleware ──> the root sampler decides now (the health and
        metrics probes excepted: as at the edge)
    none, at the edge ──> undecided (None): the request's first traced work (a Redis
        script, a database procedure, a provider call) asks the root sampler and
        makes the server span, dated from the request's start. An answer made from
        memory (sold out, a remembered limit, a refusal) does no such work and
        costs nothing more than a flag check.
    answered ──> finish(): route, status, end

Spans under a request: `span()` (a scope: a procedure call, the callback's
processing), `start()`/`end()` (a Redis script, ended by its reply's callback),
`outbound()` (a client span around an outbound HTTP call, `traceparent` written into
its headers; `client_trace_configs()` does the same for an aiohttp session),
`serving()` (a group's work, e.g. a group commit: its spans are children of the
first traced request it serves, carry a link to every one, and every one gets a
link to them). Outside requests: `background()` (a sweeper's batch: a root span once
traced work happens in it), `outbound(root=True)`.

Sampling is decided here rather than by the SDK's sampler (which the SDK is given as
ALWAYS_ON): the unsampled majority then never reaches the SDK, whose span start costs
several microseconds even for a span it drops.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Iterable, Mapping, MutableMapping
from contextvars import ContextVar, Token
from typing import Any
from urllib.parse import urlsplit

from gate.base import logs
from gate.base.settings import SettingsError
from gate.base.trace_context import parse_traceparent, parse_tracestate

log = logging.getLogger("gate.tracing")

# Read by the call sites on the hot path before they call in: off, nothing else runs.
ENABLED = False

# Span kinds (mapped to the SDK's SpanKind when on).
INTERNAL, SERVER, CLIENT = 0, 1, 2

SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
# Requests that are traced only when the caller's traceparent samples them in.
PROBE_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
# Bounded wait for the last spans when a process stops (the SDK's own exit hook
# sends what is left, within OTEL_BSP_EXPORT_TIMEOUT).
FLUSH_SECONDS = 2.0


class Sampler:
    """OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, decided by the gate."""

    __slots__ = ("name", "parent_based", "ratio")

    def __init__(self, name: str, ratio: float) -> None:
        self.name = name
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        self.ratio = {"always_on": 1.0, "always_off": 0.0}.get(root, ratio)

    def root(self) -> bool:
        """A request or batch with no caller's trace."""
        ratio = self.ratio
        return ratio >= 1.0 or (ratio > 0.0 and random.random() < ratio)

    def with_parent(self, sampled: bool) -> bool:
        """A request whose caller's traceparent says `sampled`."""
        return sampled if self.parent_based else self.root()


def parse_sampler(env: Mapping[str, str]) -> Sampler:
    name = (env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on").strip().lower()
    if name not in SAMPLERS:
        raise SettingsError(
            f"OTEL_TRACES_SAMPLER must be one of {', '.join(SAMPLERS)}, got {name!r}"
        )
    raw = (env.get("OTEL_TRACES_SAMPLER_ARG") or "").strip()
    ratio = 1.0
    if raw and name.endswith("traceidratio"):
        try:
            ratio = float(raw)
        except ValueError:
            ratio = -1.0
        if not 0.0 <= ratio <= 1.0:
            raise SettingsError(
                f"OTEL_TRACES_SAMPLER_ARG must be a ratio from 0 to 1 (0.01: 1 %), got {raw!r}"
            )
    return Sampler(name, ratio)


def exporter_endpoint(env: Mapping[str, str]) -> str | None:
    """Where spans go (OTLP/HTTP), or None: traces off. Refuses what the gate's
    exporter cannot do (another exporter, gRPC or JSON)."""
    if (env.get("OTEL_SDK_DISABLED") or "").strip().lower() == "true":
        return None
    exporters = [e.strip().lower() for e in (env.get("OTEL_TRACES_EXPORTER") or "otlp").split(",")]
    if exporters == ["none"]:
        return None
    if exporters != ["otlp"]:
        raise SettingsError(
            f"OTEL_TRACES_EXPORTER must be otlp or none (the gate exports OTLP/HTTP),"
            f" got {env.get('OTEL_TRACES_EXPORTER')!r}"
        )
    endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or "").strip()
    if not endpoint:
        base = (env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "").strip()
        if not base:
            return None
        endpoint = base.rstrip("/") + "/v1/traces"
    parts = urlsplit(endpoint)
    try:
        parts.port  # noqa: B018 (a port that is not a number raises)
    except ValueError:
        parts = parts._replace(netloc="")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        # (Not echoed: it may carry a password.)
        raise SettingsError(
            "OTEL_EXPORTER_OTLP_ENDPOINT / _TRACES_ENDPOINT must be an http(s) URL with a host"
        )
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = (env.get(name) or "").strip().lower()
        if protocol:
            if protocol != "http/protobuf":
                raise SettingsError(
                    f"{name} must be http/protobuf (the gate's exporter), got {protocol!r}"
                )
            break
    return endpoint


class Live:
    """A recording span as the gate holds it, with its ids as log lines show them."""

    __slots__ = ("context", "span", "span_hex", "trace_hex")

    def __init__(self, span: Any) -> None:
        self.span = span
        sc = span.get_span_context()
        self.context = sc
        self.trace_hex = format(sc.trace_id, "032x")
        self.span_hex = format(sc.span_id, "016x")

    def traceparent(self) -> str:
        return f"00-{self.trace_hex}-{self.span_hex}-01"


# A request the sampler left out (or whose caller's traceparent did).
DROPPED: Any = object()


class _Batch:
    """Work done for several requests at once (`serving`)."""

    __slots__ = ("live", "refs", "resolved", "size")

    def __init__(self, refs: list[Any], size: int) -> None:
        self.refs = refs
        self.size = size
        self.resolved = False
        self.live: list[Live] = []

    def spans(self) -> list[Live]:
        if not self.resolved:
            self.resolved = True
            seen: set[int] = set()
            for ref in self.refs:
                found = _live_of(ref, True)
                if found is not None and found.context.span_id not in seen:
                    seen.add(found.context.span_id)
                    self.live.append(found)
        return self.live


class Background:
    """A background unit of work (`background`): a root span only once traced work
    happens inside it (an empty poll makes none), dated from the unit's start."""

    __slots__ = ("attributes", "live", "name", "started_ns")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        self.name = name
        self.attributes = attributes
        self.started_ns = time.time_ns()
        self.live: Any = None  # None: undecided; a Live; or DROPPED

    def resolve(self, materialize: bool) -> Live | None:
        live = self.live
        if live is None:
            if not materialize:
                return None
            if _sampler.root():
                span = _tracer.start_span(
                    self.name,
                    kind=_kinds[INTERNAL],
                    attributes=self.attributes,
                    start_time=self.started_ns,
                )
                live = self.live = Live(span)
            else:
                live = self.live = DROPPED
        return None if live is DROPPED else live

    def set(self, key: str, value: Any) -> None:
        """An attribute of the unit's span (when it has one)."""
        if self.live is not None and self.live is not DROPPED:
            self.live.span.set_attribute(key, value)


# The innermost span scope of the running task (`span`, `serving`, `background`).
_SCOPE: ContextVar[Live | _Batch | Background | None] = ContextVar("gate_trace_scope", default=None)

_sampler = Sampler("parentbased_always_on", 1.0)
_tracer: Any = None
_provider: Any = None
_api: Any = None  # opentelemetry.trace, once configured
_kinds: tuple[Any, ...] = ()


# -- configuration ---------------------------------------------------------------------


def check(env: Mapping[str, str]) -> bool:
    """Whether OTEL_* asks for traces; SettingsError for what the gate cannot honour.
    No side effect (`gate serve` checks the settings before it starts workers)."""
    if exporter_endpoint(env) is None:
        return False
    parse_sampler(env)
    return True


def configure(env: Mapping[str, str] | None = None, *, service_version: str = "") -> bool:
    """Turn traces on in this process when OTEL_* asks for them; True when on. Once per
    process (a second call keeps the first one's outcome)."""
    global ENABLED, _sampler, _tracer, _provider, _api, _kinds
    if _provider is not None:
        return ENABLED
    env = os.environ if env is None else env
    endpoint = exporter_endpoint(env)
    if endpoint is None:
        return False
    sampler = parse_sampler(env)
    try:
        from opentelemetry import trace as api
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_ON
    except ImportError as exc:
        log.warning(
            "OTEL_* asks for traces but the otel extra is not installed"
            " (pip install 'gate[otel]'): traces are off (%s)",
            exc,
        )
        return False
    # Header values of the exporter (an API key of the tracing service) and a password
    # in the endpoint are secrets: never in a log line (the SDK logs failed exports).
    for name in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):
        values = [p.partition("=")[2].strip() for p in (env.get(name) or "").split(",")]
        logs.redact_secrets(v for v in values if v)
    parts = urlsplit(endpoint)
    if parts.password:
        logs.redact_secrets([parts.password])
    resource = Resource.create({"service.version": service_version, "process.pid": os.getpid()})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": "gate"}))
    provider = TracerProvider(resource=resource, sampler=ALWAYS_ON)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider = provider
    _tracer = provider.get_tracer("gate", service_version or None)
    _api = api
    _kinds = (api.SpanKind.INTERNAL, api.SpanKind.SERVER, api.SpanKind.CLIENT)
    _sampler = sampler
    logs.use_trace_ids(log_ids)
    ENABLED = True
    log.info(
        "traces on",
        extra={
            "endpoint": f"{parts.scheme}://{parts.hostname}:{parts.port or ''}{parts.path}",
            "sampler": sampler.name,
            "ratio": sampler.ratio,
        },
    )
    return True


def flush(timeout_seconds: float = FLUSH_SECONDS) -> None:
    """Send the spans ended so far (blocking, bounded): a stopping process calls it
    from a thread."""
    if _provider is not None:
        _provider.force_flush(int(timeout_seconds * 1000))


def shutdown() -> None:
    """Traces off in this process, the SDK stopped (tests; the SDK's exit hook does it
    for a process that ends)."""
    global ENABLED, _provider, _tracer
    ENABLED = False
    logs.use_trace_ids(None)
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def _remote(trace_id: int, span_id: int, sampled: bool, tracestate: Any) -> Any:
    api = _api
    state = api.TraceState(parse_tracestate(tracestate)) if tracestate else None
    context = api.SpanContext(
        trace_id,
        span_id,
        is_remote=True,
        trace_flags=api.TraceFlags(api.TraceFlags.SAMPLED if sampled else 0),
        trace_state=state,
    )
    return api.set_span_in_context(api.NonRecordingSpan(context))


# -- requests --------------------------------------------------------------------------

_REQUEST_ID, _TRACEPARENT_NAME, _TRACESTATE_NAME = b"x-request-id", b"traceparent", b"tracestate"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def request_headers(
    headers: Iterable[tuple[bytes, bytes]],
) -> tuple[bytes | None, bytes | None, bytes | None]:
    """X-Request-Id, traceparent and tracestate of a request head: one pass for the
    first two (two comparisons a header, where the untraced edge makes one), a second
    for tracestate only when a traceparent came."""
    rid = traceparent = tracestate = None
    for name, value in headers:
        if name == _REQUEST_ID:
            rid = value
        elif name == _TRACEPARENT_NAME:
            traceparent = value
    if traceparent is not None:
        for name, value in headers:
            if name == _TRACESTATE_NAME:
                tracestate = value
    return rid, traceparent, tracestate


def _start_ns(ctx: logs.RequestContext) -> int:
    """The request's start as wall-clock nanoseconds (it began at `ctx.started`,
    perf_counter seconds)."""
    if not ctx.started:
        return time.time_ns()
    return time.time_ns() - int((time.perf_counter() - ctx.started) * 1e9)


def _server_span(ctx: logs.RequestContext, parent: Any, attributes: dict[str, Any]) -> Live:
    attributes["gate.request_id"] = ctx.request_id
    span = _tracer.start_span(
        "HTTP",
        context=parent,
        kind=_kinds[SERVER],
        attributes=attributes,
        start_time=_start_ns(ctx),
    )
    live = Live(span)
    ctx.trace = live
    return live


def begin_remote(
    ctx: logs.RequestContext,
    traceparent: bytes | str | None,
    tracestate: bytes | str | None,
    attributes: dict[str, Any],
) -> None:
    """A request that came with `traceparent` (the edge calls this only then): the
    sampler decides now; an invalid header counts as none (undecided)."""
    found = parse_traceparent(traceparent)
    if found is None:
        return
    trace_id, span_id, sampled = found
    if not _sampler.with_parent(sampled):
        ctx.trace = DROPPED
        return
    _server_span(ctx, _remote(trace_id, span_id, sampled, tracestate), attributes)


def begin_asgi(ctx: logs.RequestContext, scope: Mapping[str, Any]) -> None:
    """A request at the ASGI middleware: with a traceparent as `begin_remote`; without,
    the root sampler now (the probes: left undecided, so never traced on their own)."""
    _, traceparent, tracestate = request_headers(scope.get("headers", ()))
    path = str(scope.get("path", ""))
    client = scope.get("client")
    method = str(scope.get("method", ""))
    attributes: dict[str, Any] = {
        "http.request.method": method if method in _METHODS else "_OTHER",
        "url.path": path,
        "url.scheme": str(scope.get("scheme", "http")),
    }
    if client:
        attributes["client.address"] = str(client[0])
    if traceparent is not None and parse_traceparent(traceparent) is not None:
        begin_remote(ctx, traceparent, tracestate, attributes)
    elif path not in PROBE_PATHS:
        if _sampler.root():
            _server_span(ctx, None, attributes)
        else:
            ctx.trace = DROPPED


def _materialize(ctx: logs.RequestContext) -> Live | None:
    """An undecided request's first traced work: the root sampler decides."""
    if _sampler.root():
        return _server_span(ctx, None, {})
    ctx.trace = DROPPED
    return None


def finish(
    ctx: logs.RequestContext | None, method: str, route: str, status: int, path: str = ""
) -> None:
    """The request was answered: its server span (if any) named and ended."""
    if ctx is None:
        return
    live = ctx.trace
    if live is None or live is DROPPED:
        return
    span = live.span
    if not span.is_recording():
        return
    if method not in _METHODS:
        method = "_OTHER"
    span.update_name(f"{method} {route}")
    span.set_attribute("http.request.method", method)
    span.set_attribute("http.route", route)
    span.set_attribute("http.response.status_code", status)
    if path:
        span.set_attribute("url.path", path)
    if status >= 500:
        span.set_status(_api.Status(_api.StatusCode.ERROR))
    span.end()


# -- spans under a request -------------------------------------------------------------


def _live_of(ref: Any, materialize: bool) -> Live | None:
    if isinstance(ref, Live):
        return ref
    if isinstance(ref, logs.RequestContext):
        live = ref.trace
        if live is None:
            return _materialize(ref) if materialize else None
        return None if live is DROPPED else live
    if isinstance(ref, Background):
        return ref.resolve(materialize)
    return None


def current() -> Any:
    """What work started now belongs to (kept by a group for `serving`): the innermost
    span, else the request, else None. Cheap; None when traces are off."""
    if not ENABLED:
        return None
    scope = _SCOPE.get()
    if scope is not None:
        return scope
    return logs.current.get()


def _parent(materialize: bool, root: bool) -> tuple[Any, list[Live], bool]:
    """(the parent's context or None, spans to link, traced at all) for a new span."""
    scope = _SCOPE.get()
    if type(scope) is Live:
        return _api.set_span_in_context(scope.span), [], True
    if type(scope) is _Batch:
        spans = scope.spans()
        if not spans:
            return None, [], False
        return _api.set_span_in_context(spans[0].span), spans, True
    if type(scope) is Background:
        unit = scope.resolve(materialize)
        if unit is None:
            return None, [], False
        return _api.set_span_in_context(unit.span), [], True
    ctx = logs.current.get()
    if ctx is not None:
        live = _live_of(ctx, materialize)
        if live is None:
            return None, [], False
        return _api.set_span_in_context(live.span), [], True
    if root and _sampler.root():
        return None, [], True
    return None, [], False


def traced() -> bool:
    """Whether a span started now would be recorded (an undecided request is decided
    here): lets a call site skip building a span's attributes for the untraced."""
    return ENABLED and _parent(True, False)[2]


def start(
    name: str,
    kind: int = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    *,
    materialize: bool = True,
    root: bool = False,
) -> Live | None:
    """A span under the current request or scope, not made current (ended by `end`);
    None when there is nothing traced to put it under. `materialize=False`: an
    undecided request is not decided by this span (upkeep a request triggers)."""
    if not ENABLED:
        return None
    parent, linked, traced = _parent(materialize, root)
    if not traced:
        return None
    links = [_api.Link(live.context) for live in linked]
    span = _tracer.start_span(
        name, context=parent, kind=_kinds[kind], attributes=attributes, links=links
    )
    live = Live(span)
    for other in linked:
        if other.span.is_recording():
            other.span.add_link(live.context)
    return live


def end(live: Live, error: BaseException | None = None, status: int | None = None) -> None:
    span = live.span
    if status is not None:
        span.set_attribute("http.response.status_code", status)
    if error is not None:
        span.set_attribute("error.type", type(error).__qualname__)
        span.set_status(_api.Status(_api.StatusCode.ERROR, type(error).__qualname__))
    elif status is not None and status >= 400:
        span.set_attribute("error.type", str(status))
        span.set_status(_api.Status(_api.StatusCode.ERROR))
    span.end()


class _Scope:
    __slots__ = ("live", "token")

    def __init__(self, live: Live | None, token: Token[Any] | None) -> None:
        self.live = live
        self.token = token

    def __enter__(self) -> Live | None:
        return self.live

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if self.token is not None:
            _SCOPE.reset(self.token)
        if self.live is not None:
            end(self.live, error)


_NO_SCOPE = _Scope(None, None)


def span(
    name: str,
    kind: int = INTERNAL,
    attributes: Mapping[str, Any] | None = None,
    *,
    root: bool = False,
) -> _Scope:
    """A span made current for the `with` block (log lines inside carry its ids),
    under the current request or scope; `root=True`: a trace of its own when there
    is none (a background batch), sampled by the root sampler."""
    if not ENABLED:
        return _NO_SCOPE
    live = start(name, kind, attributes, root=root)
    if live is None:
        return _NO_SCOPE
    return _Scope(live, _SCOPE.set(live))


class _BackgroundScope:
    __slots__ = ("token", "unit")

    def __init__(self, unit: Background) -> None:
        self.unit = unit
        self.token: Token[Any] | None = None

    def __enter__(self) -> Background:
        self.token = _SCOPE.set(self.unit)
        return self.unit

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        if self.token is not None:
            _SCOPE.reset(self.token)
        live = self.unit.live
        if live is not None and live is not DROPPED:
            end(live, error)


class _NoBackground:
    __slots__ = ()

    def __enter__(self) -> _NoBackground:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        pass

    def set(self, key: str, value: Any) -> None:
        pass


_NO_BACKGROUND = _NoBackground()


def background(name: str, attributes: Mapping[str, Any] | None = None) -> Any:
    """A background unit of work (a sweeper's batch) as a root span of its own, made
    only when traced work happens inside the `with` block and the root sampler picks
    it. `with tracing.background("expiry batch") as unit: … unit.set(key, value)`."""
    if not ENABLED:
        return _NO_BACKGROUND
    return _BackgroundScope(Background(name, dict(attributes or {})))


def serving(refs: Iterable[Any]) -> _Scope:
    """The `with` block does the work of several requests (`current()` of each, kept
    when each joined): its spans are children of the first traced one, linked to and
    from every traced one; none traced, none made (the task's own request, if it has
    one, is not one of them)."""
    if not ENABLED:
        return _NO_SCOPE
    items = list(refs)
    return _Scope(None, _SCOPE.set(_Batch([r for r in items if r is not None], len(items))))


def batch_size() -> int | None:
    """How many requests the current `serving` block serves, if any."""
    scope = _SCOPE.get() if ENABLED else None
    return scope.size if type(scope) is _Batch else None


def outbound(
    method: str, url: str, headers: MutableMapping[str, str], *, root: bool = False
) -> _Scope:
    """A client span around one outbound HTTP call, `traceparent` (and the caller's
    `tracestate`) written into `headers` when the call is traced. Under the current
    request or scope; `root=True`, outside of any (a delivery loop): a trace of its
    own, sampled by the root sampler.

        with tracing.outbound("POST", url, headers) as live:
            async with session.post(url, headers=headers, ...) as r:
                ...
            if live is not None:
                tracing.note_status(live, r.status)
    """
    if not ENABLED:
        return _NO_SCOPE
    live = start(method, CLIENT, _url_attributes(method, url), root=root)
    if live is None:
        return _NO_SCOPE
    inject(live, headers)
    return _Scope(live, _SCOPE.set(live))


def note_status(live: Live, status: int) -> None:
    """An outbound call's answer: its status on the span (4xx and 5xx: an error)."""
    live.span.set_attribute("http.response.status_code", status)
    if status >= 400:
        live.span.set_attribute("error.type", str(status))
        live.span.set_status(_api.Status(_api.StatusCode.ERROR))


def inject(live: Live, headers: MutableMapping[str, str]) -> None:
    headers["traceparent"] = live.traceparent()
    state = live.context.trace_state
    if state:
        headers["tracestate"] = state.to_header()


def _url_attributes(method: str, url: str) -> dict[str, Any]:
    # Without the query: it may carry ids and search terms; the path is enough.
    scheme, _, rest = url.partition("://")
    host, _, path = rest.partition("/")
    name, _, port = host.rpartition("@")[2].partition(":")
    attributes: dict[str, Any] = {
        "http.request.method": method,
        "url.full": f"{scheme}://{host.rpartition('@')[2]}/{path.split('?')[0]}",
        "server.address": name,
    }
    if port.isdigit():
        attributes["server.port"] = int(port)
    return attributes


def client_trace_configs() -> list[Any]:
    """aiohttp TraceConfigs for a client session whose calls are client spans (with
    `traceparent` propagated); none when traces are off, so the session pays nothing.
    Made when the session is made (after `configure`)."""
    if not ENABLED:
        return []
    import aiohttp

    async def on_start(session: Any, ctx: Any, params: Any) -> None:
        live = start(params.method, CLIENT, _url_attributes(params.method, str(params.url)))
        ctx.gate_live = live
        if live is not None:
            inject(live, params.headers)

    async def on_end(session: Any, ctx: Any, params: Any) -> None:
        live = getattr(ctx, "gate_live", None)
        if live is not None:
            end(live, status=params.response.status)

    async def on_exception(session: Any, ctx: Any, params: Any) -> None:
        live = getattr(ctx, "gate_live", None)
        if live is not None:
            end(live, params.exception)

    config = aiohttp.TraceConfig()
    config.on_request_start.append(on_start)
    config.on_request_end.append(on_end)
    config.on_request_exception.append(on_exception)
    return [config]


# -- ids for log lines -----------------------------------------------------------------


def log_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the innermost recording span of this task, for a log
    line (gate/base/logs.py asks through `use_trace_ids`)."""
    scope = _SCOPE.get()
    if type(scope) is Live:
        return scope.trace_hex, scope.span_hex
    if type(scope) is Background:
        live = scope.live
        return None if live is None or live is DROPPED else (live.trace_hex, live.span_hex)
    if scope is not None:
        return None  # a group's work: its own spans carry the requests' links
    ctx = logs.current.get()
    if ctx is not None:
        live = ctx.trace
        if live is not None and live is not DROPPED:
            return live.trace_hex, live.span_hex
    return None


def trace_id(ctx: logs.RequestContext | None) -> str | None:
    """The request's trace id, when it is traced."""
    if ctx is None:
        return None
    live = ctx.trace
    return None if live is None or live is DROPPED else str(live.trace_hex)
