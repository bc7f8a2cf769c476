"""The payment scenarios against a gate with payments and a running sandbox provider.

They need the payments area: until the gate has `gate sandbox`, they are skipped."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.procs import Server, free_port
from loadtest.record import ClientRecord
from tests.loadtest_support import UnansweredCallbacks, run_module
from tests.support import GATE_BIN, ROOT, GateProcess

pytestmark = pytest.mark.slow

SANDBOX_KEY = "test-loadtest-sandbox-key-0123456789"


def has_sandbox(env: dict[str, str]) -> bool:
    """Whether `gate sandbox` is the provider, not the core's "not available" stand-in."""
    out = subprocess.run([GATE_BIN, "--help"], env=env, capture_output=True, text=True, check=False)
    lines = [line for line in out.stdout.splitlines() if line.strip().startswith("sandbox ")]
    return bool(lines) and "not available" not in lines[0]


@pytest.fixture(scope="module")
def paying_gate(env: dict[str, str], prepared: None) -> Iterator[tuple[GateProcess, str, dict]]:
    if not has_sandbox(env):
        pytest.skip("needs the payments area: this gate has no sandbox provider")
    port = free_port()
    sandbox = Server(
        "sandbox",
        [GATE_BIN, "sandbox", "--port", str(port)],
        # The sandbox runs only in dev, signs with its own secret (the gate's) and wants
        # its key on its controls, which the locust users set (GATE_SANDBOX_API_KEY).
        {
            **env,
            "GATE_ENV": "dev",
            "GATE_SANDBOX_WEBHOOK_SECRET": env["GATE_WEBHOOK_SECRET"],
            "GATE_SANDBOX_API_KEY": SANDBOX_KEY,
        },
        port,
        ROOT / ".local" / f"test-sandbox-{port}.log",
        ROOT,
    )
    gate: GateProcess | None = None
    try:
        sandbox.wait_ready("/healthz")
        sandbox_url = f"http://127.0.0.1:{port}"
        gate_port = free_port()
        genv = {
            **env,
            # Plain http to the sandbox: a gate takes that only in dev.
            "GATE_ENV": "dev",
            "GATE_PAYMENT_PROVIDER_URL": sandbox_url,
            "GATE_PAYMENT_API_KEY": SANDBOX_KEY,
            "GATE_SANDBOX_API_KEY": SANDBOX_KEY,
            "GATE_PAYMENT_CALLBACK_URL": f"http://127.0.0.1:{gate_port}/v1/payments/sandbox/webhook",
            "GATE_PAYMENT_RETURN_URL": f"http://127.0.0.1:{gate_port}/paid",
        }
        gate = _start_on(genv, gate_port)
        gate.wait_ready()
        yield gate, sandbox_url, genv
    finally:
        if gate is not None:
            gate.stop()
        sandbox.stop()


def _start_on(env: dict[str, str], port: int) -> GateProcess:
    """A GateProcess on a port chosen beforehand (the callback URL names it)."""
    return GateProcess(env, port=port)


@pytest.mark.parametrize(
    ("scenario", "extra"),
    [
        ("pay", []),
        ("pay", ["--pay-via", "sandbox"]),
        ("late-pay", []),
    ],
)
def test_payment_scenarios_pass_the_verifier(
    paying_gate: tuple[GateProcess, str, dict], tmp_path: Path, scenario: str, extra: list[str]
) -> None:
    gate, sandbox_url, genv = paying_gate
    if "sandbox" in extra:
        extra = [*extra, "--sandbox-url", sandbox_url]
    out = tmp_path / scenario
    result = run_module(
        genv,
        "loadtest.scenario",
        scenario,
        "--host",
        gate.url,
        "--run-time",
        "5s",
        "--users",
        "6",
        "--out",
        str(out),
        *extra,
        "--",
        "--late-hold-seconds",
        "1",
        timeout_seconds=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "verifier: all checks hold" in result.stdout
    record = ClientRecord.read(out / "client.json")
    paid = record.late_paid if scenario == "late-pay" else record.paid
    assert paid, "no buyer got as far as paying"
    assert record.violations == []


def test_a_callback_that_got_no_answer_is_delivered_again_not_counted_as_paid(
    paying_gate: tuple[GateProcess, str, dict], tmp_path: Path
) -> None:
    """The mixed run's BREACH: a late payment recorded as paid
    while its order ended EXPIRED with no payment event. The delivery never reached the
    gate: uvicorn closed the idle keep-alive connection it was sent on (the late payer
    waits 2.5-5.5 s, the keep-alive timeout is 5 s), the client got no answer, and the
    load test counted it as paid. Here every first delivery gets no answer (a proxy
    closes the connection without forwarding it): the payers deliver each event again,
    as a provider does, the record keeps every delivery's answer, and the verifier
    passes: no such order is recorded as paid late, nor reported EXPIRED."""
    gate, _, genv = paying_gate
    proxy = UnansweredCallbacks(gate.port)
    out = tmp_path / "late-pay"
    try:
        result = run_module(
            genv,
            "loadtest.scenario",
            "late-pay",
            "--host",
            proxy.url,
            "--run-time",
            "5s",
            "--users",
            "4",
            "--out",
            str(out),
            "--",
            "--late-hold-seconds",
            "1",
            timeout_seconds=240,
        )
    finally:
        proxy.close()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "verifier: all checks hold" in result.stdout
    assert proxy.dropped > 0
    record = ClientRecord.read(out / "client.json")
    assert record.late_paid, "no buyer got as far as paying"
    assert record.unpaid == []
    by_event: dict[str, list[int]] = {}
    for _, _, event_id, _, status in record.deliveries:
        by_event.setdefault(event_id, []).append(status)
    # Every event's first copies got no answer (0); a later delivery got its 2xx.
    assert by_event and all(0 in s and any(200 <= x < 300 for x in s) for s in by_event.values())
    late = {r[0] for r in record.late_paid}
    assert late <= {d[0] for d in record.deliveries if 200 <= d[4] < 300}
    assert "callbacks: answers:" in result.stdout and "none=" in result.stdout


def test_a_gate_without_a_provider_skips_the_payment_scenarios(
    gate: GateProcess, env: dict[str, str], tmp_path: Path
) -> None:
    """The shared gate has the callback endpoint but no GATE_PAYMENT_PROVIDER_URL: every
    payment session would answer 503, so the run stops its payers and says SKIPPED."""
    out = tmp_path / "pay"
    result = run_module(
        env,
        "loadtest.scenario",
        "pay",
        "--host",
        gate.url,
        "--run-time",
        "4s",
        "--users",
        "4",
        "--out",
        str(out),
        timeout_seconds=120,
    )
    assert result.returncode == 3, result.stdout[-4000:] + result.stderr[-4000:]
    assert "SKIPPED" in result.stdout
    record = ClientRecord.read(out / "client.json")
    assert any("no payment provider configured" in note for note in record.notes), record.notes
