"""The database: one bounded aiomysql pool, session settings, bounded retries.

Every session runs READ COMMITTED (two sweepers deadlocked under REPEATABLE READ in
our probe, see DESIGN), UTC (expiry is judged by the database's NOW(6) only) and a
short lock-wait timeout, so a hot row makes requests fail fast instead of queueing.

With several hosts in GATE_MYSQL_URL the pool lives on the writer node that
gate/store/dbwriter.py chooses and moves when it changes. Every pooled connection knows its
node ("host:port", `node_of`), and `servers` who answered there (wsrep_node_name or
hostname:port, and server_id). A server thread id is only ever acted on where it was
issued:

    end_thread_of(OutcomeUnknown) ──> wait_thread_gone(id, age, node)
      node = the writer ──> KILL it here, wait until the processlist shows it gone
      node = a former writer
        answers, same server ──> KILL it there (a node cut off from the primary
                                 component refuses, and commits nothing: gone)
        answers, another server ──> not proven (the age rule decides later)
        does not answer ──> gone once the writer's cluster no longer lists it
      ──> settle(): a causal read (wsrep_sync_wait) on the writer, so the lookup that
          follows sees everything the cluster committed, the former writer's too
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiomysql
import pymysql

from gate.base import tracing
from gate.base.backoff import Backoff
from gate.base.db_health import HEALTH
from gate.base.metrics import METRICS
from gate.base.settings import MysqlNode, MysqlTarget, Settings, node_name
from gate.base.timeouts import deadline_in
from gate.store.dbwriter import NodeReport, NoWriter, WriterSelector, ask, connect_args, judge

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
# "WSREP has not yet prepared node for application use": a Galera node outside the
# primary component.
ER_WSREP_NOT_READY = 1047
# The node refuses writes (read-only) or is out of the primary component: the writer
# is probed again at once rather than at the next interval.
WRITER_LOST_ERRNOS = frozenset({1290, ER_WSREP_NOT_READY})
# Between attempts after a deadlock or lock-wait timeout: 2 to 20 ms, doubling each
# attempt (such a conflict is over in milliseconds), at most a second.
DEADLOCK_BACKOFF = Backoff(base_seconds=0.02, cap_seconds=1.0, jitter=0.9)
# A read meets at most this many dead pooled connections before it fails (each one
# met is closed, never handed out again).
READ_TRIES = 4


class DbUnavailable(Exception):
    """The database could not be reached or the pool could not give a connection."""


class OutcomeUnknown(Exception):
    """The connection broke (or the deadline passed) while a transaction was
    committing: it may have committed. It names the server thread, so that the
    caller can make sure the thread has ended (`Database.end_thread_of`) before it
    looks the outcome up."""

    def __init__(
        self,
        thread_id: int | None,
        connected_at: float | None,
        cause: BaseException,
        node: str | None = None,
    ) -> None:
        super().__init__(f"outcome unknown (thread {thread_id} on {node}): {cause!r}")
        self.thread_id = thread_id
        self.connected_at = connected_at  # event-loop time the connection was opened
        self.cause = cause
        # The server that issued thread_id ("host:port", Database.node_of): a thread
        # id is only ever looked up, or killed, there.
        self.node = node


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


async def _call(conn: Any, sql: str, args: Sequence[Any]) -> tuple[Any, ...] | None:
    """`Database.call`'s body, inside its span (untraced calls run it inline)."""
    async with conn.cursor() as cur:
        await cur.execute(sql, args)
        row = await cur.fetchone()
        while await cur.nextset():
            pass
        return tuple(row) if row is not None else None


_PROCEDURE = re.compile(r"\s*CALL\s+(\w+)", re.IGNORECASE)


