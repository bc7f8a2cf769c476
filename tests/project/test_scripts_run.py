"""`scripts/run`, README's first command: a gate with a demo deal and the sandbox
payment provider beside it, so that reserve → pay → callback works as it starts; one
Ctrl-C stops both. README's tour works in a second shell (`source .local/dev.env`),
the demo deal is reused rather than made again, the `gate` command prints no log
lines into its output, and the default metrics address does not collide with the
test suite's gates or node_exporter's 9100."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gate.base.settings import Settings, metrics_port_for
from gate.cli import DEMO_TITLE
from gate.store.db import Database
from loadtest.benchmark import http_json as http
from tests.support import ROOT, buyer, free_port

START_SECONDS_MAX = 90.0
SANDBOX_KEY = "scripts-run-sandbox-key-0123456789"


def in_a_second_shell(dev_env: Path, command: str) -> subprocess.CompletedProcess[str]:
    """`command` in a new shell that knows nothing of the gate but what README's tour
    does first: `source .local/dev.env` (here: the test's state directory's)."""
    bare = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TERM")}
    return subprocess.run(
        ["bash", "-c", f'source "$1" && {command}', "tour", str(dev_env)],
        cwd=ROOT,
        env=bare,
        capture_output=True,
        text=True,
        timeout=60,
    )


def no_log_lines(out: subprocess.CompletedProcess[str]) -> bool:
    return not any('"level":' in line for line in (out.stdout + out.stderr).splitlines())


def demo_deals(settings: Settings) -> list[int]:
    """The ids of every demo deal in the suite's database."""

    async def read() -> list[int]:
        db = Database(settings, pool_max=2)
        await db.start()
        try:
            rows = await db.fetchall(
                "SELECT id FROM deals WHERE title = %s ORDER BY id", (DEMO_TITLE,)
            )
        finally:
            await db.close()
        return [int(r[0]) for r in rows]

    return asyncio.run(read())


def answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_the_demo_sells_and_takes_a_payment_then_stops_on_ctrl_c(
    env: dict[str, str], prepared: None, settings: Settings, tmp_path: Path
) -> None:
    port, sandbox_port = free_port(), free_port()
    while not (1 <= metrics_port_for(port) <= 65_535) or answers(metrics_port_for(port)):
        port = free_port()
    log = ROOT / ".local" / f"test-scripts-run-{port}.log"
    log.parent.mkdir(exist_ok=True)
    # Its own state directory: a developer's .local/dev.env stays theirs.
    state = tmp_path / "state"
    demos_before = demo_deals(settings)
    # node_exporter's port, taken as on a host that runs it (if free here).
    node_exporter = socket.socket()
    with contextlib.suppress(OSError):
        node_exporter.bind(("127.0.0.1", 9100))
        node_exporter.listen(1)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            ["bash", "scripts/run", "--port", str(port), "--sandbox-port", str(sandbox_port)],
            cwd=ROOT,
            env={
                # The default metrics address, as a developer's shell has it.
                **{
                    k: v
                    for k, v in env.items()
                    if k not in ("GATE_PAYMENT_PROVIDER_URL", "GATE_METRICS_ADDR")
                },
                # The demo is a development stack (scripts/run's own default): its
                # sandbox speaks plain http, which only GATE_ENV=dev accepts.
                "GATE_ENV": "dev",
                "GATE_SANDBOX_API_KEY": SANDBOX_KEY,
                "GATE_STATE_DIR": str(state),
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
        found = re.search(r"Demo deal (\d+) (created|reused)", log.read_text())
        assert found, log.read_text()[-3000:]
        deal_id = int(found.group(1))
        # At most one more demo deal, and none while an earlier one has units left.
        demos = demo_deals(settings)
        assert deal_id in demos and len(demos) <= len(demos_before) + 1
        assert (found.group(2) == "reused") == (len(demos) == len(demos_before))
        # The metrics listener on its default address, beside the suite's gates.
        with urllib.request.urlopen(
            f"http://127.0.0.1:{metrics_port_for(port)}/metrics", timeout=10
        ) as scraped:
            assert scraped.status == 200 and b"gate_http_requests_total" in scraped.read()

        # README's tour in a second shell.
        dev_env = state / "dev.env"
        assert stat.S_IMODE(dev_env.stat().st_mode) == 0o600
        minted = in_a_second_shell(dev_env, ".venv/bin/gate token 42")
        assert minted.returncode == 0, minted.stderr
        token = minted.stdout.strip()
        assert token.count(".") == 2 and minted.stderr == "", minted.stdout + minted.stderr
        status, first = http(
            "POST",
            f"{base}/v1/deals/{deal_id}/reservations",
            {"quantity": 1},
            {"Authorization": f"Bearer {token}", "Idempotency-Key": f"tour-{port}"},
        )
        assert status == 201 and first["status"] == "PENDING_PAYMENT", first
        for command, shown in (
            (".venv/bin/gate check", "all invariants hold"),
            (f".venv/bin/gate deal list --after {deal_id - 1} --limit 1", f"deal {deal_id}: "),
            (f".venv/bin/gate demo --base-url {base}", f"Demo deal {deal_id} reused"),
            ('echo "key=$SANDBOX_KEY"', f"key={SANDBOX_KEY}"),
        ):
            out = in_a_second_shell(dev_env, command)
            assert out.returncode == 0, (command, out.stdout, out.stderr)
            assert shown in out.stdout, (command, out.stdout)
            assert no_log_lines(out), (command, out.stdout, out.stderr)
        assert demo_deals(settings) == demos

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
        node_exporter.close()
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
