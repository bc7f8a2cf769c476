"""Small integer outcomes of the Lua scripts and stored procedures.

Each enum mirrors, value for value, the header of its script or procedure; the
mapping of outcomes to HTTP problems lives in one place: gate.base.errors.
"""

from __future__ import annotations

from enum import IntEnum


class AdmitCode(IntEnum):
    """lua/admit.lua"""

    OK = 0
    NOT_LOADED = 1
    SOLD_OUT = 2
    NOT_ACTIVE = 3
    BAD_QUANTITY = 4
    LIMIT_EXCEEDED = 5
    REPLAY = 6
    IN_PROGRESS = 7
    MISMATCH = 8
    RATE_LIMITED = 9
    ADMISSION_REQUIRED = 10
    ADMISSION_INVALID = 11
    QUEUE_FULL = 12
    SALE_PAUSED = 13


class RoomCode(IntEnum):
    """lua/room_ticket.lua, a join or a ticket read (ticket states and refusals)."""

    WAITING = 0
    ADMITTED = 1
    SOLD_OUT = 2
    CLOSED = 3
    NOT_LOADED = 4
    NO_ROOM = 5
    NO_TICKET = 6
    EARLY = 7
    ENDED = 8
    POLL_TOO_SOON = 9
    # Join refusals of an invite-only room or a room with a challenge (gate/room/gates.py)
    ACCESS_CODE_REQUIRED = 10
    ACCESS_CODE_INVALID = 11
    ACCESS_CODE_USED = 12
    CHALLENGE_REQUIRED = 13
    CHALLENGE_INVALID = 14
    # lua/room_challenge.lua: the room asks no challenge
    NO_CHALLENGE = 15
    # A join with a code from a buyer or an address that failed too many lately
    CODE_ATTEMPTS_LIMITED = 16
    # lua/room_leave.lua: the buyer holds no ticket in the line (never joined, or the
    # ticket is closed: its admission spent or lapsed, or the sale ended)
    NOT_IN_QUEUE = 17


class LimitCode(IntEnum):
    """lua/limit.lua"""

    OK = 0
    RATE_LIMITED = 1


class SyncCode(IntEnum):
    """lua/sync_deal.lua"""

    EXISTED = 0
    IN_SYNC = 1
    APPLIED = 2
    STALE = 4
    NOT_LOADED = 5


class DbCode(IntEnum):
    """db/002_procedures.sql: gate_reserve and gate_release; db/006: gate_reserve_group."""

    OK = 0
    SOLD_OUT = 1
    LIMIT_EXCEEDED = 2
    DUPLICATE = 3
    NOT_FOUND = 4
    NOT_ACTIVE = 5
    BAD_QUANTITY = 6
    WRONG_STATE = 7
    FALL_BACK = 8


class OrderStatus:
    PENDING_PAYMENT = "PENDING_PAYMENT"
    AUTHORIZED = "AUTHORIZED"
    PAID = "PAID"
    EXPIRED = "EXPIRED"
    CANCELLED = "CANCELLED"
    REFUND_PENDING = "REFUND_PENDING"
    REFUNDED = "REFUNDED"

    HOLDING = (PENDING_PAYMENT, AUTHORIZED)
    ALL = (PENDING_PAYMENT, AUTHORIZED, PAID, EXPIRED, CANCELLED, REFUND_PENDING, REFUNDED)
