"""The waiting room's plug into the reservation path (gate/reserve/ports.py
AdmissionPort): a buyer's Admission-Token as lua/admit.lua checks it, and an admission
given back when a reservation that spent it is tried once more."""

from __future__ import annotations

import logging

from gate.room.tokens import AdmissionTokens
from gate.store.keys import deal_keys
from gate.store.scripts import ScriptRunner

log = logging.getLogger("gate.room")


class RoomAdmission:
    def __init__(self, tokens: AdmissionTokens, runner: ScriptRunner) -> None:
        self.tokens = tokens
        self.runner = runner

    def arg(self, deal_id: int, user_id: int, header: str | None) -> str:
        return self.tokens.admission_arg(deal_id, user_id, header)

    async def restore(self, deal_id: int, user_id: int, header: str | None) -> None:
        """lua/room_restore.lua for a reservation tried again after a lapsed lease."""
        held = self.tokens.admission(deal_id, user_id, header)
        if held is None:
            return
        keys = deal_keys(deal_id)
        try:
            await self.runner.call(
                "room_restore",
                (keys.room, keys.room_admitted, keys.room_expiry),
                (user_id, held[0], held[1]),
            )
        except Exception as exc:
            # The retry then answers ADMISSION_INVALID, as it would have without this.
            log.warning("admission of user %s not restored: %r", user_id, exc)
