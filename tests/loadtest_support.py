"""Helpers for the load-test suites: the baseline process, crowds, module runs."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtest.procs import Server, free_port
from tests.support import ROOT, Client, Resp, reserve


def baseline_env(env: Mapping[str, str]) -> dict[str, str]:
    """The suite's environment with the baseline in a database of its own."""
    test_db = env["GATE_MYSQL_URL"]
    return {**env, "BASELINE_MYSQL_URL": test_db + "_baseline", "PYTHONPATH": str(ROOT)}


def start_baseline(env: Mapping[str, str], workers: int = 1, *, lean: bool = False) -> Server:
    port = free_port()
    server = Server(
        "baseline",
        [
            sys.executable,
            "-m",
            "loadtest.baseline",
            "serve",
            "--port",
            str(port),
            "--workers",
            str(workers),
            *(["--lean"] if lean else []),
        ],
        env,
        port,
        ROOT / ".local" / f"test-baseline-{port}.log",
        ROOT,
    )
    server.wait_ready("/healthz")
    return server


def run_module(
    env: Mapping[str, str], module: str, *args: str, timeout_seconds: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        check=False,
    )


async def crowd(
    client: Client, deal_id: int, users: range, key_prefix: str
) -> list[tuple[int, Resp]]:
    """One attempt per buyer, all at once: (user id, answer)."""
    answers = await asyncio.gather(
        *(reserve(client, deal_id, u, f"{key_prefix}-{u:08d}") for u in users)
    )
    return list(zip(users, answers, strict=True))


def created(answers: list[tuple[int, Resp]]) -> list[tuple[str, int]]:
    return [(r.json()["order_id"], u) for u, r in answers if r.status_code == 201]


def codes(answers: list[tuple[int, Resp]]) -> dict[Any, int]:
    out: dict[Any, int] = {}
    for _, r in answers:
        key = r.status_code if r.status_code < 400 else r.json().get("code", r.status_code)
        out[key] = out.get(key, 0) + 1
    return out


def write_record(
    path: Path,
    deals: dict[str, int],
    orders: list[tuple[str, int, int]],
    outcomes: dict[int, dict[str, int]] | None = None,
) -> Path:
    from loadtest.record import ClientRecord

    record = ClientRecord(host="test", deals=deals, created=list(orders))
    for deal_id, counts in (outcomes or {}).items():
        record.outcomes[deal_id].update(counts)
    record.write(path)
    return path
