"""The edge (gate/web/edge.py), over real sockets against a real `gate serve`: its
answers are the ASGI application's (the same request with Expect: 100-continue,
which the edge leaves to the application), whether the request comes whole or in
pieces; pipelined requests are answered in order, whichever side answers each;
Connection: close and HTTP/1.0 close after the answer; a buyer who hangs up
mid-reservation leaves the gate serving and Redis = DB; request ids, request
metrics, the guard's bound and body deadline cover the edge's answers as they cover
the others; an unexpected error is a 500 problem.

Which side answered is read from `gate_edge_requests_total` (one worker, so one
process's counters)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from gate.base.metrics import METRICS, sample_values, value_of
from gate.base.settings import Settings
from gate.store.db import Database
from gate.store.keys import deal_keys
from gate.web.edge import HEAD_MAX_BYTES
from tests.raw_http import TIMEOUT_SECONDS, Answer, Reader, connect, trickle
from tests.support import (
    ADMIN_TOKEN,
    CLUSTER_RUN,
    GateProcess,
    assert_invariants,
    base_env,
    free_port,
    metrics_url_of,
    token,
)

USER_BASE = 8_800_000
# Between the pieces of a request sent in pieces: each comes in a read of its own.
SPLIT_PAUSE_SECONDS = 0.15
BODY_TIMEOUT_SECONDS = 1.0


@pytest.fixture(scope="module")
def edge_gate(prepared: None) -> Iterator[GateProcess]:
    env = base_env()
    # The sold-out near-cache on, as in production: its answers are the edge's
    # synchronous ones.
    env["GATE_SOLD_OUT_CACHE_MS"] = "1000"
    env["GATE_BODY_TIMEOUT_SECONDS"] = str(BODY_TIMEOUT_SECONDS)
    with GateProcess(env, workers=1) as proc:
        yield proc


def request(
    method: str,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    version: str = "1.1",
) -> tuple[bytes, bytes]:
    """(head, body) of one request; Content-Length when there is a body."""
    lines = [f"{method} {path} HTTP/{version}", "Host: gate"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode(), body


def reservation(deal_id: int, user: int, key: str, body: bytes = b'{"quantity": 1}') -> bytes:
    """A whole reservation request (head and body)."""
    head, _ = request("POST", f"/v1/deals/{deal_id}/reservations", buy(user, key), body)
    return head + body


def buy(user: int, key: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {token(user)}",
        "Idempotency-Key": key,
        "Content-Type": "application/json",
    }


def send(port: int, data: bytes) -> Answer:
    """One request's bytes in one write, on a connection of its own: its answer."""
    with connect(port) as sock:
        sock.sendall(data)
        return Reader(sock).answer()


def send_whole(port: int, head: bytes, body: bytes) -> Answer:
    return send(port, head + body)


def send_split(port: int, head: bytes, body: bytes) -> Answer:
    """The headers, a pause, then the body: two reads."""
    with connect(port) as sock:
        sock.sendall(head)
        time.sleep(SPLIT_PAUSE_SECONDS)
        sock.sendall(body)
        return Reader(sock).answer()


