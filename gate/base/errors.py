"""Problem details (RFC 9457) and the one mapping from outcomes to HTTP errors."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

from gate.base.codes import AdmitCode, DbCode, RoomCode
from gate.base.db_health import HEALTH

PROBLEM_TYPE_BASE = "https://gate.dev/problems/"

# code -> (status, title)
_PROBLEMS: dict[str, tuple[int, str]] = {
    "INVALID_REQUEST": (400, "Invalid request"),
    "UNAUTHORIZED": (401, "Unauthorized"),
    "FORBIDDEN": (403, "Forbidden"),
    "NOT_FOUND": (404, "Not found"),
    "WEBHOOK_URL_REFUSED": (400, "Webhook URL refused"),
    "WEBHOOK_ENDPOINT_NOT_FOUND": (404, "Webhook endpoint not found"),
    "ADMISSION_REQUIRED": (403, "Admission required"),
    "ADMISSION_INVALID": (403, "Admission invalid"),
    "ACCESS_CODE_REQUIRED": (403, "Access code required"),
    "ACCESS_CODE_INVALID": (403, "Access code invalid"),
    "ACCESS_CODE_USED": (403, "Access code used"),
    "CHALLENGE_REQUIRED": (403, "Challenge required"),
    "CHALLENGE_INVALID": (403, "Challenge invalid"),
    "NO_TICKET": (404, "No ticket"),
    "NOT_IN_QUEUE": (404, "Not in the queue"),
    "METHOD_NOT_ALLOWED": (405, "Method not allowed"),
    "REQUEST_TIMEOUT": (408, "Request timeout"),
    "SOLD_OUT": (409, "Sold out"),
    "NOT_ACTIVE": (409, "Sale not active"),
    "IDEMPOTENCY_IN_PROGRESS": (409, "Request with this idempotency key in progress"),
    "CONFLICT": (409, "Conflict"),
    "NO_WAITING_ROOM": (409, "No waiting room"),
    "NO_CHALLENGE": (409, "No challenge"),
    "PAYLOAD_TOO_LARGE": (413, "Payload too large"),
    "UNSUPPORTED_MEDIA_TYPE": (415, "Unsupported media type"),
    "IDEMPOTENCY_MISMATCH": (422, "Idempotency key reused with a different request"),
    "LIMIT_EXCEEDED": (422, "Per-user limit exceeded"),
    "RATE_LIMITED": (429, "Too many requests"),
    "INTERNAL": (500, "Internal error"),
    "OVERLOADED": (503, "Overloaded"),
    "SALE_PAUSED": (503, "Sale paused"),
}


RawHeaders = list[tuple[bytes, bytes]]
# An answer ready for the wire: status, ASGI headers, body.
Encoded = tuple[int, RawHeaders, bytes]

PROBLEM_CONTENT_TYPE = b"application/problem+json"
# Encoded answers of the common rejections (sold out, rate limited, not active,
# overloaded), per route instance: a reject costs a dictionary lookup instead of a
# dict, orjson and a header list. Bounded; emptied when full.
ENCODED_MAX = 4096
_encoded: dict[tuple[str, str, int | None, str | None], Encoded] = {}


class RawResponse(Response):
    """A Response whose status, header list and body are already made (Starlette's
    constructor would build the headers again)."""

    def __init__(self, status: int, raw_headers: RawHeaders, body: bytes) -> None:
        self.status_code = status
        self.raw_headers = raw_headers
        self.body = body
        self.background = None


def raw_headers(headers: dict[str, str]) -> RawHeaders:
    """ASGI header pairs (lower-case names, as Starlette makes them)."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def encode_answer(
    status: int, content_type: bytes, body: bytes, headers: RawHeaders | None = None
) -> Encoded:
    raw = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
    if headers:
        raw.extend(headers)
    return status, raw, body


