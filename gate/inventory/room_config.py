"""The waiting room's configuration: per deal (admin API, stored on the deal row)
and per process (GATE_ROOM_* settings, checked at start-up)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gate.base import validate
from gate.base.errors import invalid
from gate.base.limits import LimitError, LimitSpec, parse_limit
from gate.base.settings import SettingsError, env_float, env_int
from gate.inventory.origins import parse_origin
from gate.inventory.room_page import RoomPage, parse_page

ROOM_FIELDS = {
    "admit_per_second",
    "admission_ttl_seconds",
    "prequeue_seconds",
    "method",
    "message",
    "access",
    "challenge",
    "return_origins",
    "page",
    "max_admit_per_second",
    "unlikely_below",
}
ADMIT_PER_SECOND_MAX = 100_000
# "admit_per_second": "auto" (gate/room/steering.py): the room sets its own rate, up to
# max_admit_per_second (this by default).
AUTO = "auto"
AUTO_MAX_DEFAULT = 1000
# A waiting ticket reads "unlikely" while its chance is below this (0: never).
UNLIKELY_BELOW_DEFAULT = 0.02
UNLIKELY_BELOW_MAX = 0.5
TTL_SECONDS_MIN, TTL_SECONDS_MAX, TTL_SECONDS_DEFAULT = 10, 3600, 120
PREQUEUE_SECONDS_MAX = 86_400
# The admission order after the opening: join order, or the draw (docs/waiting-room.md).
METHODS = ("fifo", "random")
MESSAGE_TEXT_MAX = 280
MESSAGE_LEVELS = ("info", "warning")
# Who may join, and what a join costs (docs/waiting-room.md "Invite-only presales",
# "Proof of work").
ACCESS_VALUES = ("open", "codes")
CHALLENGE_MIN_BITS_MAX, CHALLENGE_MAX_BITS_MAX = 24, 28
# Where the buyer page (gate/room/page.py) may send an admitted buyer: exact origins,
# https only (http for the loopback names alone: a developer's shop). Bounded so a
# room's JSON always fits the deal row's column (4096 ASCII characters).
RETURN_ORIGINS_MAX = 16
ROOM_COLUMN_MAX = 4096
# The admin's bodies that carry a room (creating a deal, PUT …/waiting-room): room for a
# page's logo (a data: URL of up to 43,718 characters) besides the rest.
ROOM_BODY_MAX_BYTES = 65_536


@dataclass(frozen=True)
class RoomMessage:
    """What every ticket read shows the room's waiters."""

    text: str
    level: str = "info"

    def view(self) -> dict[str, str]:
        return {"text": self.text, "level": self.level}


@dataclass(frozen=True)
class RoomConfig:
    admit_per_second: int
    admission_ttl_seconds: int = TTL_SECONDS_DEFAULT
    prequeue_seconds: int = 0
    method: str = "fifo"
    message: RoomMessage | None = None
    # "codes": a join needs an access code (gate/room/gates.py).
    access: str = "open"
    # (min_bits, max_bits) of the join's proof of work, or None: no challenge.
    challenge: tuple[int, int] | None = None
    # The buyer page's return addresses (origins as a browser's URL.origin writes them).
    return_origins: tuple[str, ...] = ()
    # The shop's look on the buyer page (gate/inventory/room_page.py), or None.
    page: RoomPage | None = None
    # "auto": the room sets its own rate, at most admit_per_second (then the cap,
    # max_admit_per_second in the API).
    auto: bool = False
    # A waiting ticket reads "unlikely" below this chance (0 turns it off).
    unlikely_below: float = UNLIKELY_BELOW_DEFAULT

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "admit_per_second": AUTO if self.auto else self.admit_per_second,
            "admission_ttl_seconds": self.admission_ttl_seconds,
            "prequeue_seconds": self.prequeue_seconds,
            "method": self.method,
            "message": self.message.view() if self.message else None,
            "unlikely_below": self.unlikely_below,
        }
        if self.auto:
            out["max_admit_per_second"] = self.admit_per_second
        out.update(self.gates_view())
        if self.page is not None:
            out["page"] = self.page.view()
        return out

    def logo_column(self) -> str | None:
        """The page's logo as a data: URL, for deals.room_logo (just parsed only)."""
        logo = self.page.logo if self.page else None
        return logo.data_url if logo else None

    def gates_view(self) -> dict[str, Any]:
        """access, challenge and return_origins, shown only when set (absent means an
        open room without a challenge or a buyer page, as before they existed)."""
        out: dict[str, Any] = {}
        if self.return_origins:
            out["return_origins"] = list(self.return_origins)
        if self.access != "open":
            out["access"] = self.access
        if self.challenge is not None:
            out["challenge"] = {"min_bits": self.challenge[0], "max_bits": self.challenge[1]}
        return out

    def to_column(self) -> str:
        # ASCII (the column's character set): a message's other characters escaped.
        return json.dumps(self.view(), ensure_ascii=True, separators=(",", ":"))

    @classmethod
    def from_column(cls, raw: str | bytes | None) -> RoomConfig | None:
        if raw is None:
            return None
        data = json.loads(raw)
        message = data.get("message")
        auto = data["admit_per_second"] == AUTO
        return cls(
            int(data["max_admit_per_second"]) if auto else int(data["admit_per_second"]),
            int(data["admission_ttl_seconds"]),
            int(data["prequeue_seconds"]),
            str(data.get("method", "fifo")),
            RoomMessage(str(message["text"]), str(message["level"])) if message else None,
            **_gates_from_column(data),
            page=RoomPage.from_data(data.get("page")),
            auto=auto,
            unlikely_below=float(data.get("unlikely_below", UNLIKELY_BELOW_DEFAULT)),
        )


