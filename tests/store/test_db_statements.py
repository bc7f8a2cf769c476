"""Cheap requests stay off the database.

What the database sees is counted by MariaDB itself: the gate under test connects
as a MariaDB user of its own, and `information_schema.USER_STATISTICS` (MariaDB's
`userstat`) counts that user's statements (SELECT + UPDATE + OTHER commands), so the
other sessions sharing the server, even other gates on it, do not disturb the count.
The gate's own idle traffic is measured over an idle window as long as the flood
and subtracted.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

import aiomysql
import pytest

from gate.base.settings import Settings
from gate.store.db import Database, connect_kwargs, notes_off
from tests.support import (
    ADMIN,
    Client,
    GateProcess,
    Resp,
    TcpProxy,
    buyer,
    create_deal,
    redis_client,
    reserve,
)

pytestmark = pytest.mark.slow

REQUESTS = 1000
CONCURRENCY = 16
WARM_UP = 50
BOUND_PER_REQUEST = 0.05


class StatementCounter:
    """Statements MariaDB ran for one user, from USER_STATISTICS."""

    def __init__(self, settings: Settings, user: str) -> None:
        self.settings = settings
        self.user = user

    async def count(self) -> int:
        conn = await aiomysql.connect(**connect_kwargs(self.settings.mysql, 5, with_db=False))
        try:
            async with conn.cursor() as cur:
                # Counting off would make every bound hold without measuring anything.
                await cur.execute("SELECT @@GLOBAL.userstat")
                row = await cur.fetchone()
                assert row is not None and row[0] in (1, "1", "ON"), "userstat was turned off"
                await cur.execute(
                    "SELECT SELECT_COMMANDS + UPDATE_COMMANDS + OTHER_COMMANDS"
                    " FROM information_schema.USER_STATISTICS WHERE USER = %s",
                    (self.user,),
                )
                row = await cur.fetchone()
                return int(row[0]) if row else 0
        finally:
            conn.close()


async def _root(settings: Settings, *statements: str) -> list[tuple[object, ...]]:
    conn = await aiomysql.connect(**connect_kwargs(settings.mysql, 5, with_db=False))
    try:
        rows: list[tuple[object, ...]] = []
        async with conn.cursor() as cur:
            await notes_off(cur)
            for sql in statements:
                await cur.execute(sql)
                rows = [tuple(r) for r in await cur.fetchall()]
        return rows
    finally:
        conn.close()


@contextmanager
def counted_user(settings: Settings, suffix: str = "") -> Iterator[tuple[str, StatementCounter]]:
    """A MariaDB user of its own for a gate under test (its URL) and its counter."""
    database = settings.mysql.database
    user = f"stmts{suffix}_{database}"[:32]
    password = secrets.token_hex(16)
    was_on = asyncio.run(_root(settings, "SELECT @@GLOBAL.userstat"))[0][0] in (1, "1", "ON")
    asyncio.run(
        _root(
            settings,
            "SET GLOBAL userstat = 1",
            f"DROP USER IF EXISTS '{user}'@'%'",
            f"CREATE USER '{user}'@'%' IDENTIFIED BY '{password}'",
            f"GRANT ALL ON `{database}`.* TO '{user}'@'%'",
            f"GRANT PROCESS ON *.* TO '{user}'@'%'",
        )
    )
    target = settings.mysql
    url = f"mysql://{user}:{password}@{target.host}:{target.port}/{database}"
    try:
        yield url, StatementCounter(settings, user)
    finally:
        cleanup = [f"DROP USER IF EXISTS '{user}'@'%'"]
        if not was_on:
            cleanup.append("SET GLOBAL userstat = 0")
        asyncio.run(_root(settings, *cleanup))


# The floods come from one address: the fairness document's limit per address is off.
COUNTED_ENV = {"GATE_ROOM_FAIRNESS_LIMIT": "off"}


@pytest.fixture(scope="module")
def counted_gate(
    env: dict[str, str], settings: Settings, prepared: None
) -> Iterator[tuple[GateProcess, StatementCounter]]:
    """A one-worker gate without background loops, connected as its own MariaDB user."""
    with counted_user(settings) as (url, counter):
        gate = GateProcess({**env, **COUNTED_ENV, "GATE_MYSQL_URL": url}, background=False)
        try:
            gate.wait_ready()
            yield gate, counter
        finally:
            gate.stop()


@pytest.fixture
async def client(counted_gate: tuple[GateProcess, StatementCounter]) -> AsyncIterator[Client]:
    async with Client(counted_gate[0].url) as c:
        yield c


async def _flood(send: Callable[[int], Awaitable[Resp]], n: int) -> list[Resp]:
    answers: list[Resp] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            answers.append(await send(i))

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return answers


async def _per_request(
    counter: StatementCounter, send: Callable[[int], Awaitable[Resp]], status: int
) -> float:
    """Statements per request under a flood, after a warm-up, less the idle rate."""
    for r in await _flood(send, WARM_UP):
        assert r.status_code == status, r.text
    before = await counter.count()
    started = time.monotonic()
    answers = await _flood(send, REQUESTS)
    flood_seconds = time.monotonic() - started
    during = await counter.count() - before
    assert [r.status_code for r in answers] == [status] * REQUESTS, {r.status_code for r in answers}
    assert all(r.headers["Content-Type"].startswith("application/") for r in answers)
    idle_before = await counter.count()
    await asyncio.sleep(flood_seconds)
    idle = await counter.count() - idle_before
    print(f"statements: {during} in the flood, {idle} idle")
    return max(0, during - idle) / REQUESTS


async def _highest_deal_id(settings: Settings) -> int:
    database = settings.mysql.database
    rows = await _root(settings, f"SELECT COALESCE(MAX(id), 0) FROM `{database}`.deals")
    return int(str(rows[0][0]))


async def test_unknown_deal_views_stay_off_the_database(
    client: Client, counted_gate: tuple[GateProcess, StatementCounter], settings: Settings
) -> None:
    floor = await _highest_deal_id(settings) + 1_000_000
    rng = random.Random(12)

    async def send(i: int) -> Resp:
        return await client.get(f"/v1/deals/{rng.randrange(floor, 2**62)}")

    per_request = await _per_request(counted_gate[1], send, 404)
    assert per_request <= BOUND_PER_REQUEST, per_request


async def test_readiness_checks_stay_off_the_database(
    client: Client, counted_gate: tuple[GateProcess, StatementCounter]
) -> None:
    async def send(i: int) -> Resp:
        return await client.get("/readyz")

    per_request = await _per_request(counted_gate[1], send, 200)
    assert per_request <= BOUND_PER_REQUEST, per_request
    body = (await client.get("/readyz")).json()
    assert body["checks"] == {"redis": "ok", "database": "ok"}


async def test_reservations_on_unknown_deals_stay_off_the_database(
    client: Client, counted_gate: tuple[GateProcess, StatementCounter], settings: Settings
) -> None:
    floor = await _highest_deal_id(settings) + 1_000_000
    rng = random.Random(34)

    async def send(i: int) -> Resp:
        return await reserve(client, rng.randrange(floor, 2**62), 7001, f"unknown-deal-{i:06d}")

    per_request = await _per_request(counted_gate[1], send, 404)
    assert per_request <= BOUND_PER_REQUEST, per_request


@pytest.mark.parametrize(
    ("method", "suffix"), [("POST", ""), ("GET", ""), ("DELETE", ""), ("GET", "/challenge")]
)
async def test_waiting_room_calls_on_unknown_deals_stay_off_the_database(
    client: Client,
    counted_gate: tuple[GateProcess, StatementCounter],
    settings: Settings,
    method: str,
    suffix: str,
) -> None:
    """Joins (POST), reads (GET), leaves (DELETE) and challenges of a waiting room on
    random unknown deal ids meet the unknown-deal guard as reservations and deal views
    do (gate/inventory/unknown_deals.py)."""
    floor = await _highest_deal_id(settings) + 1_000_000
    rng = random.Random(f"{method}{suffix}")
    headers = buyer(7004)

    async def send(i: int) -> Resp:
        return await client.request(
            method, f"/v1/deals/{rng.randrange(floor, 2**62)}/queue{suffix}", headers=headers
        )

    per_request = await _per_request(counted_gate[1], send, 404)
    assert per_request <= BOUND_PER_REQUEST, per_request


# -- a cold gate under a flood ------------------------------------------------------------

COLD_CONNECTIONS = 256
KNOWN_DEAL_STATEMENTS_MAX = 16


def _raw(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: gate", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _burst(url: str, requests: list[bytes]) -> list[int]:
    """Each request on a connection of its own: every connection is opened first, then
    every request written at once, so all of them reach the gate together."""
    where = urlsplit(url)
    conns = await asyncio.gather(
        *(asyncio.open_connection(where.hostname, where.port) for _ in requests)
    )
    for (_, writer), request in zip(conns, requests, strict=True):
        writer.write(request)

    async def status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        try:
            answer = await asyncio.wait_for(reader.read(), 60)
        finally:
            writer.close()
        return int(answer.split(b" ", 2)[1])

    return list(await asyncio.gather(*(status(r, w) for r, w in conns)))


def _cold_requests(floor: int, rng: random.Random) -> list[bytes]:
    """One request per connection on a random unknown deal id, every route that takes
    a deal id from an unknown client in turn."""
    who = buyer(7005)
    reserve_headers = {**who, "Content-Type": "application/json"}
    requests = []
    for i in range(COLD_CONNECTIONS):
        deal = f"/v1/deals/{rng.randrange(floor, 2**62)}"
        kind = i % 7
        if kind == 0:
            requests.append(_raw("GET", deal, {}))
        elif kind == 1:
            headers = {**reserve_headers, "Idempotency-Key": f"cold-start-{i:06d}"}
            requests.append(_raw("POST", deal + "/reservations", headers, b'{"quantity": 1}'))
        elif kind == 2:
            requests.append(_raw("POST", deal + "/queue", who))
        elif kind == 3:
            requests.append(_raw("GET", deal + "/queue", who))
        elif kind == 4:
            requests.append(_raw("GET", deal + "/queue/challenge", who))
        elif kind == 5:
            requests.append(_raw("GET", deal + "/queue/fairness", {}))
        else:
            requests.append(_raw("GET", "/room/" + deal.rsplit("/", 1)[1] + "/config", {}))
    return requests


async def _idle_rate(counter: StatementCounter, seconds: float) -> int:
    before = await counter.count()
    await asyncio.sleep(seconds)
    return await counter.count() - before


def test_a_cold_gate_flooded_on_unknown_deals_asks_the_database_a_constant_number(
    env: dict[str, str], settings: Settings, prepared: None
) -> None:
    """A gate just started (nothing remembered about unknown deals) takes 256
    connections at once, each a request for a random unknown deal on any route: the
    database sees a constant number of statements (the guard's one look-up of the
    highest deal id, shared), not one deal load per connection."""

    async def flood(gate: GateProcess, counter: StatementCounter) -> float:
        floor = await _highest_deal_id(settings) + 1_000_000
        requests = _cold_requests(floor, random.Random(1024))
        before = await counter.count()
        started = time.monotonic()
        statuses = await _burst(gate.url, requests)
        during = await counter.count() - before
        idle = await _idle_rate(counter, time.monotonic() - started)
        assert statuses == [404] * COLD_CONNECTIONS, sorted(set(statuses))
        print(f"cold start: {during} statements for {COLD_CONNECTIONS} requests, {idle} idle")
        return max(0, during - idle) / COLD_CONNECTIONS

    with counted_user(settings, "c") as (url, counter):
        gate = GateProcess({**env, **COUNTED_ENV, "GATE_MYSQL_URL": url}, background=False)
        try:
            gate.wait_ready()
            per_request = asyncio.run(flood(gate, counter))
        finally:
            gate.stop()
    assert per_request <= BOUND_PER_REQUEST, per_request


def test_a_cold_gate_flooded_on_one_known_deal_loads_it_once(
    env: dict[str, str], settings: Settings, prepared: None
) -> None:
    """A room deal whose Redis state is gone (a flush), on a gate just started: 256
    connections at once on every route that reads it cost one load of the deal and
    one read of its row (each a single flight), not one per connection."""

    async def prepare(gate: GateProcess) -> int:
        client = Client(gate.url)
        try:
            room = {"admit_per_second": 100, "challenge": {"min_bits": 1, "max_bits": 2}}
            deal_id = await create_deal(client, stock=10, waiting_room=room)
        finally:
            await client.close()
        rds = redis_client(env["GATE_REDIS_URL"])
        try:
            tag = f"{{d:{deal_id}}}"
            lost = [key async for key in rds.scan_iter(match=f"{tag}*", count=1000)]
            await rds.delete(*lost)
        finally:
            await rds.aclose()
        return deal_id

    async def flood(gate: GateProcess, counter: StatementCounter, deal_id: int) -> int:
        who = buyer(7006)
        deal = f"/v1/deals/{deal_id}"
        routes = [
            (_raw("GET", deal, {}), 200),
            (_raw("GET", deal + "/queue", who), 404),
            (_raw("GET", deal + "/queue/challenge", who), 200),
            (_raw("GET", deal + "/queue/fairness", {}), 200),
            (_raw("GET", f"/room/{deal_id}/config", {}), 200),
        ]
        chosen = [routes[i % len(routes)] for i in range(COLD_CONNECTIONS)]
        before = await counter.count()
        started = time.monotonic()
        statuses = await _burst(gate.url, [r for r, _ in chosen])
        during = await counter.count() - before
        idle = await _idle_rate(counter, time.monotonic() - started)
        assert statuses == [want for _, want in chosen], statuses
        print(f"one known deal: {during} statements for {COLD_CONNECTIONS} requests, {idle} idle")
        return max(0, during - idle)

    with counted_user(settings, "k") as (url, counter):
        setup = GateProcess({**env, **COUNTED_ENV}, background=False)
        try:
            setup.wait_ready()
            deal_id = asyncio.run(prepare(setup))
        finally:
            setup.stop()
        gate = GateProcess({**env, **COUNTED_ENV, "GATE_MYSQL_URL": url}, background=False)
        try:
            gate.wait_ready()
            statements = asyncio.run(flood(gate, counter, deal_id))
        finally:
            gate.stop()
    # One load (its snapshot, the room's and the codes' rows, the buyers: 8 or 9),
    # one read of the row for the views, one of the highest deal id, and maybe a
    # renewal of either if the flood outlasts a second: a constant, whatever the
    # number of connections (on 1fadcf7: 149).
    assert statements <= KNOWN_DEAL_STATEMENTS_MAX, statements


async def test_a_refused_buyer_re_clicking_stays_off_the_database(
    client: Client, counted_gate: tuple[GateProcess, StatementCounter]
) -> None:
    counter = counted_gate[1]
    before = await counter.count()
    deal_id = await create_deal(client, stock=100, per_user_limit=1, max_per_order=1)
    # The counter sees the gate's statements: a creation is a transaction of several.
    assert await counter.count() - before >= 5
    first = await reserve(client, deal_id, 7002, "limit-first")
    assert first.status_code == 201, first.text
    keys = (f"limit-again-{n:06d}" for n in range(10**6))

    async def at_limit(i: int) -> Resp:
        return await reserve(client, deal_id, 7002, next(keys))

    per_request = await _per_request(counter, at_limit, 422)
    assert per_request <= BOUND_PER_REQUEST, per_request

    async def above_max(i: int) -> Resp:
        return await reserve(client, deal_id, 7002, next(keys), quantity=2)

    per_request = await _per_request(counter, above_max, 400)
    assert per_request <= BOUND_PER_REQUEST, per_request

    # A real replay among the refusals still gets its first answer.
    replay = await reserve(client, deal_id, 7002, "limit-first")
    assert replay.status_code == 200 and replay.json()["order_id"] == first.json()["order_id"]


async def test_a_deal_created_after_its_id_was_unknown_is_found_at_once_everywhere(
    env: dict[str, str], prepared: None, settings: Settings
) -> None:
    """Two gate processes remember the next deal id as unknown; the deal is then
    created through one of them and both find it on the very next request."""
    gates = [GateProcess(env, background=False) for _ in range(2)]
    clients = [Client(g.url) for g in gates]
    try:
        for g in gates:
            g.wait_ready()
        rows = await _root(
            settings,
            "SELECT AUTO_INCREMENT FROM information_schema.TABLES"
            f" WHERE TABLE_SCHEMA = '{settings.mysql.database}' AND TABLE_NAME = 'deals'",
        )
        next_id = int(str(rows[0][0]))
        for c in clients:
            for _ in range(3):
                assert (await c.get(f"/v1/deals/{next_id}")).status_code == 404
                assert (await c.get(f"/v1/deals/{next_id + 5}")).status_code == 404
                r = await reserve(c, next_id, 7003, f"early-{secrets.token_hex(6)}")
                assert r.status_code == 404, r.text
        created = await clients[0].post(
            "/v1/admin/deals",
            json={"title": "Late", "unit_price": 100, "currency": "EUR", "stock": 5},
            headers=ADMIN,
        )
        assert created.status_code == 201, created.text
        assert created.json()["id"] == next_id
        for c in reversed(clients):
            view = await c.get(f"/v1/deals/{next_id}")
            assert view.status_code == 200, view.text
            assert view.json()["remaining_hint"] == 5
        r = await clients[1].post(
            f"/v1/deals/{next_id}/reservations",
            json={"quantity": 1},
            headers={**buyer(7003), "Idempotency-Key": "after-creation"},
        )
        assert r.status_code == 201, r.text
        assert (await clients[0].get(f"/v1/deals/{next_id + 5}")).status_code == 404
    finally:
        for c in clients:
            await c.close()
        for g in gates:
            g.stop()


async def test_the_user_limiter_judges_a_known_buyer_before_the_quantity_refusal(
    env: dict[str, str], prepared: None, db: Database
) -> None:
    """A buyer of the deal asking above the maximum makes the gate look their keys
    up: the per-user limiter judges that request first (it did only before the
    quota). Anyone else still gets the 400 before any limiter."""
    gate = GateProcess({**env, "GATE_LIMIT_USER": "3/m burst 3"}, background=False)
    client = Client(gate.url)
    try:
        gate.wait_ready()
        deal_id = await create_deal(client, stock=50, max_per_order=1)
        assert (await reserve(client, deal_id, 7101, "known-buyer-01")).status_code == 201
        answers = [
            (await reserve(client, deal_id, 7101, f"above-max-{i:04d}", quantity=2)).status_code
            for i in range(6)
        ]
        # One admission of three was spent on the purchase.
        assert answers == [400, 400, 429, 429, 429, 429], answers
        strangers = [
            (await reserve(client, deal_id, 7102, f"stranger-{i:04d}", quantity=2)).status_code
            for i in range(6)
        ]
        assert strangers == [400] * 6, strangers
        row = await db.fetchone("SELECT COUNT(*) FROM orders WHERE deal_id = %s", (deal_id,))
        assert row == (1,)
    finally:
        await client.close()
        gate.stop()


async def _ready(client: Client) -> Resp:
    return await client.get("/readyz")


async def test_readiness_still_sees_the_database_fail_and_recover(
    env: dict[str, str], prepared: None, settings: Settings
) -> None:
    """The kept database verdict lapses: a database cut is reported (503) and its
    return seen (200) without a restart."""
    proxy = TcpProxy(settings.mysql.host, settings.mysql.port)
    await proxy.start()
    target = settings.mysql
    password = target.password.reveal()
    login = f"{target.user}:{password}" if password else target.user
    url = f"mysql://{login}@127.0.0.1:{proxy.port}/{target.database}"
    gate = GateProcess({**env, "GATE_MYSQL_URL": url}, background=False)
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        ready = await _ready(client)
        assert ready.status_code == 200 and ready.json()["checks"]["database"] == "ok"
        proxy.cut()
        for _ in range(300):
            ready = await _ready(client)
            if ready.status_code != 200:
                break
            await asyncio.sleep(0.1)
        assert ready.status_code == 503, ready.text
        assert ready.json()["checks"]["database"].startswith("unavailable")
        assert ready.json()["checks"]["redis"] == "ok"
        proxy.restore()
        for _ in range(300):
            ready = await _ready(client)
            if ready.status_code == 200:
                break
            await asyncio.sleep(0.1)
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["database"] == "ok"
    finally:
        await client.close()
        gate.stop()
        await proxy.close()
