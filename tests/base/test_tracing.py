"""gate/base/tracing.py and the access log on their own: the W3C headers, the OTEL_*
settings, the spans a request, a group and a background batch make (exported over
OTLP/HTTP to tests/otlp_receiver.py in this process), the ids on log lines, the
access log's bounded queue, and the gate without the `otel` extra at all."""

from __future__ import annotations

import contextvars
import logging
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from gate.base import logs, trace_context, tracing
from gate.base.access_log import DROPPED, AccessLog
from gate.base.settings import SettingsError
from tests.otlp_receiver import OtlpReceiver, Span
from tests.support import GATE_BIN, ROOT, Client, GateProcess, base_env, create_deal, reserve

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (f"00-{TRACE}-{PARENT}-01", (int(TRACE, 16), int(PARENT, 16), True)),
        (f"00-{TRACE}-{PARENT}-00", (int(TRACE, 16), int(PARENT, 16), False)),
        (f" 00-{TRACE}-{PARENT}-03 ", (int(TRACE, 16), int(PARENT, 16), True)),
        # A later version may append fields; version 00 may not.
        (f"01-{TRACE}-{PARENT}-01-what-follows", (int(TRACE, 16), int(PARENT, 16), True)),
        (f"00-{TRACE}-{PARENT}-01-extra", None),
        (f"ff-{TRACE}-{PARENT}-01", None),
        (f"00-{'0' * 32}-{PARENT}-01", None),
        (f"00-{TRACE}-{'0' * 16}-01", None),
        (f"00-{TRACE.upper()}-{PARENT}-01", None),
        (f"00-{TRACE[:-1]}-{PARENT}-01", None),
        ("00-xyz", None),
        ("", None),
        (None, None),
    ],
)
def test_traceparent_is_read_as_w3c_trace_context_says(header: Any, expected: Any) -> None:
    assert trace_context.parse_traceparent(header) == expected
    if isinstance(header, str):
        assert trace_context.parse_traceparent(header.encode()) == expected


def test_tracestate_is_kept_whole_or_not_at_all() -> None:
    assert trace_context.parse_tracestate("congo=t61rcWkgMzE, rojo=00f067aa0ba902b7") == [
        ("congo", "t61rcWkgMzE"),
        ("rojo", "00f067aa0ba902b7"),
    ]
    assert trace_context.parse_tracestate("tenant@vendor=x,,") == [("tenant@vendor", "x")]
    for bad in ("Upper=x", "a=x,a=y", "a=x=y", "a=" + "x" * 300, ",".join(["k=v"] * 200)):
        assert trace_context.parse_tracestate(bad) == [], bad
    many = ",".join(f"k{i}=v" for i in range(33))
    assert trace_context.parse_tracestate(many) == []


