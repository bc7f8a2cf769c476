"""The process liveness lease: how a janitor learns at once that a gate died.

    start ──> take a lease {gate:o:OWNER}:lease (TTL GATE_LEASE_SECONDS, "host pid")
    every GATE_LEASE_SECONDS / 3 ──> renew it (PEXPIRE: never re-creates a lapsed one)
        └─ lapsed (a stall longer than the lease, Redis lost it) ──> take a new owner id
    admission ──> the token's in-flight marker names the owner (lua/admit.lua)
    before a reservation transaction on a connection ──> record the connection's
        server thread id in {gate:o:OWNER}:conns ("id@host:port" with several
        database hosts: the node that issued it), only while the lease exists
        (lua/lease.lua); a connection that could not be recorded is not used (the
        request gives its units back and tries once more under a new owner id)
    stop ──> release (delete the lease): a stopped process has no transaction left

A janitor that finds a marker whose owner's lease is gone kills the owner's recorded
threads, waits until the server shows them gone, and then asks the database whether
the token's order committed (gate/inventory/janitor.py). Every transaction of the owner's
tokens ran on a recorded thread (recorded while the lease existed, so before the
janitor looked), and a thread that is gone can run nothing more: the database's
answer is final, and the units go back exactly once. A missed renewal alone never
gives anything back: the janitor acts on the database's answer, after the thread is
gone, never on the lease alone (docs/redis-mirror.md, "A dead gate's markers").
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import weakref
from typing import Any

import pymysql

from gate.base.settings import Settings
from gate.store.db import Database, DbUnavailable
from gate.store.keys import OwnerKeys, owner_keys
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.lease")

# Thread ids recorded per owner before the gone ones are pruned (a pool replaces its
# connections now and then; the record must not grow for the process's lifetime).
RECORDED_THREADS_MAX = 256


def thread_field(thread_id: int, node: str | None) -> str:
    """How a connection is recorded under its owner: the server thread id, and with
    several database nodes the node that issued it ("123@host:port"), so that a
    janitor ends it on that node and never on another."""
    return str(thread_id) if node is None else f"{thread_id}@{node}"


def parse_thread_field(field: str) -> tuple[int, str | None]:
    thread_id, _, node = field.partition("@")
    return int(thread_id), node or None


def new_owner() -> str:
    return secrets.token_hex(8)


class LeaseLapsed(DbUnavailable):
    """A transaction was about to run for a token whose owner's lease has lapsed;
    nothing was sent. The request gives its units back and may try once more under
    the process's current lease (`Lease.ensure`)."""