@functools.lru_cache(maxsize=256)
def _procedure(sql: str, node: str | None) -> tuple[str, tuple[tuple[str, Any], ...]]:
    m = _PROCEDURE.match(sql)
    procedure = m.group(1) if m else "statement"
    attributes: dict[str, Any] = {
        "db.system.name": "mariadb",
        "db.operation.name": "CALL",
        "db.stored_procedure.name": procedure,
        "db.query.summary": f"CALL {procedure}",
    }
    if node:
        host, _, port = node.rpartition(":")
        attributes["server.address"] = host or node
        if port.isdigit():
            attributes["server.port"] = int(port)
    return f"CALL {procedure}", tuple(attributes.items())


def procedure_span(sql: str, node: str | None) -> tuple[str, int, dict[str, Any]]:
    """The name, kind and attributes of a procedure call's span (semantic conventions
    for database calls; never the arguments)."""
    name, fixed = _procedure(sql, node)
    attributes = dict(fixed)
    size = tracing.batch_size()
    if size is not None:
        attributes["gate.batch.size"] = size
    return name, tracing.CLIENT, attributes


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


# Notes ("database exists", "table exists" after IF [NOT] EXISTS) reach a client as
# warnings, which set-up statements never want. note_verbosity = '' turns them off
# (MariaDB 10.6.16, 10.11.6 and later); sql_notes = 0 did before it, and is itself
# answered with a deprecation warning on newer servers (Debian 13's MariaDB 11.8).
NOTES_OFF_SQL = "SET SESSION note_verbosity = ''"
NOTES_OFF_BEFORE_NOTE_VERBOSITY_SQL = "SET SESSION sql_notes = 0"
UNKNOWN_SYSTEM_VARIABLE = 1193


async def notes_off(cursor: Any) -> None:
    """Turn notes off for an aiomysql cursor's session, on any supported MariaDB."""
    try:
        await cursor.execute(NOTES_OFF_SQL)
    except pymysql.err.MySQLError as exc:
        if errno_of(exc) != UNKNOWN_SYSTEM_VARIABLE:
            raise
        await cursor.execute(NOTES_OFF_BEFORE_NOTE_VERBOSITY_SQL)


def notes_off_blocking(cursor: Any) -> None:
    """`notes_off` for a PyMySQL (blocking) cursor."""
    try:
        cursor.execute(NOTES_OFF_SQL)
    except pymysql.err.MySQLError as exc:
        if errno_of(exc) != UNKNOWN_SYSTEM_VARIABLE:
            raise
        cursor.execute(NOTES_OFF_BEFORE_NOTE_VERBOSITY_SQL)


async def server_version(target: MysqlTarget, timeout_seconds: float) -> str:
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds, with_db=False))
    try:
        return str(conn.get_server_info())
    finally:
        conn.close()