class Problem(Exception):
    """An error answered as application/problem+json.

    `cacheable`: the answer (body and headers) is a function of the code, the detail,
    Retry-After and the instance alone, so its encoding is kept and reused.
    """

    def __init__(
        self,
        code: str,
        detail: str,
        *,
        status: int | None = None,
        retry_after_seconds: int | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        cacheable: bool = False,
    ) -> None:
        super().__init__(detail)
        default_status, title = _PROBLEMS[code]
        self.code = code
        self.status = status or default_status
        self.title = title
        self.detail = detail
        self.retry_after_seconds = retry_after_seconds
        self.headers = headers or {}
        self.extra = extra or {}
        self.cacheable = cacheable
        if self.status in (429, 503) and retry_after_seconds is None:
            self.retry_after_seconds = 1

    def encoded(self, instance: str | None = None) -> Encoded:
        """The answer on the wire. The header list is the caller's to keep or change."""
        if not self.cacheable:
            status, headers, body = self._encode(instance)
            return status, headers, body
        key = (self.code, self.detail, self.retry_after_seconds, instance)
        hit = _encoded.get(key)
        if hit is None:
            if len(_encoded) >= ENCODED_MAX:
                _encoded.clear()
            hit = _encoded[key] = self._encode(instance)
        return hit[0], list(hit[1]), hit[2]

    def _encode(self, instance: str | None) -> Encoded:
        body: dict[str, Any] = {
            "type": PROBLEM_TYPE_BASE + self.code.lower().replace("_", "-"),
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
        }
        if instance:
            body["instance"] = instance
        body.update(self.extra)
        headers = raw_headers(self.headers)
        if self.retry_after_seconds is not None:
            headers.append((b"retry-after", b"%d" % max(1, int(self.retry_after_seconds))))
        if self.status == 401 and b"www-authenticate" not in {k for k, _ in headers}:
            headers.append((b"www-authenticate", b"Bearer"))
        return encode_answer(self.status, PROBLEM_CONTENT_TYPE, orjson.dumps(body), headers)

    def response(self, instance: str | None = None) -> Response:
        return RawResponse(*self.encoded(instance))


def invalid(detail: str) -> Problem:
    return Problem("INVALID_REQUEST", detail)


def not_found(what: str = "resource") -> Problem:
    return Problem("NOT_FOUND", f"No such {what}.")


def overloaded(detail: str, retry_after_seconds: int = 1) -> Problem:
    HEALTH.overloaded()  # the automatic room rate's signal (gate/room/steering.py)
    return Problem("OVERLOADED", detail, retry_after_seconds=retry_after_seconds, cacheable=True)


# A paused sale lasts until a person acts (gate deal resume): buyers are told to come
# back in half a minute rather than every second.
SALE_PAUSED_RETRY_SECONDS = 30


def sale_paused() -> Problem:
    return Problem(
        "SALE_PAUSED",
        "The sale of this deal is paused; nothing is sold until it resumes.",
        retry_after_seconds=SALE_PAUSED_RETRY_SECONDS,
        cacheable=True,
    )


def from_admit(code: AdmitCode, detail: str) -> Problem:
    """Map a rejecting admit.lua outcome to its problem."""
    if code == AdmitCode.SOLD_OUT:
        left = int(detail or 0)
        text = "The deal is sold out." if left == 0 else f"Only {left} unit(s) left."
        return Problem("SOLD_OUT", text, extra={"remaining_hint": left}, cacheable=True)
    if code == AdmitCode.NOT_ACTIVE:
        text = "The sale has not started yet." if detail == "early" else "The sale has ended."
        return Problem("NOT_ACTIVE", text, cacheable=True)
    if code == AdmitCode.SALE_PAUSED:
        return sale_paused()
    if code == AdmitCode.BAD_QUANTITY:
        return invalid(f"quantity must be an integer between 1 and {detail}.")
    if code == AdmitCode.LIMIT_EXCEEDED:
        return Problem("LIMIT_EXCEEDED", f"At most {detail} unit(s) per buyer for this deal.")
    if code == AdmitCode.IN_PROGRESS:
        return Problem(
            "IDEMPOTENCY_IN_PROGRESS", "A request with this Idempotency-Key is still in progress."
        )
    if code == AdmitCode.MISMATCH:
        return Problem(
            "IDEMPOTENCY_MISMATCH", "This Idempotency-Key was used with a different request."
        )
    if code == AdmitCode.ADMISSION_REQUIRED:
        return Problem(
            "ADMISSION_REQUIRED",
            "This deal has a waiting room: join its queue and reserve with the"
            " Admission-Token header once admitted.",
            cacheable=True,
        )
    if code == AdmitCode.ADMISSION_INVALID:
        return Problem(
            "ADMISSION_INVALID",
            "The Admission-Token is expired, spent, or not this buyer's for this deal.",
            cacheable=True,
        )
    raise AssertionError(f"admit code {code!r} is not a rejection")