def send_asgi(port: int, head: bytes, body: bytes) -> Answer:
    """The request with Expect: 100-continue, which the edge leaves to the ASGI
    application (the body is sent at once, without waiting for the 100)."""
    assert head.endswith(b"\r\n\r\n")
    return send_whole(port, head[:-2] + b"Expect: 100-continue\r\n\r\n", body)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples of the gate serving `port`, from its metrics listener."""
    listener = metrics_url_of(f"http://127.0.0.1:{port}")
    with connect(int(listener.rsplit(":", 1)[1])) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: gate\r\n\r\n")
        return sample_values(Reader(sock).answer().body.decode())


def edge_count(port: int) -> float:
    return value_of(scrape(port), "gate_edge_requests_total")


def admin_deal(port: int, **fields: object) -> int:
    body = orjson.dumps(
        {"title": "edge", "unit_price": 500, "currency": "EUR", "stock": 10, **fields}
    )
    head, body = request(
        "POST",
        "/v1/admin/deals",
        {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        body,
    )
    answer = send_whole(port, head, body)
    assert answer.status == 201, answer
    return int(answer.json()["id"])  # type: ignore[call-overload]


def sold_out_deal(port: int) -> int:
    deal_id = admin_deal(port, stock=1)
    assert send(port, reservation(deal_id, USER_BASE, f"edge-first-{deal_id}")).status == 201
    # A sold-out answer from Redis fills this process's near-cache.
    assert send(port, reservation(deal_id, USER_BASE + 1, f"edge-fill-{deal_id}")).status == 409
    return deal_id


SAME = ("content-type", "content-length", "retry-after", "location", "idempotent-replayed")


def comparable(answer: Answer) -> tuple[int, dict[str, str], bytes]:
    """What must be the same whichever side answered (not the date or the id)."""
    return answer.status, {k: v for k, v in answer.headers.items() if k in SAME}, answer.body


def test_edge_and_asgi_give_the_same_answers(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    sold = sold_out_deal(port)
    path = f"/v1/deals/{sold}/reservations"
    user = USER_BASE + 10
    cases: list[tuple[str, dict[str, str], bytes, int]] = [
        ("sold out", buy(user, "edge-same-0001"), b'{"quantity": 1}', 409),
        (
            "no token",
            {"Content-Type": "application/json", "Idempotency-Key": "edge-same-0002"},
            b'{"quantity": 1}',
            401,
        ),
        ("bad key", buy(user, "no"), b'{"quantity": 1}', 400),
        ("not JSON", buy(user, "edge-same-0003"), b'{"quantity": ', 400),
        ("empty", buy(user, "edge-same-0004"), b"", 400),
        ("unknown field", buy(user, "edge-same-0005"), b'{"quantity": 1, "price": 0}', 400),
        ("quantity", buy(user, "edge-same-0006"), b'{"quantity": 0}', 400),
        ("array", buy(user, "edge-same-0007"), b"[1]", 400),
        (
            "too large",
            buy(user, "edge-same-0008"),
            b'{"quantity": 1, "x": "' + b"a" * 5000 + b'"}',
            413,
        ),
        (
            "media type",
            {**buy(user, "edge-same-0009"), "Content-Type": "text/plain"},
            b'{"quantity": 1}',
            415,
        ),
    ]
    before = edge_count(port)
    for name, headers, body, status in cases:
        head, _ = request("POST", path, headers, body)
        whole = send_whole(port, head, body)
        split = send_split(port, head, body)
        asgi = send_asgi(port, head, body)
        assert whole.status == status, (name, whole)
        assert comparable(whole) == comparable(split) == comparable(asgi), name
        assert whole.headers["content-type"] == "application/problem+json", name
    # An unknown deal, after the buyer is known; an id past any row.
    for unknown in ("/v1/deals/999999999/reservations", "/v1/deals/0/reservations"):
        head, body = request("POST", unknown, buy(user, "edge-same-0010"), b'{"quantity": 1}')
        whole, asgi = send_whole(port, head, body), send_asgi(port, head, body)
        assert whole.status == 404 and comparable(whole) == comparable(asgi), unknown
    # Each request whole and in two reads at the edge, with Expect: 100-continue not.
    assert edge_count(port) - before == 2 * len(cases) + 2


def test_deal_views_alike_on_both_sides(edge_gate: GateProcess) -> None:
    """GET /v1/deals/{id} at the edge answers what the ASGI route answers: the view,
    a deal that is not there, an id out of range; a longer id and other spellings
    are the ASGI route's."""
    port = edge_gate.port
    deal_id = admin_deal(port, stock=7)
    assert send(port, reservation(deal_id, USER_BASE + 300, f"edge-view-{deal_id}")).status == 201
    before = edge_count(port)
    edge_paths = (f"/v1/deals/{deal_id}", f"/v1/deals/{deal_id}?x=1", "/v1/deals/999999999")
    for path in (*edge_paths, "/v1/deals/0"):
        head, _ = request("GET", path, {})
        whole, asgi = send_whole(port, head, b""), send_asgi(port, head, b"")
        assert comparable(whole) == comparable(asgi), path
    assert edge_count(port) - before == len(edge_paths) + 1
    head, _ = request("GET", f"/v1/deals/{deal_id}", {})
    view = send_whole(port, head, b"")
    assert view.status == 200 and view.headers["content-type"] == "application/json"
    body = view.json()
    assert isinstance(body, dict)
    assert (body["id"], body["remaining_hint"], body["sold_out"]) == (deal_id, 6, False)
    unknown = send_whole(port, *request("GET", "/v1/deals/999999999", {}))
    assert unknown.status == 404 and unknown.headers["content-type"] == "application/problem+json"
    before = edge_count(port)
    # Starlette's router: 404, the same deal percent-encoded, a redirect for the
    # trailing slash.
    encoded = "".join(f"%{ord(c):02X}" for c in str(deal_id))
    for path, status in (
        ("/v1/deals/" + "9" * 19, 404),
        (f"/v1/deals/{encoded}", 200),
        (f"/v1/deals/{deal_id}/", 307),
    ):
        assert send_whole(port, *request("GET", path, {})).status == status, path
    assert edge_count(port) == before


def test_order_views_alike_on_both_sides(edge_gate: GateProcess) -> None:
    """GET /v1/orders/{id} at the edge answers what the ASGI route answers: the
    owner's order, another buyer's, no token, an id the gate never made; an id not
    spelled as the gate makes them is the ASGI route's."""
    port = edge_gate.port
    deal_id = admin_deal(port, stock=5)
    owner = USER_BASE + 400
    made = send(port, reservation(deal_id, owner, f"edge-order-{deal_id}"))
    assert made.status == 201, made
    order_id = str(made.json()["order_id"])  # type: ignore[call-overload]
    own = {"Authorization": f"Bearer {token(owner)}"}
    other = {"Authorization": f"Bearer {token(owner + 1)}"}
    path = f"/v1/orders/{order_id}"
    cases = [
        (path, own, 200),
        (path + "?fields=all", own, 200),
        (path, other, 404),
        (path, {}, 401),
        ("/v1/orders/" + "0" * 26, own, 404),
    ]
    before = edge_count(port)
    for target, headers, status in cases:
        head, _ = request("GET", target, headers)
        whole, asgi = send_whole(port, head, b""), send_asgi(port, head, b"")
        assert whole.status == status, (target, whole)
        assert comparable(whole) == comparable(asgi), target
    assert edge_count(port) - before == len(cases)
    body = send_whole(port, *request("GET", path, own)).json()
    assert isinstance(body, dict) and body["order_id"] == order_id
    assert body["status"] == "PENDING_PAYMENT"
    before = edge_count(port)
    for target in (path.lower(), path + "0", "/v1/orders/" + "I" * 26, path + "/"):
        answer = send_whole(port, *request("GET", target, own))
        assert answer.status in (404, 307), (target, answer)
    assert edge_count(port) == before