def _gates_from_column(data: dict[str, Any]) -> dict[str, Any]:
    challenge = data.get("challenge")
    return {
        "access": str(data.get("access", "open")),
        "challenge": (int(challenge["min_bits"]), int(challenge["max_bits"]))
        if challenge
        else None,
        "return_origins": tuple(str(o) for o in data.get("return_origins", ())),
    }


def _parse_gates(value: dict[str, Any]) -> dict[str, Any]:
    """The room's `access` ("open" | "codes", default open) and `challenge`
    ({"min_bits": 0..24, "max_bits": min_bits..28} or null, default null)."""
    access = value.get("access", "open")
    if access not in ACCESS_VALUES:
        raise invalid('\'access\' must be "open" or "codes".')
    challenge = value.get("challenge")
    if challenge is None:
        return {"access": access, "challenge": None}
    if not isinstance(challenge, dict):
        raise invalid("'challenge' must be an object or null.")
    validate.no_unknown(challenge, {"min_bits", "max_bits"})
    low = validate.integer(challenge, "min_bits", 0, CHALLENGE_MIN_BITS_MAX)
    high = validate.integer(challenge, "max_bits", low, CHALLENGE_MAX_BITS_MAX)
    return {"access": access, "challenge": (low, high)}


def parse_return_origins(value: Any) -> tuple[str, ...]:
    """`return_origins`: a list of at most 16 origins, each "https://host[:port]"
    (or "http://" for localhost, 127.0.0.1 and [::1]), no path, no trailing slash;
    stored as a browser's URL.origin writes it (host in lowercase, the scheme's
    default port left out), duplicates once."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > RETURN_ORIGINS_MAX:
        raise invalid(f"'return_origins' must be a list of at most {RETURN_ORIGINS_MAX} origins.")
    found: dict[str, None] = {}
    for i, origin in enumerate(value):
        found[parse_origin(origin, f"return_origins[{i}]")] = None
    return tuple(found)


def parse_room(value: Any) -> RoomConfig | None:
    """The admin API's `waiting_room` value: null (no room) or the object; every
    failure a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'waiting_room' must be an object or null.")
    validate.no_unknown(value, ROOM_FIELDS)
    for name in ("admission_ttl_seconds", "prequeue_seconds"):
        # Optional, but an integer when given (the contract's type): null is refused.
        if name in value and value[name] is None:
            raise invalid(f"'{name}' must be an integer (omit it for the default).")
    auto = value.get("admit_per_second") == AUTO
    room = RoomConfig(
        admit_per_second=_parse_rate(value, auto),
        admission_ttl_seconds=validate.integer(
            value,
            "admission_ttl_seconds",
            TTL_SECONDS_MIN,
            TTL_SECONDS_MAX,
            default=TTL_SECONDS_DEFAULT,
        ),
        prequeue_seconds=validate.integer(
            value, "prequeue_seconds", 0, PREQUEUE_SECONDS_MAX, default=0
        ),
        method=parse_method(value),
        message=parse_message(value.get("message")),
        **_parse_gates(value),
        return_origins=parse_return_origins(value.get("return_origins")),
        page=parse_page(value.get("page")),
        auto=auto,
        unlikely_below=parse_unlikely_below(value),
    )
    return fitting(room)


def fitting(room: RoomConfig) -> RoomConfig:
    """`room`, or the 400 problem when its JSON would not fit the deal row's column
    (ROOM_COLUMN_MAX ASCII characters). Every change of a room goes through it: the
    admin API's whole room (`parse_room`) and the console's message alone."""
    if len(room.to_column()) > ROOM_COLUMN_MAX:
        # Only a long message of escaped characters with many long origins (and a
        # page's long shop name and help link) gets here; the logo is stored apart.
        raise invalid(
            "The waiting room is too long: shorten its message, its return_origins or"
            " its page's shop_name or help_url."
        )
    return room


