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
    def __init__(self, tokens: AdmissionTokens, runner: ScriptRunner, ratio: float = 1.0) -> None:
        self.tokens = tokens
        self.runner = runner
        # The room's bound (GATE_ROOM_ADMISSION_RATIO): a restore stays within it.
        self.ratio = ratio

    def arg(self, deal_id: int, user_id: int, header: str | None) -> str:
        return self.tokens.admission_arg(deal_id, user_id, header)

    async def restore(self, deal_id: int, user_id: int, header: str | None) -> None:
        """lua/room_restore.lua for a reservation that spent the admission and held
        nothing (its units given back): the buyer may try again."""
        held = self.tokens.admission(deal_id, user_id, header)
        if held is None:
            return
        keys = deal_keys(deal_id)
        try:
            await self.runner.call(
                "room_restore",
                (keys.room, keys.room_admitted, keys.room_expiry, keys.meta),
                (user_id, held[0], held[1], repr(self.ratio)),
            )
        except Exception as exc:
            # The retry then answers ADMISSION_INVALID, as it would have without this.
            log.warning("admission of user %s not restored: %r", user_id, exc)
