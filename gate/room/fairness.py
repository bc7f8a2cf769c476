"""The waiting room's verifiable draw (docs/waiting-room.md, "Verifiable draw").

    room created ──> seed: 32 random bytes (deals.room_seed; the room's Redis hash)
                     commitment = SHA-256(seed), published at once, never changed
    join ──> ticket_id: 128 random bits (hex), made by the gate, kept in the ticket
             draw = HMAC-SHA256(seed, ticket_id); its first 50 bits are the queue
             score of a prequeue joiner (and of every joiner of a "random" room);
             the ticket id is appended to the room's draw list
    starts_at (fifo) / ends_at (random) ──> GET /v1/deals/{id}/queue/fairness
             reveals the seed and the draw list (in pages, gate/room/fairness_doc.py):
             anyone sorts the ids by hmac-sha256(seed, ticket_id), hex ascending,
             and gets the order

Before the reveal the document carries the commitment only ("seed" and
"participants" null), so nobody can compute the order while it still matters, and
nobody can change the seed afterwards without the commitment giving it away.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

from gate.store.keys import deal_keys

RULE = "hmac-sha256(seed, ticket_id) ascending"
SEED_BYTES = 32
TICKET_ID_BYTES = 16
RANDOM_BATCH = 1024
# Queue scores are doubles: 50 bits of the draw stay exact and below 2^50, where a
# "fifo" room's later joiners start (lua/room_ticket.lua).
SCORE_BITS = 50
# An ended sale's draw list is kept this long for anyone to check, then deleted
# (lua/room_retire.lua).
DRAW_KEEP_MS = 7 * 86_400 * 1000
# The draw list is read in pages of this many ids (gate/room/fairness_doc.py encodes
# the document once per change and serves it in pages).
PAGE = 10_000


def draw_key(deal_id: int) -> str:
    """The list of ticket ids drawn (in the deal's slot, next to the room's keys)."""
    return deal_keys(deal_id).room + ":draw"


def new_seed() -> bytes:
    return secrets.token_bytes(SEED_BYTES)


def commitment(seed: bytes) -> str:
    return hashlib.sha256(seed).hexdigest()


class TicketIds:
    """New ticket ids: 128 bits of os.urandom as hex, fetched 1,024 at a time (one
    system call per 1,024 joins instead of one per join, secrets' quality)."""

    def __init__(self) -> None:
        self._buf = b""
        self._at = 0

    def new(self) -> str:
        at = self._at
        if at + TICKET_ID_BYTES > len(self._buf):
            self._buf = os.urandom(TICKET_ID_BYTES * RANDOM_BATCH)
            at = 0
        self._at = at + TICKET_ID_BYTES
        return self._buf[at : at + TICKET_ID_BYTES].hex()


def draw(seed: bytes, ticket_id: str) -> str:
    """The ticket's place in the draw: lower first (hex compares as the number)."""
    return hmac.digest(seed, ticket_id.encode("ascii"), "sha256").hex()


class Drawer:
    """A room's draw scores: HMAC-SHA256 with the seed's inner and outer pads hashed
    once (RFC 2104), so a join costs two hash copies and updates (hmac.digest
    costs more than twice that, `timeit`)."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, seed: bytes) -> None:
        key = seed.ljust(64, b"\0")  # SHA-256's block: a 32-byte seed is padded
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def score(self, ticket_id: str) -> int:
        """The queue score of a drawn ticket: the draw's first SCORE_BITS bits."""
        inner = self._inner.copy()
        inner.update(ticket_id.encode("ascii"))
        outer = self._outer.copy()
        outer.update(inner.digest())
        return int.from_bytes(outer.digest()[:8], "big") >> (64 - SCORE_BITS)
