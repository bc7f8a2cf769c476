"""Running wrk with the scripts in loadtest/wrk/ and reading their one-line JSON result."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

WRK_DIR = Path(__file__).with_name("wrk")
RESERVE = WRK_DIR / "reserve.lua"
GET = WRK_DIR / "get.lua"
ROOM = WRK_DIR / "room.lua"
MARK = "WRKJSON "
# A once-mode run that does not finish in this time is ended and reported as such.
ONCE_MAX_SECONDS = 600
REQUEST_TIMEOUT = "10s"


class WrkError(RuntimeError):
    pass


@dataclass
class WrkResult:
    command: str
    requests: int
    duration_s: float
    status: dict[int, int]
    latency_us: dict[str, float]
    errors: dict[str, int]
    sent: int
    fillers: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        """Answered requests per second, filler health checks excluded."""
        return (self.requests - self.fillers) / self.duration_s if self.duration_s else 0.0

    def count(self, *statuses: int) -> int:
        return sum(self.status.get(s, 0) for s in statuses)

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "requests": self.requests,
            "duration_s": round(self.duration_s, 3),
            "rps": round(self.rps, 1),
            "status": {str(k): v for k, v in sorted(self.status.items())},
            "latency_us": self.latency_us,
            "errors": self.errors,
            "sent": self.sent,
            "fillers": self.fillers,
            **self.extra,
        }


def parse(output: str, command: str) -> WrkResult:
    for line in output.splitlines():
        if line.startswith(MARK):
            data = orjson.loads(line[len(MARK) :])
            return WrkResult(
                command=command,
                requests=int(data["requests"]),
                duration_s=int(data["duration_us"]) / 1e6,
                status={int(k): int(v) for k, v in data["status"].items()},
                latency_us={k: float(v) for k, v in data["latency_us"].items()},
                errors={k: int(v) for k, v in data["errors"].items()},
                sent=int(data.get("sent", 0)),
                fillers=int(data.get("fillers", 0)),
            )
    raise WrkError(f"no result line from wrk:\n{output[-2000:]}")


def unique(tag: str) -> str:
    """Keys are per buyer and buyers recur across runs: every wrk run gets its own tag,
    or a key would come back with another deal (422 IDEMPOTENCY_MISMATCH)."""
    return f"{tag}{secrets.token_hex(3)}"


def _command(
    url: str, script: Path, script_args: list[str], connections: int, seconds: float, threads: int
) -> list[str]:
    return [
        "wrk",
        "-t",
        str(threads),
        "-c",
        str(max(connections, threads)),
        "-d",
        f"{max(1, round(seconds))}s",
        "--timeout",
        REQUEST_TIMEOUT,
        "-s",
        str(script),
        url,
        "--",
        *script_args,
    ]


def get(url: str, path: str, connections: int, seconds: float, threads: int = 1) -> WrkResult:
    cmd = _command(url, GET, [path], connections, seconds, threads)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise WrkError(done.stderr or done.stdout)
    return parse(done.stdout, shlex.join(cmd))


def room(
    url: str,
    method: str,
    deal_id: int,
    tokens: Path,
    connections: int,
    seconds: float,
    threads: int = 1,
) -> WrkResult:
    """Waiting-room joins (POST) or polls (GET) by the buyers in `tokens`, in turn."""
    args = [str(tokens), method, f"/v1/deals/{deal_id}/queue", str(threads)]
    cmd = _command(url, ROOM, args, connections, seconds, threads)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise WrkError(done.stderr or done.stdout)
    return parse(done.stdout, shlex.join(cmd))


def reserve_loop(
    url: str,
    deal_id: int,
    tokens: Path,
    tag: str,
    connections: int,
    seconds: float,
    threads: int = 1,
    delay_ms: float = 0.0,
) -> WrkResult:
    """Reservations for `seconds`, cycling through the buyers, a fresh key each time."""
    tag = unique(tag)
    args = [str(tokens), "loop", f"/v1/deals/{deal_id}/reservations", f"{delay_ms:.3f}", tag]
    args += [str(threads), "-"]
    cmd = _command(url, RESERVE, args, connections, seconds, threads)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise WrkError(done.stderr or done.stdout)
    return parse(done.stdout, shlex.join(cmd))


def reserve_once(
    url: str, deal_id: int, tokens: Path, tag: str, connections: int, threads: int = 1
) -> WrkResult:
    """Every buyer in `tokens` makes exactly one attempt; ends when all are answered.

    wrk runs for a fixed duration, so each thread reports when its share is done and
    wrk is then interrupted (SIGINT ends its sleep and it prints its summary).
    `extra["wall_s"]` is the time from start until the last answer."""
    tag = unique(tag)
    args = [str(tokens), "once", f"/v1/deals/{deal_id}/reservations", "0", tag, str(threads)]
    return run_until_done(url, RESERVE, args, connections, ONCE_MAX_SECONDS, threads)


def run_until_done(
    url: str, script: Path, args: list[str], connections: int, max_seconds: float, threads: int
) -> WrkResult:
    """Run a wrk script that sends a fixed set of requests and whose threads each
    touch a file in a directory (its last argument, added here) when their share is
    answered; wrk is then interrupted (SIGINT ends its sleep and it prints its
    summary). `extra["wall_s"]` is the time from start until the last answer."""
    with tempfile.TemporaryDirectory(prefix="bench-done-") as done_dir:
        cmd = _command(url, script, [*args, done_dir], connections, max_seconds, threads)
        started = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        finished = False
        while proc.poll() is None:
            if len(os.listdir(done_dir)) >= threads:
                finished = True
                break
            time.sleep(0.01)
        wall = time.monotonic() - started
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    result = parse(out, shlex.join(cmd))
    result.extra.update({"wall_s": round(wall, 3), "finished": finished})
    if not finished:
        result.extra["stderr"] = err[-2000:]
    return result
