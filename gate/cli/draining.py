"""How one serving process stops: drained first, so that a rolling restart behind a
load balancer loses no request.

    SIGTERM (or SIGINT)
      -> /readyz answers 503 "draining" at once (gate/api/health.py DRAINING)
      -> keeps serving everything for GATE_SHUTDOWN_DELAY_SECONDS: the balancer's
         health checks see the 503 and take the process out of rotation
      -> stops accepting (closes its listening socket)
      -> requests in flight get up to GATE_SHUTDOWN_GRACE_SECONDS to finish
         (uvicorn's timeout_graceful_shutdown; then they are cancelled)
      -> the lifespan's shutdown: gate.stop() finishes the database groups, gives
         back the background loops' leases and the process lease (its in-flight
         markers are resolved at once instead of after the lease lapses)
      -> exit 0

A second SIGTERM or SIGINT during the delay ends the delay at once (the rest of the
sequence runs as above); a SIGINT during the grace stops waiting for the requests in
flight and skips the lifespan's shutdown (uvicorn's force quit: the process lease
then lapses by itself after GATE_LEASE_SECONDS).

uvicorn's own handler is replaced, not extended: it stops at once, and after a
graceful stop it raises the signal again, so that a process stopped by SIGTERM would
end killed by it (exit status 143) instead of 0.
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

import uvicorn

from gate.api.health import DRAINING

log = logging.getLogger("gate.shutdown")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, delay_seconds: float) -> None:
        super().__init__(config)
        self.delay_seconds = delay_seconds
        self._stops = 0  # stop requests seen
        # time.monotonic() when the delay ends; None until asked to stop.
        self._stop_at: float | None = None
        self._announced = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: flags only (no logging, no I/O); on_tick acts on them.
        self.stop_requested(self._stops + 1, sig)

    def stop_requested(self, count: int, sig: int = signal.SIGTERM) -> None:
        """The `count`th request to stop (a signal, or the supervisor's count):
        the first drains, the second ends the delay, a SIGINT after that stops
        waiting for the requests in flight."""
        if count <= self._stops:
            return
        first = self._stops == 0
        self._stops = count
        if first:
            DRAINING.begin()
            self._stop_at = time.monotonic() + self.delay_seconds
            if count == 1 and self.delay_seconds > 0:
                return
        if not self.should_exit:
            self.should_exit = True
        elif sig == signal.SIGINT:
            self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        stop_at = self._stop_at
        if stop_at is not None:
            left = 0.0 if self.should_exit else max(0.0, stop_at - time.monotonic())
            if not self._announced:
                self._announced = True
                log.warning(
                    "draining: /readyz answers 503; serving %.1f s more"
                    " (GATE_SHUTDOWN_DELAY_SECONDS), then up to %s s for requests in flight",
                    left,
                    self.config.timeout_graceful_shutdown,
                )
            if left <= 0:
                self.should_exit = True
        return await super().on_tick(counter)
