"""A pipelined Redis connection for the hot path's script calls.

redis-py's pipeline machinery costs ≈ 130–150 µs per EVALSHA here; packing RESP by
hand and parsing replies with hiredis (the C parser redis-py itself uses) costs ≈ 40
µs including the script's run on the server (docs/hotpath.md). Only the script
runner uses this; everything else keeps redis-py.

Both connections to Redis (this one and redis-py's pool) read GATE_REDIS_URL through
one parser (gate/base/redis_url.py): the two always reach the same server, database
and user.

Replies come back in request order on one connection, so each connection keeps a
FIFO of futures. Every batch carries a deadline: a batch still unanswered after
`timeout_seconds` fails everything pending on that connection with a timeout and
closes it. Nothing is ever re-sent: a timed-out script may have run.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gate.base.redis_url import parse_redis_url

READ_CHUNK_BYTES = 1 << 16


def text(value: Any) -> str:
    """A reply's string, whether the client decodes replies (str) or not (bytes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def pack(args: Sequence[Any]) -> bytes:
    """One command in RESP: an array of bulk strings. hiredis packs str, int, float and
    bytes arguments in C, byte for byte as `_pack_py` does (an admission's 35 arguments:
    about 5 µs against 13 µs, docs/hotpath.md); any other type falls back."""
    try:
        return _pack_command(args if type(args) is tuple else tuple(args))
    except TypeError:
        return _pack_py(args)


def _pack_py(args: Sequence[Any]) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = bytes(arg) if isinstance(arg, bytes | bytearray | memoryview) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


_pack_command: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command


def _error(reply: hiredis.ReplyError) -> ResponseError:
    text = str(reply)
    if text.startswith("NOSCRIPT"):
        return NoScriptError(text)
    return ResponseError(text)


class Waiter(Protocol):
    """What waits for one reply: an asyncio future, or a caller's own object that
    hands one reply on to several futures (gate/room/wire.py's batches)."""

    def done(self) -> bool: ...

    def set_result(self, result: Any, /) -> None: ...

    def set_exception(self, exception: BaseException, /) -> None: ...


