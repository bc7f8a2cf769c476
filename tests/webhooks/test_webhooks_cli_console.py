"""`gate webhooks …` from a shell, and the console's Webhooks panel with its Retry."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.console_support import console_env, sign_in
from tests.support import GATE_BIN, Client, GateProcess
from tests.webhooks_support import Receiver, no_endpoints_left, verify, wait_for, webhook_env

ENV = webhook_env(GATE_WEBHOOK_RETRY_SCHEDULE="0.1,0.1")
pytestmark = pytest.mark.usefixtures("no_endpoints_left")
__all__ = ["no_endpoints_left"]


def _gate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GATE_BIN, "webhooks", *args],
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def gate(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The command in a thread: the receiver in this event loop keeps answering."""
    return await asyncio.to_thread(_gate, *args, env=env)


async def gate_json(*args: str) -> Any:
    done = await gate(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def serving(prepared: None) -> Iterator[GateProcess]:
    with GateProcess(console_env(ENV), workers=1) as proc:
        yield proc


async def test_the_commands_do_what_the_api_does(serving: GateProcess) -> None:
    failing = [True]

    async def policy(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        return (500 if failing[0] else 200), {}, 0.0

    receiver = Receiver(policy)
    await receiver.start()
    try:
        made = await gate_json(
            "create",
            "--url",
            receiver.url,
            "--events",
            "payment.quarantined",
            "--description",
            "cli",
        )
        endpoint_id = made["id"]
        assert made["secret"].startswith("whsec_") and made["description"] == "cli"
        plain = await gate("show", endpoint_id)
        assert plain.returncode == 0 and endpoint_id in plain.stdout
        assert made["secret"] not in plain.stdout
        listed = (await gate_json("list"))["endpoints"]
        assert endpoint_id in {e["id"] for e in listed}
        # A test event sent by the serving gate; it fails until the receiver is fixed.
        sent = await gate_json("test", endpoint_id)
        assert sent["status"] == "pending"

        async def failed() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = (
                await gate_json("deliveries", endpoint_id, "--status", "failed")
            )["deliveries"]
            return found

        (delivery,) = await wait_for(failed, 20, 0.3)
        assert delivery["event_id"] == sent["event_id"] and len(delivery["attempts"]) == 3
        text = await gate("deliveries", endpoint_id, "--limit", "5")
        assert text.returncode == 0 and "HTTP 500" in text.stdout
        failing[0] = False
        again = await gate("retry", endpoint_id, str(delivery["id"]))
        assert again.returncode == 0, again.stderr
        await wait_for(lambda: receiver.delivered(), 20)
        rotated = (await gate_json("rotate", endpoint_id))["secret"]
        assert (await gate_json("test", endpoint_id))["status"] == "pending"
        await wait_for(lambda: len(receiver.delivered()) == 2, 20)
        verify(rotated, receiver.received[-1])
        verify(made["secret"], receiver.received[-1])
        assert (await gate_json("disable", endpoint_id))["status"] == "disabled"
        assert (await gate_json("enable", endpoint_id))["status"] == "enabled"
        # Refusals: exit 1 with the problem's code; bad arguments: exit 2.
        missing = await gate("show", "01JD3W9K2XG5W7Q8M4Z6V1R0TB")
        assert missing.returncode == 1 and "WEBHOOK_ENDPOINT_NOT_FOUND" in missing.stderr
        refused = await gate("create", "--url", "https://169.254.169.254/", "--events", "*")
        assert refused.returncode == 1 and "WEBHOOK_URL_REFUSED" in refused.stderr
        unknown = await gate("create", "--url", receiver.url, "--events", "order.nope")
        assert unknown.returncode == 1 and "INVALID_REQUEST" in unknown.stderr
        assert (await gate("deliveries", endpoint_id, "--limit", "101")).returncode == 2
        assert (await gate("retry", endpoint_id, "0")).returncode == 2
        assert (await gate("frobnicate")).returncode == 2
        no_key = {**ENV, "GATE_WEBHOOK_ENCRYPTION_KEY": "short"}
        assert (await gate("list", env=no_key)).returncode == 2
    finally:
        await receiver.stop()


async def test_the_console_panel_shows_endpoints_and_retries(serving: GateProcess) -> None:
    async def refuse(msg_id: str, attempt: int) -> tuple[int, dict[str, str], float]:
        return (503 if attempt <= 3 else 200), {}, 0.0

    receiver = Receiver(refuse)
    await receiver.start()
    client = Client(serving.url)
    try:
        made = await gate_json("create", "--url", receiver.url, "--events", "order.paid")
        await gate_json("test", made["id"])
        _, session = await sign_in(client)
        assert session is not None

        async def panel() -> dict[str, Any] | None:
            snap = (await client.get("/console/api/snapshot", headers=session.read())).json()
            hooks: dict[str, Any] | None = snap.get("panels", {}).get("webhooks")
            if hooks and any(f["endpoint_id"] == made["id"] for f in hooks["failed"]):
                return hooks
            return None

        hooks = await wait_for(panel, 30, 0.5)
        row = next(e for e in hooks["endpoints"] if e["id"] == made["id"])
        assert row["status"] == "enabled" and row["failed"] == 1
        assert row["success_rate_24h"] == 0.0 and row["attempts_24h"] == 3
        (failed,) = [f for f in hooks["failed"] if f["endpoint_id"] == made["id"]]
        action = "/console/api/panels/webhooks/retry"
        body = {"endpoint_id": made["id"], "delivery_id": failed["id"]}
        # The CSRF token is required; bad bodies are 4xx.
        r = await client.post(action, json=body, headers=session.read())
        assert r.status_code == 403
        for bad in ({}, {"endpoint_id": made["id"], "delivery_id": "1"}, [1]):
            r = await client.post(action, json=bad, headers=session.write())
            assert r.status_code == 400, r.text
        r = await client.post(
            "/console/api/panels/webhooks/explode", json=body, headers=session.write()
        )
        assert r.status_code == 404
        r = await client.post(action, json=body, headers=session.write())
        assert r.status_code == 200 and r.json()["status"] == "pending", r.text
        await wait_for(lambda: receiver.delivered(), 20)
        page = await client.get("/console", headers=session.read())
        assert page.status_code == 200 and b"webhooks-panel" in page.content
    finally:
        await client.close()
        await receiver.stop()
