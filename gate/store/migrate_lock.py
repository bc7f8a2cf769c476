"""The migration lock (one `gate migrate` at a time, on every node of a cluster) and
the retry of statements a database refuses for a moment.

    migration_lock(target) ──> the `gate.migrate` row of schema_lock, a lease:
      take:  UPDATE schema_lock SET holder = me, expires_at = NOW(6) + LEASE_SECONDS
               WHERE name = 'gate.migrate' AND (holder IS NULL OR expires_at < NOW(6))
               │ 1 row ──> held (committed; on Galera certified cluster-wide)
               │ 0 rows, or 1213 (another node's take won certification)
               │       ──> look again after a backoff, up to LOCK_WAIT_SECONDS,
               │           then MigrationError naming the holder
      held:  every RENEW_SECONDS, expires_at = NOW(6) + LEASE_SECONDS WHERE holder = me
             (the row names someone else: the lease was lost, Lease.check raises
             before the run's next statement)
      done:  UPDATE schema_lock SET holder = NULL WHERE holder = me

A committed lease rather than a row held `FOR UPDATE` by an open transaction: on
Galera a row lock binds only the node that takes it (a transaction is certified at
commit, and a lock's transaction that never commits is never certified), so two runs
started on two nodes both held it and both applied the same migration ("Table
'deals' already exists", "Duplicate column name"). A committed UPDATE is certified:
of two nodes taking the lease at once, one commit wins and the other gets errno 1213.
A run that dies keeps the lease until it runs out (LEASE_SECONDS; LOCK_WAIT_SECONDS
is longer, so a run started right after the crash still gets it). expires_at is
written by one server's clock and read by another's: clocks apart by seconds are
harmless against a lease of 30 s that is renewed every 5.

    execute_retried(cur, statement) ──> 1213 or 1047 ──> Backoff, again
                                        (RETRY_ATTEMPTS_MAX attempts in all)

Errno 1213 is an InnoDB deadlock (two first runs inserting the lock row into an
empty table deadlock on its gap lock), or on Galera a certification conflict or a
brute-force abort by another node's write or DDL; 1047 ("WSREP has not yet prepared
node for application use") is a Galera node out of the primary component for a
moment. Both come before the statement took effect (an autocommit statement rolled
back, a DDL never started), so running the same statement again is safe.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiomysql
import pymysql

from gate.base.backoff import Backoff
from gate.base.settings import MysqlTarget
from gate.store.db import ER_WSREP_NOT_READY, connect_kwargs, errno_of, notes_off

log = logging.getLogger("gate.migrate")

LOCK_NAME = "gate.migrate"  # the schema_lock row (a name, not the module path)
LOCK_TABLE = "schema_lock"
LOCK_WAIT_SECONDS = 60.0
LEASE_SECONDS = 30
RENEW_SECONDS = 5.0
ER_LOCK_DEADLOCK = 1213
# Refusals after which the very same statement may simply run again (see above).
TRANSIENT_ERRNOS = {
    ER_LOCK_DEADLOCK: "deadlock or Galera certification conflict",
    ER_WSREP_NOT_READY: "Galera node not ready",
}
RETRY = Backoff(base_seconds=0.05, cap_seconds=2.0)
RETRY_ATTEMPTS_MAX = 10  # about 10 s of waiting in all at most
# Looks at a lock another run holds.
POLL = Backoff(base_seconds=0.05, cap_seconds=1.0)

_TAKE = (
    f"UPDATE {LOCK_TABLE} SET holder = %s, expires_at = NOW(6) + INTERVAL %s SECOND"
    " WHERE name = %s AND (holder IS NULL OR expires_at IS NULL OR expires_at < NOW(6))"
)
_RENEW = (
    f"UPDATE {LOCK_TABLE} SET expires_at = NOW(6) + INTERVAL %s SECOND"
    " WHERE name = %s AND holder = %s"
)
_RELEASE = (
    f"UPDATE {LOCK_TABLE} SET holder = NULL, expires_at = NULL WHERE name = %s AND holder = %s"
)
_HOLDER = f"SELECT holder, expires_at, expires_at < NOW(6) FROM {LOCK_TABLE} WHERE name = %s"


class MigrationError(RuntimeError):
    pass


async def execute_retried(cur: Any, statement: str, args: Any = None) -> int:
    """cur.execute(statement, args), run again after a transient refusal (errno 1213,
    1047) with a bounded backoff; any other error, or the last attempt's, is raised."""
    attempt = 0
    while True:
        try:
            return int(await cur.execute(statement, args))
        except pymysql.err.MySQLError as exc:
            code = errno_of(exc)
            attempt += 1
            if code not in TRANSIENT_ERRNOS or attempt >= RETRY_ATTEMPTS_MAX:
                raise
            delay = RETRY.delay_seconds(attempt)
            log.info(
                "errno %d (%s), attempt %d of %d; again in %.2f s: %s",
                code,
                TRANSIENT_ERRNOS[code],
                attempt,
                RETRY_ATTEMPTS_MAX,
                delay,
                " ".join(statement.split())[:120],
            )
            await asyncio.sleep(delay)


