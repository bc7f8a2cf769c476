"""A read outlives dead pooled connections (a server restart, a janitor's KILL of a
dead gate's threads); a write is never sent twice."""

from __future__ import annotations

import time

import pymysql
import pytest

from gate.base.settings import Settings
from gate.store.db import READ_TRIES, Database, connect_kwargs


async def _kill_all(settings: Settings, victim: Database, n: int) -> None:
    """KILL the server threads of `n` connections the victim's pool holds idle, from a
    blocking connection: the event loop does not run meanwhile, so the pool has not
    read the closed sockets when its next statement takes one (as when a janitor's
    KILL lands between two requests)."""
    assert victim.pool is not None
    conns = [await victim.pool.acquire() for _ in range(n)]
    ids = [int(c.thread_id()) for c in conns]
    for c in conns:
        victim.pool.release(c)
    _kill(settings, ids)


def _kill(settings: Settings, ids: list[int]) -> None:
    killer = pymysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        with killer.cursor() as cur:
            for t in ids:
                cur.execute(f"KILL {t}")
            marks = ",".join(["%s"] * len(ids))
            for _ in range(500):
                cur.execute(
                    f"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID IN ({marks})",
                    ids,
                )
                row = cur.fetchone()
                if row is not None and int(row[0]) == 0:
                    return
                time.sleep(0.002)
        raise AssertionError("killed threads did not end")
    finally:
        killer.close()


async def test_reads_survive_dead_pooled_connections(settings: Settings, prepared: None) -> None:
    n = READ_TRIES - 1
    victim = Database(settings, pool_max=n)
    await victim.start()
    try:
        await _kill_all(settings, victim, n)
        assert await victim.fetchone("SELECT 1") == (1,)
        await _kill_all(settings, victim, n)
        assert await victim.fetchall("SELECT 2 UNION ALL SELECT 3") == [(2,), (3,)]
        # A statement that may change something is not retried: its caller decides.
        await _kill_all(settings, victim, n)
        with pytest.raises(pymysql.err.OperationalError):
            await victim.execute("DO 1")
    finally:
        await victim.close()
