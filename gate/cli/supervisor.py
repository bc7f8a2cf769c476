"""The worker processes of `gate serve --workers N`, each with a listening socket of
its own (SO_REUSEPORT).

uvicorn's own supervisor binds one socket and shares it: every idle worker wakes on
each new connection and the first to run accepts all that are queued. Connections
that stay open (a load balancer's keep-alive pool, a load generator's) then pile up on
whichever worker won a race, and the other idles while the first saturates: in the
benchmark one run in three used 1.0 of the machine's 2 cores instead of 1.4. With a
socket per worker in one SO_REUSEPORT group the kernel spreads connections over the
workers by a hash of their addresses, so each gets its share however they arrive.

The parent only supervises: it starts the workers (spawned, as uvicorn does),
restarts one that dies (at most `RESTARTS_MAX` times in `RESTART_WINDOW_SECONDS`),
replaces one that stops answering, stops them all when one cannot start, and on
SIGTERM or SIGINT has every worker drain and stop (gate/cli/draining.py: /readyz 503
at once, the shutdown delay, the grace for requests in flight); a further signal
cuts the workers' delay short. What is still running after the delay, the grace and
`KILL_MARGIN_SECONDS` is killed.

The stop requests reach the workers as a count in shared memory, read on their loop's
every tick, not as signals passed on: an orchestrator that signals every process of
the group (systemd's default, a terminal's Ctrl+C) reaches each worker directly too,
and one stop seen twice would cut the delay short. A worker acts on the higher of the
two counts, its own signals and the supervisor's.

A hung worker (stopped, deadlocked, its event loop blocked) keeps its socket in the
port's group, so the kernel keeps handing it its share of new connections, which
wait forever. Each worker therefore beats, as gunicorn's workers do for its worker
timeout: its event loop writes the time into a slot of shared memory on every tick
of uvicorn's main loop (10 a second), so a beat proves the loop itself runs, not
just the process:

    worker event loop --(every 0.1 s)--> beat slot (shared double, CLOCK_MONOTONIC)
    supervisor poll (every POLL_SECONDS) reads it:
        now - beat > worker_timeout_seconds  -> SIGKILL, join, start another
        (before the first beat, i.e. while starting: max(timeout, STARTUP_GRACE_SECONDS))

SIGKILL, not SIGTERM: a hung worker would not act on SIGTERM (a stopped one cannot
even receive it until continued), and its connections are lost either way.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import sys
import threading
import time
from collections import deque
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

log = logging.getLogger("gate.supervisor")

STARTUP_FAILURE = 3  # uvicorn's exit status for a worker that could not start
RESTARTS_MAX = 10
RESTART_WINDOW_SECONDS = 60.0
POLL_SECONDS = 0.2
# A worker that has not beaten yet is starting (spawn, imports, the lifespan's
# connections): give it at least this long before calling it hung.
STARTUP_GRACE_SECONDS = 60.0
WORKER_TIMEOUT_SECONDS = 30.0
KILL_WAIT_SECONDS = 5.0
# On top of a worker's shutdown delay and grace: its lifespan's shutdown (gate.stop()).
KILL_MARGIN_SECONDS = 5.0


def available() -> bool:
    return hasattr(socket, "SO_REUSEPORT")


def listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A socket of the port's SO_REUSEPORT group."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    return sock


class _Beat(Protocol):
    value: float


class _Count(Protocol):
    value: int


def _worker(
    uvicorn_kwargs: dict[str, Any],
    host: str,
    port: int,
    backlog: int,
    beat: _Beat,
    delay_seconds: float,
    stops: _Count,
) -> None:
    import uvicorn

    from gate.cli.draining import DrainingServer

    class BeatingServer(DrainingServer):
        async def on_tick(self, counter: int) -> bool:
            # time.monotonic is CLOCK_MONOTONIC: one clock for every process.
            beat.value = time.monotonic()
            self.stop_requested(stops.value)
            return await super().on_tick(counter)

    try:
        sock = listening_socket(host, port, backlog)
    except OSError as exc:
        print(f"gate: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    config = uvicorn.Config(host=host, port=port, backlog=backlog, **uvicorn_kwargs)
    BeatingServer(config, delay_seconds).run(sockets=[sock])


class Supervisor:
    def __init__(
        self,
        uvicorn_kwargs: dict[str, Any],
        host: str,
        port: int,
        workers: int,
        backlog: int,
        grace_seconds: float,
        worker_timeout_seconds: float = WORKER_TIMEOUT_SECONDS,
        delay_seconds: float = 0.0,
    ) -> None:
        assert workers >= 2, "one worker needs no supervisor"
        self.uvicorn_kwargs = uvicorn_kwargs
        self.host = host
        self.port = port
        self.workers = workers
        self.backlog = backlog
        self.grace_seconds = grace_seconds
        self.delay_seconds = delay_seconds
        self.worker_timeout_seconds = worker_timeout_seconds
        self._context = multiprocessing.get_context("spawn")
        self._procs: list[BaseProcess] = []
        # Per worker slot: its last beat (0.0: none yet) and when it was started.
        self._beats: list[_Beat] = []
        self._started: list[float] = []
        self._restarts: deque[float] = deque()
        self._stop = threading.Event()
        # How many times the supervisor was asked to stop (every worker reads it).
        self._stops: _Count = self._context.RawValue("i", 0)
        self.exit_code = 0

    def _start(self, slot: int) -> BaseProcess:
        # A lock-free double: one writer (the worker), one reader (here); a torn read
        # is impossible for an aligned 8-byte store on the platforms we run on.
        beat: _Beat = self._context.RawValue("d", 0.0)
        proc = self._context.Process(
            target=_worker,
            args=(
                self.uvicorn_kwargs,
                self.host,
                self.port,
                self.backlog,
                beat,
                self.delay_seconds,
                self._stops,
            ),
            name="gate-worker",
        )
        proc.start()
        if slot == len(self._procs):
            self._procs.append(proc)
            self._beats.append(beat)
            self._started.append(time.monotonic())
        else:
            self._procs[slot] = proc
            self._beats[slot] = beat
            self._started[slot] = time.monotonic()
        return proc

    def _hung(self, slot: int, now: float) -> float | None:
        """Seconds since the worker of `slot` last beat, when that is too long."""
        last = self._beats[slot].value
        if last == 0.0:
            silent = now - self._started[slot]
            limit = max(self.worker_timeout_seconds, STARTUP_GRACE_SECONDS)
        else:
            silent = now - last
            limit = self.worker_timeout_seconds
        return silent if silent > limit else None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stops.value += 1
        self._stop.set()

    def run(self) -> int:
        # The port is checked once here, without SO_REUSEPORT: a port in use, even by
        # another gate's SO_REUSEPORT group, fails before any worker starts (two gates
        # must never share a port unknowingly).
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((self.host, self.port))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("starting %d workers on %s:%d (SO_REUSEPORT)", self.workers, self.host, self.port)
        for slot in range(self.workers):
            self._start(slot)
        while not self._stop.wait(POLL_SECONDS):
            self._keep_alive()
        self._shut_down()
        return self.exit_code

    def _keep_alive(self) -> None:
        for i, proc in enumerate(self._procs):
            if proc.is_alive():
                silent = self._hung(i, time.monotonic())
                if silent is None:
                    continue
                log.error(
                    "worker %s has not answered for %.1f s (GATE_WORKER_TIMEOUT_SECONDS=%g);"
                    " killing it",
                    proc.pid,
                    silent,
                    self.worker_timeout_seconds,
                )
                proc.kill()
                # Bounded: a process stuck in the kernel (uninterruptible I/O) dies
                # only when that returns; the next poll tries again meanwhile.
                proc.join(KILL_WAIT_SECONDS)
                if proc.is_alive():
                    continue
            else:
                proc.join()
            if proc.exitcode == STARTUP_FAILURE:
                log.error("worker %s could not start; stopping", proc.pid)
                self.exit_code = STARTUP_FAILURE
                self._stop.set()
                return
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > RESTART_WINDOW_SECONDS:
                self._restarts.popleft()
            if len(self._restarts) >= RESTARTS_MAX:
                log.error(
                    "workers keep dying (%d restarts in %.0f s); stopping",
                    RESTARTS_MAX,
                    RESTART_WINDOW_SECONDS,
                )
                self.exit_code = 1
                self._stop.set()
                return
            self._restarts.append(now)
            log.warning("worker %s died (exit %s); starting another", proc.pid, proc.exitcode)
            self._start(i)

    def _shut_down(self) -> None:
        if self._stops.value == 0:
            # A stop the supervisor decided (workers that cannot start or keep dying):
            # nothing to drain for, the second request skips the delay.
            self._stops.value = 2
        deadline = time.monotonic() + self.delay_seconds + self.grace_seconds
        deadline += KILL_MARGIN_SECONDS
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                log.warning("worker %s did not stop in time; killing it", proc.pid)
                proc.kill()
                proc.join()
