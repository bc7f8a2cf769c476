"""Slow or endless bodies cannot pin connections, over real sockets.

A gate with a one-second body deadline and room for one request at a time:
  - headers and part of a body, then silence: 408 problem+json, connection closed;
  - a body trickled a byte at a time: the deadline is the request's, not each read's;
  - while a slow request holds the one slot, another gets 503 problem+json at once
    (and the probes still answer); once the slot is free, requests are served again.
Timings are guarded generously (the machine is shared): the outcomes are asserted.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import orjson
import pytest

from gate.store.db import Database
from tests import raw_http
from tests.raw_http import Answer, read_answer
from tests.support import ADMIN_TOKEN, GateProcess, base_env, token

BODY_TIMEOUT_SECONDS = 1.0
# Far beyond the deadline, far below "pinned forever".
GUARD_SECONDS = 20.0


@pytest.fixture(scope="module")
def guarded(prepared: None) -> Iterator[GateProcess]:
    env = base_env()
    env["GATE_BODY_TIMEOUT_SECONDS"] = str(BODY_TIMEOUT_SECONDS)
    env["GATE_HTTP_CONCURRENCY_MAX"] = "1"
    with GateProcess(env, workers=1, background=False) as proc:
        yield proc


def connect(port: int) -> socket.socket:
    return raw_http.connect(port, GUARD_SECONDS)


def head(
    method: str, path: str, auth: str, length: int, content_type: str = "application/json"
) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: gate",
        f"Authorization: Bearer {auth}",
        "Idempotency-Key: guard-test-key-01",
        f"Content-Type: {content_type}",
        f"Content-Length: {length}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def get(port: int, path: str) -> Answer:
    with connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gate\r\n\r\n".encode())
        return read_answer(sock)


async def _deals(db: Database) -> int:
    row = await db.fetchone("SELECT COUNT(*) FROM deals")
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("path", "auth"),
    [
        ("/v1/admin/deals", ADMIN_TOKEN),  # through the router
        ("/v1/deals/1/reservations", token(71)),  # the fast lane
    ],
)
async def test_a_stalled_body_is_408_and_the_connection_closed(
    guarded: GateProcess, db: Database, path: str, auth: str
) -> None:
    before = await _deals(db)
    with connect(guarded.port) as sock:
        started = time.monotonic()
        sock.sendall(head("POST", path, auth, 200) + b'{"title": "slo')
        answer = read_answer(sock)
        waited = time.monotonic() - started
    assert answer.status == 408, answer
    assert answer.problem()["code"] == "REQUEST_TIMEOUT"
    assert answer.closed, "the connection must be closed after a 408"
    assert waited < GUARD_SECONDS
    assert await _deals(db) == before


@pytest.mark.parametrize(
    ("path", "auth"),
    [
        ("/v1/admin/deals", ADMIN_TOKEN),  # through the router
        ("/v1/deals/1/reservations", token(72)),  # the fast lane
    ],
)
def test_the_rest_of_a_late_body_does_not_reset_its_408(
    guarded: GateProcess, path: str, auth: str
) -> None:
    with connect(guarded.port) as sock:
        sock.sendall(head("POST", path, auth, 200) + b'{"title": "slo')
        # The 408 has come (and the server has closed its side); the rest of the
        # body follows it. A socket closed with those bytes unread is reset, and the
        # reset throws the unread 408 away on the client's side.
        assert sock.recv(1, socket.MSG_PEEK)
        sock.sendall(b"w" * 185)
        time.sleep(0.3)
        answer = read_answer(sock)
    assert answer.status == 408 and answer.closed


async def test_a_trickled_body_gets_no_more_time_than_a_stalled_one(
    guarded: GateProcess, db: Database
) -> None:
    before = await _deals(db)
    body = orjson.dumps({"title": "trickle", "unit_price": 1, "currency": "EUR", "stock": 1})
    with connect(guarded.port) as sock:
        sock.sendall(head("POST", "/v1/admin/deals", ADMIN_TOKEN, len(body)))
        # A byte every 0.2 s would take len(body) / 5 s, several times the deadline;
        # each byte arrives well within the deadline of the one before.
        sent = await asyncio.to_thread(raw_http.trickle, sock, body, 0.2, GUARD_SECONDS)
        answer = read_answer(sock)
    assert sent < len(body) - 1, "the server waited for the whole trickle"
    assert answer.status == 408 and answer.closed
    assert await _deals(db) == before


def test_beyond_the_concurrency_bound_the_answer_is_503_at_once(
    guarded: GateProcess,
) -> None:
    with connect(guarded.port) as slow:
        # The slow request takes the one slot (its body never comes)...
        slow.sendall(head("POST", "/v1/admin/deals", ADMIN_TOKEN, 100) + b"{")
        time.sleep(0.2)
        # ...so another is refused at once, before the slow one's deadline.
        started = time.monotonic()
        busy = get(guarded.port, "/v1/deals/1")
        refused_after = time.monotonic() - started
        slow.setblocking(False)
        try:
            early = slow.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            early = b""
        slow.setblocking(True)
        assert early == b"", "the slow request was answered before the busy one"
        assert busy.status == 503, busy
        assert busy.problem()["code"] == "OVERLOADED"
        assert busy.headers["retry-after"] == "1"
        assert refused_after < GUARD_SECONDS
        # The probes still reach an overloaded worker; the metrics are scraped from
        # their own listener, which the worker's load does not hold up.
        assert get(guarded.port, "/healthz").status == 200
        assert guarded.metrics_port is not None
        assert get(guarded.metrics_port, "/metrics").status == 200
        slow.settimeout(GUARD_SECONDS)
        assert read_answer(slow).status == 408
    # The slot is free again: served as usual (no such deal).
    deadline = time.monotonic() + GUARD_SECONDS
    while True:
        answer = get(guarded.port, "/v1/deals/999999999")
        if answer.status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.status == 404, answer


def test_the_edge_s_requests_count_in_the_same_bound(guarded: GateProcess) -> None:
    """A reservation that comes whole is answered by the edge (gate/web/edge.py), which
    shares the worker's bound: with the one slot held, it is refused 503 at once and
    its connection closed, like any other."""
    body = b'{"quantity": 1}'
    with connect(guarded.port) as slow:
        slow.sendall(head("POST", "/v1/admin/deals", ADMIN_TOKEN, 100) + b"{")
        time.sleep(0.2)
        with connect(guarded.port) as sock:
            sock.sendall(head("POST", "/v1/deals/1/reservations", token(72), len(body)) + body)
            busy = read_answer(sock)
        assert busy.status == 503, busy
        assert busy.problem()["code"] == "OVERLOADED"
        assert busy.closed
        slow.settimeout(GUARD_SECONDS)
        assert read_answer(slow).status == 408
    # The slot is free again, and the edge's answer is the deal's (no such deal).
    deadline = time.monotonic() + GUARD_SECONDS
    while True:
        with connect(guarded.port) as sock:
            sock.sendall(
                head("POST", "/v1/deals/999999999/reservations", token(72), len(body)) + body
            )
            answer = read_answer(sock)
        if answer.status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert answer.status == 404, answer
