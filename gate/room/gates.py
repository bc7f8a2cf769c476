"""A room's gates in front of the queue: access codes (invite-only presales) and a
proof of work priced by demand (docs/waiting-room.md).

    admin ── POST /v1/admin/deals/{id}/access-codes {"codes": [...]}
          ──> HMAC-SHA256(GATE_ADMISSION_SECRET, code) ──> room_access_codes (db)
                                                      ──> {d:ID}:rcodes (Redis)
    buyer ── GET /v1/deals/{id}/queue/challenge ──> room_challenge.lua (demand)
          <── {"challenge": <deal>.<user>.<bits>.<expires_ms>.<id>.<HMAC>, "bits", ...}
    buyer ── POST /v1/deals/{id}/queue {"access_code", "challenge", "nonce"}
          ──> JoinPasses.parse: the code's HMAC (and the client's address, which the
              failed attempts are counted by); the challenge's HMAC and one SHA-256
              (a wrong, expired or foreign challenge is refused here, before Redis)
          ──> room_ticket.lua, for a buyer without a ticket: challenge required and
              unspent? then code required? too many failed lately (429)? known,
              unbound or this buyer's? (refused: a failed attempt counted, the
              challenge spent) ... then the join, and only if it makes a ticket:
              the code bound, the challenge id spent (a key with a TTL)

The codes are kept hashed: a leak of Redis or of the database gives no usable code.
Codes an admin sends are at least 8 characters; codes the gate makes
(`{"generate": n}`) carry 80 random bits (docs/waiting-room.md says how long codes
must be for how many codes and guesses).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import orjson

from gate.base.codes import RoomCode
from gate.base.errors import Problem, from_room, invalid
from gate.base.settings import Secret
from gate.inventory.room_config import RoomConfig

# A code a join may carry: any a deal may hold (codes of 6 and 7 characters added
# before the admin's bound was 8 are still judged).
CODE_RE = re.compile(r"[A-Za-z0-9_-]{6,64}")
# A code an admin adds: 8 characters at least (docs/waiting-room.md, "How long").
CODE_MIN_CHARS = 8
ADMIN_CODE_RE = re.compile(r"[A-Za-z0-9_-]{8,64}")
CODES_PER_CALL_MAX = 10_000
# Codes the gate makes: Crockford's base32 (no I, L, O, U: read aloud and typed
# without confusion), 16 symbols of 5 random bits (80 bits), in groups of four.
GENERATED_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
GENERATED_SYMBOLS = 16
GENERATED_BITS = 5 * GENERATED_SYMBOLS
# A deal holds at most this many codes (each ~100 B in Redis, a row in the database).
CODES_PER_DEAL_MAX = 1_000_000
# 10,000 codes of 64 characters, quoted and separated, with room to spare.
CODES_BODY_MAX_BYTES = 1_048_576
# The hash of a code as stored: the first 16 bytes of its HMAC, in hex.
CODE_HASH_HEX = 32

CHALLENGE_SECONDS = 120
# A challenge's parts: deal, user, bits, expires_ms, id (hex), HMAC (hex).
CHALLENGE_MAX_CHARS = 200
NONCE_MAX_CHARS = 64
CHALLENGE_ID_BYTES = 12
# A join's body: {"access_code", "challenge", "nonce"}, well within the gate's bound.
JOIN_FIELDS = ("access_code", "challenge", "nonce")


def challenge_bits(min_bits: int, max_bits: int, waiting: int, available: int) -> int:
    """clamp(min_bits + floor(log2(1 + waiting / max(1, available))), min, max)."""
    ratio = 1 + waiting / max(1, available)
    return max(min_bits, min(max_bits, min_bits + math.floor(math.log2(ratio))))


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def solves(challenge: str, nonce: str, bits: int) -> bool:
    """SHA-256(challenge + ":" + nonce) starts with `bits` zero bits."""
    if not 0 <= bits <= 256:
        return False
    digest = hashlib.sha256(f"{challenge}:{nonce}".encode()).digest()
    return int.from_bytes(digest, "big") >> (256 - bits) == 0


def solve(challenge: str, bits: int) -> str:
    """A nonce that solves the challenge (what a client does; tests and load tests)."""
    prefix = f"{challenge}:".encode()
    shift = 256 - bits
    n = 0
    while True:
        nonce = b"%x" % n
        if (
            bits == 0
            or int.from_bytes(hashlib.sha256(prefix + nonce).digest(), "big") >> shift == 0
        ):
            return nonce.decode()
        n += 1


@dataclass(frozen=True, slots=True)
class JoinPass:
    """What a join's body proved, as room_ticket.lua is told: the code's hash ("" for
    none), the verified challenge ("<id>|<expires_ms>", "" for none) and, with a
    code, the client's address (its failed attempts are counted by it)."""

    code_hash: bytes = b""
    challenge: bytes = b""
    address: bytes = b""

    def at(self, address: str) -> JoinPass:
        """This pass, from this client address (wanted only with a code)."""
        return JoinPass(self.code_hash, self.challenge, address.encode())


