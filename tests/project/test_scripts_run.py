"""`scripts/run`, README's first command: a gate with a demo deal and the sandbox
payment provider beside it, so that reserve → pay → callback works as it starts; one
Ctrl-C stops both."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from typing import Any

import pytest

from loadtest.benchmark import http_json as http
from tests.support import ROOT, buyer, free_port

START_SECONDS_MAX = 90.0
SANDBOX_KEY = "scripts-run-sandbox-key-0123456789"


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_the_demo_sells_and_takes_a_payment_then_stops_on_ctrl_c(
    env: dict[str, str], prepared: None
) -> None:
    port, sandbox_port = free_port(), free_port()
    log = ROOT / ".local" / f"test-scripts-run-{port}.log"
    log.parent.mkdir(exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "scripts/run", "--port", str(port), "--sandbox-port", str(sandbox_port)],
            cwd=ROOT,
            env={
                **{k: v for k, v in env.items() if k != "GATE_PAYMENT_PROVIDER_URL"},
                # The demo is a development stack (scripts/run's own default): its
                # sandbox speaks plain http, which only GATE_ENV=dev accepts.
                "GATE_ENV": "dev",
                "GATE_SANDBOX_API_KEY": SANDBOX_KEY,
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_SECONDS_MAX
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if http("GET", base + "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("scripts/run did not come up: " + log.read_text()[-3000:])
        found = re.search(r"Demo deal (\d+) created", log.read_text())
        assert found, log.read_text()[-3000:]
        deal_id = int(found.group(1))

        status, order = http(
            "POST",
            f"{base}/v1/deals/{deal_id}/reservations",
            {"quantity": 1},
            {**buyer(7_700_001), "Idempotency-Key": f"scripts-run-{port}"},
        )
        assert status == 201, order
        status, session = http(
            "POST", f"{base}/v1/orders/{order['order_id']}/payment", None, buyer(7_700_001)
        )
        assert status == 201, session
        assert session["redirect_url"].startswith(f"http://127.0.0.1:{sandbox_port}/pay/")
        # The pay step moves money: the sandbox wants its key there too.
        status, paid = http(
            "POST",
            session["redirect_url"],
            {"outcome": "succeed"},
            {"Authorization": f"Bearer {SANDBOX_KEY}"},
        )
        assert "Authorization: Bearer " + SANDBOX_KEY in log.read_text()
        assert status == 200 and paid["status"] == "succeeded", paid
        # The sandbox delivers the signed callback to the gate it was started beside.
        deadline = time.monotonic() + 20
        view: dict[str, Any] = {}
        while time.monotonic() < deadline:
            view = http("GET", f"{base}/v1/orders/{order['order_id']}", None, buyer(7_700_001))[1]
            if view["status"] == "PAID":
                break
            time.sleep(0.2)
        assert view["status"] == "PAID", view
    finally:
        # Ctrl-C in a terminal: SIGINT to the whole foreground process group.
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    # Neither the gate nor the provider outlives the script.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (answers(port) or answers(sandbox_port)):
        time.sleep(0.2)
    assert not answers(port) and not answers(sandbox_port)
