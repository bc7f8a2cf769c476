"""Helpers of the console tests: a signed-in console session over plain HTTP.

The cookie is carried by hand (aiohttp's jar keeps no cookies of an IP address),
which also lets the tests send a cookie without its CSRF token and the other way
round.

Sign-in is limited to 10 attempts a minute per client address, and every test
signs in from 127.0.0.1: the console's gates trust 127.0.0.1 as a proxy
(`console_env`) and each sign-in names an address of its own in X-Forwarded-For
unless the test picks one."""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass

from tests.support import ADMIN_TOKEN, Client, Resp


@dataclass
class ConsoleSession:
    cookie: str  # "gate_console=…", for a Cookie header
    csrf: str

    def read(self) -> dict[str, str]:
        return {"Cookie": self.cookie}

    def write(self) -> dict[str, str]:
        return {"Cookie": self.cookie, "X-CSRF-Token": self.csrf}


def session_cookie(r: Resp) -> str | None:
    for value in r.headers.getall("Set-Cookie", []):
        if value.startswith("gate_console="):
            return value.split(";", 1)[0]
    return None


# Addresses of 10.0.0.0/8, unique per sign-in of this test process.
_ADDRESSES = itertools.count((os.getpid() % 256) << 16)


def fresh_address() -> str:
    n = next(_ADDRESSES) % (1 << 24)
    return f"10.{n >> 16}.{(n >> 8) & 255}.{n & 255}"


async def sign_in(
    client: Client,
    token: str = ADMIN_TOKEN,
    address: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[Resp, ConsoleSession | None]:
    sent = {"X-Forwarded-For": address or fresh_address(), **(headers or {})}
    r = await client.post("/console/api/session", json={"token": token}, headers=sent)
    cookie = session_cookie(r)
    if r.status_code != 200 or cookie is None:
        return r, None
    return r, ConsoleSession(cookie, r.json()["csrf_token"])


def console_env(env: Mapping[str, str], **extra: str) -> dict[str, str]:
    return {**env, "GATE_CONSOLE": "1", "GATE_TRUSTED_PROXIES": "127.0.0.1", **extra}
