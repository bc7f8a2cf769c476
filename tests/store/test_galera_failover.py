"""A sale on a 3-node MariaDB Galera cluster keeps every promise while its writer node
fails: SIGKILLed for good, restarted and rejoining, partitioned away.

    buyers (one Idempotency-Key each, retried until a definite answer)
        -> two `gate serve` on GATE_MYSQL_URL = node0,node1,node2
             writes to the first healthy node (gate/store/dbwriter.py)
        -> LocalGalera (tests/galera.py): node0 killed / restarted / isolated mid-sale

    then: every order answered 201 (or 200 on a retry) is a row on every live node,
    no unit sold twice (total = available + held + sold, Redis = DB: gate.inventory.check),
    exactly the stock sold when demand exceeds it, `gate check` clean, and the sale
    resumed within the contract's 10 s.

Only on a Galera run (GATE_TEST_GALERA=1, scripts/test's Galera suite); each test
leaves the session's cluster whole (three Synced nodes) for the files after it.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
import redis.asyncio as aioredis

from gate.base.metrics import sample_values
from gate.base.settings import Settings
from gate.store.db import Database
from gate.store.keys import deal_keys
from tests.galera import LocalGalera
from tests.support import (
    GALERA_RUN,
    GATE_BIN,
    Client,
    GateProcess,
    assert_invariants,
    create_deal,
    reserve,
)

pytestmark = pytest.mark.skipif(
    not GALERA_RUN,
    reason="needs the local Galera cluster: GATE_TEST_GALERA=1 (scripts/test's Galera suite)",
)

# The contract: every gate process moves to the next node within 10 s of its writer
# failing (docs/high-availability.md).
FAILOVER_SECONDS = 10.0
# Short for the tests (production: 30 s): the gates come back to the first node soon
# after it is healthy again.
HOLD_DOWN_SECONDS = 3
# A buyer still without a definite answer after this long fails the test.
BUYER_PATIENCE_SECONDS = 120.0
WRITER = "gate_db_writer_info"


@dataclass
class Buyers:
    """Buyers of one deal, each with its own key, retrying it until they get an order
    (201, or 200 when a retry finds it) or SOLD_OUT. 503s, 429s and lost connections
    (the writer died under the request) are retried with the same key."""

    client: Client
    deal_id: int
    user_base: int
    orders: dict[str, str] = field(default_factory=dict)  # key -> order id
    answered: list[tuple[float, float]] = field(default_factory=list)  # (sent, 201 at)
    sold_out: int = 0
    retried: Counter[str] = field(default_factory=Counter)
    last: dict[str, str] = field(default_factory=dict)  # key -> the last answer not final
    stuck: list[tuple[int, str]] = field(default_factory=list)  # (user, key) never answered
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def buy(self, n: int) -> None:
        key = f"galera-{self.deal_id}-{n:06d}"
        deadline = time.monotonic() + BUYER_PATIENCE_SECONDS
        while True:
            sent = time.monotonic()
            try:
                r = await reserve(self.client, self.deal_id, self.user_base + n, key)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.retried[type(exc).__name__] += 1
            else:
                if r.status_code in (200, 201):
                    self.orders[key] = r.json()["order_id"]
                    if r.status_code == 201:
                        self.answered.append((sent, time.monotonic()))
                    return
                code = r.json().get("code", "") if r.content else ""
                if r.status_code == 409 and code == "SOLD_OUT":
                    self.sold_out += 1
                    return
                assert r.status_code in (409, 429) or r.status_code >= 500, r.text
                self.retried[f"{r.status_code} {code}"] += 1
                self.last[key] = f"{r.status_code} {code} {r.text[:200]}"
            if time.monotonic() >= deadline:
                self.stuck.append((self.user_base + n, key))
                return
            await asyncio.sleep(0.05)

    async def crowd(self, buyers: int, concurrency: int) -> None:
        """`buyers` buyers, at most `concurrency` of them at a time."""
        gate = asyncio.Semaphore(concurrency)

        async def one(n: int) -> None:
            async with gate:
                await self.buy(n)

        await asyncio.gather(*(one(n) for n in range(buyers)))

    def start_stream(self, workers: int) -> None:
        """New buyers one after another on `workers` lanes until finish()."""

        async def lane(w: int) -> None:
            n = w
            while not self.stop.is_set():
                await self.buy(n)
                n += workers

        self._tasks = [asyncio.create_task(lane(w)) for w in range(workers)]

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self._tasks)

    async def wait_orders(self, count: int, timeout_seconds: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while len(self.orders) < count:
            assert time.monotonic() < deadline, f"{len(self.orders)} orders: {self.retried}"
            await asyncio.sleep(0.05)

    def first_201_sent_after(self, moment: float) -> float:
        """When the first 201 to a request sent after `moment` arrived."""
        after = [done for sent, done in self.answered if sent >= moment]
        assert after, f"no 201 after the fault: {self.retried}"
        return min(after)


@pytest.fixture
def galera_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "GATE_DB_WRITER_HOLD_DOWN_SECONDS": str(HOLD_DOWN_SECONDS)}


@pytest.fixture
def cluster(galera: LocalGalera | None) -> Iterator[LocalGalera]:
    """The session's cluster, made whole again after the test (every node alive,
    in the group and Synced), whatever the test did to it."""
    assert galera is not None
    try:
        yield galera
    finally:
        for i in range(galera.nodes):
            if not galera.alive(i):
                galera.restart(i)
            elif not galera.status(i).synced:
                galera.heal(i)
        for i in range(galera.nodes):
            galera.wait_synced(i, cluster_size=galera.nodes)


@pytest.fixture
async def gates(galera_env: dict[str, str]) -> AsyncIterator[list[GateProcess]]:
    """Two `gate serve` processes on the cluster, one worker each."""
    procs = [GateProcess(galera_env, workers=1) for _ in range(2)]
    try:
        for proc in procs:
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def buyers_client(gates: list[GateProcess]) -> AsyncIterator[Client]:
    """Requests alternate between the two gates."""
    c = Client(gates[0].url, peers=[g.url for g in gates])
    try:
        yield c
    finally:
        await c.close()


async def writer_of(gate: GateProcess) -> str | None:
    """The node a gate process writes to, from its /metrics."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(f"{gate.metrics_url}/metrics") as r,
    ):
        samples = sample_values(await r.text())
    nodes = [dict(labels)["node"] for (name, labels), v in samples.items() if name == WRITER and v]
    return nodes[0] if len(nodes) == 1 else None


