"""Background work done once across processes and hosts, not once per process.

Every gate process (every worker of every host) starts the janitor, the resync loop
and the invariant monitor. Before each pass a loop asks for its kind's lease
(lua/work_lease.lua, key `{gate:bg}:KIND`):

    loop of process A                      loop of process B
    held(cover=interval) -> 1: pass        held(cover=interval) -> 0: skip
    pause (interval)                       pause
    held(...) -> 1 (extended): pass        held(...) -> 0: skip
    (A dies: its lease lapses)             held(...) -> 1 (taken): pass

The lease's TTL is the loop's pause until it asks again (`cover`) plus
GATE_BACKGROUND_LEASE_SECONDS (default 5 s, which covers the pass itself): the
holder always asks again before its lease lapses, whatever the loop's interval (a
TTL shorter than the interval would let every process take the lapsed lease in
turn). A loop that stops gives its lease back (lua/work_lease_release.lua), so the
next process to ask takes the work at once; when the holder dies its work pauses
at most the TTL. Each pass is safe to run twice at once (the per-deal
sync lock, the scripts' own checks), so a lease that lapses during a long pass costs
duplicated work, never a wrong result. When Redis cannot be asked the pass runs, as
it did before leases existed. GATE_BACKGROUND_LEASE_SECONDS=0 turns leases off
(every process runs every pass).

What a pass reads of its own process is not leased: each process's invariant monitor
still evaluates its own sweeper's release failures and lag (gate/expiry/invariant_monitor.py); only
the deal checks are done once.
"""

from __future__ import annotations

import logging
import secrets

from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.worklease")


def lease_key(kind: str) -> str:
    return f"{{gate:bg}}:{kind}"


class WorkLease:
    def __init__(self, runner: ScriptRunner, kind: str, ttl_seconds: float) -> None:
        self.runner = runner
        self.kind = kind
        self.key = lease_key(kind)
        self.ttl_ms = int(ttl_seconds * 1000)
        # Per loop: two loops of one process never share a lease by accident.
        self.owner = secrets.token_hex(8)

    async def held(self, cover_seconds: float = 0.0) -> bool:
        """Whether this loop runs the pass now (the lease taken or extended). The
        lease lasts `cover_seconds` (the loop's pause until it asks again) plus the
        configured TTL. True when leases are off or Redis cannot be asked."""
        if self.ttl_ms <= 0:
            return True
        ttl_ms = self.ttl_ms + int(max(0.0, cover_seconds) * 1000)
        try:
            return int(await self.runner.call("work_lease", (self.key,), (self.owner, ttl_ms))) == 1
        except Exception as exc:
            log.info("%s lease not asked (%r); running the pass", self.kind, exc)
            return True

    async def release(self) -> None:
        """Give the lease back when the loop stops (if this loop still holds it), so
        the next process to ask takes the work at once rather than after the TTL."""
        if self.ttl_ms <= 0:
            return
        try:
            await self.runner.call("work_lease_release", (self.key,), (self.owner,))
        except Exception as exc:
            # It lapses on its own within its TTL.
            log.info("%s lease not given back (%r)", self.kind, exc)
