"""`gate serve` stopping (gate/cli/draining.py): on SIGTERM /readyz answers 503
"draining" at once while everything else is still served; a second stop request
ends the delay and the gate exits 0. A signal sent to the whole process group (as
systemd and a terminal do) is one stop request, not one per process.

The delay here is long (300 s): a gate that exits within the test's bounds did so
because the second request cut the delay short."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.support import Client, GateProcess, create_deal, reserve

pytestmark = pytest.mark.slow

LONG_DELAY = {"GATE_SHUTDOWN_DELAY_SECONDS": "300", "GATE_SHUTDOWN_GRACE_SECONDS": "5"}
WAIT_ROUNDS = 300  # of 0.1 s


async def _until_draining(client: Client) -> None:
    for _ in range(WAIT_ROUNDS):
        r = await client.get("/readyz")
        if r.status_code == 503:
            assert r.headers["Content-Type"] == "application/problem+json"
            body = r.json()
            assert body["code"] == "OVERLOADED" and body["draining"] is True, body
            assert "Draining" in body["detail"], body
            return
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.1)
    raise AssertionError("/readyz never reported draining")


async def _still_serving(client: Client, deal_id: int, user: int) -> None:
    assert (await client.get("/healthz")).status_code == 200
    r = await reserve(client, deal_id, user, f"drain-{deal_id}-{user}")
    assert r.status_code == 201, r.text


@pytest.mark.parametrize("workers", [1, 2])
async def test_sigterm_drains_and_a_second_one_ends_the_delay(
    env: dict[str, str], workers: int
) -> None:
    gate = GateProcess({**env, **LONG_DELAY}, workers=workers)
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        deal_id = await create_deal(client, stock=10)
        os.kill(gate.proc.pid, signal.SIGTERM)
        await _until_draining(client)
        # Draining is not stopped: balancers still sending are served.
        await _still_serving(client, deal_id, 9_700_001)
        assert gate.alive()
        os.kill(gate.proc.pid, signal.SIGTERM)
        status = await asyncio.to_thread(gate.proc.wait, 60)
    finally:
        await client.close()
        gate.stop()
    assert status == 0, gate.output()[-3000:]
    assert "draining: /readyz answers 503" in gate.output()


async def test_a_signal_to_the_process_group_is_one_stop_request(env: dict[str, str]) -> None:
    gate = GateProcess({**env, **LONG_DELAY}, workers=2)
    client = Client(gate.url)
    try:
        await asyncio.to_thread(gate.wait_ready)
        deal_id = await create_deal(client, stock=10)
        # The supervisor and each worker get it: still one request (the delay runs).
        os.killpg(gate.proc.pid, signal.SIGTERM)
        await _until_draining(client)
        await asyncio.sleep(1.0)
        await _still_serving(client, deal_id, 9_700_002)
        assert gate.alive()
        os.killpg(gate.proc.pid, signal.SIGTERM)
        status = await asyncio.to_thread(gate.proc.wait, 60)
    finally:
        await client.close()
        gate.stop()
    assert status == 0, gate.output()[-3000:]
