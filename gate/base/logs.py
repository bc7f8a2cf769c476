"""Structured JSON log lines, one object per line, on stderr (`configure`: the
server and the background loops); one-shot commands (`gate deal list`, `gate
check`, …) write their output for people on stdout and the gate's own records as
plain "gate: warning: …" lines on stderr, warnings and above (`configure_command`).

Every line written while a request is being answered carries that request's id
(and the buyer's id once authentication found it): the request middleware
(gate.ops) opens a `RequestContext` for each request in a context variable, which
the formatter reads. Secrets never reach a formatter on purpose (settings.Secret
hides them); as a second line of defence the formatter also replaces every secret
the gate was configured with, and anything shaped like a JWT or a bearer
credential, before a line is written.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

import orjson

# Kept for modules that read or set the id directly.
request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

# LogRecord's own attributes, and uvicorn's ANSI-coloured copy of its message.
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "color_message",
}

REDACTED = "[redacted]"
# Shorter "secrets" (an empty or one-letter test password) would mangle every line.
MIN_SECRET_CHARS = 6
REQUEST_ID_MAX_CHARS = 128
_SANE_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:-]{1,%d}" % REQUEST_ID_MAX_CHARS)
_JWT = re.compile(r"eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*")
_BEARER = re.compile(r"(?i)(bearer\s+)[^\s\"',;]+")
# Standard Webhooks secrets, configured or made (each outbound webhook endpoint's).
_WHSEC = re.compile(r"whsec_[A-Za-z0-9+/=_-]{8,}")


class RequestContext:
    """What is known about the request being answered; one per request. `started` is
    its start (perf_counter seconds, 0: unknown); `trace` is gate/base/tracing.py's
    (None: no trace decided)."""

    __slots__ = ("request_id", "started", "trace", "user_id")

    def __init__(self, rid: str, started: float = 0.0) -> None:
        self.request_id = rid
        self.user_id: int | None = None
        self.started = started
        self.trace: Any = None


current: ContextVar[RequestContext | None] = ContextVar("gate_request", default=None)


def sane_request_id(raw: bytes) -> str | None:
    """An incoming X-Request-Id worth keeping: 1–128 characters of [A-Za-z0-9._:-]."""
    if _SANE_REQUEST_ID.fullmatch(raw):
        return raw.decode("ascii")
    return None


def _new_prefix() -> None:
    global _id_prefix, _id_counter
    _id_prefix = f"{os.urandom(4).hex()}{os.getpid() & 0xFFFF:04x}-"
    _id_counter = itertools.count(1)


_id_prefix = ""
_id_counter = itertools.count(1)
_new_prefix()
# A forked worker must not repeat its parent's ids.
os.register_at_fork(after_in_child=_new_prefix)


def new_request_id() -> str:
    """A random per-process prefix and a counter: unique, far cheaper than a UUID."""
    return f"{_id_prefix}{next(_id_counter):x}"


def begin_request(rid: str, started: float = 0.0) -> RequestContext:
    """Open the context of one request (in the request's own task)."""
    ctx = RequestContext(rid, started)
    current.set(ctx)
    request_id.set(rid)
    return ctx


def set_user(user_id: int) -> None:
    """Note the authenticated buyer of the request being answered, for its log lines."""
    ctx = current.get()
    if ctx is not None:
        ctx.user_id = user_id


class _Redactor:
    def __init__(self) -> None:
        self.secrets: tuple[str, ...] = ()

    def add(self, secrets: Iterable[str]) -> None:
        found = {s for s in secrets if s and len(s) >= MIN_SECRET_CHARS}
        # Longest first, so a secret containing another is replaced whole.
        self.secrets = tuple(sorted(found | set(self.secrets), key=len, reverse=True))

    def __call__(self, line: str) -> str:
        for secret in self.secrets:
            if secret in line:
                line = line.replace(secret, REDACTED)
        if "eyJ" in line:
            line = _JWT.sub(REDACTED, line)
        if "earer" in line:
            line = _BEARER.sub(r"\1" + REDACTED, line)
        if "whsec_" in line:
            line = _WHSEC.sub(REDACTED, line)
        return line


redact = _Redactor()

# The trace and span ids of the running code, when traces are on (gate/base/tracing.py
# hands its reader over: this module cannot import it).
_trace_ids: Callable[[], tuple[str, str] | None] | None = None


def use_trace_ids(reader: Callable[[], tuple[str, str] | None] | None) -> None:
    """Every line written inside a span carries `trace_id` and `span_id` from `reader`."""
    global _trace_ids
    _trace_ids = reader


def redact_secrets(secrets: Iterable[str]) -> None:
    """Register configured secrets that must never appear in a log line."""
    redact.add(secrets)


class JsonFormatter(logging.Formatter):
    _second = -1
    _second_text = ""

    def _timestamp(self, created: float, msecs: float) -> str:
        second = int(created)
        if second != self._second:
            self._second_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = second
        return f"{self._second_text}.{int(msecs):03d}Z"

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self._timestamp(record.created, record.msecs),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ctx = current.get()
        if ctx is not None:
            entry["request_id"] = ctx.request_id
            if ctx.user_id is not None:
                entry["user_id"] = ctx.user_id
        else:
            rid = request_id.get()
            if rid:
                entry["request_id"] = rid
        if _trace_ids is not None:
            ids = _trace_ids()
            if ids is not None:
                entry["trace_id"], entry["span_id"] = ids
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = record.stack_info
        return redact(orjson.dumps(entry, default=str).decode())


_formatter = JsonFormatter()
# The handler configure() installed: request lines are written to it directly.
_handler: logging.StreamHandler[Any] | None = None


def json_handler() -> logging.StreamHandler[Any] | None:
    """configure()'s handler while it is the root logger's only one: lines may then be
    written to its stream directly (under its lock)."""
    handler = _handler
    if handler is None or logging.getLogger().handlers != [handler]:
        return None
    return handler


def timestamp(seconds: float) -> str:
    """A line's `ts` for a unix time (any thread: nothing cached)."""
    whole = int(seconds)
    milli = int((seconds - whole) * 1000)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(whole))}.{milli:03d}Z"