def from_room(code: RoomCode, detail: str = "") -> Problem:
    """Map a refusing room_ticket.lua (join or read) outcome to its problem."""
    if code == RoomCode.NO_ROOM:
        return Problem("NO_WAITING_ROOM", "This deal has no waiting room.", cacheable=True)
    if code == RoomCode.NO_TICKET:
        return Problem("NO_TICKET", "You hold no ticket for this deal's waiting room.")
    if code == RoomCode.NOT_IN_QUEUE:
        return Problem("NOT_IN_QUEUE", "You are not in this deal's waiting room's line.")
    if code == RoomCode.EARLY:
        return Problem("NOT_ACTIVE", "The waiting room is not open yet.", cacheable=True)
    if code == RoomCode.ENDED:
        return Problem("NOT_ACTIVE", "The sale has ended.", cacheable=True)
    if code == RoomCode.POLL_TOO_SOON:
        wait_ms = int(detail or 1000)
        return Problem(
            "RATE_LIMITED",
            "Polled sooner than poll_after_ms advised.",
            retry_after_seconds=max(1, -(-wait_ms // 1000)),
            extra={"scope": "poll", "retry_after_ms": wait_ms},
        )
    if code == RoomCode.CODE_ATTEMPTS_LIMITED:
        wait_ms = int(detail or 1000)
        seconds = max(1, -(-wait_ms // 1000))
        return Problem(
            "RATE_LIMITED",
            f"Too many access codes refused lately; retry in {seconds} s.",
            retry_after_seconds=seconds,
            extra={"scope": "access_code", "retry_after_ms": wait_ms},
        )
    gate = _ROOM_GATES.get(code)
    if gate is not None:
        return Problem(*gate, cacheable=True)
    raise AssertionError(f"room code {code!r} is not a refusal")


# The refusals of a room's gates (access codes, proof of work): (code, detail).
_ROOM_GATES: dict[RoomCode, tuple[str, str]] = {
    RoomCode.ACCESS_CODE_REQUIRED: (
        "ACCESS_CODE_REQUIRED",
        'This waiting room is invite-only: join with {"access_code": "..."}.',
    ),
    RoomCode.ACCESS_CODE_INVALID: (
        "ACCESS_CODE_INVALID",
        "The access code is not one of this deal's.",
    ),
    RoomCode.ACCESS_CODE_USED: ("ACCESS_CODE_USED", "The access code is bound to another buyer."),
    RoomCode.CHALLENGE_REQUIRED: (
        "CHALLENGE_REQUIRED",
        "Join with a solved challenge: GET .../queue/challenge, then"
        ' {"challenge": "...", "nonce": "..."}.',
    ),
    RoomCode.CHALLENGE_INVALID: (
        "CHALLENGE_INVALID",
        "The challenge is wrong, expired, spent or another buyer's,"
        " or the nonce does not solve it.",
    ),
    RoomCode.NO_CHALLENGE: ("NO_CHALLENGE", "This deal's waiting room asks no challenge."),
}


def from_db(code: DbCode) -> Problem:
    """Map a rejecting gate_reserve outcome to its problem."""
    if code == DbCode.SOLD_OUT:
        return Problem("SOLD_OUT", "The deal is sold out.", extra={"remaining_hint": 0})
    if code == DbCode.LIMIT_EXCEEDED:
        return Problem("LIMIT_EXCEEDED", "Per-buyer limit for this deal reached.")
    if code == DbCode.NOT_FOUND:
        return not_found("deal")
    if code == DbCode.NOT_ACTIVE:
        return Problem("NOT_ACTIVE", "The sale is not active.")
    if code == DbCode.BAD_QUANTITY:
        return invalid("quantity exceeds the deal's max_per_order.")
    raise AssertionError(f"db code {code!r} is not a rejection")
