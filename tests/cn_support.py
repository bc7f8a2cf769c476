"""Test helpers for the Alipay and WeChat Pay adapters: RSA keys generated per test
session (never committed), the providers' fakes as real processes on loopback, and a
notification sink that verifies with the adapter's own webhook code.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from gate.base.errors import Encoded
from gate.payments.adapters import verifier_completion
from gate.payments.provider import EventInvalid, ProviderError, ProviderEvent
from gate.payments.signing import WebhookRejected
from tests.support import ServerProcess, base_env, free_port


@dataclass(frozen=True)
class KeyPair:
    private: rsa.RSAPrivateKey
    private_file: str
    public_file: str


def make_key_pair(directory: Path, name: str) -> KeyPair:
    """A fresh 2048-bit RSA pair as PEM files (PKCS#8 private, SPKI public)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    private_file = directory / f"{name}-private.pem"
    public_file = directory / f"{name}-public.pem"
    private_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public_file.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return KeyPair(key, str(private_file), str(public_file))


def make_certificate(directory: Path, pair: KeyPair, name: str, serial: int) -> str:
    """A self-signed PEM certificate of `pair`'s key with serial number `serial`
    (as WeChat Pay's platform certificates: the serial is the key's id)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import NameOID

    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Tenpay.com Root CA test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(pair.private.public_key())
        .serial_number(serial)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=30))
        .sign(pair.private, hashes.SHA256())
    )
    path = directory / f"{name}-cert.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def fake_process(module: str, env: Mapping[str, str]) -> ServerProcess:
    """`python -m tests.fake_<provider> --port N`, a real process on 127.0.0.1."""
    port = free_port()
    return ServerProcess(
        module.rsplit(".", 1)[-1],
        [sys.executable, "-m", module, "--port", str(port)],
        {**base_env(), **env},
        port,
    )


class FakeControl:
    def __init__(self, url: str) -> None:
        self.url = url
        self.http = aiohttp.ClientSession()

    async def close(self) -> None:
        await self.http.close()

    async def post(self, path: str, doc: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(self.url + path, json=doc) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str) -> Any:
        async with self.http.get(self.url + path) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.json()


class Webhook(Protocol):
    header_names: tuple[str, ...]

    def parse(self, headers: Mapping[str, str], body: bytes, now: float) -> ProviderEvent: ...

    def acknowledge(self, outcome: str) -> Encoded: ...


@dataclass
class Sink:
    """An HTTP endpoint on loopback that receives a fake's notifications, verifies
    them with the adapter's webhook code and answers like the gate (its
    acknowledgement once "recorded"; 401/400 otherwise). `fail_next` answers 500
    that many times first, to see the provider retry."""

    webhook: Webhook
    port: int = field(default_factory=free_port)
    events: list[ProviderEvent] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    fail_next: int = 0
    received: int = 0
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/notify"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received += 1
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=500, text="busy")
        headers = {k.lower(): v for k, v in request.headers.items()}
        try:
            event = self.webhook.parse(headers, body, time.time())
        except WebhookRejected as exc:
            self.refused.append(str(exc))
            return web.Response(status=401, text=str(exc))
        except EventInvalid as exc:
            self.refused.append(str(exc))
            return web.Response(status=400, text=str(exc))
        complete = verifier_completion(self.webhook)
        if complete is not None:
            try:
                event = await complete(event)
            except ProviderError as exc:
                self.refused.append(str(exc))
                return web.Response(status=503, text=str(exc))
        if event.event_id not in {e.event_id for e in self.events}:
            self.events.append(event)
        status, raw_headers, answer = self.webhook.acknowledge("applied")
        content_type = dict(raw_headers).get(b"content-type", b"").decode() or None
        return web.Response(
            status=status,
            body=answer if status != 204 else None,
            content_type=content_type.split(";")[0] if content_type else None,
        )

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/notify", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def of_type(self, event_type: str, order_id: str) -> list[ProviderEvent]:
        return [e for e in self.events if e.type == event_type and e.order_id == order_id]


async def eventually(predicate: Any, timeout_seconds: float = 15.0) -> Any:
    import asyncio

    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


class StaticWindow:
    """An OrderWindow over a fixed list (the gate's sessions table in e2e tests)."""

    def __init__(self, orders: list[str]) -> None:
        self.orders_list = orders

    async def orders(
        self, provider: str, since: int, cursor: str | None, limit: int
    ) -> tuple[list[str], str | None]:
        start = 0 if cursor is None else self.orders_list.index(cursor) + 1
        part = self.orders_list[start : start + limit]
        more = start + limit < len(self.orders_list)
        return part, (part[-1] if more and part else None)
