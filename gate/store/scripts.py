"""Lua scripts: loaded once at start-up, then called through one coalescing runner.

Every call made during one event-loop turn goes out in one pipeline (DESIGN lever 1:
×2 on a one-script endpoint), so a burst of buyers costs one Redis round trip per
turn instead of one per buyer. The pipeline is written as raw RESP on a connection
of the runner's own (gate/store/resp.py): redis-py's pipeline objects cost three times
the whole call.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.resources
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gate.base import tracing
from gate.base.metrics import METRICS, HistogramTally
from gate.base.redis_url import parse_redis_url
from gate.store.batcher import TurnBatcher
from gate.store.resp import RespConnection

log = logging.getLogger("gate.scripts")

SCRIPT_SECONDS = METRICS.redis_script_seconds
# One tally per script name and process (gate/base/metrics.py): a call's latency is kept
# as a bucket count and added to the histogram every TALLY_FLUSH_SECONDS, instead of
# prometheus-client's lock and, under several workers, a write to the shared file per
# call (2.8 against 0.2 µs an observation); there are as many as SCRIPT_NAMES and the
# room's own call.
_SCRIPT_TALLIES: dict[str, HistogramTally] = {}


def script_seconds(name: str) -> HistogramTally:
    """The `gate_redis_script_seconds{script=name}` tally of this process."""
    tally = _SCRIPT_TALLIES.get(name)
    if tally is None:
        tally = _SCRIPT_TALLIES[name] = METRICS.histogram_tally(SCRIPT_SECONDS.labels(name))
    return tally


REDIS_ERRORS = METRICS.redis_errors

# Scripts a request starts for the near-cache's upkeep (a sold-out answer renewing the
# entry): traced under a request already traced, never deciding an undecided one, so
# that a sold-out answer stays untraced unless its caller asked (gate/base/tracing.py).
UPKEEP_SCRIPTS = frozenset({"soldout_renew"})
_SPAN_ATTRIBUTES: dict[str, dict[str, Any]] = {}


def _trace(name: str, fut: asyncio.Future[Any]) -> None:
    """A script call's client span, from the call to its reply."""
    attributes = _SPAN_ATTRIBUTES.get(name)
    if attributes is None:
        attributes = _SPAN_ATTRIBUTES[name] = {
            "db.system.name": "redis",
            "db.operation.name": "EVALSHA",
            "db.query.summary": f"EVALSHA {name}",
            "gate.redis.script": name,
        }
    live = tracing.start(
        f"EVALSHA {name}",
        tracing.CLIENT,
        attributes,
        materialize=name not in UPKEEP_SCRIPTS,
    )
    if live is not None:
        fut.add_done_callback(lambda done: _traced_reply(live, done))


def _traced_reply(live: tracing.Live, done: asyncio.Future[Any]) -> None:
    if done.cancelled():
        tracing.end(live, asyncio.CancelledError())
    else:
        # (Marks the error retrieved; the caller awaits the same future anyway.)
        tracing.end(live, done.exception())


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | ConnectionError | OSError):
        return "connection"
    if isinstance(exc, ResponseError):
        return "script"
    return "other"


# The scripts are the data package gate.lua (lua/ in a checkout, pyproject.toml
# package-dir), found alike in a checkout and in an installed wheel; GATE_LUA_DIR
# points elsewhere (a patched copy, a test's directory).
LUA_DIR = Path(str(importlib.resources.files("gate.lua")))
SCRIPT_NAMES = (
    "admit",
    "deal_parts",
    "deal_avail",
    "limit",
    "confirm",
    "confirm_many",
    "soldout_renew",
    "compensate",
    "intend",
    "apply",
    "sync_deal",
    "lease",
    "work_lease",
    "work_lease_release",
    # Queue mode (gate/queuemode/).
    "queue_index",
    "enqueue",
    "queue_take",
    "queue_cancel",
    "queue_reject",
    "queue_ack",
    "queue_locate",
    "queue_peek",
)


