"""Admission tokens: HMAC-SHA256 (GATE_ADMISSION_SECRET, a key of their own) over the
deal, the buyer, the admission's sequence number and its expiry. Verified without
Redis or the database; Redis then checks that the admission is still unspent
(lua/admit.lua), so a token is good for one reservation.

    <deal>.<user>.<seq>.<expires_ms>.<base64url HMAC, unpadded>
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time

from gate.base.settings import Secret
from gate.base.validate import ADMISSION_TOKEN_MAX_CHARS as TOKEN_MAX_CHARS

# What lua/admit.lua is told (ARGV[17]).
NO_TOKEN = ""
BAD_TOKEN = "-"


class AdmissionTokens:
    def __init__(self, secret: Secret) -> None:
        self._key = secret.reveal().encode()

    def _sign(self, deal_id: int, user_id: int, seq: int, expires_ms: int) -> str:
        msg = f"admission:v1|{deal_id}|{user_id}|{seq}|{expires_ms}".encode()
        digest = hmac.new(self._key, msg, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def mint(self, deal_id: int, user_id: int, seq: int, expires_ms: int) -> str:
        sig = self._sign(deal_id, user_id, seq, expires_ms)
        return f"{deal_id}.{user_id}.{seq}.{expires_ms}.{sig}"

    def admission_arg(self, deal_id: int, user_id: int, header: str | None) -> str:
        """The admission sequence number a valid token of this buyer for this deal
        names; NO_TOKEN without a header, BAD_TOKEN for a forged, expired or foreign
        one (the script answers ADMISSION_INVALID only if the deal has a room, and
        only after a replay had its answer)."""
        if header is None or header == "":
            return NO_TOKEN
        token = header.strip()
        if len(token) > TOKEN_MAX_CHARS:
            return BAD_TOKEN
        parts = token.split(".")
        if len(parts) != 5 or not all(p.isascii() and p.isdigit() for p in parts[:4]):
            return BAD_TOKEN
        if not parts[4].isascii():
            # hmac.compare_digest refuses a str with characters past ASCII (a header's
            # bytes 0x80-0xff reach the gate as such): a forgery, not an error.
            return BAD_TOKEN
        deal, user, seq, expires_ms = (int(p) for p in parts[:4])
        if deal != deal_id or user != user_id:
            return BAD_TOKEN
        if not hmac.compare_digest(parts[4], self._sign(deal, user, seq, expires_ms)):
            return BAD_TOKEN
        if expires_ms <= time.time() * 1000:
            return BAD_TOKEN
        return str(seq)

    def admission(self, deal_id: int, user_id: int, header: str | None) -> tuple[int, int] | None:
        """(sequence number, expiry in ms) of a valid token of this buyer for this
        deal, else None."""
        seq = self.admission_arg(deal_id, user_id, header)
        if seq in (NO_TOKEN, BAD_TOKEN):
            return None
        assert header is not None
        return int(seq), int(header.strip().split(".")[3])
