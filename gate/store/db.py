"""The database: one bounded aiomysql pool, session settings, bounded retries.

Every session runs READ COMMITTED (two sweepers deadlocked under REPEATABLE READ in
our probe, see DESIGN), UTC (expiry is judged by the database's NOW(6) only) and a
short lock-wait timeout, so a hot row makes requests fail fast instead of queueing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiomysql
import pymysql
from pymysql.constants import CLIENT

from gate.base.metrics import METRICS
from gate.base.settings import MysqlTarget, Settings
from gate.base.timeouts import deadline_in

log = logging.getLogger("gate.db")

# The pool gauges (gate_db_pool_in_use / _waiting) are sampled by gate/api/ops.py.
POOL_REFUSED = METRICS.counter(
    "gate_db_pool_refused_total",
    "Requests refused because no database connection was free in time.",
    ["use"],
)

T = TypeVar("T")

# Errors after which the statement or transaction may simply be run again.
RETRYABLE_ERRNOS = frozenset({1213, 1205})  # deadlock, lock wait timeout
# Errors that mean the connection is gone: the outcome of what was in flight is unknown.
CONNECTION_ERRNOS = frozenset({2003, 2006, 2013, 2014, 2055, 1927, 1053, 4031})
# A read meets at most this many dead pooled connections before it fails (each one
# met is closed, never handed out again).
READ_TRIES = 4


class DbUnavailable(Exception):
    """The database could not be reached or the pool could not give a connection."""


class OutcomeUnknown(Exception):
    """The connection broke while a transaction was committing; it may have committed."""

    def __init__(
        self, thread_id: int | None, connected_at: float | None, cause: BaseException
    ) -> None:
        super().__init__(f"outcome unknown (thread {thread_id}): {cause!r}")
        self.thread_id = thread_id
        self.connected_at = connected_at  # event-loop time the connection was opened
        self.cause = cause


def errno_of(exc: BaseException) -> int | None:
    if isinstance(exc, pymysql.err.MySQLError) and exc.args and isinstance(exc.args[0], int):
        return int(exc.args[0])
    return None


def is_connection_error(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | asyncio.IncompleteReadError | EOFError | OSError):
        return True
    if isinstance(exc, pymysql.err.InterfaceError):
        return True
    code = errno_of(exc)
    return code is not None and code in CONNECTION_ERRNOS


def is_retryable(exc: BaseException) -> bool:
    code = errno_of(exc)
    return code is not None and code in RETRYABLE_ERRNOS


def isolation_variable(server_version: str) -> str:
    """The isolation variable's name: tx_isolation on MariaDB before 11.1."""
    # MariaDB may announce itself as "5.5.5-10.11.19-MariaDB…" for old clients.
    match = re.search(r"(\d+)\.(\d+)\.\d+-MariaDB", server_version, re.IGNORECASE)
    if match and (int(match[1]), int(match[2])) < (11, 1):
        return "tx_isolation"
    return "transaction_isolation"


async def server_version(target: MysqlTarget, timeout_seconds: float) -> str:
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    try:
        return str(conn.get_server_info())
    finally:
        conn.close()


def connect_kwargs(
    target: MysqlTarget, timeout_seconds: float, *, with_db: bool = True
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "user": target.user,
        "password": target.password.reveal(),
        "connect_timeout": timeout_seconds,
        "autocommit": True,
        "charset": "utf8mb4",
        "client_flag": CLIENT.MULTI_STATEMENTS | CLIENT.MULTI_RESULTS,
    }
    if target.unix_socket:
        kwargs["unix_socket"] = target.unix_socket
    else:
        kwargs["host"] = target.host
        kwargs["port"] = target.port
    if with_db:
        kwargs["db"] = target.database
    return kwargs


