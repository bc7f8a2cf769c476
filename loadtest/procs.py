"""Processes the benchmark starts (a gate, the baseline) and the CPU they use."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A server process in its own process group, logging to a file. A gate's
    /metrics is on its own listener (GATE_METRICS_ADDR): unless the environment
    names one, each server is given a free port for it (`metrics_url`), so that
    servers started side by side never collide on a metrics port
    (`metrics_url` is empty when the environment says `off`)."""

    def __init__(
        self,
        name: str,
        args: Sequence[str],
        env: Mapping[str, str],
        port: int,
        log_path: Path,
        cwd: Path,
    ) -> None:
        self.name = name
        self.args = list(args)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        address = env.get("GATE_METRICS_ADDR") or f"127.0.0.1:{free_port()}"
        env = {**env, "GATE_METRICS_ADDR": address}
        self.metrics_url = "" if address == "off" else f"http://{address}"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args,
            env=dict(env),
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, path: str, timeout_seconds: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready: {self.log_path.read_text()[-2000:]}")

    def pids(self) -> list[int]:
        """The server's processes: its group (uvicorn's supervisor and its workers)."""
        return [pid for pid, pgrp, _ in _processes() if pgrp == self.proc.pid]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


def _processes() -> Iterable[tuple[int, int, str]]:
    """(pid, process group, command name) of every process we may read."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2 :].split()
        yield int(entry), int(fields[2]), name


def pids_named(*names: str) -> list[int]:
    return [pid for pid, _, name in _processes() if name in names]


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU time of these processes so far."""
    total = 0
    for pid in pids:
        try:
            raw = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (every core, every process) so far."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def children_seconds() -> float:
    """CPU time of this process's finished children (the load generator runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class CpuMeter:
    """CPU used between start() and stop(), in cores: by named groups of processes,
    by the load generator (finished children), and by the whole machine — "other" is
    what none of them explains (anything else running skews the measurement)."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = {k: list(v) for k, v in groups.items()}
        self._start: dict[str, float] = {}
        self._t0 = 0.0

    def _sample(self) -> dict[str, float]:
        sample = {k: cpu_seconds(v) for k, v in self.groups.items()}
        sample["wrk"] = children_seconds()
        sample["machine"] = machine_busy_seconds()
        return sample

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._start = self._sample()

    def stop(self) -> dict[str, float]:
        elapsed = max(1e-6, time.monotonic() - self._t0)
        end = self._sample()
        cores = {k: (end[k] - self._start[k]) / elapsed for k in end}
        known = sum(v for k, v in cores.items() if k != "machine")
        cores["other"] = max(0.0, cores["machine"] - known)
        return {k: round(v, 2) for k, v in cores.items()}