class RespConnection:
    def __init__(
        self, url: str, timeout_seconds: float, address: tuple[str, int] | None = None
    ) -> None:
        """A connection to the server of `url`, or to `address` (a cluster node) with
        the URL's credentials and TLS."""
        target = parse_redis_url(url)
        self.unix_path = target.unix_path if address is None else None
        self.host = target.host if address is None else address[0]
        self.port = target.port if address is None else address[1]
        self.tls = target.tls
        self.username = target.username
        self.password = target.password
        # A cluster node has database 0 only: never SELECT there.
        self.db = target.db if address is None else 0
        self.timeout_seconds = timeout_seconds
        self._writer: asyncio.StreamWriter | None = None
        self._pending: deque[Waiter] = deque()
        self._reader_task: asyncio.Task[None] | None = None
        self._parser = hiredis.Reader(encoding="utf-8", replyError=hiredis.ReplyError)
        self._connecting: asyncio.Future[None] | None = None
        # The last future of every batch still unanswered, with its deadline, in the
        # order sent (so in deadline order), and one timer for the oldest: replies come
        # in order, so the oldest unanswered batch is the only one that can be late.
        self._deadlines: deque[tuple[float, Waiter]] = deque()
        self._deadline_timer: asyncio.TimerHandle | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def connected(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def connect(self) -> None:
        if self.connected:
            return
        if self._connecting is not None:
            return await asyncio.shield(self._connecting)
        self._connecting = asyncio.get_running_loop().create_future()
        try:
            await self._open()
            self._connecting.set_result(None)
        except BaseException as exc:
            self._connecting.set_exception(exc)
            self._connecting.exception()
            raise
        finally:
            self._connecting = None

    async def _open(self) -> None:
        context = ssl.create_default_context() if self.tls else None
        try:
            if self.unix_path:
                opening = asyncio.open_unix_connection(self.unix_path)
            else:
                opening = asyncio.open_connection(self.host, self.port, ssl=context)
            reader, writer = await asyncio.wait_for(opening, self.timeout_seconds)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc!r}") from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket

            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._parser = hiredis.Reader(encoding="utf-8", replyError=hiredis.ReplyError)
        self._writer = writer
        self._pending.clear()
        self._deadlines.clear()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        self._reader_task = asyncio.get_running_loop().create_task(self._read(reader, writer))
        setup: list[Sequence[Any]] = []
        if self.password is not None:
            setup.append(
                ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
            )
        if self.db:
            setup.append(("SELECT", self.db))
        if setup:
            for reply in await asyncio.gather(*self.send(setup)):
                if isinstance(reply, Exception):
                    self.close(RedisConnectionError(f"Redis refused set-up: {reply}"))
                    raise reply

    def send(self, commands: Sequence[Sequence[Any]]) -> list[asyncio.Future[Any]]:
        """Write a batch of commands; one future per command, resolved in order.
        A reply that is an error resolves to the exception object (not raised)."""
        writer = self._writer
        if writer is None or writer.is_closing():
            raise RedisConnectionError("Redis connection is not open")
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in commands]
        writer.write(b"".join(pack(c) for c in commands))
        self._pending.extend(futures)
        due = loop.time() + self.timeout_seconds
        self._deadlines.append((due, futures[-1]))
        if self._deadline_timer is None:
            self._deadline_timer = loop.call_at(due, self._check_deadlines, writer)
        return futures

    def send_packed(self, data: bytes, futures: Sequence[Waiter]) -> None:
        """Write commands already packed in RESP (`data`), one waiter per command,
        resolved in order as `send`'s futures are (an error reply resolves to the
        exception object). For a caller that packs most of its command once and
        hands each reply on itself (gate/room/wire.py)."""
        writer = self._writer
        if writer is None or writer.is_closing():
            raise RedisConnectionError("Redis connection is not open")
        loop = asyncio.get_running_loop()
        writer.write(data)
        self._pending.extend(futures)
        due = loop.time() + self.timeout_seconds
        self._deadlines.append((due, futures[-1]))
        if self._deadline_timer is None:
            self._deadline_timer = loop.call_at(due, self._check_deadlines, writer)

    def _check_deadlines(self, writer: asyncio.StreamWriter) -> None:
        """Close the connection when its oldest unanswered batch is past its deadline;
        otherwise wait for that batch's deadline (one timer per connection rather than
        one per batch)."""
        if writer is not self._writer:
            return  # closed meanwhile (close() cancels the timer; this is a guard)
        self._deadline_timer = None
        deadlines = self._deadlines
        while deadlines and deadlines[0][1].done():
            deadlines.popleft()
        if not deadlines:
            return
        loop = asyncio.get_running_loop()
        due = deadlines[0][0]
        if due <= loop.time():
            self.close(RedisTimeoutError(f"no Redis reply within {self.timeout_seconds} s"))
            return
        self._deadline_timer = loop.call_at(due, self._check_deadlines, writer)

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parser = self._parser
        try:
            while True:
                data = await reader.read(READ_CHUNK_BYTES)
                if not data:
                    raise RedisConnectionError("Redis closed the connection")
                parser.feed(data)
                while (reply := parser.gets()) is not False:
                    if not self._pending:
                        raise RedisConnectionError("reply without a pending command")
                    fut = self._pending.popleft()
                    if not fut.done():
                        fut.set_result(
                            _error(reply) if isinstance(reply, hiredis.ReplyError) else reply
                        )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if writer is self._writer:
                self.close(
                    exc
                    if isinstance(exc, RedisConnectionError)
                    else RedisConnectionError(repr(exc))
                )

    def close(self, reason: Exception | None = None) -> None:
        """Close the connection and fail everything still pending on it."""
        writer, self._writer = self._writer, None
        pending, self._pending = self._pending, deque()
        self._deadlines = deque()
        timer, self._deadline_timer = self._deadline_timer, None
        if timer is not None:
            timer.cancel()
        failure = reason or RedisConnectionError("Redis connection closed")
        for fut in pending:
            if not fut.done():
                fut.set_exception(failure)
        if writer is not None:
            writer.close()
        task, self._reader_task = self._reader_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