@dataclass
class Lease:
    """The lock as one run holds it."""

    holder: str
    lost: str = ""  # why it was lost; empty while held

    def check(self) -> None:
        """Raise before the next statement of a run whose lease was lost."""
        if self.lost:
            raise MigrationError(
                f"the migration lock was lost ({self.lost}); run gate migrate again"
            )


def _holder_name() -> str:
    return f"{socket.gethostname()[:120]} pid {os.getpid()} {secrets.token_hex(4)}"


async def _ensure_lock_row(cur: Any) -> None:
    """schema_lock with its lease columns, and the `gate.migrate` row."""
    await cur.execute(
        "SELECT COLUMN_NAME FROM information_schema.COLUMNS"
        " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
        (LOCK_TABLE,),
    )
    columns = {str(r[0]).lower() for r in await cur.fetchall()}
    # DDL only when something is missing: on Galera every DDL is replicated in total
    # order and aborts what conflicts with it on every node.
    if not columns:
        await execute_retried(
            cur,
            f"CREATE TABLE IF NOT EXISTS {LOCK_TABLE} ("
            " name VARCHAR(64) CHARACTER SET ascii NOT NULL PRIMARY KEY,"
            " holder VARCHAR(255) NULL,"
            " expires_at DATETIME(6) NULL"
            ") ENGINE=InnoDB",
        )
    elif not {"holder", "expires_at"} <= columns:
        # A table made when the lock was a row held FOR UPDATE (name only).
        await execute_retried(
            cur,
            f"ALTER TABLE {LOCK_TABLE} ADD COLUMN IF NOT EXISTS holder VARCHAR(255) NULL,"
            " ADD COLUMN IF NOT EXISTS expires_at DATETIME(6) NULL",
        )
    await execute_retried(
        cur,
        f"INSERT INTO {LOCK_TABLE} (name) VALUES (%s) ON DUPLICATE KEY UPDATE name = name",
        (LOCK_NAME,),
    )


async def _take(cur: Any, lease: Lease) -> None:
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    attempt = 0
    while True:
        await cur.execute(_HOLDER, (LOCK_NAME,))
        row = await cur.fetchone()
        holder, expires_at, expired = (row[0], row[1], row[2]) if row else (None, None, 1)
        taken = 0
        if holder is None or expired:
            try:
                taken = int(await cur.execute(_TAKE, (lease.holder, LEASE_SECONDS, LOCK_NAME)))
            except pymysql.err.MySQLError as exc:
                # Another node's take committed first (certification), or a deadlock:
                # look at the row again.
                if errno_of(exc) not in TRANSIENT_ERRNOS:
                    raise
        if taken:
            if holder is not None:
                log.warning(
                    "took over the migration lock from %s, whose lease ran out at %s"
                    " (a run that died)",
                    holder,
                    expires_at,
                )
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise MigrationError(
                f"could not take the migration lock in {LOCK_WAIT_SECONDS:g} s: held by"
                f" {holder or 'another run'} (lease until {expires_at}); another gate"
                " migrate is running or stuck"
            )
        attempt += 1
        await asyncio.sleep(min(POLL.delay_seconds(attempt), remaining))


async def _renew(cur: Any, lease: Lease, stop: asyncio.Event) -> None:
    """Every RENEW_SECONDS until `stop`: push the lease's end; note its loss."""
    while not lease.lost:
        try:
            await asyncio.wait_for(stop.wait(), RENEW_SECONDS)
            return
        except TimeoutError:
            pass
        try:
            if await execute_retried(cur, _RENEW, (LEASE_SECONDS, LOCK_NAME, lease.holder)):
                continue
            await cur.execute(_HOLDER, (LOCK_NAME,))
            row = await cur.fetchone()
            if row is None or row[0] != lease.holder:
                lease.lost = f"now held by {row[0] if row else 'nobody'}"
        except Exception as exc:
            lease.lost = f"renewing it failed: {exc!r}"
    log.error("the migration lock was lost: %s", lease.lost)


@asynccontextmanager
async def migration_lock(target: MysqlTarget, timeout_seconds: float) -> AsyncIterator[Lease]:
    """Hold the migration lock for the body (on a connection of its own, to
    target.database, which must exist). MigrationError when it cannot be taken."""
    conn = await aiomysql.connect(**connect_kwargs(target, timeout_seconds))
    lease = Lease(_holder_name())
    try:
        async with conn.cursor() as cur:
            # Two first runs may both create the table: "already exists" is no news.
            await notes_off(cur)
            await _ensure_lock_row(cur)
            await _take(cur, lease)
            stop = asyncio.Event()
            renewing = asyncio.create_task(_renew(cur, lease, stop))
            try:
                yield lease
            finally:
                stop.set()
                # A renewal in flight ends first (the connection carries one statement
                # at a time); one that hangs is given up with the connection.
                done, _ = await asyncio.wait({renewing}, timeout=timeout_seconds + 1.0)
                if done and not lease.lost:
                    try:
                        await execute_retried(cur, _RELEASE, (LOCK_NAME, lease.holder))
                    except Exception as exc:
                        log.warning(
                            "could not release the migration lock (%r); it runs out in %d s",
                            exc,
                            LEASE_SECONDS,
                        )
                else:
                    renewing.cancel()
    finally:
        conn.close()