class Database:
    """The pool plus helpers; every wait on it is bounded."""

    def __init__(self, settings: Settings, *, pool_max: int | None = None) -> None:
        self.settings = settings
        self.pool_max = pool_max or settings.db_pool_max
        self.pool: aiomysql.Pool | None = None
        self.init_sql = ""
        # Reservations may hold only this many connections at once: the rest of the
        # pool stays free for callbacks, cancels and reads however hot the sale.
        self.reservation_max = min(settings.db_reservation_pool_max, self.pool_max)
        self._reservation_slots = asyncio.Semaphore(self.reservation_max)
        self.reservations_in_use = 0
        self.reservations_waiting = 0

    async def start(self) -> None:
        version = await server_version(
            self.settings.mysql, self.settings.db_connect_timeout_seconds
        )
        self.init_sql = session_init_sql(version, self.settings.db_lock_wait_seconds)
        self.pool = await aiomysql.create_pool(
            minsize=0,
            maxsize=self.pool_max,
            pool_recycle=3600,
            init_command=self.init_sql,
            **connect_kwargs(self.settings.mysql, self.settings.db_connect_timeout_seconds),
        )

    async def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            await self.pool.wait_closed()
            self.pool = None

    @asynccontextmanager
    async def reservation_connection(self) -> AsyncIterator[Any]:
        """A connection from the reservations' share of the pool, or DbUnavailable
        after a short wait: a saturated database answers 503 at once."""
        wait = self.settings.db_reservation_acquire_seconds
        self.reservations_waiting += 1
        try:
            async with deadline_in(wait):
                await self._reservation_slots.acquire()
        except TimeoutError:
            POOL_REFUSED.labels("reservation").inc()
            raise DbUnavailable("the reservations' share of the database pool is busy") from None
        finally:
            self.reservations_waiting -= 1
        self.reservations_in_use += 1
        try:
            async with self.connection(wait) as conn:
                yield conn
        finally:
            self.reservations_in_use -= 1
            self._reservation_slots.release()

    @asynccontextmanager
    async def connection(self, timeout_seconds: float | None = None) -> AsyncIterator[Any]:
        """A pooled connection; a broken one is closed instead of returned."""
        assert self.pool is not None, "database not started"
        wait = (
            timeout_seconds
            if timeout_seconds is not None
            else self.settings.db_acquire_timeout_seconds
        )
        try:
            conn = await asyncio.wait_for(self.pool.acquire(), wait)
        except TimeoutError as exc:
            POOL_REFUSED.labels("other" if timeout_seconds is None else "reservation").inc()
            raise DbUnavailable("no database connection available in time") from exc
        except Exception as exc:
            if is_connection_error(exc) or isinstance(exc, pymysql.err.OperationalError):
                raise DbUnavailable(f"database unreachable: {exc}") from exc
            raise
        broken = False
        try:
            yield conn
        except BaseException as exc:
            broken = not isinstance(exc, pymysql.err.MySQLError) or is_connection_error(exc)
            if isinstance(exc, pymysql.err.MySQLError) and not broken:
                # A failed statement may leave a transaction open; never hand a
                # connection back to the pool in the middle of one.
                try:
                    await conn.rollback()
                except Exception:
                    broken = True
            raise
        finally:
            if broken:
                conn.close()
            self.pool.release(conn)

    @asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Any]:
        """A cursor reading one consistent, read-only snapshot of the database."""
        async with self.connection() as conn, conn.cursor() as cur:
            # REPEATABLE READ for this one transaction only: the session default
            # (READ COMMITTED) comes back with the next one.
            await cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            await cur.execute("START TRANSACTION WITH CONSISTENT SNAPSHOT, READ ONLY")
            try:
                yield cur
            finally:
                await cur.execute("COMMIT")

    async def fetchone(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        """The first row of a read (SELECT or SHOW only: see `_read`)."""
        rows = await self._read(sql, args, one=True)
        return rows[0] if rows else None

    async def fetchall(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Every row of a read (SELECT or SHOW only: see `_read`)."""
        return await self._read(sql, args, one=False)

    async def _read(self, sql: str, args: Sequence[Any], *, one: bool) -> list[tuple[Any, ...]]:
        """A read, tried again on another connection when the pooled one it got was
        dead: after a server restart or a janitor's KILL of a dead gate's threads
        (gate/store/process_lease.py) every idle connection of the pool fails once, and a read that
        resolves an unknown outcome must not fail for that. Only reads: a statement
        that changes something is never sent twice."""
        for i in range(READ_TRIES):
            try:
                async with self.connection() as conn, conn.cursor() as cur:
                    await cur.execute(sql, args)
                    if one:
                        row = await cur.fetchone()
                        return [tuple(row)] if row is not None else []
                    return [tuple(r) for r in await cur.fetchall()]
            except (pymysql.err.MySQLError, OSError, EOFError) as exc:
                if i == READ_TRIES - 1 or not is_connection_error(exc):
                    raise
                log.info("read retried on another connection: %r", exc)
        raise AssertionError("unreachable")

    async def execute(self, sql: str, args: Sequence[Any] = ()) -> int:
        async with self.connection() as conn, conn.cursor() as cur:
            return int(await cur.execute(sql, args))

    async def call(self, conn: Any, sql: str, args: Sequence[Any]) -> tuple[Any, ...] | None:
        """Run a CALL and read its single result row, draining the trailing results."""
        async with conn.cursor() as cur:
            await cur.execute(sql, args)
            row = await cur.fetchone()
            while await cur.nextset():
                pass
            return tuple(row) if row is not None else None

    def pool_stats(self) -> dict[str, int]:
        pool = self.pool
        return {
            "size": pool.size if pool else 0,
            "free": pool.freesize if pool else 0,
            "max": self.pool_max,
            "reservation_in_use": self.reservations_in_use,
            "reservation_max": self.reservation_max,
            "reservation_waiting": self.reservations_waiting,
        }

    async def retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt` again after a deadlock or lock-wait timeout, bounded, jittered."""
        tries = self.settings.db_retry_max
        for i in range(tries):
            try:
                return await attempt()
            except pymysql.err.MySQLError as exc:
                if not is_retryable(exc) or i == tries - 1:
                    raise
                log.info("retrying after errno %s (attempt %d)", errno_of(exc), i + 1)
                METRICS.db_retries.labels(str(errno_of(exc))).inc()
                await asyncio.sleep(random.uniform(0.002, 0.02) * (2**i))
        raise AssertionError("unreachable")

    async def wait_thread_gone(
        self, thread_id: int, connection_age_seconds: float, timeout_seconds: float = 5.0
    ) -> bool:
        """End the server thread of a connection that broke mid-transaction, and wait
        until it has ended: from then on its transaction has committed or rolled back,
        and a lookup tells the truth.

        Thread ids are unique within one server run, so the thread is ours unless the
        server restarted since the connection opened, in which case its transaction
        is already over. (The processlist cannot identify it by statement text: inside
        a stored procedure it shows the current inner statement, not the CALL.)
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        row = await self.fetchone("SHOW GLOBAL STATUS LIKE 'Uptime'")
        if row is not None and float(row[1]) < connection_age_seconds:
            return True
        killed = False
        while loop.time() < deadline:
            row = await self.fetchone(
                "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", (thread_id,)
            )
            if row is None or int(row[0]) == 0:
                return True
            if not killed:
                try:
                    await self.execute(f"KILL {int(thread_id)}")
                except pymysql.err.MySQLError as exc:
                    if errno_of(exc) != 1094:  # unknown thread: already gone
                        raise
                killed = True
            await asyncio.sleep(0.02)
        return False


def session_init_sql(version: str, lock_wait_seconds: int) -> str:
    # One statement: aiomysql reads only the first result of its init_command.
    return (
        f"SET SESSION {isolation_variable(version)} = 'READ-COMMITTED', "
        f"time_zone = '+00:00', innodb_lock_wait_timeout = {int(lock_wait_seconds)}"
    )