def connect_kwargs(
    target: MysqlTarget, timeout_seconds: float, *, with_db: bool = True
) -> dict[str, Any]:
    """aiomysql.connect's arguments for the target's first node (`target.on(node)`
    for another one; gate/store/dbwriter.py says which node takes the writes)."""
    kwargs = connect_args(target, (target.host, target.port), timeout_seconds)
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
        # The writer node (gate/store/dbwriter.py), its pool, and pools of former writers
        # still closing.
        self.selector: WriterSelector | None = None
        self.node: str | None = None
        self.wsrep = False
        # Who answered at each node's address when this process last wrote there
        # (NodeReport.server: wsrep_node_name or hostname:port, and server_id): a
        # former writer's thread id is acted on only while the same server answers.
        self.servers: dict[str, str] = {}
        self._retired: set[aiomysql.Pool] = set()
        self._probe_task: asyncio.Task[None] | None = None
        self._probe_stop = asyncio.Event()

    async def start(self) -> None:
        """Choose the writer node (gate/store/dbwriter.py) and open the pool on it; NoWriter
        naming each node's reason when no listed node is usable."""
        self._probe_stop = asyncio.Event()
        self.selector = WriterSelector(self.settings, self._switch)
        if await self.selector.run_once() is None:
            reports = list(self.selector.reports.values())
            self.selector.close()
            raise NoWriter(
                "no database node takes writes: "
                + "; ".join(f"{r.name} {r.reason}" for r in reports)
            )
        if self.settings.mysql.clustered:
            self._probe_task = asyncio.get_running_loop().create_task(
                self.selector.run(self._probe_stop)
            )
        else:
            # A single server has nowhere to move to: it is not probed again (and its
            # probe connection is not kept).
            self.selector.close()

    async def _switch(self, old: MysqlNode | None, new: MysqlNode, report: NodeReport) -> None:
        """Move the pool to `new`: the old pool takes no more connections out, closes
        its free ones now and the busy ones as they come back."""
        self.init_sql = session_init_sql(report.version, self.settings.db_lock_wait_seconds)
        pool = await aiomysql.create_pool(
            minsize=0,
            maxsize=self.pool_max,
            pool_recycle=3600,
            init_command=self.init_sql,
            **connect_kwargs(self.settings.mysql.on(new), self.settings.db_connect_timeout_seconds),
        )
        previous = self.pool
        self.pool, self.node, self.wsrep = pool, node_name(new), report.wsrep
        self.servers[self.node] = report.server
        if previous is not None:
            previous.close()
            self._retired.add(previous)
            # Forgotten once its busy connections have come back and been closed.
            closing = asyncio.get_running_loop().create_task(previous.wait_closed())
            closing.add_done_callback(lambda _: self._retired.discard(previous))

    async def close(self) -> None:
        self._probe_stop.set()
        if self._probe_task is not None:
            await self._probe_task
            self._probe_task = None
        if self.selector is not None:
            self.selector.close()
        pools = [*self._retired, *([self.pool] if self.pool is not None else [])]
        self.pool = None
        self._retired.clear()
        for pool in pools:
            pool.close()
            await pool.wait_closed()

    def node_of(self, conn: Any) -> str | None:
        """The node ("host:port") a pooled connection was opened on."""
        node = getattr(conn, "gate_node", None)
        return str(node) if node is not None else self.node

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
        pool, node = self.pool, self.node
        assert pool is not None, "database not started"
        wait = (
            timeout_seconds
            if timeout_seconds is not None
            else self.settings.db_acquire_timeout_seconds
        )
        if pool.freesize == 0 and pool.size >= pool.maxsize:
            HEALTH.pool_wait()  # the automatic room rate's signal (gate/room/steering.py)
        try:
            conn = await asyncio.wait_for(pool.acquire(), wait)
        except TimeoutError as exc:
            POOL_REFUSED.labels("other" if timeout_seconds is None else "reservation").inc()
            raise DbUnavailable("no database connection available in time") from exc
        except Exception as exc:
            if is_connection_error(exc) or isinstance(exc, pymysql.err.OperationalError):
                self._poke()
                raise DbUnavailable(f"database unreachable: {exc}") from exc
            raise
        conn.gate_node = node
        broken = False
        try:
            yield conn
        except BaseException as exc:
            broken = not isinstance(exc, pymysql.err.MySQLError) or is_connection_error(exc)
            if errno_of(exc) in WRITER_LOST_ERRNOS:
                self._poke()  # the node turned read-only or left the cluster
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
                self._poke()
            pool.release(conn)

    def _poke(self) -> None:
        """A connection failed: have the writer probed again at once (clusters only)."""
        if self._probe_task is not None and self.selector is not None:
            self.selector.poke()

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
        """Run a CALL and read its single result row, draining the trailing results.
        With traces on, a client span (gate/base/tracing.py; a group's call is one span
        linked to and from every request it serves)."""
        if tracing.ENABLED and tracing.traced():
            with tracing.span(*procedure_span(sql, self.node_of(conn))):
                return await _call(conn, sql, args)
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
                await asyncio.sleep(DEADLOCK_BACKOFF.delay_seconds(i + 1))
        raise AssertionError("unreachable")

    def outcome_unknown(self, conn: Any, cause: BaseException) -> OutcomeUnknown:
        """`cause` broke `conn` while its transaction was committing: the
        OutcomeUnknown naming the connection's server thread and node."""
        return OutcomeUnknown(conn.thread_id(), conn.connected_time, cause, self.node_of(conn))

    async def end_thread_of(self, unknown: OutcomeUnknown, timeout_seconds: float = 5.0) -> None:
        """Make sure the server thread of an unknown outcome has ended (`wait_thread_gone`),
        so that a lookup afterwards tells whether it committed. Returns at once when
        the connection never had a thread; TimeoutError when the thread did not end
        within `timeout_seconds`, or whatever the database raised."""
        if unknown.thread_id is None or unknown.connected_at is None:
            return
        age = asyncio.get_running_loop().time() - unknown.connected_at
        if not await self.wait_thread_gone(
            unknown.thread_id, age, timeout_seconds, node=unknown.node
        ):
            raise TimeoutError("the server thread did not end in time")

    async def wait_thread_gone(
        self,
        thread_id: int,
        connection_age_seconds: float,
        timeout_seconds: float = 5.0,
        node: str | None = None,
    ) -> bool:
        """End the server thread of a connection that broke mid-transaction, and wait
        until it has ended: from then on its transaction has committed or rolled back,
        and a lookup tells the truth.

        Thread ids are unique within one server run, so the thread is ours unless the
        server restarted since the connection opened, in which case its transaction
        is already over. (The processlist cannot identify it by statement text: inside
        a stored procedure it shows the current inner statement, not the CALL.)

        `node` is where the connection was opened (`node_of`). A thread id means
        nothing on another server: when the writer has moved since, the thread is
        ended on its own node (`_other_node_thread_gone`), never on the current one.
        """
        here = self.node
        if node is not None and node != here:
            return await self._other_node_thread_gone(
                node, thread_id, connection_age_seconds, timeout_seconds
            )
        try:
            return await end_thread(
                self.fetchone, self.execute, thread_id, connection_age_seconds, timeout_seconds
            )
        except (DbUnavailable, pymysql.err.MySQLError, OSError) as exc:
            # The writer itself failed: once the probe has moved the pool, the thread
            # is a former writer's.
            lost = isinstance(exc, DbUnavailable) or is_connection_error(exc)
            if not lost or here is None or not await self._moved_from(here, timeout_seconds):
                raise
        return await self._other_node_thread_gone(
            here, thread_id, connection_age_seconds, timeout_seconds
        )

    async def _moved_from(self, node: str, timeout_seconds: float) -> bool:
        """Whether the writer moves off `node` within `timeout_seconds` (clusters only)."""
        if self._probe_task is None or self.selector is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while self.node == node and loop.time() < deadline:
            self.selector.poke()
            await asyncio.sleep(0.05)
        return self.node != node

    async def _other_node_thread_gone(
        self, node: str, thread_id: int, age_seconds: float, timeout_seconds: float
    ) -> bool:
        """A thread of a former writer: ended on that node when it answers; when it
        does not, gone only once the current writer's cluster no longer counts the
        node among its members (a node out of the primary component commits nothing).
        Either way the current writer then applies everything the cluster committed
        before a lookup reads it (`settle`)."""
        target = self.settings.mysql
        found = [n for n in target.node_list if node_name(n) == node]
        if not found:
            return False
        timeout = self.settings.db_probe_timeout_seconds
        try:
            conn = await asyncio.wait_for(
                aiomysql.connect(**connect_kwargs(target.on(found[0]), timeout, with_db=False)),
                timeout,
            )
        except Exception:
            conn = None
        if conn is not None:
            try:
                answered = judge(found[0], *await ask(conn)).server
                if self.servers.get(node, answered) != answered:
                    # Another server at that address: the id is not one of its
                    # threads, and where the thread's server went is not known.
                    log.warning("%s is now %s, not %s", node, answered, self.servers[node])
                    return False
                gone = await end_thread(
                    _direct_fetchone(conn),
                    _direct_execute(conn),
                    thread_id,
                    age_seconds,
                    timeout_seconds,
                )
            finally:
                conn.close()
        else:
            gone = await self._left_cluster(node, timeout_seconds)
        return gone and await self.settle(timeout_seconds)

    async def _left_cluster(self, node: str, timeout_seconds: float) -> bool:
        """Whether the current writer's primary component has dropped `node` (waits up
        to `timeout_seconds` for the cluster to notice a node that died)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_seconds
        while True:
            if self.wsrep:
                rows = await self.fetchall(
                    "SHOW GLOBAL STATUS WHERE Variable_name IN"
                    " ('wsrep_incoming_addresses', 'wsrep_cluster_status')"
                )
                status = {str(k).lower(): str(v) for k, v in rows}
                members = {m.strip() for m in status.get("wsrep_incoming_addresses", "").split(",")}
                if status.get("wsrep_cluster_status") == "Primary" and not (
                    await _addresses(node) & members
                ):
                    return True
            if not self.wsrep or loop.time() >= deadline:
                return False
            await asyncio.sleep(0.2)

    async def settle(self, timeout_seconds: float = 5.0) -> bool:
        """On Galera: wait until the writer has applied every write set the cluster
        ordered before now (a causal read, wsrep_sync_wait), so that a lookup that
        follows sees a former writer's last commits. True at once elsewhere;
        TimeoutError after `timeout_seconds` (a stalled cluster)."""
        if not self.wsrep:
            return True
        async with (
            deadline_in(timeout_seconds),
            self.connection() as conn,
            conn.cursor() as cur,
        ):
            await cur.execute("SET SESSION wsrep_sync_wait = 1")
            try:
                await cur.execute("SELECT COUNT(*) FROM deals WHERE id = 0")
                await cur.fetchall()
            finally:
                await cur.execute("SET SESSION wsrep_sync_wait = 0")
        return True


async def _addresses(node: str) -> set[str]:
    """ "host:port" and "ip:port" for each address the node's host resolves to (Galera
    lists its members' addresses as it sees them)."""
    host, _, port = node.rpartition(":")
    found = {node}
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host.strip("[]"), int(port))
    except OSError:
        return found
    for info in infos:
        address = str(info[4][0])
        found.add(f"[{address}]:{port}" if ":" in address else f"{address}:{port}")
    return found


