"""The shop's identity provider's public keys (a JWKS), for buyer tokens it signs.

    GATE_JWT_JWKS_FILE or GATE_JWT_JWKS_URL
        │  read at start-up (`load`: a failure stops start-up), then by `run()`:
        │  every GATE_JWT_JWKS_REFRESH_SECONDS, and soon after a token named a kid
        │  the set does not hold (at most once every UNKNOWN_KID_REFRESH_SECONDS)
        ▼
    parse_jwks: ≤ JWKS_MAX_BYTES, ≤ JWKS_KEYS_MAX keys; signing keys of RSA, EC
        │  and OKP only, each pinned to one algorithm (its `alg`, or RSA -> RS256,
        │  EC P-256 -> ES256, P-384 -> ES384, P-521 -> ES512, OKP Ed25519 -> EdDSA)
        ▼
    JwksKeys.keys: kid -> PyJWK, replaced whole in the event loop
        ▲
    BuyerAuth (gate/web/auth.py) looks a token's kid up with `key_for`: a request
    never waits on the network. An unknown kid is a 401 and a wish for a refresh;
    a refresh that drops a kid tells `on_removed` (the verified-token cache is
    emptied, so a token of a withdrawn key stops working at once).

A symmetric key (kty "oct") in the set is refused: a key published in a JWKS is
public, and an HMAC key that is public lets anyone sign.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
from jwt import PyJWK
from jwt.exceptions import PyJWKError, PyJWTError

log = logging.getLogger("gate.jwks")

# A provider's set holds a few keys (the current one, the next, the last); these
# bounds keep a wrong URL (a web page, a huge file) from costing memory.
JWKS_MAX_BYTES = 64 * 1024
JWKS_KEYS_MAX = 32
FETCH_TIMEOUT_SECONDS = 5.0
# A token with an unknown kid asks for a refresh; a crowd of forged kids still
# costs the provider one request a minute.
UNKNOWN_KID_REFRESH_SECONDS = 60.0
REFRESH_DEFAULT_SECONDS = 300

# The algorithms a public key may be pinned to (never HS*, never "none").
_FAMILY = {
    "RS256": "RSA",
    "RS384": "RSA",
    "RS512": "RSA",
    "PS256": "RSA",
    "PS384": "RSA",
    "PS512": "RSA",
    "ES256": "EC",
    "ES384": "EC",
    "ES512": "EC",
    "EdDSA": "OKP",
}
_EC_CURVE = {"ES256": "P-256", "ES384": "P-384", "ES512": "P-521"}
_DERIVED: dict[tuple[object, object], str] = {
    ("RSA", None): "RS256",
    ("EC", "P-256"): "ES256",
    ("EC", "P-384"): "ES384",
    ("EC", "P-521"): "ES512",
    ("OKP", "Ed25519"): "EdDSA",
}


class JwksError(ValueError):
    """The key set cannot be read or holds no usable signing key."""


def _algorithm(entry: dict[str, Any]) -> str | None:
    """The one algorithm this JWK verifies, or None if it is not a signing key Gate
    accepts (encryption keys, symmetric keys, unknown types or curves)."""
    if entry.get("use", "sig") != "sig":
        return None
    kty, crv = entry.get("kty"), entry.get("crv")
    alg = entry.get("alg") or _DERIVED.get((kty, None if kty == "RSA" else crv))
    if not isinstance(alg, str) or _FAMILY.get(alg) != kty:
        return None
    if kty == "EC" and _EC_CURVE[alg] != crv:
        return None
    if kty == "OKP" and crv != "Ed25519":
        return None
    return alg


def parse_jwks(raw: bytes) -> dict[str, PyJWK]:
    """kid -> key of a JWKS document (a key without kid is filed under "")."""
    if len(raw) > JWKS_MAX_BYTES:
        raise JwksError(f"the key set is over {JWKS_MAX_BYTES} bytes")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise JwksError("the key set is not JSON") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        raise JwksError('the key set has no "keys" list')
    if len(entries) > JWKS_KEYS_MAX:
        raise JwksError(f"the key set has over {JWKS_KEYS_MAX} keys")
    keys: dict[str, PyJWK] = {}
    for entry in entries:
        alg = _algorithm(entry) if isinstance(entry, dict) else None
        kid = entry.get("kid", "") if isinstance(entry, dict) else None
        if alg is None or not isinstance(kid, str):
            continue
        if kid in keys:
            raise JwksError(f"the key set names kid {kid!r} twice")
        try:
            keys[kid] = PyJWK(entry, algorithm=alg)
        except (PyJWKError, PyJWTError) as exc:
            raise JwksError(f"key {kid!r}: {exc}") from None
    if not keys:
        raise JwksError("the key set holds no RSA, EC or Ed25519 signing key")
    return keys


def _read_file(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(JWKS_MAX_BYTES + 1)


async def _fetch(url: str) -> bytes:
    timeout = aiohttp.ClientTimeout(total=FETCH_TIMEOUT_SECONDS)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(url, allow_redirects=False, headers={"Accept": "application/json"}) as resp,
    ):
        if resp.status != 200:
            raise JwksError(f"the key set URL answered {resp.status}")
        body = b""
        while len(body) <= JWKS_MAX_BYTES:
            chunk = await resp.content.read(JWKS_MAX_BYTES + 1 - len(body))
            if not chunk:
                break
            body += chunk
        return body


class JwksKeys:
    """The current key set and its refresh loop (one per gate process)."""

    def __init__(
        self,
        *,
        file: str | None,
        url: str | None,
        refresh_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (file is None) == (url is None):
            raise ValueError("one of file and url")
        self._file = Path(file) if file else None
        self._url = url
        self._refresh_seconds = refresh_seconds
        self._clock = clock
        self.keys: dict[str, PyJWK] = {}
        self._fetched_at = float("-inf")
        self._wanted = asyncio.Event()
        self.on_removed: list[Callable[[], None]] = []

    @property
    def source(self) -> str:
        """Where the keys come from, for logs (a URL without its query or user)."""
        if self._file is not None:
            return str(self._file)
        assert self._url is not None
        parts = urlsplit(self._url)
        port = f":{parts.port}" if parts.port else ""
        return f"{parts.scheme}://{parts.hostname}{port}{parts.path}"

    def key_for(self, kid: str | None) -> PyJWK | None:
        """The key a token's header names; no kid: the set's only key. An unknown
        kid asks the refresh loop to look again soon."""
        if kid is None:
            return next(iter(self.keys.values())) if len(self.keys) == 1 else None
        key = self.keys.get(kid)
        if key is None:
            self._wanted.set()
        return key

    async def _read(self) -> bytes:
        if self._file is not None:
            return await asyncio.to_thread(_read_file, self._file)
        assert self._url is not None
        return await _fetch(self._url)

    async def load(self) -> None:
        """Read the set now; JwksError (or OSError, aiohttp's errors) when it fails."""
        self._wanted.clear()
        self._fetched_at = self._clock()
        try:
            keys = parse_jwks(await self._read())
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            raise JwksError(f"reading the key set from {self.source} failed: {exc!r}") from None
        removed = self.keys.keys() - keys.keys()
        if self.keys.keys() != keys.keys():
            log.info("JWKS from %s: kids %s", self.source, sorted(keys))
        self.keys = keys
        if removed:
            for hook in self.on_removed:
                hook()

    def due_at(self) -> float:
        """When the next read is due (the clock's time)."""
        periodic = self._fetched_at + self._refresh_seconds
        if self._wanted.is_set():
            return min(periodic, self._fetched_at + UNKNOWN_KID_REFRESH_SECONDS)
        return periodic

    async def run_once(self) -> bool:
        """One refresh; False (logged) when it failed: the keys stay as they were."""
        try:
            await self.load()
        except JwksError as exc:
            log.warning("%s", exc)
            return False
        return True

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            delay = self.due_at() - self._clock()
            if delay <= 0:
                await self.run_once()
                continue
            # Woken early by an unknown kid unless one already asked (then the
            # minute since the last read is what is waited for).
            events = [stop] if self._wanted.is_set() else [stop, self._wanted]
            waits = [asyncio.ensure_future(event.wait()) for event in events]
            try:
                await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waits:
                    waiter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiter
