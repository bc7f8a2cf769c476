"""Lua scripts: loaded once at start-up, then called through one coalescing runner.

Every call made during one event-loop turn goes out in one pipeline (DESIGN lever 1:
×2 on a one-script endpoint), so a burst of buyers costs one Redis round trip per
turn instead of one per buyer. The pipeline is written as raw RESP on a connection
of the runner's own (gate/resp.py): redis-py's pipeline objects cost three times
the whole call.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gate.metrics import METRICS
from gate.resp import RespConnection

log = logging.getLogger("gate.scripts")

SCRIPT_SECONDS = METRICS.redis_script_seconds
REDIS_ERRORS = METRICS.redis_errors


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | ConnectionError | OSError):
        return "connection"
    if isinstance(exc, ResponseError):
        return "script"
    return "other"


LUA_DIR = Path(__file__).resolve().parent.parent / "lua"
SCRIPT_NAMES = (
    "admit",
    "limit",
    "confirm",
    "confirm_many",
    "compensate",
    "intend",
    "apply",
    "sync_deal",
    "lease",
    # Queue mode (gate/queue/).
    "queue_index",
    "enqueue",
    "queue_take",
    "queue_cancel",
)


class ScriptMissing(RuntimeError):
    """A script file is absent: start-up must stop."""


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str

    @functools.cached_property
    def seconds(self) -> Any:
        """Its `gate_redis_script_seconds` series, looked up once (prometheus-client's
        labels() takes a lock and builds a key on every call)."""
        return SCRIPT_SECONDS.labels(self.name)


def lua_dir() -> Path:
    # Installed as a package the lua/ folder sits next to gate/ in the source tree;
    # GATE_LUA_DIR lets a container or wheel install point elsewhere.
    import os

    return Path(os.environ.get("GATE_LUA_DIR", str(LUA_DIR)))


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


_Call = tuple[Script, Sequence[str], Sequence[Any], "asyncio.Future[Any]", float]


class ScriptRunner:
    """Runs scripts by name; calls issued in the same loop turn share one pipeline,
    written to one of a few raw RESP connections (gate/resp.py)."""

    def __init__(
        self,
        client: aioredis.Redis,
        scripts: dict[str, Script],
        batch_max: int,
        url: str,
        timeout_seconds: float,
        connections: int = 2,
    ) -> None:
        self.client = client
        self.scripts = scripts
        self.batch_max = batch_max
        self._conns = [RespConnection(url, timeout_seconds) for _ in range(max(1, connections))]
        self._pending: list[_Call] = []
        self._scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def load(self) -> None:
        """SCRIPT LOAD every script; a failure here stops start-up."""
        for script in self.scripts.values():
            sha = await self.client.script_load(script.source)
            if sha != script.sha:
                raise ScriptMissing(
                    f"Redis returned sha {sha} for {script.name}, expected {script.sha}"
                )

    def call(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._pending.append((self.scripts[name], keys, args, fut, time.perf_counter()))
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), self.batch_max):
            task = asyncio.get_running_loop().create_task(
                self._send(pending[i : i + self.batch_max])
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[_Call]) -> None:
        try:
            results = await self._execute(batch)
        except BaseException as exc:  # the whole pipeline failed: every caller learns why
            REDIS_ERRORS.labels(error_kind(exc)).inc(len(batch))
            for call in batch:
                fut = call[3]
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else RedisError(str(exc)))
            if not isinstance(exc, Exception):
                raise
            return
        retry = self._deliver(batch, results)
        if not retry:
            return
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

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for conn in self._conns:
            conn.close()


def make_redis(url: str, pool_max: int, timeout_seconds: float) -> aioredis.Redis:
    """A client that never retries on its own.

    redis-py retries failed commands by default, timeouts included. A timed-out
    admission may well have run, so re-sending it could take stock twice; the
    in-flight token, not a blind retry, decides what happened.
    """
    return aioredis.Redis.from_url(
        url,
        decode_responses=True,
        max_connections=pool_max,
        socket_timeout=timeout_seconds,
        socket_connect_timeout=timeout_seconds,
        health_check_interval=0,
        retry=Retry(NoBackoff(), 0),
    )
