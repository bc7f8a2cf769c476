"""Logs: JSON lines, a request id on every request line (the client's when sane,
echoed), one line per request with the route template and the buyer, and no token
or secret from the environment anywhere in the output."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jwt
import orjson
import pytest

from gate.base import logs
from tests.ops_support import multiprocess_env
from tests.support import (
    ADMIN,
    ADMIN_TOKEN,
    JWT_SECRET,
    WEBHOOK_SECRET,
    Client,
    GateProcess,
    buyer,
    create_deal,
    reserve,
    running_gate,
    token,
)

RESERVE_ROUTE = "/v1/deals/{deal_id}/reservations"


def test_incoming_request_ids_are_kept_only_when_sane() -> None:
    assert logs.sane_request_id(b"abc-123_x.y:z") == "abc-123_x.y:z"
    assert logs.sane_request_id(b"a" * 128) == "a" * 128
    for bad in (b"", b"a" * 129, b"has space", b"new\nline", b'quote"', "é".encode()):
        assert logs.sane_request_id(bad) is None
    ids = {logs.new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(logs.sane_request_id(i.encode()) == i for i in ids)


def test_formatter_redacts_configured_secrets_and_credentials() -> None:
    logs.redact_secrets(["s3cret-value-xyz", "abc"])  # too short to redact: ignored
    fmt = logs.JsonFormatter()
    jwt_like = token(5)
    record = logging.LogRecord(
        "gate.test",
        logging.WARNING,
        __file__,
        1,
        "failed with %s and Authorization: Bearer opaque-credential-1 and %s",
        ("s3cret-value-xyz", jwt_like),
        None,
    )
    line = fmt.format(record)
    entry = orjson.loads(line)
    assert entry["level"] == "warning" and entry["logger"] == "gate.test"
    for leaked in ("s3cret-value-xyz", "opaque-credential-1", jwt_like):
        assert leaked not in line
    assert entry["msg"].count(logs.REDACTED) == 3


@pytest.fixture(scope="module")
def log_gate(
    env: dict[str, str], prepared: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GateProcess]:
    run_env = multiprocess_env(env, tmp_path_factory.mktemp("log-metrics"), workers=2)
    run_env["GATE_LOG_LEVEL"] = "INFO"
    with running_gate(run_env, workers=2) as proc:
        yield proc


def read_lines(path: Path) -> list[dict[str, Any]]:
    entries = []
    for raw in path.read_text().splitlines():
        if not raw.strip():
            continue
        entry = orjson.loads(raw)  # every line is one JSON object
        assert isinstance(entry, dict), raw
        assert {"ts", "level", "logger", "msg"} <= set(entry), raw
        entries.append(entry)
    return entries


async def test_request_lines_are_json_with_ids_and_no_secrets(log_gate: GateProcess) -> None:
    client = Client(log_gate.url)
    buyer_token = token(4242)
    wrong_token = jwt.encode({"sub": "77", "exp": 4_000_000_000}, "x" * 40, algorithm="HS256")
    sent: list[tuple[str, int, str | None]] = []  # (request id, status, route)
    try:
        deal_id = await create_deal(client, stock=1)

        r = await client.get("/healthz", headers={"X-Request-Id": "ops-log-test-0001"})
        assert r.headers["X-Request-Id"] == "ops-log-test-0001"
        sent.append(("ops-log-test-0001", 200, "/healthz"))

        for bad in ("has spaces in it", "x" * 200, "semi;colon"):
            r = await client.get("/healthz", headers={"X-Request-Id": bad})
            assert r.status_code == 200
            assert r.headers["X-Request-Id"] != bad and r.headers["X-Request-Id"]
            sent.append((r.headers["X-Request-Id"], 200, "/healthz"))

        r = await client.post(
            f"/v1/deals/{deal_id}/reservations",
            json={"quantity": 1},
            headers={
                "Authorization": f"Bearer {buyer_token}",
                "Idempotency-Key": "ops-log-key-0001",
                "X-Request-Id": "ops-log-reserve",
            },
        )
        assert r.status_code == 201, r.text
        sent.append(("ops-log-reserve", 201, RESERVE_ROUTE))

        r = await reserve(client, deal_id, 4243, "ops-log-key-0002")
        assert r.status_code == 409
        sent.append((r.headers["X-Request-Id"], 409, RESERVE_ROUTE))

        r = await client.get(
            f"/v1/deals/{deal_id}", headers={"Authorization": f"Bearer {wrong_token}"}
        )
        assert r.status_code == 200
        r = await client.get(
            "/v1/orders/01JD3W9K2XG5W7Q8M4Z6V1R0TB",
            headers={"Authorization": f"Bearer {wrong_token}", "X-Request-Id": "ops-log-401"},
        )
        assert r.status_code == 401
        sent.append(("ops-log-401", 401, "/v1/orders/{order_id}"))

        # A client sending a secret as its request id gets it echoed (it already has
        # it), but the log never prints it.
        r = await client.get(
            f"/v1/admin/deals/{deal_id}", headers={**ADMIN, "X-Request-Id": ADMIN_TOKEN}
        )
        assert r.status_code == 200

        r = await client.get("/no/such/route", headers=buyer(4244))
        assert r.status_code == 404
        sent.append((r.headers["X-Request-Id"], 404, "unmatched"))
    finally:
        await client.close()
    log_gate.stop()  # flushes and closes the log

    text = log_gate.log_path.read_text()
    entries = read_lines(log_gate.log_path)
    requests = [e for e in entries if e["logger"] == "gate.request"]
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in requests:
        assert e["request_id"], e
        assert {"method", "route", "status", "duration_ms"} <= set(e), e
        by_id.setdefault(e["request_id"], []).append(e)
    for rid, status, route in sent:
        assert len(by_id.get(rid, [])) == 1, (rid, by_id.get(rid))
        line = by_id[rid][0]
        assert line["status"] == status and line["route"] == route and line["level"] == "info"
    assert by_id["ops-log-reserve"][0]["user_id"] == 4242
    assert "user_id" not in by_id["ops-log-401"][0]

    for secret in (
        JWT_SECRET,
        ADMIN_TOKEN,
        WEBHOOK_SECRET,
        WEBHOOK_SECRET.removeprefix("whsec_"),
        buyer_token,
        wrong_token,
    ):
        assert secret not in text
    assert "Bearer" not in text and "authorization" not in text.lower()


async def test_an_unhandled_error_is_counted_and_logged_with_its_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from gate.base.metrics import METRICS, sample_values, value_of
    from gate.web.recorder import RequestObserver

    seen: list[str | None] = []

    async def broken(request: Request) -> Response:
        logging.getLogger("gate.test").warning("about to fail")
        raise RuntimeError("boom")

    async def on_error(request: Request, exc: Exception) -> Response:
        ctx = logs.current.get()
        seen.append(ctx.request_id if ctx else None)
        return Response("internal", status_code=500)

    app = Starlette(
        routes=[Route("/broken/{item_id:int}", broken)],
        middleware=[Middleware(RequestObserver)],
        exception_handlers={Exception: on_error},
    )
    before = value_of(
        sample_values(METRICS.render().decode()),
        "gate_http_requests_total",
        route="/broken/{item_id}",
        status="500",
    )
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/broken/17",
        "raw_path": b"/broken/17",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"x-request-id", b"unit-500")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    fmt = logs.JsonFormatter()
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError):
        await app(scope, receive, send)  # the error reaches the server after the answer
    assert messages[0]["status"] == 500
    assert seen == ["unit-500"]
    lines = [orjson.loads(fmt.format(r)) for r in caplog.records]
    assert [line["request_id"] for line in lines if line["logger"] == "gate.test"] == ["unit-500"]
    request_lines = [line for line in lines if line["logger"] == "gate.request"]
    assert request_lines and request_lines[0]["status"] == 500
    assert request_lines[0]["route"] == "/broken/{item_id}"
    after = value_of(
        sample_values(METRICS.render().decode()),
        "gate_http_requests_total",
        route="/broken/{item_id}",
        status="500",
    )
    assert after == before + 1


async def test_the_gate_500_answer_carries_the_request_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The gate's handler of unexpected errors answers from outside the request
    middleware; its 500 still names the request, as every other answer does."""
    from starlette.requests import Request

    from gate.api.app import _unexpected

    logs.begin_request("unit-500-gate")
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/v1/deals/1",
        "raw_path": b"/v1/deals/1",
        "root_path": "",
        "query_string": b"",
        "headers": [],
        "scheme": "http",
        "server": ("127.0.0.1", 80),
    }
    with caplog.at_level(logging.ERROR):
        answer = await _unexpected(Request(scope), RuntimeError("boom"))
    assert answer.status_code == 500
    assert answer.headers["x-request-id"] == "unit-500-gate"
    assert answer.headers["content-type"] == "application/problem+json"
    assert orjson.loads(answer.body)["code"] == "INTERNAL"