def test_malformed_http_is_a_problem_400_and_closed(edge_gate: GateProcess) -> None:
    """What the HTTP parser cannot read is answered problem+json like every other
    refusal (uvicorn's own answer is text/plain), then the connection is closed;
    counted, not logged (uvicorn logged a warning for each: a log any client could
    flood)."""
    port = edge_gate.port
    before = value_of(scrape(port), "gate_http_malformed_total")
    malformed = (
        b"GET /v1/deals/1 HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\nContent-Length: 5\r\n\r\n",
        b"GET /v1/deals/\xc3\xa9 HTTP/1.1\r\nHost: gate\r\n\r\n",
        b"POST /v1/deals/1/reservations HTTP/1.1\r\nHost: gate\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"not http at all\r\n\r\n",
    )
    for data in malformed:
        answer = send(port, data)
        assert answer.status == 400, (data, answer)
        assert answer.headers["content-type"] == "application/problem+json", answer
        assert answer.json()["code"] == "INVALID_REQUEST"  # type: ignore[call-overload]
        assert answer.headers["connection"] == "close" and answer.headers["x-request-id"]
    assert value_of(scrape(port), "gate_http_malformed_total") == before + len(malformed)
    assert "Invalid HTTP request received" not in edge_gate.log_path.read_text()