NO_PASS = JoinPass()


class JoinPasses:
    """Hashes access codes and mints and verifies challenges, keyed with
    GATE_ADMISSION_SECRET (domain-separated from admission tokens by a prefix)."""

    def __init__(self, secret: Secret) -> None:
        self._key = secret.reveal().encode()
        # The challenges' MAC, keyed and prefixed once: each signature is a copy and
        # one update (cheaper than a new HMAC: verification is on every join).
        self._challenge_mac = hmac.new(self._key, b"challenge:v1|", hashlib.sha256)

    def code_hash(self, code: str) -> str:
        digest = hmac.new(self._key, b"access-code:v1|" + code.encode(), hashlib.sha256)
        return digest.hexdigest()[:CODE_HASH_HEX]

    def _sign(self, head: str) -> str:
        mac = self._challenge_mac.copy()
        mac.update(head.encode())
        return mac.hexdigest()

    def mint(
        self, deal_id: int, user_id: int, bits: int, now: float | None = None
    ) -> tuple[str, int]:
        """A signed challenge for this buyer and deal: (challenge, expires_ms)."""
        expires_ms = int(((now or time.time()) + CHALLENGE_SECONDS) * 1000)
        head = f"{deal_id}.{user_id}.{bits}.{expires_ms}.{os.urandom(CHALLENGE_ID_BYTES).hex()}"
        return f"{head}.{self._sign(head)}", expires_ms

    def verify(self, deal_id: int, user_id: int, challenge: str, nonce: str) -> bytes:
        """ "<id>|<expires_ms>" of a challenge of this buyer and deal, unexpired, signed
        by a gate and solved by the nonce; else CHALLENGE_INVALID. One HMAC and one
        SHA-256, no Redis (whether its id is spent is room_ticket.lua's to judge)."""
        if len(challenge) > CHALLENGE_MAX_CHARS or len(nonce) > NONCE_MAX_CHARS:
            raise from_room(RoomCode.CHALLENGE_INVALID)
        head, _, sig = challenge.rpartition(".")
        parts = head.split(".")
        # compare_digest takes only ASCII strings. The numbers are parsed leniently
        # (int() takes "+1" or "1_0"): the HMAC is over the exact text, so only what
        # a gate minted verifies.
        if len(parts) != 5 or not challenge.isascii():
            raise from_room(RoomCode.CHALLENGE_INVALID)
        try:
            expires_ms = int(parts[3])
            bits = int(parts[2])
            mine = int(parts[0]) == deal_id and int(parts[1]) == user_id
        except ValueError:
            raise from_room(RoomCode.CHALLENGE_INVALID) from None
        if (
            not mine
            or expires_ms <= time.time() * 1000
            or not hmac.compare_digest(sig, self._sign(head))
            or not solves(challenge, nonce, bits)
        ):
            raise from_room(RoomCode.CHALLENGE_INVALID)
        return f"{parts[4]}|{expires_ms}".encode()

    def parse(self, deal_id: int, user_id: int, body: bytes) -> JoinPass:
        """A join's body: empty (nothing proved), or {"access_code"?, "challenge"?,
        "nonce"?}. A malformed body is 400; a bad challenge 403 CHALLENGE_INVALID,
        before any Redis call. A pass with a code needs the client's address
        (`JoinPass.at`) before it is sent."""
        if not body or body.isspace():
            return NO_PASS
        try:
            data: Any = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise invalid("The body must be JSON.") from None
        if data is None:
            return NO_PASS
        if not isinstance(data, dict):
            raise invalid("The body must be a JSON object.")
        unknown = sorted(set(data) - set(JOIN_FIELDS))
        if unknown:
            raise invalid(f"Unknown field(s): {', '.join(unknown)}.")
        code, challenge, nonce = (data.get(name) for name in JOIN_FIELDS)
        for name, value in zip(JOIN_FIELDS, (code, challenge, nonce), strict=True):
            if value is not None and not isinstance(value, str):
                raise invalid(f"'{name}' must be a string.")
        code_hash = b""
        if code is not None:
            # A code of the wrong shape can be no deal's: a hash no code has, so the
            # script answers it as unknown (and an open room ignores it, as any code).
            code_hash = self.code_hash(code).encode() if CODE_RE.fullmatch(code) else b"-"
        proof = b""
        if challenge is not None or nonce is not None:
            if challenge is None or nonce is None:
                raise from_room(RoomCode.CHALLENGE_INVALID)
            proof = self.verify(deal_id, user_id, challenge, nonce)
        return JoinPass(code_hash, proof)