async def wait_writers(gates: list[GateProcess], node: str, timeout_seconds: float = 60.0) -> float:
    """Every gate writes to `node`; returns when that was first seen (monotonic)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        writers = [await writer_of(g) for g in gates]
        if all(w == node for w in writers):
            return time.monotonic()
        assert time.monotonic() < deadline, f"writers {writers}, expected {node}"
        await asyncio.sleep(0.1)


def rows_on(galera: LocalGalera, i: int, database: str, deal_id: int) -> dict[str, int]:
    """{order id: quantity} of the deal's held or sold orders, read on node i."""
    with galera.connect(i) as conn, conn.cursor() as cur:
        cur.execute(
            f"SELECT id, quantity FROM `{database}`.orders WHERE deal_id = %s"
            " AND status IN ('PENDING_PAYMENT', 'PAID')",
            (deal_id,),
        )
        return {str(k): int(q) for k, q in cur.fetchall()}


def gate_check(env: dict[str, str], deal_id: int) -> None:
    done = subprocess.run(
        [GATE_BIN, "check", "--deal", str(deal_id)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"deal {deal_id}: OK" in done.stdout, done.stdout


async def assert_none_stuck(buyers: Buyers, rds: aioredis.Redis, gates: list[GateProcess]) -> None:
    """Every buyer got a definite answer; for one that did not, what Redis holds for
    its key and what the gates logged about its admission token."""
    if not buyers.stuck:
        return
    keys = deal_keys(buyers.deal_id)
    told = []
    for user, key in buyers.stuck[:3]:
        record = await rds.get(keys.idempotency(user, key))
        token = str(record).rsplit("|", 1)[-1] if record else ""
        marker = await rds.hget(keys.inflight, token) if token else None
        lines = [
            line for gate in gates for line in gate.output().splitlines() if token and token in line
        ]
        told.append(
            f"{key}: redis {record!r}, marker {marker!r}, last {buyers.last.get(key)!r},"
            f" logged {lines[-8:]}"
        )
    raise AssertionError(
        f"{len(buyers.stuck)} buyer(s) never answered within {BUYER_PATIENCE_SECONDS} s"
        f" ({buyers.retried}): " + "; ".join(told)
    )


async def assert_kept(
    galera: LocalGalera,
    settings: Settings,
    db: Database,
    rds: aioredis.Redis,
    env: dict[str, str],
    buyers: Buyers,
) -> dict[str, int]:
    """Every order a buyer got is a row on every live node, and nothing else is;
    the deal's counters balance and Redis agrees (gate check too)."""
    report = await assert_invariants(db, rds, buyers.deal_id, timeout_seconds=30)
    answered = set(buyers.orders.values())
    assert len(answered) == len(buyers.orders), "two buyers got one order"
    for i in range(galera.nodes):
        if galera.alive(i):
            rows = await asyncio.to_thread(
                rows_on, galera, i, settings.mysql.database, buyers.deal_id
            )
            assert set(rows) == answered, f"node{i}: {len(rows)} rows, {len(answered)} answered"
    await asyncio.to_thread(gate_check, env, buyers.deal_id)
    totals: dict[str, int] = report["totals"]
    return totals


async def test_writer_killed_for_good_mid_sale_keeps_every_201(
    cluster: LocalGalera,
    gates: list[GateProcess],
    buyers_client: Client,
    settings: Settings,
    db: Database,
    rds: aioredis.Redis,
    galera_env: dict[str, str],
) -> None:
    stock, crowd = 700, 2_500
    first = cluster.hosts[0]
    await wait_writers(gates, first)
    deal_id = await create_deal(buyers_client, stock=stock, buckets=8)
    buyers = Buyers(buyers_client, deal_id, user_base=71_000_000)

    sale = asyncio.create_task(buyers.crowd(crowd, concurrency=64))
    await buyers.wait_orders(stock // 5)
    await asyncio.to_thread(cluster.kill, 0)
    killed_at = time.monotonic()  # node0's process is gone (reaped)
    await sale
    await assert_none_stuck(buyers, rds, gates)

    resumed_seconds = buyers.first_201_sent_after(killed_at) - killed_at
    assert resumed_seconds < FAILOVER_SECONDS, (resumed_seconds, buyers.retried)
    assert not cluster.alive(0)
    assert all(w != first for w in [await writer_of(g) for g in gates])
    # Demand exceeded the stock: every unit sold once, every other buyer told so.
    assert len(buyers.orders) == stock
    assert len(buyers.orders) + buyers.sold_out == crowd
    totals = await assert_kept(cluster, settings, db, rds, galera_env, buyers)
    assert totals == {"total": stock, "available": 0, "held": stock, "sold": 0}


async def test_writer_restarted_rejoins_and_takes_the_writes_back(
    cluster: LocalGalera,
    gates: list[GateProcess],
    buyers_client: Client,
    settings: Settings,
    db: Database,
    rds: aioredis.Redis,
    galera_env: dict[str, str],
) -> None:
    first, second = cluster.hosts[0], cluster.hosts[1]
    await wait_writers(gates, first)
    deal_id = await create_deal(buyers_client, stock=1_000_000, buckets=8)
    buyers = Buyers(buyers_client, deal_id, user_base=72_000_000)
    buyers.start_stream(workers=16)
    try:
        await buyers.wait_orders(100)
        await asyncio.to_thread(cluster.kill, 0)
        killed_at = time.monotonic()
        moved_at = await wait_writers(gates, second)
        assert moved_at - killed_at < FAILOVER_SECONDS
        await buyers.wait_orders(len(buyers.orders) + 100)

        # node0 rejoins with its datadir (state transfer from a survivor) while the
        # sale goes on; the gates take it back only after the hold-down.
        await asyncio.to_thread(cluster.restart, 0)
        synced_at = time.monotonic()
        back_at = await wait_writers(gates, first)
        assert back_at - synced_at >= HOLD_DOWN_SECONDS - 1.0
        count = len(buyers.orders)
        await buyers.wait_orders(count + 100)
    finally:
        await buyers.finish()
    await assert_none_stuck(buyers, rds, gates)
    resumed_seconds = buyers.first_201_sent_after(killed_at) - killed_at
    assert resumed_seconds < FAILOVER_SECONDS, (resumed_seconds, buyers.retried)
    assert cluster.status(0).synced
    totals = await assert_kept(cluster, settings, db, rds, galera_env, buyers)
    assert totals["held"] == len(buyers.orders)


async def test_a_writer_partitioned_away_is_treated_as_down(
    cluster: LocalGalera,
    gates: list[GateProcess],
    buyers_client: Client,
    settings: Settings,
    db: Database,
    rds: aioredis.Redis,
    galera_env: dict[str, str],
) -> None:
    if not cluster.can_isolate():
        pytest.skip("the nodes refuse gmcast.isolate at run time (the wsrep_provider plugin)")
    first, second = cluster.hosts[0], cluster.hosts[1]
    await wait_writers(gates, first)
    deal_id = await create_deal(buyers_client, stock=1_000_000, buckets=8)
    buyers = Buyers(buyers_client, deal_id, user_base=73_000_000)
    buyers.start_stream(workers=16)
    try:
        await buyers.wait_orders(100)
        # node0 stays up and answers, but out of the group: non-Primary, not Synced.
        await asyncio.to_thread(cluster.isolate, 0)
        state = await asyncio.to_thread(cluster.wait_not_synced, 0)
        unsynced_at = time.monotonic()
        assert not state.synced and state.cluster_status != "Primary"
        moved_at = await wait_writers(gates, second)
        assert moved_at - unsynced_at < FAILOVER_SECONDS
        count = len(buyers.orders)
        await buyers.wait_orders(count + 100)

        await asyncio.to_thread(cluster.heal, 0)
        await wait_writers(gates, first)
        await buyers.wait_orders(len(buyers.orders) + 50)
    finally:
        await buyers.finish()
    await assert_none_stuck(buyers, rds, gates)
    totals = await assert_kept(cluster, settings, db, rds, galera_env, buyers)
    assert totals["held"] == len(buyers.orders)