class ScriptMissing(RuntimeError):
    """A script file is absent: start-up must stop."""


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str

    @functools.cached_property
    def seconds(self) -> HistogramTally:
        """Its `gate_redis_script_seconds` series' tally (`script_seconds`), looked up
        once."""
        return script_seconds(self.name)


def lua_dir() -> Path:
    return Path(os.environ.get("GATE_LUA_DIR") or LUA_DIR)


def read_scripts(directory: Path | None = None) -> dict[str, Script]:
    base = directory or lua_dir()
    scripts: dict[str, Script] = {}
    for name in SCRIPT_NAMES:
        path = base / f"{name}.lua"
        if not path.is_file():
            raise ScriptMissing(f"Lua script {path} is missing; refusing to start")
        source = path.read_text(encoding="utf-8")
        sha = hashlib.sha1(source.encode("utf-8")).hexdigest()
        scripts[name] = Script(name, source, sha)
    return scripts


# Read-only scripts run outside the hot path by code that holds a redis-py client
# rather than the runner (`gate check`: lua/deal_state.lua, lua/room_state.lua).
_READ_SOURCES: dict[str, str] = {}


async def read_call(client: Any, name: str, keys: Sequence[str]) -> Any:
    """Run the read-only script lua/<name>.lua with EVAL on `client` (one Redis, or a
    cluster client, which routes it by its keys' slot): several reads in one step."""
    source = _READ_SOURCES.get(name)
    if source is None:
        source = _READ_SOURCES[name] = lua_source(name)
    return await client.eval(source, len(keys), *keys)


def lua_source(name: str) -> str:
    """The text of lua/<name>.lua, for code that runs it through a redis-py client
    (`register_script`) rather than the runner; ScriptMissing when absent."""
    path = lua_dir() / f"{name}.lua"
    if not path.is_file():
        raise ScriptMissing(f"Lua script {path} is missing; refusing to start")
    return path.read_text(encoding="utf-8")


_Call = tuple[Script, Sequence[str], Sequence[Any], "asyncio.Future[Any]", float]
_Addr = tuple[str, int]

CLUSTER_SLOTS = 16384
# A call redirected (MOVED, ASK) or told TRYAGAIN more often than this fails.
REDIRECTS_MAX = 5
TRYAGAIN_SECONDS = 0.05
# The slot map is asked again at most this often (a failover makes every caller
# of the lost node ask at once).
REFRESH_MIN_SECONDS = 0.2
# Nodes the runner ever learned of (a cluster of thousands is not a thing).
NODES_MAX = 1000
# After a node failed, the slot map is read again this often, for at most this long,
# while it still names that node (`_until_replaced`).
FAILED_NODE_REREAD_SECONDS = 1.0
FAILED_NODE_WATCH_SECONDS = 60.0


def _redirect(result: Any) -> tuple[str, int, _Addr | None] | None:
    """("MOVED" | "ASK", slot, address) of a redirection, ("TRYAGAIN", 0, None), or
    None. Each means the script did not run."""
    if not isinstance(result, ResponseError) or isinstance(result, NoScriptError):
        return None
    text = str(result)
    if text.startswith(("MOVED ", "ASK ")):
        kind, slot, addr = text.split(" ", 2)
        host, _, port = addr.rpartition(":")
        return kind, int(slot), (host, int(port))
    if text.startswith("TRYAGAIN"):
        return "TRYAGAIN", 0, None
    return None


