"""Helpers for the load-test suites: the baseline process, crowds, module runs."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
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


class UnansweredCallbacks:
    """A TCP proxy in front of a gate that lets every request through except the first
    copies of each payment callback: a request carrying a webhook-id seen for the first
    time less than `window_seconds` ago gets its connection closed, unanswered and
    never forwarded. That is what a client sees when the gate (uvicorn) closes an idle
    keep-alive connection just as a request leaves on it: no answer, and the gate never
    had the request. A redelivery after the window goes through."""

    HEAD_MAX_BYTES = 65_536

    def __init__(self, upstream_port: int, window_seconds: float = 0.3) -> None:
        self.upstream_port = upstream_port
        self.window_seconds = window_seconds
        self.first_seen: dict[bytes, float] = {}
        self.dropped = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _drop(self, head: bytes) -> bool:
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"webhook-id":
                now = time.monotonic()
                with self.lock:
                    first = self.first_seen.setdefault(value.strip(), now)
                    drop = now - first < self.window_seconds
                    self.dropped += drop
                return drop
        return False

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = client.recv(65_536)
                    if not chunk or len(buffer) > self.HEAD_MAX_BYTES:
                        return
                    buffer += chunk
                head, _, rest = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value.strip())
                while len(rest) < length:
                    chunk = client.recv(65_536)
                    if not chunk:
                        return
                    rest += chunk
                if self._drop(head):
                    return
                upstream.sendall(head + b"\r\n\r\n" + rest[:length])
                buffer = rest[length:]
        except OSError:
            return
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65_536):
                sink.sendall(chunk)
        except OSError:
            return