Fetch = Callable[[str, Sequence[Any]], Awaitable[tuple[Any, ...] | None]]
Execute = Callable[[str], Awaitable[int]]


def _direct_fetchone(conn: Any) -> Fetch:
    async def fetchone(sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        async with conn.cursor() as cur:
            await cur.execute(sql, args)
            row = await cur.fetchone()
            return tuple(row) if row is not None else None

    return fetchone


def _direct_execute(conn: Any) -> Execute:
    async def execute(sql: str) -> int:
        async with conn.cursor() as cur:
            return int(await cur.execute(sql))

    return execute


async def end_thread(
    fetchone: Fetch,
    execute: Execute,
    thread_id: int,
    age_seconds: float,
    timeout_seconds: float,
) -> bool:
    """KILL a server thread (once) and wait until the processlist no longer shows it,
    on the server `fetchone`/`execute` talk to; True at once when that server started
    after the connection opened (the thread id is not ours any more)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_seconds
    row = await fetchone("SHOW GLOBAL STATUS LIKE 'Uptime'", ())
    if row is not None and float(row[1]) < age_seconds:
        return True
    killed = False
    while loop.time() < deadline:
        row = await fetchone(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", (thread_id,)
        )
        if row is None or int(row[0]) == 0:
            return True
        if not killed:
            try:
                await execute(f"KILL {int(thread_id)}")
            except pymysql.err.MySQLError as exc:
                if errno_of(exc) == ER_WSREP_NOT_READY:
                    # A Galera node out of the primary component refuses KILL, and
                    # commits nothing: its open transactions can only roll back.
                    return True
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
