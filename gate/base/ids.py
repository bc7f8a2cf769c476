"""Ids: ULIDs, 48 bits of milliseconds then 80 random bits, as 26 Crockford digits.

    new_id()    ──> "01J…" one id: order ids on the reservation path, ledger op ids
    new_ids(n)  ──> n ids of one millisecond, made in one draw: a sweeper batch's
                    release intents

    0         10                        26
    ├─ time ──┼──────── random ─────────┤
    ms since the epoch, 10 digits         80 bits, 16 digits

Crockford's digits sort in ASCII order, so ids of a later millisecond sort after
those of an earlier one for as long as the wall clock does not step back; ids of one
millisecond are not ordered among themselves. 80 random bits a millisecond make a
collision as likely as guessing a 1-in-10^24 draw.

Why not python-ulid: it builds each id from an object, a timestamp and a fresh
`os.urandom` call, which costs several times what `new_id` does on every reservation
(docs/hotpath.md, lever 6, has the measurement). Here the time digits are computed
once per millisecond and the random part is drawn and encoded `IDS_PER_REFILL` ids
at a time (10 random bytes are exactly 16 base-32 digits, so base64's base-32
encoder does the work without padding). `new_ids` draws and encodes all of its
random parts at once and shares one time prefix: no call per id.
"""

from __future__ import annotations

import base64
import os
import time

DIGITS = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
# RFC 4648 base 32 to Crockford's: the same 5-bit groups, other digits.
_TO_CROCKFORD = bytes.maketrans(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567", DIGITS.encode())
# Random parts drawn and encoded at once by `new_id`.
IDS_PER_REFILL = 256
# At most this many ids in one `new_ids` call (160 KiB of random bytes).
IDS_PER_CALL_MAX = 16_384

_random_parts: list[str] = []
_stamp_ms = -1
_stamp = ""


def _forget_random_parts() -> None:
    # A forked worker must not hand out the ids its parent had drawn.
    _random_parts.clear()


os.register_at_fork(after_in_child=_forget_random_parts)


def _time_digits(ms: int) -> str:
    return "".join(DIGITS[(ms >> s) & 31] for s in range(45, -5, -5))


def _random_digits(n: int) -> str:
    """16·n Crockford digits from 10·n random bytes."""
    return base64.b32encode(os.urandom(10 * n)).translate(_TO_CROCKFORD).decode("ascii")


def new_id() -> str:
    """One ULID (see the module's docstring)."""
    global _stamp_ms, _stamp
    ms = time.time_ns() // 1_000_000
    if ms != _stamp_ms:
        _stamp = _time_digits(ms)
        _stamp_ms = ms
    if not _random_parts:
        text = _random_digits(IDS_PER_REFILL)
        _random_parts.extend(text[i : i + 16] for i in range(0, len(text), 16))
    return _stamp + _random_parts.pop()


def new_ids(n: int) -> list[str]:
    """`n` ULIDs of this millisecond (0 ≤ n ≤ IDS_PER_CALL_MAX), in one draw."""
    if not 0 <= n <= IDS_PER_CALL_MAX:
        raise ValueError(f"new_ids makes 0..{IDS_PER_CALL_MAX} ids at once, not {n}")
    stamp = _time_digits(time.time_ns() // 1_000_000)
    digits = _random_digits(n)
    return [stamp + digits[i : i + 16] for i in range(0, 16 * n, 16)]