# The gates' fields of the room's Redis hash (room_ticket.lua, room_challenge.lua).
GATE_FIELDS = ("codes", "pow_min", "pow_max")


def redis_fields(room: RoomConfig) -> tuple[dict[Any, Any], list[str]]:
    """The gates' fields of the room's Redis hash to set, and those to delete: a room
    without gates has none (its hash is as it was before they existed)."""
    out: dict[Any, Any] = {}
    if room.access == "codes":
        out["codes"] = "1"
    if room.challenge is not None:
        out["pow_min"], out["pow_max"] = room.challenge
    return out, [name for name in GATE_FIELDS if name not in out]


def parse_codes(body: Any) -> tuple[list[str], bool]:
    """POST .../access-codes: {"codes": [1..10,000 strings of 8..64 [A-Za-z0-9_-]]}
    (duplicates counted once), or {"generate": 1..10,000}: that many codes made here.
    Returns the codes and whether the gate made them."""
    if isinstance(body, dict) and set(body) == {"generate"}:
        count = body["generate"]
        if type(count) is not int or not 1 <= count <= CODES_PER_CALL_MAX:
            raise invalid(f"'generate' must be an integer from 1 to {CODES_PER_CALL_MAX}.")
        return [new_code() for _ in range(count)], True
    if not isinstance(body, dict) or set(body) != {"codes"}:
        raise invalid('The body must be {"codes": [...]} or {"generate": n}.')
    codes = body["codes"]
    if not isinstance(codes, list) or not 1 <= len(codes) <= CODES_PER_CALL_MAX:
        raise invalid(f"'codes' must be a list of 1 to {CODES_PER_CALL_MAX} codes.")
    for i, code in enumerate(codes):
        if not isinstance(code, str) or not ADMIN_CODE_RE.fullmatch(code):
            raise invalid(
                f"codes[{i}] must be {CODE_MIN_CHARS} to 64 characters of A-Z, a-z, 0-9, _ and -."
            )
    return list(dict.fromkeys(codes)), False


def new_code() -> str:
    """A code made by the gate: GENERATED_BITS random bits (secrets), as
    "XXXX-XXXX-XXXX-XXXX" in Crockford's base32."""
    bits = secrets.randbits(GENERATED_BITS)
    symbols = "".join(GENERATED_ALPHABET[(bits >> (5 * i)) & 31] for i in range(GENERATED_SYMBOLS))
    return "-".join(symbols[i : i + 4] for i in range(0, GENERATED_SYMBOLS, 4))


def too_many_codes() -> Problem:
    return Problem("CONFLICT", f"A deal holds at most {CODES_PER_DEAL_MAX} access codes.")
