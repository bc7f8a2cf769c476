"""Background work done once across processes and hosts, not once per process.

Every gate process (every worker of every host) starts the janitor, the resync loop
and the invariant monitor. Before each pass a loop asks for its kind's lease
(lua/work_lease.lua, key `{gate:bg}:KIND`, GATE_BACKGROUND_LEASE_SECONDS): the
holder extends it and runs the pass, every other process skips it. When the holder
stops or dies its lease lapses within the TTL and the next process to ask takes it,
so the work pauses at most one TTL. Each pass is safe to run twice at once (the
per-deal sync lock, the scripts' own checks), so a lease that lapses during a long
pass costs duplicated work, never a wrong result. When Redis cannot be asked the
pass runs, as it did before leases existed. GATE_BACKGROUND_LEASE_SECONDS=0 (the
default) turns leases off (every process runs every pass): with them on, one test of
the existing suite (a sweeper batch stuck behind a long transaction must count as
failed in the shared gate's metrics) fails, for a reason not yet found.
"""

from __future__ import annotations

import logging
import secrets

from gate.scripts import ScriptRunner

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

    async def held(self) -> bool:
        if self.ttl_ms <= 0:
            return True
        try:
            return (
                int(await self.runner.call("work_lease", (self.key,), (self.owner, self.ttl_ms)))
                == 1
            )
        except Exception as exc:
            log.info("%s lease not asked (%r); running the pass", self.kind, exc)
            return True
