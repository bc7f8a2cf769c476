"""The edge's transport side: how one connection's reads and writes are held in
bounds (gate/web/edge.py uses these in `EdgeProtocol`).

    client ─▶ uvloop transport ─▶ Linger (a close that does not reset the connection)
                                    │
    EdgeProtocol.data_received ─▶ parse FEED_SLICE_BYTES at a time
        Flow: reading stops while the client does not read its answers (the write
              buffer past WRITE_HIGH_WATER_BYTES) or uvicorn paused it, and goes on
              when they drain
        Trailers: a chunked request's trailer fields counted against what is left
              of the head's bound, never kept (they never stand in for a header)

Every connection the server closes after an answer (a 408, a Connection: close, on
any route) is closed lingering (`Linger`), as nginx does: the answer is sent and
the write side shut (FIN), then whatever the client still sends is read and dropped
until it closes too (or `LINGER_SECONDS` pass, or `LINGER_MAX_BYTES` came). Closed
at once, a socket with unread bytes (the rest of a late body, a pipelined request)
is reset by the kernel, and a reset can throw away the answer before the client has
read it. An idle keep-alive connection past its timeout, and every connection at
shutdown, is closed at once, as uvicorn does.

Trailer fields (after a chunked body's last chunk) go to a `Trailers`, which counts
them against what the head left of its bound and keeps none; a trailer field still
coming is bounded by the bytes fed after its chunk began (`_feed`).

What a request's headers say of its body, before it comes: `has_body` (a GET with
one goes to the ASGI route), `declared_too_long` (answered 413 before it is read).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from uvicorn.protocols.http.flow_control import FlowControl

# A server-side close first shuts the write side and reads what the client still
# sends for at most this long, and at most this many bytes (a close with unread
# input resets the connection, and the answer with it).
LINGER_SECONDS = 2.0
LINGER_MAX_BYTES = 256 * 1024


class Reader(Protocol):
    """What `Flow` and `Trailers` need of the protocol they serve."""

    head_too_large: bool

    def stop_reading(self) -> None: ...

    def go_on(self) -> None: ...


class HeadTooLarge(Exception):
    """Raised in a parser callback to stop the parser: the head passed its bound."""


# Back-pressure (`Flow`): a read is parsed a slice of this many bytes at a time, the
# event loop getting a turn between slices, so one read of pipelined requests (up to
# 250 KB with uvloop) is not answered in one go: at most this slice's worth of the
# shortest requests (about 150) are answered without the loop getting a turn.
FEED_SLICE_BYTES = 4 * 1024
# A connection's unsent answers past this: its reading stops until they drain to a
# quarter of it (asyncio's and uvloop's default, set explicitly so the bound is
# known). Together with one slice's answers, at most about 200 KiB are held.
WRITE_HIGH_WATER_BYTES = 64 * 1024


class Flow(FlowControl):
    """uvicorn's flow control (pipelined requests and large bodies pause reading, its
    answers wait for the socket to drain), with the edge's part in it: while the
    client does not read its answers (the transport's write buffer is past its high
    water mark), the gate stops reading from it; and what was read but not yet parsed
    (`EdgeProtocol._backlog`) is parsed when reading may go on."""

    def __init__(self, transport: asyncio.Transport, protocol: Reader) -> None:
        super().__init__(transport)
        self.protocol = protocol

    def pause_reading(self) -> None:
        self.read_paused = True
        self.protocol.stop_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.protocol.go_on()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            self._is_writable_event.clear()
            self.protocol.stop_reading()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            self._is_writable_event.set()
            self.protocol.go_on()


class Trailers(list[tuple[bytes, bytes]]):
    """Where uvicorn's `on_header` puts the trailer fields of a chunked request (after
    its last chunk): counted against what is left of the head's bound, never kept, so
    they never stand in for a header on either side (the request's headers are the
    list the head filled)."""

    __slots__ = ("protocol", "room_bytes")

    def __init__(self, protocol: Reader, room_bytes: int) -> None:
        super().__init__()
        self.protocol = protocol
        self.room_bytes = room_bytes

    def append(self, field: tuple[bytes, bytes]) -> None:
        self.room_bytes -= len(field[0]) + len(field[1]) + 4
        if self.room_bytes < 0:
            self.protocol.head_too_large = True
            raise HeadTooLarge


class Linger(asyncio.Transport):
    """The connection's transport, with a server-side close that does not reset the
    connection (see the module docstring). It stands in for the transport uvicorn
    was given (uvloop's transports cannot be patched), so uvicorn's closes and the
    edge's all go through it; everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport) -> None:
        # asyncio.Transport's __init__ is not called: `_extra` is the transport's.
        self.transport = transport
        self.write = transport.write  # type: ignore[method-assign]
        self.lingering = False  # the write side is shut; reads are dropped
        self.peer_done = False  # the client shut its write side (EOF)
        self.discarded = 0  # bytes dropped while lingering
        self.at_once = False  # close without lingering (idle timeout, shutdown)
        self.timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def writelines(self, list_of_data: Any) -> None:
        self.transport.writelines(list_of_data)

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close(self) -> None:
        if self.lingering and not self.peer_done:
            return  # already closing: the client's EOF or the timer ends it
        transport = self.transport
        if (
            self.at_once
            or self.peer_done
            or transport.is_closing()
            or not transport.can_write_eof()
        ):
            self.finish()
            return
        self.lingering = True
        try:
            transport.write_eof()  # after what is buffered: the answer goes first
            transport.resume_reading()  # reads paused by uvicorn's flow control: drained
        except (OSError, RuntimeError):
            self.finish()
            return
        self.timer = asyncio.get_running_loop().call_later(LINGER_SECONDS, self.finish)

    def dropped(self, size: int) -> None:
        """Bytes that came while lingering: dropped; past the bound, closed now."""
        self.discarded += size
        if self.discarded > LINGER_MAX_BYTES:
            self.finish()

    def finish(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.transport.close()


_CONTENT_LENGTH = b"content-length"
_TRANSFER_ENCODING = b"transfer-encoding"


def has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """A body announced (a Content-Length other than 0, or any Transfer-Encoding)."""
    for name, value in headers:
        if name == _TRANSFER_ENCODING or (name == _CONTENT_LENGTH and value.strip() != b"0"):
            return True
    return False


def declared_too_long(headers: list[tuple[bytes, bytes]], max_bytes: int) -> bool:
    """A Content-Length past `max_bytes` (a malformed one is the route's to answer)."""
    for name, value in headers:
        if name == _CONTENT_LENGTH:
            return len(value) > 9 or (value.isdigit() and int(value) > max_bytes)
    return False
