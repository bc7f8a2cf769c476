"""Helpers of the console tests: a signed-in console session over plain HTTP.

The cookie is carried by hand (aiohttp's jar keeps no cookies of an IP address),
which also lets the tests send a cookie without its CSRF token and the other way
round."""

from __future__ import annotations

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


async def sign_in(client: Client, token: str = ADMIN_TOKEN) -> tuple[Resp, ConsoleSession | None]:
    r = await client.post("/console/api/session", json={"token": token})
    cookie = session_cookie(r)
    if r.status_code != 200 or cookie is None:
        return r, None
    return r, ConsoleSession(cookie, r.json()["csrf_token"])


def console_env(env: Mapping[str, str], **extra: str) -> dict[str, str]:
    return {**env, "GATE_CONSOLE": "1", **extra}