def write_line(logger: logging.Logger, msg: str, fields: dict[str, Any]) -> None:
    """One info line with these fields, the request's context added.

    The request log's fast path: one line per request through `logging` costs about
    30 µs (record, caller lookup, formatter, flush), this about a fifth of it. The
    caller checks `logger.isEnabledFor(logging.INFO)` first. Falls back to `logging`
    when configure() did not install the JSON handler (other handlers, tests).
    """
    handler = _handler
    root = logging.getLogger()
    if handler is None or root.handlers != [handler] or logger.handlers:
        logger.info(msg, extra=fields)
        return
    now = time.time()
    entry: dict[str, Any] = {
        "ts": _formatter._timestamp(now, (now - int(now)) * 1000),
        "level": "info",
        "logger": logger.name,
        "msg": msg,
    }
    ctx = current.get()
    if ctx is not None:
        entry["request_id"] = ctx.request_id
        if ctx.user_id is not None:
            entry["user_id"] = ctx.user_id
    if _trace_ids is not None:
        ids = _trace_ids()
        if ids is not None:
            entry["trace_id"], entry["span_id"] = ids
    entry.update(fields)
    line = redact(orjson.dumps(entry, default=str).decode()) + "\n"
    handler.acquire()
    try:
        handler.stream.write(line)
        handler.stream.flush()
    except Exception:
        handler.handleError(logging.makeLogRecord({"msg": msg}))
    finally:
        handler.release()


def configure(level: str = "INFO") -> None:
    global _handler
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter)
    _handler = handler
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    # uvicorn's access lines are unstructured; the gate writes its own request log.
    access = logging.getLogger("uvicorn.access")
    access.handlers[:] = []
    access.propagate = False
    # Warnings (deprecations and the like) become log records, hence JSON lines too.
    logging.captureWarnings(True)


class HumanFormatter(logging.Formatter):
    """`gate: <level>: <message>`, the exception after it; redacted as JSON lines are."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"gate: {record.levelname.lower()}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return redact(text)


def configure_command(level: str = "WARNING") -> None:
    """Logging for a one-shot command: human-readable lines on stderr, warnings and
    above (`level` when it asks for fewer), so that what the command prints on
    stdout (a table, JSON, a token) is all there is there and a terminal shows no
    JSON between its lines."""
    configure(level)
    assert _handler is not None
    _handler.setFormatter(HumanFormatter())
    root = logging.getLogger()
    root.setLevel(max(logging.WARNING, logging.getLevelName(level)))