def _parse_rate(value: dict[str, Any], auto: bool) -> int:
    """`admit_per_second`: 1..100000, or "auto" with `max_admit_per_second` (1..100000,
    default 1000) as its cap; `max_admit_per_second` only with "auto"."""
    if not auto:
        if "max_admit_per_second" in value:
            raise invalid('\'max_admit_per_second\' is only for "admit_per_second": "auto".')
        return validate.integer(value, "admit_per_second", 1, ADMIT_PER_SECOND_MAX)
    return validate.integer(
        value, "max_admit_per_second", 1, ADMIT_PER_SECOND_MAX, default=AUTO_MAX_DEFAULT
    )


def parse_unlikely_below(value: dict[str, Any]) -> float:
    """`unlikely_below`: a number in [0, 0.5] (default 0.02; 0 turns "unlikely" off)."""
    raw = value.get("unlikely_below", UNLIKELY_BELOW_DEFAULT)
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise invalid(f"'unlikely_below' must be a number from 0 to {UNLIKELY_BELOW_MAX}.")
    if not 0 <= raw <= UNLIKELY_BELOW_MAX:
        raise invalid(f"'unlikely_below' must be a number from 0 to {UNLIKELY_BELOW_MAX}.")
    return float(raw)


def parse_method(room: dict[str, Any]) -> str:
    """`method`: "fifo" (the default) or "random"."""
    method = room.get("method", "fifo")
    if method not in METHODS:
        raise invalid("'method' must be 'fifo' or 'random'.")
    return str(method)


def parse_message(value: Any) -> RoomMessage | None:
    """`message`: null, or {"text": 1..280 characters, "level": "info" | "warning"}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'message' must be an object or null.")
    validate.no_unknown(value, {"text", "level"})
    text = value.get("text")
    if not isinstance(text, str) or not 1 <= len(text) <= MESSAGE_TEXT_MAX:
        raise invalid(f"'message.text' must be a string of 1..{MESSAGE_TEXT_MAX} characters.")
    if any(ord(c) < 0x20 and c not in "\n\t" for c in text):
        raise invalid("'message.text' must not hold control characters.")
    level = value.get("level", "info")
    if level not in MESSAGE_LEVELS:
        raise invalid("'message.level' must be 'info' or 'warning'.")
    return RoomMessage(text, str(level))


def room_view(raw: str | bytes | None) -> dict[str, Any] | None:
    """The deal row's column as the admin view shows it."""
    room = RoomConfig.from_column(raw)
    return room.view() if room else None


@dataclass(frozen=True)
class RoomSettings:
    # Unspent admissions <= ceil(available units x ratio). 1.0: one admission per unit
    # left; above 1 admits more buyers than units (some abandon), below 1 fewer.
    admission_ratio: float = 1.0
    # How often each process's room loop advances every room (Redis time decides).
    interval_seconds: float = 0.1
    # poll_after_ms advice: never below the floor, never above the ceiling.
    poll_min_ms: int = 1000
    poll_max_ms: int = 10_000
    # Work bounds of one advance call per room.
    admit_batch_max: int = 1000
    lapse_batch_max: int = 1000
    # Failed access codes per minute, per buyer and per client address, per deal.
    code_attempts_per_minute: int = 10
    # GET …/queue/fairness per client address (None: no limit).
    fairness_limit: LimitSpec | None = None
    # The automatic rate backs off above this commit p99 (gate/room/steering.py).
    auto_commit_p99_ms: float = 250.0


FAIRNESS_LIMIT_DEFAULT = "60/m burst 60"


def load_room_settings(env: Mapping[str, str]) -> RoomSettings:
    poll_min = env_int(env, "GATE_ROOM_POLL_MIN_MS", 1000, 100, 60_000)
    poll_max = env_int(env, "GATE_ROOM_POLL_MAX_MS", 10_000, 100, 600_000)
    if poll_max < poll_min:
        raise SettingsError("GATE_ROOM_POLL_MAX_MS must be at least GATE_ROOM_POLL_MIN_MS")
    try:
        fairness_limit = parse_limit(
            "GATE_ROOM_FAIRNESS_LIMIT", env.get("GATE_ROOM_FAIRNESS_LIMIT"), FAIRNESS_LIMIT_DEFAULT
        )
    except LimitError as exc:
        raise SettingsError(str(exc)) from None
    return RoomSettings(
        admission_ratio=env_float(env, "GATE_ROOM_ADMISSION_RATIO", 1.0, 0.01, 100.0),
        interval_seconds=env_int(env, "GATE_ROOM_INTERVAL_MS", 100, 10, 5000) / 1000,
        poll_min_ms=poll_min,
        poll_max_ms=poll_max,
        code_attempts_per_minute=env_int(env, "GATE_ROOM_CODE_ATTEMPTS_PER_MINUTE", 10, 1, 1000),
        fairness_limit=fairness_limit,
        auto_commit_p99_ms=env_float(env, "GATE_ROOM_AUTO_COMMIT_P99_MS", 250.0, 1.0, 60_000.0),
    )