class Lease:
    def __init__(self, settings: Settings, runner: ScriptRunner, db: Database) -> None:
        self.settings = settings
        self.runner = runner
        self.db = db
        self.lease_ms = int(settings.lease_seconds * 1000)
        # The connection record outlives the lease long enough for any janitor to use
        # it: past it, a dead owner's markers are old enough for the age rule anyway.
        self.record_ms = int((settings.inflight_max_seconds + settings.lease_seconds) * 1000)
        self.info = f"{socket.gethostname()} {os.getpid()}"
        self.owner = new_owner()
        self.keys: OwnerKeys = owner_keys(self.owner)
        # Connection -> its server thread id and the owners it is recorded under (weak:
        # a closed connection's entry goes with it; its thread id stays recorded until
        # pruned). The thread id is kept so that a connection object that reconnected
        # (a new server thread) counts as not recorded.
        self._recorded: weakref.WeakKeyDictionary[Any, tuple[int, set[str]]] = (
            weakref.WeakKeyDictionary()
        )
        # The recorded fields (`thread_field`) of this owner's connections.
        self._threads: dict[str, None] = {}
        self._recordings = 0  # connections recorded so far (a prune racing one stands down)
        # The current owner, once a recording found its lease gone (a flush, a stall):
        # the next `ensure` takes a new one at once rather than at the next renewal.
        self._lapsed: str | None = None
        self._taking = asyncio.Lock()
        self._stop = asyncio.Event()

    async def start(self) -> None:
        """Take the first lease; a failure stops start-up."""
        if not await self._take():
            raise RuntimeError("could not take a process lease")

    async def _take(self) -> bool:
        async with self._taking:
            return await self._take_locked()

    async def _take_locked(self) -> bool:
        owner = new_owner()
        keys = owner_keys(owner)
        done = await self.runner.call(
            "lease",
            (keys.lease, keys.conns),
            ("take", self.lease_ms, self.record_ms, self.info),
        )
        if int(done) != 1:
            return False
        self.owner, self.keys = owner, keys
        self._threads.clear()
        return True

    async def renew(self) -> None:
        keys = self.keys
        renewed = await self.runner.call(
            "lease", (keys.lease, keys.conns), ("renew", self.lease_ms, self.record_ms)
        )
        if int(renewed) == 1:
            if len(self._threads) > RECORDED_THREADS_MAX:
                await self._prune()
            return
        # Lapsed: a janitor may already be resolving this owner's markers. Its tokens
        # stay bound to it (a transaction for them runs only on a connection recorded
        # under it, so nothing new can start); new admissions get a new owner.
        await self._replace(keys.lease)

    async def ensure(self) -> None:
        """Take a new owner now if the current one's lease was found lapsed."""
        if self._lapsed == self.owner:
            await self._replace(self.keys.lease)

    async def _replace(self, lapsed_lease: str) -> None:
        async with self._taking:
            if self.keys.lease != lapsed_lease:
                return  # another caller replaced it meanwhile
            old = self.owner
            if await self._take_locked():
                log.warning("process lease %s lapsed; now %s", old, self.owner)

    async def run(self) -> None:
        """Renew every third of the lease until stopped (one renewal at a time, each
        bounded by the interval)."""
        interval = self.settings.lease_seconds / 3
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            started = loop.time()
            try:
                await asyncio.wait_for(self.renew(), interval)
            except Exception as exc:
                log.warning("process lease renewal failed: %r", exc)
            try:
                await asyncio.wait_for(
                    self._stop.wait(), max(0.0, started + interval - loop.time())
                )
            except TimeoutError:
                pass

    async def stop(self) -> None:
        """Stop renewing and release the lease (call once the process has no
        reservation transaction left: its pool is closed)."""
        self._stop.set()
        try:
            await asyncio.wait_for(self.runner.client.delete(self.keys.lease), 2.0)
        except Exception as exc:
            log.warning("process lease not released (it lapses by itself): %r", exc)

    async def bind(self, conn: Any, owners: set[str]) -> None:
        """Make sure `conn` is recorded under every owner of the tokens whose
        transaction is about to run on it; DbUnavailable when one's lease has lapsed
        (the transaction must not run: a janitor may be giving its units back)."""
        thread_id = int(conn.thread_id())
        done = self._recorded.get(conn)
        if done is None or done[0] != thread_id:
            done = (thread_id, set())
            self._recorded[conn] = done
        missing = owners - done[1]
        if not missing:
            return
        age_ms = int((asyncio.get_running_loop().time() - conn.connected_time) * 1000)
        field = thread_field(
            thread_id, self.db.node_of(conn) if self.db.settings.mysql.clustered else None
        )
        for owner in missing:
            keys = owner_keys(owner)
            try:
                ok = await self.runner.call(
                    "lease",
                    (keys.lease, keys.conns),
                    ("thread", self.lease_ms, self.record_ms, field, max(0, age_ms)),
                )
            except Exception as exc:
                # Perhaps recorded, perhaps not: the connection is not used this time.
                raise DbUnavailable(f"connection not recorded under its lease: {exc!r}") from exc
            if int(ok) != 1:
                if owner == self.owner:
                    self._lapsed = owner
                raise LeaseLapsed(f"process lease {owner} lapsed")
            done[1].add(owner)
            self._recordings += 1
            if owner == self.owner:
                self._threads[field] = None

    async def _prune(self) -> None:
        """Forget recorded threads the server shows gone: they can run nothing more.
        Only the current writer's threads are asked about (a thread id means nothing
        on another server); a former writer's stay recorded until the record lapses."""
        here = {f: parse_thread_field(f)[0] for f in self._threads}
        here = {f: t for f, t in here.items() if parse_thread_field(f)[1] in (None, self.db.node)}
        ids = list(set(here.values()))
        if not ids:
            return
        recordings = self._recordings
        marks = ",".join(["%s"] * len(ids))
        try:
            rows = await self.db.fetchall(
                f"SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN ({marks})", ids
            )
        except (DbUnavailable, pymysql.err.MySQLError) as exc:
            log.info("recorded threads not pruned: %r", exc)
            return
        alive = {int(r[0]) for r in rows}
        gone = [f for f, t in here.items() if t not in alive]
        # A connection recorded meanwhile may have a gone thread's id (a server
        # restart starts the ids again): its record must stay.
        if gone and recordings == self._recordings:
            await self.runner.client.hdel(self.keys.conns, *gone)
            for f in gone:
                self._threads.pop(f, None)
