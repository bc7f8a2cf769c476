"""Session fixtures: a fresh test database and Redis, and real gate processes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from gate.base.settings import Settings, load_settings
from gate.runtime import Gate
from gate.store.db import Database
from gate.store.redis_mode import detect_mode, make_redis
from tests.cluster import cluster_clients_used, mark_cluster_clients_used
from tests.galera import LocalGalera
from tests.support import (
    CLUSTER_PORT,
    CLUSTER_RUN,
    GALERA_PORT,
    GALERA_RUN,
    Client,
    GateProcess,
    base_env,
    reset_stores,
)


@pytest.hookimpl(trylast=True)  # after pytest's own hook is installed: wrap it
def pytest_configure(config: pytest.Config) -> None:
    # redis-py's asyncio cluster client leaves the connection of a node it used while
    # discovering the cluster unclosed (a socket at garbage collection, not a failure
    # of the gate). Once a test has used such a client in this process (a cluster run,
    # tests/store/test_cluster.py), those ResourceWarnings are not turned into errors.
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if cluster_clients_used() and isinstance(unraisable.exc_value, ResourceWarning):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    if CLUSTER_RUN:
        mark_cluster_clients_used()
        config.addinivalue_line("filterwarnings", "ignore::ResourceWarning")


# A test needs Redis and MariaDB (the `integration` marker) when it asks, directly or
# through another fixture, for the suite's environment, or when its module reaches the
# services by itself (its own gate processes, connections or environment).
SERVICE_FIXTURES = frozenset({"env"})
SERVICE_MARKS = (
    "GateProcess",
    "base_env(",
    "GATE_TEST_MYSQL_URL",
    "GATE_TEST_REDIS_URL",
    "redis.asyncio",
    "aiomysql",
    "Database(",
)


def _reaches_services(path: Path, seen: dict[Path, bool]) -> bool:
    if path not in seen:
        text = path.read_text(encoding="utf-8") if path.suffix == ".py" else ""
        seen[path] = any(mark in text for mark in SERVICE_MARKS)
    return seen[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`pytest -m "not integration"` runs the pure tests alone, in seconds."""
    seen: dict[Path, bool] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & SERVICE_FIXTURES or _reaches_services(item.path, seen):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def galera() -> Iterator[LocalGalera | None]:
    """GATE_TEST_GALERA=1: a local 3-node MariaDB Galera cluster for the session
    (tests/galera.py; nodes at GATE_TEST_GALERA_PORT, +10, +20, default 18610), the
    suite's database on it (base_env names all three nodes). None otherwise."""
    if not GALERA_RUN:
        yield None
        return
    cluster = LocalGalera(GALERA_PORT)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def env(galera: LocalGalera | None) -> Iterator[dict[str, str]]:
    """The suite's environment. GATE_TEST_REDIS_CLUSTER=1 runs it against a local
    Redis Cluster started for the session (tests/cluster.py; 3 primaries, 3
    replicas on ports GATE_TEST_REDIS_CLUSTER_PORT.. +5, default 18510);
    GATE_TEST_GALERA=1 against a local Galera cluster (`galera`)."""
    variables = base_env()
    if not CLUSTER_RUN:
        yield variables
        return
    from tests.cluster import LocalCluster

    cluster = LocalCluster(CLUSTER_PORT)
    try:
        cluster.start()
        variables["GATE_REDIS_URL"] = cluster.url
        yield variables
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def settings(env: dict[str, str]) -> Settings:
    return load_settings(env)


def _redis(settings: Settings) -> aioredis.Redis:
    """A redis-py client for the suite's Redis, standalone or cluster as it is."""
    mode = detect_mode(settings.redis_url, settings.redis_mode, 2.0)
    client: aioredis.Redis = make_redis(settings.redis_url, 20, 5.0, mode)
    return client


@pytest.fixture(scope="session")
def prepared(settings: Settings) -> None:
    asyncio.run(reset_stores(settings))


@pytest.fixture(scope="session")
def gate(env: dict[str, str], prepared: None) -> Iterator[GateProcess]:
    """The shared gate: two worker processes, background loops on. On a cluster run
    a second `gate serve` shares the load (`client` alternates between the two)."""
    procs = [GateProcess(env, workers=2) for _ in range(2 if CLUSTER_RUN else 1)]
    try:
        for proc in procs:
            proc.wait_ready()
        procs[0].peers = [p.url for p in procs]
        procs[0].partners = procs[1:]
        yield procs[0]
    finally:
        for proc in procs:
            proc.stop()


@pytest.fixture
async def local_gate(settings: Settings, gate: GateProcess) -> AsyncIterator[Gate]:
    """An in-process gate without background loops, to drive its parts (mirror,
    sweeper, invariant monitor) directly beside the shared gate process."""
    g = Gate(settings)
    await g.start(background=False)
    try:
        yield g
    finally:
        await g.stop()


@pytest.fixture
async def client(gate: GateProcess) -> AsyncIterator[Client]:
    async with Client(gate.url, peers=gate.peers) as c:
        yield c


@pytest.fixture(scope="session")
async def db(settings: Settings, prepared: None) -> AsyncIterator[Database]:
    database = Database(settings, pool_max=20)
    await database.start()
    yield database
    await database.close()


@pytest.fixture(scope="session")
async def rds(settings: Settings, prepared: None) -> AsyncIterator[aioredis.Redis]:
    client = _redis(settings)
    yield client
    try:
        await client.aclose()
    except RuntimeError:
        # The cluster client's startup node may hold a connection of a closed loop
        # (see pytest_configure); nothing is left to close.
        if not CLUSTER_RUN:
            raise
