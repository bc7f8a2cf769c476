"""`gate serve --workers N` (gate/cli/supervisor.py): a listening socket per worker, so
connections that arrive together spread over the workers; a port in use stops
start-up; a worker that dies is replaced."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time

import aiohttp
import pytest

from tests.support import GATE_BIN, GateProcess

pytestmark = pytest.mark.slow


def _workers(gate: GateProcess) -> set[int]:
    out = subprocess.run(
        ["pgrep", "-P", str(gate.proc.pid), "-f", "multiprocessing.spawn"],
        capture_output=True,
        text=True,
        check=False,
    )
    return {int(p) for p in out.stdout.split()}


async def _answering_processes(url: str, connections: int) -> set[str]:
    """The request-id prefixes (one per process) of answers over `connections`
    keep-alive connections opened at once."""
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in range(connections)
    ]
    try:

        async def ask(session: aiohttp.ClientSession) -> str:
            async with session.get(url + "/healthz") as r:
                assert r.status == 200
                return r.headers["X-Request-Id"].rsplit("-", 1)[0]

        return set(await asyncio.gather(*(ask(s) for s in sessions)))
    finally:
        await asyncio.gather(*(s.close() for s in sessions))


async def test_connections_opened_together_reach_every_worker(env: dict[str, str]) -> None:
    gate = GateProcess(env, workers=2, background=False)
    try:
        await asyncio.to_thread(gate.wait_ready)
        assert len(_workers(gate)) == 2
        # 32 connections hashed over two sockets all land on one with odds of 2^-31.
        answering = await _answering_processes(gate.url, 32)
        assert len(answering) == 2, (answering, gate.output()[-3000:])
    finally:
        assert gate.stop() == 0, gate.output()[-2000:]


async def test_a_port_in_use_stops_start_up(env: dict[str, str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            GATE_BIN,
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            "--no-background",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode != 0
    assert b"Address already in use" in out, out[-2000:]


async def test_a_killed_worker_is_replaced(env: dict[str, str]) -> None:
    gate = GateProcess(env, workers=2, background=False)
    try:
        await asyncio.to_thread(gate.wait_ready)
        before = _workers(gate)
        assert len(before) == 2
        victim = min(before)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            now = _workers(gate)
            if len(now) == 2 and victim not in now:
                break
            await asyncio.sleep(0.2)
        now = _workers(gate)
        assert len(now) == 2 and victim not in now, (before, now)
        await asyncio.to_thread(gate.wait_ready)
        # Both sockets answer again: the replacement joined the port's group.
        deadline = time.monotonic() + 20
        seen: set[str] = set()
        while len(seen) < 2 and time.monotonic() < deadline:
            seen |= await _answering_processes(gate.url, 32)
        assert len(seen) >= 2
    finally:
        assert gate.stop() == 0, gate.output()[-2000:]


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _all_answer(url: str, connections: int, timeout_seconds: float) -> bool:
    """Whether every one of `connections` new connections gets its /healthz answer."""
    timeout = aiohttp.ClientTimeout(total=timeout_seconds)
    sessions = [
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1), timeout=timeout)
        for _ in range(connections)
    ]
    try:

        async def ask(session: aiohttp.ClientSession) -> bool:
            try:
                async with session.get(url + "/healthz") as r:
                    return r.status == 200
            except (TimeoutError, aiohttp.ClientError):
                return False

        return all(await asyncio.gather(*(ask(s) for s in sessions)))
    finally:
        await asyncio.gather(*(s.close() for s in sessions))


async def test_a_hung_worker_is_killed_and_replaced(env: dict[str, str]) -> None:
    """A worker stopped by SIGSTOP keeps its socket in the port's group: without the
    heartbeat, its share of new connections waits forever."""
    gate = GateProcess({**env, "GATE_WORKER_TIMEOUT_SECONDS": "4"}, workers=2, background=False)
    victim = 0
    try:
        await asyncio.to_thread(gate.wait_ready)
        before = _workers(gate)
        assert len(before) == 2
        # Both workers serve (and so beat): one still starting has a longer grace.
        deadline = time.monotonic() + 30
        seen: set[str] = set()
        while len(seen) < 2 and time.monotonic() < deadline:
            seen |= await _answering_processes(gate.url, 32)
        assert len(seen) == 2
        victim = min(before)
        os.kill(victim, signal.SIGSTOP)
        # While it hangs, some of 32 new connections land on it (odds 2^-32 that none does).
        assert not await _all_answer(gate.url, 32, 1.0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = _workers(gate)
            if len(now) == 2 and victim not in now:
                break
            await asyncio.sleep(0.2)
        now = _workers(gate)
        assert len(now) == 2 and victim not in now, (before, now)
        # SIGKILLed (a stopped process cannot act on SIGTERM) and reaped by the supervisor.
        assert not _exists(victim)
        await asyncio.to_thread(gate.wait_ready)
        deadline = time.monotonic() + 30
        ok = False
        while not ok and time.monotonic() < deadline:
            ok = await _all_answer(gate.url, 32, 10.0)
        assert ok, gate.output()[-2000:]
        assert "has not answered for" in gate.output()
    finally:
        if victim and _exists(victim):
            os.kill(victim, signal.SIGCONT)
        assert gate.stop() == 0, gate.output()[-2000:]


def test_a_bad_worker_timeout_stops_start_up(env: dict[str, str]) -> None:
    for bad in ("0", "abc", "-1"):
        out = subprocess.run(
            [GATE_BIN, "serve", "--port", "1", "--workers", "2", "--no-background"],
            env={**env, "GATE_WORKER_TIMEOUT_SECONDS": bad},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert out.returncode == 2, out.stderr
        assert "GATE_WORKER_TIMEOUT_SECONDS" in out.stderr