def test_otel_settings_turn_traces_on_only_with_an_exporter() -> None:
    endpoint = "http://collector:4318"
    assert tracing.exporter_endpoint({}) is None
    assert tracing.exporter_endpoint({"OTEL_SERVICE_NAME": "gate"}) is None
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    assert tracing.exporter_endpoint(on) == endpoint + "/v1/traces"
    assert tracing.exporter_endpoint({**on, "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint + "/"}) == (
        endpoint + "/v1/traces"
    )
    own = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://x.example/otlp/traces"}
    assert tracing.exporter_endpoint({**on, **own}) == "https://x.example/otlp/traces"
    assert tracing.exporter_endpoint({**on, "OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracing.exporter_endpoint({**on, "OTEL_SDK_DISABLED": "true"}) is None
    assert tracing.exporter_endpoint({**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    refused = [
        {**on, "OTEL_TRACES_EXPORTER": "zipkin"},
        {**on, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        {**on, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:port"},
        {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://collector/v1/traces"},
    ]
    for env in refused:
        with pytest.raises(SettingsError):
            tracing.exporter_endpoint(env)


def test_samplers_are_the_standard_ones() -> None:
    default = tracing.parse_sampler({})
    assert (default.name, default.parent_based, default.ratio) == ("parentbased_always_on", True, 1)
    ratio = tracing.parse_sampler(
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    )
    assert ratio.parent_based and ratio.ratio == 0.01
    # Parent-based: the caller's flag decides, whatever the ratio.
    assert ratio.with_parent(True) and not ratio.with_parent(False)
    assert sum(ratio.root() for _ in range(20_000)) < 600
    off = tracing.parse_sampler({"OTEL_TRACES_SAMPLER": "always_off"})
    assert not off.root() and not off.with_parent(True)
    on = tracing.parse_sampler({"OTEL_TRACES_SAMPLER": "always_on"})
    assert on.root() and on.with_parent(False)
    for env in (
        {"OTEL_TRACES_SAMPLER": "jaeger_remote"},
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1%"},
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"},
    ):
        with pytest.raises(SettingsError):
            tracing.parse_sampler(env)


def test_gate_serve_refuses_otel_values_it_cannot_honour() -> None:
    env = {
        **base_env(),
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
        "OTEL_TRACES_SAMPLER": "traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "1%",
    }
    out = subprocess.run(
        [GATE_BIN, "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "OTEL_TRACES_SAMPLER_ARG must be a ratio" in out.stderr
    assert "Traceback" not in out.stderr


# -- the spans, in this process --------------------------------------------------------


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.endpoint)
        monkeypatch.setenv("OTEL_SERVICE_NAME", "gate-unit")
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        assert tracing.configure(os.environ, service_version="9.9.9")
        try:
            yield r
        finally:
            tracing.shutdown()
            assert not tracing.ENABLED


def _request(run: Any, traceparent: str | None = None) -> logs.RequestContext:
    """A request's context as the edge opens one (its own contextvars.Context)."""
    context = contextvars.copy_context()

    def begin() -> logs.RequestContext:
        ctx = logs.begin_request(logs.new_request_id(), time.perf_counter() - 0.001)
        if traceparent is not None:
            tracing.begin_remote(ctx, traceparent, "rojo=1", {"url.path": "/x"})
        run(ctx)
        return ctx

    return context.run(begin)


def _flushed(r: OtlpReceiver, count: int) -> list[Span]:
    tracing.flush()
    return r.wait_for(lambda spans: len(spans) >= count, 10)


def test_a_request_its_work_and_a_group_linked_both_ways(receiver: OtlpReceiver) -> None:
    headers: dict[str, str] = {}
    kept: list[Any] = []
    lines: list[dict[str, Any]] = []
    formatter = logs.JsonFormatter()

    def work(ctx: logs.RequestContext) -> None:
        redis = tracing.start("EVALSHA admit", tracing.CLIENT, {"db.system.name": "redis"})
        assert redis is not None
        tracing.end(redis)
        kept.append(tracing.current())
        with tracing.outbound("POST", "https://psp.example:8443/v1/x?secret=1", headers) as live:
            assert live is not None
            record = logging.LogRecord("gate.t", logging.WARNING, "", 0, "inside", (), None)
            lines.append(orjson.loads(formatter.format(record)))
            tracing.note_status(live, 201)

    traced = _request(work, f"00-{TRACE}-{PARENT}-01")
    # A second request the caller did not sample, in the same group.
    dropped = _request(lambda ctx: kept.append(tracing.current()), f"00-{TRACE}-{PARENT}-00")
    assert dropped.trace is tracing.DROPPED
    with tracing.serving([*kept, None]):
        assert tracing.batch_size() == 3
        with tracing.span("CALL gate_reserve_group", tracing.CLIENT):
            pass
    # Answered once its group committed (the request waited for it).
    tracing.finish(traced, "POST", "/v1/deals/{deal_id}/reservations", 201, "/v1/deals/1/r")

    spans = {s.name: s for s in _flushed(receiver, 4)}
    server = spans["POST /v1/deals/{deal_id}/reservations"]
    assert (server.trace_id, server.parent_span_id, server.kind) == (TRACE, PARENT, "server")
    assert server.attributes["http.response.status_code"] == 201
    assert server.attributes["gate.request_id"] == traced.request_id
    assert server.resource["service.name"] == "gate-unit"
    assert server.resource["service.version"] == "9.9.9"
    assert spans["EVALSHA admit"].parent_span_id == server.span_id
    client = spans["POST"]
    assert client.parent_span_id == server.span_id and client.kind == "client"
    assert client.attributes["url.full"] == "https://psp.example:8443/v1/x"
    assert client.attributes["server.port"] == 8443
    assert headers["traceparent"] == f"00-{TRACE}-{client.span_id}-01"
    assert headers["tracestate"] == "rojo=1"
    assert lines[0]["trace_id"] == TRACE and lines[0]["span_id"] == client.span_id
    group = spans["CALL gate_reserve_group"]
    assert group.parent_span_id == server.span_id
    assert group.links == [(TRACE, server.span_id)]
    assert (TRACE, group.span_id) in server.links


def test_an_answer_from_memory_is_not_traced_and_work_decides_the_rest(
    receiver: OtlpReceiver,
) -> None:
    def memory(ctx: logs.RequestContext) -> None:
        # Upkeep the answer triggered decides nothing; the answer is not traced.
        assert tracing.start("EVALSHA soldout_renew", tracing.CLIENT, materialize=False) is None
        tracing.finish(ctx, "POST", "/v1/deals/{deal_id}/reservations", 409)

    untraced = _request(memory)
    assert untraced.trace is None

    def work(ctx: logs.RequestContext) -> None:
        live = tracing.start("EVALSHA admit", tracing.CLIENT)
        assert live is not None
        tracing.end(live, RuntimeError("lost"))
        tracing.finish(ctx, "POST", "/v1/deals/{deal_id}/reservations", 503)

    decided = _request(work)
    spans = {s.name: s for s in _flushed(receiver, 2)}
    server = spans["POST /v1/deals/{deal_id}/reservations"]
    assert server.parent_span_id == "" and server.trace_id == decided.trace.trace_hex
    assert server.status == 2  # error: a 5xx
    # Dated from the request's start, before its work.
    assert server.start_ns <= spans["EVALSHA admit"].start_ns
    assert spans["EVALSHA admit"].attributes["error.type"] == "RuntimeError"
    time.sleep(0.2)
    assert len(receiver.spans) == 2


def test_a_background_batch_is_a_root_only_when_it_does_traced_work(
    receiver: OtlpReceiver,
) -> None:
    with tracing.background("expiry batch") as unit:
        unit.set("gate.expiry.released", 0)
    with tracing.background("expiry batch") as unit:
        with tracing.span("CALL gate_expire_batch", tracing.CLIENT):
            pass
        unit.set("gate.expiry.released", 3)
    spans = {s.name: s for s in _flushed(receiver, 2)}
    batch = spans["expiry batch"]
    assert batch.parent_span_id == "" and batch.attributes["gate.expiry.released"] == 3
    assert spans["CALL gate_expire_batch"].parent_span_id == batch.span_id
    time.sleep(0.2)
    assert len(receiver.spans) == 2  # the empty batch made none
    # Outside any request or batch, work makes no span; an outbound call may be a root.
    assert tracing.start("EVALSHA x", tracing.CLIENT) is None
    headers: dict[str, str] = {}
    with tracing.outbound("POST", "https://shop.example/hooks", headers):
        pass
    assert headers == {}
    with tracing.outbound("POST", "https://shop.example/hooks", headers, root=True) as live:
        assert live is not None
    delivery = _flushed(receiver, 3)[-1]
    assert (delivery.name, delivery.kind, delivery.parent_span_id) == ("POST", "client", "")
    assert headers["traceparent"] == f"00-{delivery.trace_id}-{delivery.span_id}-01"


def test_off_everything_is_a_flag_check() -> None:
    assert not tracing.ENABLED
    assert tracing.current() is None
    assert tracing.start("x") is None
    assert tracing.client_trace_configs() == []
    headers: dict[str, str] = {}
    with tracing.outbound("GET", "http://x/", headers) as live, tracing.serving([1]):
        assert live is None and tracing.batch_size() is None
    assert headers == {}


# -- the access log --------------------------------------------------------------------


def test_the_access_log_drops_and_counts_rather_than_wait(caplog: pytest.LogCaptureFixture) -> None:
    access = AccessLog(queue_max=3)
    before = DROPPED._value.get()
    for i in range(5):
        access.put("POST", "/v1/deals/{deal_id}/reservations", 409, 0.0012, f"rid-{i}", None)
    access.put("GET", "/x", 200, 0.0, "rid-x", TRACE)  # dropped too: still full
    access._dropped.flush()
    assert DROPPED._value.get() - before == 3
    with caplog.at_level(logging.INFO, logger="gate.access"):
        assert access.write_pending() == 3
        assert access.write_pending() == 0
    records = [r for r in caplog.records if r.name == "gate.access"]
    assert [r.__dict__["request_id"] for r in records] == ["rid-0", "rid-1", "rid-2"]
    first = records[0].__dict__
    assert (first["method"], first["route"], first["status"], first["duration_ms"]) == (
        "POST",
        "/v1/deals/{deal_id}/reservations",
        409,
        1.2,
    )
    assert "trace_id" not in first


def test_the_access_log_thread_writes_what_is_queued_then_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    access = AccessLog()
    with caplog.at_level(logging.INFO, logger="gate.access"):
        access.start()
        access.put("GET", "/v1/deals/{deal_id}", 200, 0.0, "rid-t", TRACE)
        access.stop()
    [record] = [r for r in caplog.records if r.name == "gate.access"]
    assert record.__dict__["trace_id"] == TRACE


# -- without the extra -----------------------------------------------------------------

BLOCKER = textwrap.dedent(
    """
    # The `otel` extra absent: every opentelemetry import fails as if not installed.
    import sys

    class _Absent:
        def find_spec(self, name, path=None, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Absent())
    """
)


def test_without_the_extra_nothing_imports_it_when_off(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    code = (
        "import sys, os\n"
        "from gate.base import tracing\n"
        "import gate.api.app, gate.runtime, gate.web.edge\n"
        "assert not tracing.configure({})\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules)\n"
        "assert not tracing.configure({'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://127.0.0.1:9'})\n"
        "print('untraced')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0 and out.stdout.strip() == "untraced", out.stderr
    assert "the otel extra is not installed" in out.stderr


async def test_a_gate_without_the_extra_serves_untraced(tmp_path: Path, prepared: None) -> None:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    with OtlpReceiver() as receiver:
        env = {
            **base_env(),
            "PYTHONPATH": str(tmp_path),
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "GATE_LOG_LEVEL": "INFO",
        }
        gate = GateProcess(env, workers=1)
        try:
            gate.wait_ready()
            client = Client(gate.url)
            try:
                deal = await create_deal(client, stock=2)
                r = await reserve(client, deal, 8101, "no-extra-8101")
                assert r.status_code == 201, r.text
            finally:
                await client.close()
        finally:
            gate.stop()
        assert receiver.spans == []
        assert "the otel extra is not installed" in gate.log_path.read_text()