class ScriptRunner:
    """Runs scripts by name; calls issued in the same loop turn share one pipeline,
    written to one of a few raw RESP connections (gate/store/resp.py).

    On Redis Cluster (mode "cluster") the runner keeps the cluster's slot map and a
    few connections per primary; each loop turn's batch is split per node and the
    parts go out at once, still one round trip. A `MOVED` reply (the slot moved: the
    script did not run) refreshes the map and re-sends the call to the named node;
    `ASK` (a slot being migrated) re-sends it there after `ASKING`; `TRYAGAIN`
    re-sends after a short pause. Nothing else is ever re-sent: a call whose
    connection failed or timed out may have run (the in-flight token decides)."""

    def __init__(
        self,
        client: aioredis.Redis,
        scripts: dict[str, Script],
        batch_max: int,
        url: str,
        timeout_seconds: float,
        connections: int = 2,
        mode: str = "standalone",
        flush_every: int = 0,
        nodes: Sequence[tuple[str, int]] = (),
    ) -> None:
        self.client = client
        self.scripts = scripts
        self.batch_max = batch_max
        # Calls waiting when a batch is written before the loop turn ends (0: at the
        # end of the turn only). Redis starts on the first requests of a crowded
        # turn while the gate still parses the rest, instead of idling until all are.
        self.flush_every = flush_every if flush_every > 0 else batch_max
        self.cluster = mode == "cluster"
        self._url = url
        self._timeout = timeout_seconds
        self._per_node = max(1, connections)
        self._conns = (
            []
            if self.cluster
            else [RespConnection(url, timeout_seconds) for _ in range(self._per_node)]
        )
        # Every call of one loop turn, one group (in chunks of batch_max).
        self._calls: TurnBatcher[None, _Call] = TurnBatcher(
            self._write, batch_max, self.flush_every
        )
        self._tasks: set[asyncio.Task[None]] = set()
        # Cluster mode: slot -> primary address, connections per node, every node
        # seen (primaries and replicas: where to ask for the map after a failover).
        self._slots: list[_Addr | None] = [None] * CLUSTER_SLOTS
        self._node_conns: dict[_Addr, list[RespConnection]] = {}
        target = parse_redis_url(url)
        # The URL's node, then the other nodes named to start from
        # (GATE_REDIS_CLUSTER_NODES): the slot map is asked of the first that answers.
        self._known: dict[_Addr, None] = {(target.host, target.port): None}
        self._known.update((node, None) for node in nodes)
        self._refreshing: asyncio.Future[None] | None = None
        # Nodes that failed, watched until the map no longer names them.
        self._watchers: dict[_Addr, asyncio.Task[None]] = {}
        # Told the names (node_of) of the primaries serving slots after every read of
        # the slot map: a node that failed over serves nothing any more.
        self.slot_map_listeners: list[Callable[[frozenset[str]], None]] = []
        self._refreshed_at = -REFRESH_MIN_SECONDS
        self.slot_map_refreshes = 0
        self.redirects = 0

    # -- cluster slot map ------------------------------------------------------------

    def node_of(self, key: str) -> str:
        """The name of the node a call on `key` goes to now ("redis" standalone):
        the reservations keep one breaker per name."""
        if not self.cluster:
            return "redis"
        addr = self._slots[key_slot(key.encode())]
        return "redis" if addr is None else f"redis {addr[0]}:{addr[1]}"

    def _conn_for(self, addr: _Addr) -> RespConnection:
        conns = self._node_conns.get(addr)
        if conns is None:
            if len(self._node_conns) >= NODES_MAX:
                raise RedisConnectionError("too many Redis Cluster nodes")
            conns = self._node_conns[addr] = [
                RespConnection(self._url, self._timeout, addr) for _ in range(self._per_node)
            ]
        return min(conns, key=lambda c: (not c.connected, c.pending))

    async def refresh(self, force: bool = False) -> None:
        """Read the slot map (CLUSTER SLOTS) from the first node that answers."""
        if self._refreshing is not None:
            return await asyncio.shield(self._refreshing)
        loop = asyncio.get_running_loop()
        if not force and loop.time() - self._refreshed_at < REFRESH_MIN_SECONDS:
            return
        self._refreshing = loop.create_future()
        try:
            await self._refresh()
            self._refreshing.set_result(None)
        except BaseException as exc:
            self._refreshing.set_exception(exc)
            self._refreshing.exception()
            raise
        finally:
            self._refreshing = None
            self._refreshed_at = loop.time()

    async def _refresh(self) -> None:
        last: Exception | None = None
        # The nodes last seen serving slots first, then the others (the URL's, replicas).
        primaries = {a: None for a in self._slots if a is not None}
        for addr in [*primaries, *(a for a in self._known if a not in primaries)]:
            try:
                conn = self._conn_for(addr)
                await conn.connect()
                (reply,) = await asyncio.gather(*conn.send([("CLUSTER", "SLOTS")]))
                if isinstance(reply, Exception):
                    raise reply
            except (RedisError, OSError) as exc:
                last = exc
                continue
            slots: list[_Addr | None] = [None] * CLUSTER_SLOTS
            for entry in reply:
                start, end, primary = int(entry[0]), int(entry[1]), entry[2]
                host = str(primary[0]) or addr[0]
                node = (host, int(primary[1]))
                slots[start : end + 1] = [node] * (end - start + 1)
                for member in entry[2:]:
                    if len(self._known) < NODES_MAX:
                        self._known[(str(member[0]) or addr[0], int(member[1]))] = None
            self._slots = slots
            self.slot_map_refreshes += 1
            serving = frozenset(f"redis {a[0]}:{a[1]}" for a in {a for a in slots if a})
            for listener in self.slot_map_listeners:
                listener(serving)
            return
        raise RedisConnectionError(f"no Redis Cluster node gave its slot map: {last!r}")

    def _refresh_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._refresh_quietly())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def probe(self, name: str) -> bool:
        """A breaker's probe with no call to make it (`Breakers.probe`, gate/reserve/breaker.py):
        does the node named as `node_of` names it answer, and, on Redis Cluster, say
        its cluster is ok (a node answers PING while it refuses every key, CLUSTERDOWN,
        during a failover)? Redis's own reply deadline bounds it."""
        if self.cluster and name == "redis":
            # The breaker of calls made before the slot map was known: the map read.
            try:
                await self.refresh(force=True)
            except (RedisError, OSError):
                return False
            return any(addr is not None for addr in self._slots)
        try:
            if self.cluster:
                host, _, port = name.removeprefix("redis ").rpartition(":")
                conn = self._conn_for((host, int(port)))
                command: tuple[str, ...] = ("CLUSTER", "INFO")
            else:
                conn = min(self._conns, key=lambda c: (not c.connected, c.pending))
                command = ("PING",)
            await conn.connect()
            (reply,) = await asyncio.gather(*conn.send([command]))
        except (RedisError, OSError, ValueError):
            return False
        if isinstance(reply, Exception):
            return False
        return not self.cluster or b"cluster_state:ok" in (
            reply if isinstance(reply, bytes) else str(reply).encode()
        )

    def _watch_failed(self, addr: _Addr) -> None:
        if addr in self._watchers or len(self._watchers) >= NODES_MAX:
            return
        task = asyncio.get_running_loop().create_task(self._until_replaced(addr))
        self._watchers[addr] = task
        task.add_done_callback(lambda _: self._watchers.pop(addr, None))

    async def _until_replaced(self, addr: _Addr) -> None:
        """A node failed. The map read at once may still name it (its replica not
        promoted yet), and nothing reads the map again unless a call goes to one of
        its slots: after a sale ends, a gate would keep the dead node's slots, and
        its breaker would stay open (/readyz "degraded") for good. So the map is read
        again every FAILED_NODE_REREAD_SECONDS while it names that node, for at most
        FAILED_NODE_WATCH_SECONDS (a node that came back is read as serving: the
        watch then just ends)."""
        loop = asyncio.get_running_loop()
        ends = loop.time() + FAILED_NODE_WATCH_SECONDS
        while addr in self._slots and loop.time() < ends:
            await asyncio.sleep(FAILED_NODE_REREAD_SECONDS)
            await self._refresh_quietly(force=True)

    async def _refresh_quietly(self, force: bool = False) -> None:
        try:
            await self.refresh(force)
        except Exception as exc:
            log.warning("redis cluster slot map not refreshed: %r", exc)

    async def load(self) -> None:
        """SCRIPT LOAD every script (on every primary of a cluster); a failure here
        stops start-up."""
        if self.cluster:
            await self.refresh(force=True)
            for addr in {a: None for a in self._slots if a is not None}:
                conn = self._conn_for(addr)
                await conn.connect()
                replies = await asyncio.gather(
                    *conn.send([("SCRIPT", "LOAD", s.source) for s in self.scripts.values()])
                )
                for script, sha in zip(self.scripts.values(), replies, strict=True):
                    if isinstance(sha, Exception):
                        raise sha
                    if sha != script.sha:
                        raise ScriptMissing(
                            f"Redis returned sha {sha} for {script.name}, expected {script.sha}"
                        )
            return
        for script in self.scripts.values():
            sha = await self.client.script_load(script.source)
            if sha != script.sha:
                raise ScriptMissing(
                    f"Redis returned sha {sha} for {script.name}, expected {script.sha}"
                )

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.add(None, (self.scripts[name], keys, args, fut, time.perf_counter()))
        if tracing.ENABLED:
            _trace(name, fut)
        return fut

    def _write(self, groups: list[tuple[None, list[_Call]]]) -> None:
        for _, batch in groups:
            if not self.cluster and self._write_now(batch):
                continue
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _write_now(self, batch: list[_Call]) -> bool:
        """Standalone, a connection open: the batch written in this loop turn, its
        replies delivered by a callback on its last future (no task per batch).
        False when no connection is open: `_send` connects first."""
        conn = min(self._conns, key=lambda c: (not c.connected, c.pending))
        if not conn.connected:
            return False
        try:
            futures = conn.send(
                [("EVALSHA", sc.sha, len(keys), *keys, *args) for sc, keys, args, _, _ in batch]
            )
        except RedisError:
            return False  # closed meanwhile: `_send` reconnects or fails the callers
        futures[-1].add_done_callback(lambda last: self._replied(batch, futures, last))
        return True

    def _replied(
        self, batch: list[_Call], futures: list[asyncio.Future[Any]], last: asyncio.Future[Any]
    ) -> None:
        # Replies resolve in order and a failed connection fails every pending
        # future at once: the last one's outcome is the batch's.
        exc = RedisConnectionError("cancelled") if last.cancelled() else last.exception()
        if exc is not None:
            for fut in futures:  # retrieved: each failed with the connection
                if not fut.cancelled():
                    fut.exception()
            self._fail(batch, exc)
            return
        retry = self._deliver(batch, [f.result() for f in futures])
        if retry:
            task = asyncio.get_running_loop().create_task(self._reload_and_retry(retry))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _fail(batch: list[_Call], exc: BaseException) -> None:
        """The whole pipeline failed: every caller learns why."""
        REDIS_ERRORS.labels(error_kind(exc)).inc(len(batch))
        for call in batch:
            fut = call[3]
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, Exception) else RedisError(str(exc)))

    async def _send(self, batch: list[_Call]) -> None:
        try:
            results = await self._execute(batch)
        except BaseException as exc:
            self._fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        retry = self._deliver(batch, results)
        if retry:
            await self._reload_and_retry(retry)

    async def _reload_and_retry(self, retry: list[_Call]) -> None:
        # NOSCRIPT means the script did not run (Redis restarted or was flushed of
        # scripts), so re-running it after a reload cannot apply anything twice.
        log.warning("redis lost %d script(s); reloading", len(retry))
        try:
            await self.load()
            results = await self._execute(retry)
        except Exception as exc:
            for call in retry:
                if not call[3].done():
                    call[3].set_exception(exc)
            return
        for call in self._deliver(retry, results):
            if not call[3].done():
                call[3].set_exception(NoScriptError("script missing after reload"))

    @staticmethod
    def _deliver(batch: list[_Call], results: list[Any]) -> list[_Call]:
        """Hand each caller its result; return the calls that met NOSCRIPT."""
        missing: list[_Call] = []
        now = time.perf_counter()
        for call, result in zip(batch, results, strict=True):
            fut = call[3]
            if fut.done():
                continue
            if isinstance(result, NoScriptError):
                missing.append(call)
                continue
            call[0].seconds.observe(now - call[4])
            if isinstance(result, Exception):
                REDIS_ERRORS.labels(error_kind(result)).inc()
                fut.set_exception(result)
            else:
                fut.set_result(result)
        return missing

    async def _execute(self, batch: list[_Call]) -> list[Any]:
        if self.cluster:
            return await self._execute_cluster(batch)
        conn = min(self._conns, key=lambda c: (not c.connected, c.pending))
        if not conn.connected:
            await conn.connect()
        futures = conn.send(
            [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _, _ in batch]
        )
        # Replies resolve in the order sent, and a failed connection fails every
        # future still pending at once: when the last is done, all are (no gather, so
        # no callback per command).
        await futures[-1]
        return [f.result() for f in futures]

    async def _execute_cluster(self, batch: list[_Call]) -> list[Any]:
        """One result per call (an exception object for a failed one): the batch split
        per primary, the parts sent at once; redirections re-sent (module doc)."""
        if all(a is None for a in self._slots):
            await self.refresh(force=True)
        results: list[Any] = [None] * len(batch)
        todo = list(range(len(batch)))
        asking: dict[int, _Addr] = {}
        for attempt in range(REDIRECTS_MAX + 1):
            groups: dict[tuple[_Addr, bool], list[int]] = {}
            for i in todo:
                keys = batch[i][1]
                addr = asking.get(i)
                if addr is None:
                    addr = self._slots[key_slot(keys[0].encode())] if keys else None
                if addr is None:
                    results[i] = RedisConnectionError("no Redis Cluster node serves this slot")
                    continue
                groups.setdefault((addr, i in asking), []).append(i)
            asking = {}
            await asyncio.gather(
                *(
                    self._send_node(addr, ask, idx, batch, results)
                    for (addr, ask), idx in groups.items()
                )
            )
            todo = []
            pause = False
            for i in (i for idx in groups.values() for i in idx):
                redirect = _redirect(results[i])
                if redirect is None:
                    continue
                kind, slot, addr = redirect
                if attempt == REDIRECTS_MAX:
                    continue  # the error stays the caller's answer
                self.redirects += 1
                todo.append(i)
                if kind == "MOVED":
                    assert addr is not None
                    self._slots[slot] = addr
                    if len(self._known) < NODES_MAX:
                        self._known[addr] = None
                    self._refresh_soon()
                elif kind == "ASK":
                    assert addr is not None
                    asking[i] = addr
                else:
                    pause = True
            if not todo:
                break
            if pause:
                await asyncio.sleep(TRYAGAIN_SECONDS)
        return results

    async def _send_node(
        self, addr: _Addr, ask: bool, idx: list[int], batch: list[_Call], results: list[Any]
    ) -> None:
        commands: list[Sequence[Any]] = []
        for i in idx:
            script, keys, args = batch[i][0], batch[i][1], batch[i][2]
            if ask:
                commands.append(("ASKING",))
            commands.append(("EVALSHA", script.sha, len(keys), *keys, *args))
        try:
            conn = self._conn_for(addr)
            await conn.connect()
            replies = list(await asyncio.gather(*conn.send(commands)))
        except Exception as exc:
            # The node failed (a failover, perhaps): the map is asked again; these calls
            # may have run and are never re-sent.
            self._refresh_soon()
            self._watch_failed(addr)
            for i in idx:
                results[i] = exc
            return
        if ask:
            replies = replies[1::2]
        for i, reply in zip(idx, replies, strict=True):
            results[i] = reply

    async def aclose(self) -> None:
        watchers = list(self._watchers.values())
        for watcher in watchers:
            watcher.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in self._conns:
            conn.close()
        for conns in self._node_conns.values():
            for conn in conns:
                conn.close()
