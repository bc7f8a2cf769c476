"""One connection cannot hurt a worker (gate/web/edge.py `_Flow`, `_Trailers`), over real
sockets against a real `gate serve` (one worker, so its memory is one process's):

- a client that pipelines requests and never reads the answers is no longer read
  from: the worker holds at most the documented bound of its unsent answers and
  unparsed input (docs/api.md), answered by the edge or by the ASGI application;
  what it sent is still answered, in order, once it reads;
- trailer fields of a chunked request never stand in for a header (Authorization,
  Idempotency-Key), on the edge's side or the application's, and count against the
  head's bound: an endless trailer section is a 400 and the connection closed.

The worker's memory is its resident set (/proc/<pid>/status VmRSS)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gate.web.edge import FEED_SLICE_BYTES, HEAD_MAX_BYTES
from tests.raw_http import Answer, Reader, connect
from tests.support import ADMIN_TOKEN, GateProcess, base_env, token

USER_BASE = 8_900_000
# The documented bound (docs/api.md): about 1 MiB held for one connection; the rest
# is measuring slack (the allocator, the metrics, the test's own requests).
HELD_MAX_BYTES = 1024 * 1024
RSS_SLACK_BYTES = 4 * 1024 * 1024
# What a flood sends at most, and how long it tries once the gate stops reading.
FLOOD_MAX_BYTES = 9 * 1024 * 1024
STALLED_SECONDS = 2.0


@pytest.fixture(scope="module")
def edge_gate(prepared: None) -> Iterator[GateProcess]:
    with GateProcess(base_env(), workers=1) as proc:
        yield proc


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def healthz(port: int) -> Answer:
    with connect(port, timeout_seconds=5.0) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: gate\r\n\r\n")
        return Reader(sock).answer()


def answered(sock: socket.socket) -> bool:
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False


def flood(sock: socket.socket, data: bytes, until_answered: bool = False) -> int:
    """`data` again and again, never reading, until the gate stops taking it (nothing
    sent for `STALLED_SECONDS`), `FLOOD_MAX_BYTES` went, or (`until_answered`) an
    answer came: the bytes sent."""
    sock.setblocking(False)
    sent = 0
    stalled_since = time.monotonic()
    pending = memoryview(data)
    try:
        while sent < FLOOD_MAX_BYTES and not (until_answered and answered(sock)):
            try:
                n = sock.send(pending)
            except (BrokenPipeError, ConnectionResetError):
                break
            except BlockingIOError:
                if time.monotonic() - stalled_since > STALLED_SECONDS:
                    break
                time.sleep(0.01)
                continue
            sent += n
            stalled_since = time.monotonic()
            pending = pending[n:] if n < len(pending) else memoryview(data)
    finally:
        sock.setblocking(True)
    return sent


def chunked(path: str, headers: dict[str, str], body: bytes, trailers: bytes) -> bytes:
    """A chunked request: its body in one chunk, then the last chunk and `trailers`
    (fields, each ending in CRLF), then the empty line."""
    lines = [f"POST {path} HTTP/1.1", "Host: gate", "Transfer-Encoding: chunked"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    return head + b"%x\r\n" % len(body) + body + b"\r\n0\r\n" + trailers + b"\r\n"


def asgi(data: bytes) -> bytes:
    """The same request with Expect: 100-continue, which the edge leaves to the ASGI
    application."""
    head, rest = data.split(b"\r\n\r\n", 1)
    return head + b"\r\nExpect: 100-continue\r\n\r\n" + rest


def send(port: int, data: bytes) -> Answer:
    with connect(port) as sock:
        sock.sendall(data)
        return Reader(sock).answer()


def new_deal(port: int, stock: int) -> int:
    body = b'{"title": "pressure", "unit_price": 500, "currency": "EUR", "stock": %d}' % stock
    head = (
        b"POST /v1/admin/deals HTTP/1.1\r\nHost: gate\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    answer = send(port, head + body)
    assert answer.status == 201, answer
    return int(answer.json()["id"])  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "path",
    ["/v1/deals/999999999", "/healthz"],
    ids=["edge", "asgi"],
)
def test_a_pipelined_flood_never_read_is_not_read_either(edge_gate: GateProcess, path: str) -> None:
    """Small pipelined requests on one connection that never reads its answers: the
    gate stops reading it, the worker's memory stays within the bound, other
    clients are answered at once, and what was sent is answered in order once the
    client reads."""
    port, pid = edge_gate.port, edge_gate.proc.pid
    one = f"GET {path} HTTP/1.1\r\nHost: g\r\n\r\n".encode()
    expected = send(port, one)
    assert expected.status in (200, 404), expected
    data = one * 1000
    before = rss_bytes(pid)
    with connect(port) as sock:
        sent = flood(sock, data)
        grown = rss_bytes(pid) - before
        assert grown < HELD_MAX_BYTES + RSS_SLACK_BYTES, (grown, sent)
        assert healthz(port).status == 200
        # Once read, the answers come, in order, each the request's own.
        reader = Reader(sock)
        for _ in range(2000):
            answer = reader.answer()
            assert answer.status == expected.status, answer
            assert answer.body == expected.body
    # Closed with answers unsent: the request being answered sees a disconnect (no
    # write on a closed transport, no 500 logged).
    assert healthz(port).status == 200
    assert "Exception in ASGI application" not in edge_gate.output()
    assert "unhandled error" not in edge_gate.output()


@pytest.mark.parametrize("side", ["edge", "asgi"])
@pytest.mark.parametrize("field", ["Authorization", "Idempotency-Key"])
def test_a_trailer_never_stands_in_for_a_header(
    edge_gate: GateProcess, side: str, field: str
) -> None:
    """A chunked reservation whose Authorization (or Idempotency-Key) is a trailer
    field is answered as the same request without it (401, 400); with it as a header
    (and a harmless trailer) it is made (201)."""
    port = edge_gate.port
    deal_id = new_deal(port, stock=5)
    path = f"/v1/deals/{deal_id}/reservations"
    user = USER_BASE + (1 if field == "Authorization" else 2) + (10 if side == "asgi" else 0)
    headers = {
        "Authorization": f"Bearer {token(user)}",
        "Idempotency-Key": f"pressure-{deal_id}-{side}-{field}",
        "Content-Type": "application/json",
    }
    body = b'{"quantity": 1}'
    shape = asgi if side == "asgi" else (lambda data: data)
    smuggled = f"{field}: {headers.pop(field)}\r\n".encode()
    without = send(port, shape(chunked(path, headers, body, b"")))
    assert without.status in (400, 401), without
    answer = send(port, shape(chunked(path, headers, body, smuggled)))
    assert (answer.status, answer.problem()["code"]) == (
        without.status,
        without.problem()["code"],
    ), answer
    key, value = smuggled.decode().rstrip().split(": ", 1)
    made = send(port, shape(chunked(path, {**headers, key: value}, body, b"X-Note: 1\r\n")))
    assert made.status == 201, made


@pytest.mark.parametrize("side", ["edge", "asgi"])
@pytest.mark.parametrize("shape", ["many", "one-long"])
def test_endless_trailers_are_a_400_and_closed(
    edge_gate: GateProcess, side: str, shape: str
) -> None:
    """A chunked request followed by trailer fields without end (many small fields,
    or one that never ends) is answered 400 INVALID_REQUEST past the head's bound
    and the connection closed; the worker's memory stays within the bound. Trailers
    within the bound are accepted."""
    port, pid = edge_gate.port, edge_gate.proc.pid
    deal_id = new_deal(port, stock=5)
    headers = {
        "Authorization": f"Bearer {token(USER_BASE + 30)}",
        "Idempotency-Key": f"pressure-trailers-{deal_id}",
        "Content-Type": "application/json",
    }
    start = chunked(f"/v1/deals/{deal_id}/reservations", headers, b'{"quantity": 1}', b"")
    start = start[:-2]  # before the empty line: trailers follow
    if side == "asgi":
        start = asgi(start)
    fits = send(port, start + b"X-T: " + b"t" * (HEAD_MAX_BYTES - 1000) + b"\r\n\r\n")
    assert fits.status == 201, fits
    endless = b"X-T: tttttttttttttttttttt\r\n" * 2000 if shape == "many" else b"t" * 50_000
    before = rss_bytes(pid)
    with connect(port) as sock:
        sock.sendall(start + (b"" if shape == "many" else b"X-T: "))
        sent = flood(sock, endless, until_answered=True)
        grown = rss_bytes(pid) - before
        assert grown < HELD_MAX_BYTES + RSS_SLACK_BYTES, (grown, sent)
        answer = Reader(sock).answer()
    assert answer.status == 400, answer
    assert answer.problem()["code"] == "INVALID_REQUEST"
    assert str(HEAD_MAX_BYTES) in str(answer.json()["detail"])
    assert answer.closed
    assert healthz(port).status == 200


def test_a_pipelined_read_then_eof_is_answered_whole_then_closed(edge_gate: GateProcess) -> None:
    """Many pipelined requests in one write (parsed a slice at a time), then the
    client shuts its write side: every request is answered, in order, then the
    connection is closed."""
    port = edge_gate.port
    deal_id = new_deal(port, stock=3)
    views = [f"GET /v1/deals/{deal_id} HTTP/1.1\r\nHost: gate\r\n\r\n".encode()] * 300
    asks = [b"GET /healthz HTTP/1.1\r\nHost: gate\r\n\r\n"] * 300
    mixed = [request for pair in zip(views, asks, strict=True) for request in pair]
    data = b"".join(mixed)
    assert len(data) > 5 * FEED_SLICE_BYTES
    with connect(port) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        reader = Reader(sock)
        for i in range(len(mixed)):
            answer = reader.answer()
            assert answer.status == 200, (i, answer)
            if i % 2 == 0:
                assert answer.json()["id"] == deal_id
        assert reader.closed()


@pytest.mark.parametrize("side", ["edge", "asgi"])
def test_a_body_in_many_small_chunks_is_not_taken_for_trailers(
    edge_gate: GateProcess, side: str
) -> None:
    """Chunk framing is not trailer bytes: a body of nearly 4 KiB sent a byte per chunk
    (about 24 KB of chunk lines, parsed over several slices) makes its reservation."""
    port = edge_gate.port
    deal_id = new_deal(port, stock=2)
    body = b'{"quantity": 1}' + b" " * 3900
    head = chunked(
        f"/v1/deals/{deal_id}/reservations",
        {
            "Authorization": f"Bearer {token(USER_BASE + 40 + (side == 'asgi'))}",
            "Idempotency-Key": f"pressure-chunks-{deal_id}-{side}",
            "Content-Type": "application/json",
        },
        b"",
        b"",
    ).split(b"\r\n\r\n", 1)[0]
    chunks = b"".join(b"1\r\n" + body[i : i + 1] + b"\r\n" for i in range(len(body)))
    data = head + b"\r\n\r\n" + chunks + b"0\r\n\r\n"
    assert len(data) > HEAD_MAX_BYTES * 2 // 3
    answer = send(port, asgi(data) if side == "asgi" else data)
    assert answer.status == 201, answer