def test_a_request_head_past_its_bound_is_a_problem_400_and_closed(
    edge_gate: GateProcess,
) -> None:
    """The request line and headers are bounded (httptools bounds neither: a 20 MB
    header was read whole): one long header coming in several reads, many headers,
    a long URL. A head under the bound is served."""
    port = edge_gate.port
    head = b"GET /v1/deals/1 HTTP/1.1\r\nHost: gate\r\n"
    for parts in (
        [head + b"X-Big: " + b"a" * 20_000, b"a" * 20_000, b"a" * 20_000, b"\r\n\r\n"],
        [head, b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n"],
        [head + b"X-H: a\r\n" * 5_000 + b"\r\n"],
        [b"GET /v1/deals/1?" + b"q" * (HEAD_MAX_BYTES + 1) + b" HTTP/1.1\r\nHost: gate\r\n\r\n"],
    ):
        with connect(port) as sock:
            for part in parts:
                sock.sendall(part)
                time.sleep(0.02)
            answer = Reader(sock).answer()
        assert answer.status == 400, answer
        body = answer.json()
        assert isinstance(body, dict) and str(HEAD_MAX_BYTES) in str(body["detail"]), body
        assert answer.headers["connection"] == "close"
    fits = send(port, head + b"X-Big: " + b"a" * (HEAD_MAX_BYTES - 200) + b"\r\n\r\n")
    assert fits.status in (200, 404), fits
    # Many small pipelined requests in one write (past the bound together): each its
    # own head, each answered.
    pipelined = (head + b"X-Pad: " + b"p" * 200 + b"\r\n\r\n") * 300
    with connect(port) as sock:
        sock.sendall(pipelined)
        reader = Reader(sock)
        statuses = {reader.answer().status for _ in range(300)}
    assert statuses in ({200}, {404}), statuses


def test_a_body_declared_too_long_is_413_before_it_comes(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    head, _ = request("POST", "/v1/deals/1/reservations", buy(USER_BASE + 5, "edge-long-0001"))
    head = head.replace(b"Content-Length: 0", b"Content-Length: 1000000")
    with connect(port) as sock:
        sock.sendall(head + b'{"quantity": 1')
        answer = Reader(sock).answer()
    assert answer.status == 413 and answer.json()["code"] == "PAYLOAD_TOO_LARGE"


def test_bodies_on_routes_that_read_none_are_skipped_not_a_400(edge_gate: GateProcess) -> None:
    """A waiting-room join (a POST whose route reads no body) with a body declared
    past the bound is taken at its headers and answered later; the body bytes that
    arrive meanwhile are skipped, the join answered as the ASGI route answers it (it
    was a bare 400 "Invalid HTTP request received." and a closed connection). A GET
    with a body goes to the ASGI route, which ignores the body."""
    port = edge_gate.port
    deal_id = admin_deal(port, stock=10, waiting_room={"admit_per_second": 1})
    before = edge_count(port)
    for user in (USER_BASE + 500, USER_BASE + 501):
        head, _ = request(
            "POST", f"/v1/deals/{deal_id}/queue", {"Authorization": f"Bearer {token(user)}"}
        )
        head = head.replace(b"Content-Length: 0", b"Content-Length: 1000000")
        with connect(port) as sock:
            sock.sendall(head + b"{}")
            time.sleep(0.05)
            sock.sendall(b" " * 1000)
            answer = Reader(sock).answer()
        assert answer.status == 201, answer
        assert answer.headers["content-type"] == "application/json"
    assert edge_count(port) - before == 2
    head, _ = request("GET", f"/v1/deals/{deal_id}", {"Content-Length": "1000000"})
    with connect(port) as sock:
        sock.sendall(head + b"x" * 100)
        answer = Reader(sock).answer()
    assert answer.status == 200 and answer.json()["id"] == deal_id  # type: ignore[call-overload]
    assert edge_count(port) - before == 2


def test_a_body_that_does_not_come_is_408_and_closed(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    body = b'{"quantity": 1}'
    head, _ = request(
        "POST", "/v1/deals/1/reservations", buy(USER_BASE + 6, "edge-late-0001"), body
    )
    before = edge_count(port)
    with connect(port) as sock:
        started = time.monotonic()
        sock.sendall(head + body[:5])
        reader = Reader(sock)
        answer = reader.answer()
        waited = time.monotonic() - started
        assert answer.status == 408 and answer.json()["code"] == "REQUEST_TIMEOUT"
        assert answer.headers["connection"] == "close"
        assert reader.closed()
    assert BODY_TIMEOUT_SECONDS <= waited < TIMEOUT_SECONDS
    assert edge_count(port) - before == 1
    # A body trickled in pieces, each within the deadline, but not all of it by then.
    with connect(port) as sock:
        sock.sendall(head)
        sent = trickle(sock, body, 0.2, TIMEOUT_SECONDS)
        answer = Reader(sock).answer()
    assert sent < len(body) - 1 and answer.status == 408


def test_a_reservation_and_its_replay_alike_on_both_sides(
    edge_gate: GateProcess,
) -> None:
    port = edge_gate.port
    deal_id = admin_deal(port, stock=10)
    path = f"/v1/deals/{deal_id}/reservations"
    body = b'{"quantity": 1}'
    made = {}
    for side, send in (("edge", send_whole), ("asgi", send_asgi)):
        head, _ = request("POST", path, buy(USER_BASE + 20, f"edge-made-{deal_id}-{side}"), body)
        first = send(port, head, body)
        assert first.status == 201, first
        # The replay of the same key, on the other side.
        replay = (send_asgi if side == "edge" else send_whole)(port, head, body)
        assert replay.status == 200, replay
        assert replay.headers["idempotent-replayed"] == "true"
        assert replay.json() == first.json()
        made[side] = first
    assert set(made["edge"].headers) == set(made["asgi"].headers)
    assert made["edge"].json().keys() == made["asgi"].json().keys()


def test_pipelined_requests_are_answered_in_order(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    sold = sold_out_deal(port)
    open_deal = admin_deal(port, stock=10)
    body = b'{"quantity": 1}'
    reqs = [
        request(
            "POST", f"/v1/deals/{sold}/reservations", buy(USER_BASE + 30, "edge-pipe-0001"), body
        ),
        request("GET", "/healthz"),
        # Answered later (Redis and the database): what follows waits for it.
        request(
            "POST",
            f"/v1/deals/{open_deal}/reservations",
            buy(USER_BASE + 31, f"edge-pipe-{open_deal}"),
            body,
        ),
        request(
            "POST", f"/v1/deals/{sold}/reservations", buy(USER_BASE + 32, "edge-pipe-0002"), body
        ),
        request("GET", f"/v1/deals/{open_deal}"),
        request(
            "POST",
            f"/v1/deals/{sold}/reservations",
            buy(USER_BASE + 33, "edge-pipe-0003"),
            b'{"quantity": 7',
        ),
    ]
    with connect(port) as sock:
        sock.sendall(b"".join(h + b for h, b in reqs))
        reader = Reader(sock)
        answers = [reader.answer() for _ in reqs]
        statuses = [a.status for a in answers]
        assert statuses == [409, 200, 201, 409, 200, 400], [a.body for a in answers]
        assert answers[4].json()["id"] == open_deal
        # The connection is still usable.
        head, b = request("GET", "/healthz")
        sock.sendall(head + b)
        assert reader.answer().status == 200


def test_connection_close_and_http_1_0_close_after_the_answer(
    edge_gate: GateProcess,
) -> None:
    port = edge_gate.port
    sold = sold_out_deal(port)
    open_deal = admin_deal(port, stock=10)
    body = b'{"quantity": 1}'
    for deal_id, status in ((sold, 409), (open_deal, 201)):
        for version, extra in (("1.1", {"Connection": "close"}), ("1.0", {})):
            headers = {**buy(USER_BASE + 40, f"edge-close-{deal_id}-{version}"), **extra}
            head, _ = request("POST", f"/v1/deals/{deal_id}/reservations", headers, body, version)
            with connect(port) as sock:
                sock.sendall(head + body)
                reader = Reader(sock)
                answer = reader.answer()
                assert answer.status == status, answer
                assert answer.headers.get("connection") == "close"
                assert reader.closed()


def test_a_client_that_shuts_its_write_side_is_answered_then_closed(
    edge_gate: GateProcess,
) -> None:
    """A client may half-close (shut its write side) right after its requests, as
    `nc -N` does: what it sent whole is answered, in order, whichever side answers
    each, then the connection is closed. A request cut short by the shutdown (a
    body that will not come) ends the connection without an answer; the client's EOF
    alone never leaves a whole request unanswered."""
    port = edge_gate.port
    sold = sold_out_deal(port)
    open_deal = admin_deal(port, stock=10)
    body = b'{"quantity": 1}'
    reqs = [
        request("GET", f"/v1/deals/{open_deal}"),  # the edge, in a task
        request(
            "POST", f"/v1/deals/{sold}/reservations", buy(USER_BASE + 50, "edge-half-0001"), body
        ),
        request("GET", "/healthz"),  # the ASGI application
        request(
            "POST",
            f"/v1/deals/{open_deal}/reservations",
            buy(USER_BASE + 51, f"edge-half-{open_deal}"),
            body,
        ),
    ]
    for sent, statuses in (
        (reqs[:1], [200]),
        (reqs[2:3], [200]),
        (reqs, [200, 409, 200, 201]),
    ):
        with connect(port) as sock:
            sock.sendall(b"".join(h + b for h, b in sent))
            sock.shutdown(socket.SHUT_WR)
            reader = Reader(sock)
            answers = [reader.answer() for _ in sent]
            assert [a.status for a in answers] == statuses, [a.body for a in answers]
            assert reader.closed()
    head, _ = request(
        "POST", f"/v1/deals/{open_deal}/reservations", buy(USER_BASE + 52, "edge-half-0002")
    )
    short = head.replace(b"Content-Length: 0", b"Content-Length: 15")
    for data in (short + b'{"qua', b"GET /healthz HTTP/1.1\r\nHost: ga"):
        with connect(port) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            assert Reader(sock).closed(), data
    # Nothing was taken for the request cut short.
    assert send(port, request("GET", f"/v1/deals/{open_deal}")[0]).json()["remaining_hint"] == 9


def test_an_upgrade_is_answered_as_http_1_1_then_closed(edge_gate: GateProcess) -> None:
    """`gate serve` speaks HTTP/1.1 only. A request asking for a WebSocket used to
    be handed to uvicorn's WebSocket protocol, which the edge's transport cannot
    switch to: no answer, the connection dropped and an error logged. Now it, and
    an h2c upgrade, are answered by their route as any request, then the connection
    is closed (the parser reads nothing after an upgrade request); counted, not
    logged."""
    port = edge_gate.port
    deal_id = admin_deal(port, stock=3)
    before = value_of(scrape(port), "gate_http_upgrades_refused_total")
    for upgrade in (
        {
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version": "13",
        },
        {"Upgrade": "h2c", "Connection": "Upgrade, HTTP2-Settings", "HTTP2-Settings": "AAMAAABk"},
    ):
        head, _ = request("GET", f"/v1/deals/{deal_id}", upgrade)
        with connect(port) as sock:
            # A request sent after it on the same connection is not read.
            sock.sendall(head + request("GET", "/healthz")[0])
            reader = Reader(sock)
            answer = reader.answer()
            assert answer.status == 200 and answer.json()["id"] == deal_id, answer
            assert reader.closed()
    assert value_of(scrape(port), "gate_http_upgrades_refused_total") == before + 2
    log = edge_gate.log_path.read_text()
    assert "Fatal error on transport" not in log and "Unsupported upgrade" not in log


def test_request_ids_are_echoed_or_made(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    sold = sold_out_deal(port)
    path = f"/v1/deals/{sold}/reservations"
    body = b'{"quantity": 1}'
    given = {**buy(USER_BASE + 50, "edge-rid-0001"), "X-Request-Id": "edge-test.42:a"}
    head, _ = request("POST", path, given, body)
    assert send_whole(port, head, body).headers["x-request-id"] == "edge-test.42:a"
    made = set()
    for bad in ("no spaces allowed", "x" * 129, None):
        headers = buy(USER_BASE + 50, "edge-rid-0002")
        if bad is not None:
            headers["X-Request-Id"] = bad
        head, _ = request("POST", path, headers, body)
        rid = send_whole(port, head, body).headers["x-request-id"]
        assert rid and rid != bad
        made.add(rid)
    assert len(made) == 3


def test_the_edge_s_answers_are_in_the_request_metrics(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    sold = sold_out_deal(port)
    route = "/v1/deals/{deal_id}/reservations"

    def count(status: str) -> float:
        return value_of(
            scrape(port), "gate_http_requests_total", route=route, method="POST", status=status
        )

    before = count("409"), count("400")
    with connect(port) as sock:
        reader = Reader(sock)
        for i in range(20):
            sock.sendall(reservation(sold, USER_BASE + 60 + i, f"edge-metric-{i:04d}"))
            assert reader.answer().status == 409
        sock.sendall(reservation(sold, USER_BASE + 60, "edge-metric-bad", b"{"))
        assert reader.answer().status == 400
    assert (count("409") - before[0], count("400") - before[1]) == (20, 1)


async def test_a_buyer_who_hangs_up_mid_reservation_leaves_nothing_behind(
    edge_gate: GateProcess, db: Database, rds: aioredis.Redis
) -> None:
    port = edge_gate.port
    deal_id = admin_deal(port, stock=40)
    # Thirty buyers send their reservation whole and hang up at once.
    for i in range(30):
        with connect(port) as sock:
            sock.sendall(reservation(deal_id, USER_BASE + 100 + i, f"edge-gone-{deal_id}-{i}"))
    # Each reservation ran to its end (committed, or never admitted): the gate still
    # answers, and what Redis holds is what the database holds. Settled: nothing in
    # flight and the orders unchanged for half a second (nothing in flight is also
    # what a gate shows before it has admitted anything).
    deadline = time.monotonic() + TIMEOUT_SECONDS
    orders, steady = -1, 0
    while True:
        inflight = await rds.hlen(deal_keys(deal_id).inflight)
        row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
        assert row is not None
        steady = steady + 1 if int(row[0]) == orders and inflight == 0 else 0
        orders = int(row[0])
        if (steady >= 10 and orders > 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert inflight == 0
    assert 0 < orders <= 30
    await assert_invariants(db, rds, deal_id)
    assert send(port, reservation(deal_id, USER_BASE + 99, f"edge-after-{deal_id}")).status == 201


def test_waiting_room_tickets_alike_on_both_sides(edge_gate: GateProcess) -> None:
    port = edge_gate.port
    deal_id = admin_deal(port, stock=10, waiting_room={"admit_per_second": 1})
    path = f"/v1/deals/{deal_id}/queue"
    auth = {"Authorization": f"Bearer {token(USER_BASE + 200)}"}
    other = {"Authorization": f"Bearer {token(USER_BASE + 201)}"}
    before = edge_count(port)
    head, body = request("POST", path, auth, b"{}")
    joined = send_whole(port, head, body)
    # A buyer polls as advised (faster is answered 429 by the room's limiter).
    advised = int(joined.json()["poll_after_ms"]) / 1000  # type: ignore[call-overload]
    time.sleep(advised)
    again = send_asgi(port, head, body)
    head, body = request("POST", path, other, b"{}")
    second = send_split(port, head, body)
    time.sleep(advised)
    head, _ = request("GET", path, auth)
    read = send_whole(port, head, b"")
    assert (joined.status, again.status, second.status, read.status) == (201, 200, 201, 200)
    # The same ticket (the room may admit the buyer meanwhile: its state may move).
    fixed = ("deal_id", "joined_at")
    ticket = {k: joined.json()[k] for k in fixed}
    assert {k: again.json()[k] for k in fixed} == ticket
    assert {k: read.json()[k] for k in fixed} == ticket
    assert second.json()["joined_at"] >= ticket["joined_at"]  # type: ignore[operator]
    # The first join, the second buyer's (in two reads) and the read at the edge.
    assert edge_count(port) - before == 3
    # Not a buyer: the same problem from both sides.
    head, body = request("POST", path, {}, b"{}")
    whole, asgi = send_whole(port, head, body), send_asgi(port, head, body)
    assert whole.status == 401 and comparable(whole) == comparable(asgi)


async def test_an_unexpected_error_at_the_edge_is_a_500_problem(
    settings: Settings, prepared: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In process (a real uvicorn server on a real socket, the gate's app and
    protocol), so that the gate can be made to fail: in the answer made at once and in
    the one made by a task. Each is a 500 problem+json with the request id, the error
    is logged, and the connection goes on serving."""
    async with in_process_gate(settings) as (app, port):
        gate = app.state.gate
        logged: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = logged.append  # type: ignore[method-assign]
        logging.getLogger("gate.edge").addHandler(handler)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:

            def boom(*args: object, **kwargs: object) -> None:
                raise RuntimeError("edge test")

            async def boom_later(*args: object) -> None:
                raise RuntimeError("edge test, later")

            body = b'{"quantity": 1}'
            for name, replacement in (("take", boom), ("reserve", boom_later)):
                with monkeypatch.context() as patch:
                    patch.setattr(gate.reservations, name, replacement)
                    head, _ = request(
                        "POST",
                        "/v1/deals/1/reservations",
                        {**buy(USER_BASE + 300, "edge-boom-0001"), "X-Request-Id": f"boom-{name}"},
                        body,
                    )
                    writer.write(head + body)
                    answer = await _read_answer(reader)
                assert answer.status == 500, answer
                assert answer.json()["code"] == "INTERNAL"
                assert answer.headers["content-type"] == "application/problem+json"
                assert answer.headers["x-request-id"] == f"boom-{name}"
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: gate\r\n\r\n")
            assert (await _read_answer(reader)).status == 200
        finally:
            writer.close()
            logging.getLogger("gate.edge").removeHandler(handler)
        errors = [r for r in logged if r.levelno == logging.ERROR]
        assert [str(r.exc_info[1]) for r in errors if r.exc_info] == [
            "edge test",
            "edge test, later",
        ]


@contextlib.asynccontextmanager
async def in_process_gate(settings: Settings) -> AsyncIterator[tuple[Any, int]]:
    """The gate's application served by uvicorn with the edge's protocol on a real
    socket, in this process (so that a test can reach into it): (app, port)."""
    import uvicorn

    from gate.api.app import build_app
    from gate.web.edge import EdgeProtocol

    app = build_app(settings, background=False)
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=EdgeProtocol,
        # As gate serve runs it: a wrapped application would have no edge.
        proxy_headers=False,
        lifespan="on",
        log_config=None,
        access_log=False,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.05)
        assert server.started
        yield app, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


async def _read_answer(reader: asyncio.StreamReader) -> Answer:
    raw_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT_SECONDS)
    status_line, *lines = raw_head[:-4].decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return Answer(int(status_line.split()[1]), headers, body)


Ask = Callable[[str, str, dict[str, str], bytes], Awaitable[Answer]]


def _asker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Ask:
    """One request at a time on one kept-alive connection: (method, path, headers,
    body) -> its answer."""

    async def ask(method: str, path: str, headers: dict[str, str], body: bytes) -> Answer:
        head, body = request(method, path, headers, body)
        writer.write(head + body)
        return await _read_answer(reader)

    return ask


async def _created_deal(ask: Ask, deal: dict[str, Any]) -> int:
    """A deal created through the admin API on that connection (EUR): its id."""
    created = await ask(
        "POST",
        "/v1/admin/deals",
        {"Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"},
        orjson.dumps({"currency": "EUR", **deal}),
    )
    assert created.status == 201, created
    return int(created.json()["id"])  # type: ignore[call-overload]


async def test_a_ticket_at_the_edge_when_redis_lost_the_deal_or_its_scripts_or_is_gone(
    settings: Settings, prepared: None, rds: aioredis.Redis
) -> None:
    """The edge settles a join or a read in a callback on its reply (gate/room/edge_lane.py
    TicketEdge): a deal Redis lost (NOT_LOADED) and a script Redis lost (NOSCRIPT) go
    the coroutine's way, which loads and asks again, and the buyer gets the ticket; a
    Redis that cannot be reached is a 503 problem, and the connection goes on
    serving. In process, on a real socket, so that the room's wire can be swapped."""
    import hashlib

    from gate.room.service import Room
    from gate.room.wire import Wire
    from gate.store.scripts import Script

    async with in_process_gate(settings) as (app, port):
        gate = app.state.gate
        ext = next(e for e in gate.extensions if e.name == "room")
        room = getattr(ext.workers[0], "__self__", None)
        assert isinstance(room, Room)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        ask = _asker(reader, writer)
        try:
            deal_id = await _created_deal(
                ask,
                {
                    "title": "edge room",
                    "unit_price": 500,
                    "stock": 5,
                    "waiting_room": {"admit_per_second": 1},
                },
            )
            path = f"/v1/deals/{deal_id}/queue"

            async def edge_requests() -> float:
                # In this process: its own registry (no listener: GATE_METRICS_ADDR=off).
                text = METRICS.render().decode()
                return value_of(sample_values(text), "gate_edge_requests_total")

            edge_before = await edge_requests()

            def auth(user: int) -> dict[str, str]:
                return {"Authorization": f"Bearer {token(USER_BASE + user)}"}

            first = await ask("POST", path, auth(400), b"{}")
            assert first.status == 201, first

            # Redis lost the deal: the join loads it and is answered with a ticket.
            lost = [k async for k in rds.scan_iter(match=f"{deal_keys(deal_id).meta}*")]
            assert lost
            await rds.delete(*lost)
            again = await ask("POST", path, auth(401), b"{}")
            assert again.status == 201, again
            assert again.json()["deal_id"] == deal_id  # type: ignore[index]

            # Redis lost the script (as after a restart): loaded again, answered.
            script = room.runner.scripts["room_ticket"]
            source = f"{script.source}\n-- {time.monotonic_ns()}\n"
            room.runner.scripts["room_ticket"] = Script(
                "room_ticket", source, hashlib.sha1(source.encode()).hexdigest()
            )
            room._prefixes.clear()
            third = await ask("POST", path, auth(402), b"{}")
            assert third.status == 201, third
            # A read at the edge, answered from the same reply shape.
            await asyncio.sleep(int(third.json()["poll_after_ms"]) / 1000)  # type: ignore[call-overload]
            read = await ask("GET", path, auth(402), b"")
            assert read.status == 200, read
            assert read.json()["joined_at"] == third.json()["joined_at"]  # type: ignore[index]

            # Redis cannot be reached: 503, and the connection serves on. (One Redis
            # only: a cluster's tickets go through the runner, not the wire.)
            if not CLUSTER_RUN:
                wire = room.wire
                room.wire = Wire("redis://127.0.0.1:1/0", 0.5, 16)
                try:
                    gone = await ask("POST", path, auth(403), b"{}")
                finally:
                    await room.wire.aclose()
                    room.wire = wire
                assert gone.status == 503, gone
                assert gone.headers["content-type"] == "application/problem+json"
                assert gone.json()["code"] == "OVERLOADED"  # type: ignore[index]
            healthz = await ask("GET", "/healthz", {}, b"")
            assert healthz.status == 200
            # Every ticket request above was the edge's (none went to the ASGI lane).
            assert await edge_requests() - edge_before == (4 if CLUSTER_RUN else 5)
        finally:
            writer.close()


async def test_a_queued_reservation_at_the_edge_settled_by_its_reply_or_the_task_path(
    settings: Settings, prepared: None, rds: aioredis.Redis
) -> None:
    """Queue mode at the edge (gate/reserve/path.py `start_queued` / `QueuedCall.settle`):
    the 202 is written from the admission's callback and its order is found by id
    (the admission wrote the index); a deal's first request (its price not read yet),
    a replay, a refusal, a deal Redis lost and a script Redis lost go on in a task
    with the coroutine's answers; a Redis that cannot be reached is a 503 problem and
    the connection serves on. No reservation is left counted in flight. In process,
    on a real socket (the shared gate's consumers may commit the entries meanwhile:
    an order reads QUEUED or PENDING_PAYMENT)."""
    import hashlib

    from gate.store.resp import RespConnection
    from gate.store.scripts import Script

    async with in_process_gate(settings) as (app, port):
        gate = app.state.gate
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        ask = _asker(reader, writer)
        try:
            deal_id = await _created_deal(
                ask, {"title": "edge queue", "unit_price": 700, "stock": 6, "mode": "queue"}
            )

            def auth(user: int) -> dict[str, str]:
                return {"Authorization": f"Bearer {token(USER_BASE + user)}"}

            async def reserve(user: int, key: str) -> Answer:
                return await ask(
                    "POST",
                    f"/v1/deals/{deal_id}/reservations",
                    {**auth(user), "Idempotency-Key": key, "Content-Type": "application/json"},
                    b'{"quantity": 1}',
                )

            def queued(answer: Answer) -> str:
                assert answer.status == 202, answer
                body = answer.json()
                assert body["status"] == "QUEUED" and body["deal_id"] == deal_id, body
                assert body["amount"] == 700 and "expires_at" not in body, body
                order_id = str(body["order_id"])
                assert answer.headers["location"] == f"/v1/orders/{order_id}"
                return order_id

            # (buyer, order) of each 202; the deal's first reads its price in a task.
            accepted = [(500, queued(await reserve(500, "edge-queue-500")))]
            second = queued(await reserve(501, "edge-queue-501"))  # the callback's 202
            accepted.append((501, second))
            view = await ask("GET", f"/v1/orders/{second}", auth(501), b"")
            assert view.status == 200, view
            assert view.json()["status"] in ("QUEUED", "PENDING_PAYMENT")
            assert await rds.get(f"gate:q:i:{second}") == f"{deal_id}|{USER_BASE + 501}"
            # A replay while it waits (or once committed): the same order.
            replay = await reserve(501, "edge-queue-501")
            assert replay.status in (200, 202), replay
            assert replay.json()["order_id"] == second
            # The same key for another quantity: a refusal, from the task path.
            mismatch = await ask(
                "POST",
                f"/v1/deals/{deal_id}/reservations",
                {
                    **auth(501),
                    "Idempotency-Key": "edge-queue-501",
                    "Content-Type": "application/json",
                },
                b'{"quantity": 2}',
            )
            assert mismatch.status == 422, mismatch
            assert mismatch.problem()["code"] == "IDEMPOTENCY_MISMATCH"

            # Redis lost the deal: the task loads it and the request is queued.
            await rds.delete(deal_keys(deal_id).meta)
            accepted.append((502, queued(await reserve(502, "edge-queue-502"))))

            # Redis lost the admission script (as after a restart): loaded again.
            script = gate.runner.scripts["admit"]
            source = f"{script.source}\n-- {time.monotonic_ns()}\n"
            gate.runner.scripts["admit"] = Script(
                "admit", source, hashlib.sha1(source.encode()).hexdigest()
            )
            accepted.append((503, queued(await reserve(503, "edge-queue-503"))))

            # Redis cannot be reached: 503, nothing taken, and the connection serves on.
            # (One Redis only: the runner's connections are swapped for a dead one; a
            # cluster's are per node, tests/store/test_cluster.py kills a primary instead.)
            avail = await rds.hget(deal_keys(deal_id).meta, "avail")
            assert avail == "2", avail
            runner = gate.runner
            if not CLUSTER_RUN:
                conns = runner._conns
                runner._conns = [RespConnection("redis://127.0.0.1:1/0", 0.5)]
                try:
                    gone = await reserve(506, "edge-queue-506")
                finally:
                    runner._conns[0].close()
                    runner._conns = conns
                assert gone.status == 503, gone
                assert gone.problem()["code"] == "OVERLOADED"
                assert await rds.hget(deal_keys(deal_id).meta, "avail") == avail

            accepted.append((504, queued(await reserve(504, "edge-queue-504"))))
            accepted.append((507, queued(await reserve(507, "edge-queue-507"))))
            # Six admitted: sold out (the admission's refusal, or the near-cache's).
            sold = await reserve(505, "edge-queue-505")
            assert sold.status == 409, sold
            assert sold.problem()["code"] == "SOLD_OUT"
            for user, order_id in accepted:
                view = await ask("GET", f"/v1/orders/{order_id}", auth(user), b"")
                assert view.status == 200, view
                assert view.json()["status"] in ("QUEUED", "PENDING_PAYMENT"), view
            healthz = await ask("GET", "/healthz", {}, b"")
            assert healthz.status == 200
            assert gate.reservations.in_flight == 0
        finally:
            writer.close()
